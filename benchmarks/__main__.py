"""Run the benchmark sweeps and write the results file, the markdown report and the plots.

    python -m benchmarks run [--kernels NAME ...] [--quick] [--tag TAG] [--match REGEX] [--time-limit S]
    python -m benchmarks run --smoke [--out-dir DIR]     # tiny shapes on the CPU (interpreter): tests the code
    python -m benchmarks render RESULTS.json             # re-render the .md and plots (also: run --render)
    python -m benchmarks merge OUT.json IN.json ...      # one report from several runs (later points win)
    python -m benchmarks list

Results go to ``benchmarks/results/<gpu>-<date>[-tag].json`` (merged into the file of the same name when it
exists: a point measured again replaces the old one, others are kept; ``--fresh`` starts over), with the report
``<stem>.md`` and the plots ``<stem>-plots/*.png`` rendered from it after every module. On a GPU each module
runs in its own worker process (``--no-isolate`` to run in this one), so one module's crash or memory held by
jax cannot spoil the next. ``LIGER_BENCH_MIRROR=DIR`` (or ``--mirror``) also copies the files there after every
module (the device tool's $OUT, so a run cut short still brings back what it measured).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import time
import traceback

# jax must not take 75% of the GPU up front: torch providers share the card.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # no GPU: keep jax from probing for one

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def available_kernels():
    here = os.path.dirname(__file__)
    return sorted(m.name[len("bench_"):] for m in pkgutil.iter_modules([here]) if m.name.startswith("bench_"))


def module_tasks(name: str, quick: bool, smoke: bool):
    from . import harness

    harness.SETTINGS.update(quick=quick, smoke=smoke)
    module = importlib.import_module(f".bench_{name}", __package__)
    if hasattr(module, "tasks"):
        return module.tasks(quick=quick, smoke=smoke)
    return [harness.case_task(c) for c in module.cases(quick=quick, smoke=smoke)]


def run_tasks(name, tasks, ceilings, *, match=None, deadline=None, emit=None, reverse=False) -> list[dict]:
    """Run ``tasks`` (those whose label matches ``match``; last first with ``reverse``), with a progress bar on a
    terminal and one line per point otherwise; a task started after ``deadline`` is recorded as skipped, one
    that raises as failed."""
    from .harness import classify, free_memory, short_line

    tasks = [t for t in tasks if not match or re.search(match, t.label)]
    if reverse:
        tasks = tasks[::-1]
    try:
        from tqdm import tqdm

        bar = tqdm(total=len(tasks), desc=name, disable=not sys.stderr.isatty(), file=sys.stderr)
    except ImportError:
        bar = None
    points = []
    for i, task in enumerate(tasks, 1):
        if deadline is not None and time.time() > deadline:
            new = [dict(task.meta, status="skipped", error="time limit reached before this task started")]
        else:
            try:
                new = task.run(ceilings)
            except Exception as err:  # a task that fails as a whole is recorded, not dropped
                status, message = classify(err)
                if status == "error":
                    traceback.print_exc()
                new = [dict(task.meta, status=status, error=message)]
            finally:
                free_memory()
        for p in new:
            p["module"] = name
            if emit:
                emit(p)
        points += new
        if bar is not None and not bar.disable:
            bar.set_postfix_str(short_line(new[-1])[:70] if new else "")
            bar.update()
        else:
            for p in new:
                print(f"[{i}/{len(tasks)}] {name}: {short_line(p)}", flush=True)
    if bar is not None:
        bar.close()
    return points


def _ceilings_in_process() -> tuple[dict, dict]:
    from .harness import measure_ceilings, torch_machine

    return measure_ceilings(), torch_machine()


def _worker(args) -> int:
    """One module (or the ceilings) in this process, points appended to ``--points-file`` as JSON lines."""
    with open(args.points_file, "a") as out:
        if args.ceilings_only:
            from .harness import device

            if not args.smoke and device() != "cuda":
                print("the worker sees no CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
                return 2
            ceilings, machine = _ceilings_in_process()
            out.write(json.dumps({"ceilings": ceilings, "machine": machine}) + "\n")
            return 0
        ceilings = json.loads(args.ceilings)

        def emit(p):
            out.write(json.dumps(p) + "\n")
            out.flush()

        tasks = module_tasks(args.module, args.quick, args.smoke)
        run_tasks(args.module, tasks, ceilings, match=args.match, deadline=args.deadline, emit=emit,
                  reverse=args.reverse)
    return 0


def _worker_cmd(args, extra) -> list[str]:
    cmd = [sys.executable, "-m", "benchmarks", "_worker"] + extra
    if args.quick:
        cmd.append("--quick")
    if args.smoke:
        cmd.append("--smoke")
    return cmd


def _read_lines(path) -> list[dict]:
    out = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        out.append(json.loads(line))
                    except json.JSONDecodeError:
                        pass  # a line cut off by a crash
    return out


def _run_isolated(args, extra, timeout) -> tuple[int, list[dict]]:
    fd, path = tempfile.mkstemp(prefix="liger-bench-", suffix=".jsonl")
    os.close(fd)
    try:
        proc = subprocess.Popen(_worker_cmd(args, extra + ["--points-file", path]), cwd=REPO)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = "killed after the time limit"
        return rc, _read_lines(path)
    finally:
        os.remove(path)


def _run(args) -> int:
    from . import harness, report

    if args.render:
        print(f"wrote {report.render_files(args.render)}")
        return 0
    kernels = args.kernels or available_kernels()
    unknown = [k for k in kernels if k not in available_kernels()]
    if unknown:
        print(f"unknown benchmark modules {unknown}; available: {available_kernels()}", file=sys.stderr)
        return 2
    env = harness.environment()
    on_gpu = env.get("gpu") is not None  # nvidia-smi saw one; this process does not touch CUDA to find out
    if not args.smoke and not on_gpu:
        import torch

        if not torch.cuda.is_available():
            print("benchmarks need a CUDA GPU (or --smoke: tiny shapes on the CPU)", file=sys.stderr)
            return 2
    isolate = on_gpu and not args.smoke if args.isolate is None else args.isolate
    start = time.time()
    deadline = start + args.time_limit if args.time_limit is not None else None
    mirror = args.mirror or os.environ.get("LIGER_BENCH_MIRROR") or None

    if isolate and on_gpu:  # this process never initialises CUDA: the workers get the whole GPU
        rc, lines = _run_isolated(args, ["--ceilings-only"], timeout=900)
        if rc != 0 or not lines:
            print(f"measuring the ceilings failed (worker exit {rc})", file=sys.stderr)
            return 1
        ceilings, machine = lines[-1]["ceilings"], lines[-1]["machine"]
    else:
        if not args.smoke:
            from .harness import device

            if device() != "cuda":
                print("benchmarks need a CUDA GPU (or --smoke)", file=sys.stderr)
                return 2
        ceilings, machine = _ceilings_in_process()
    print(f"ceilings: {ceilings}", flush=True)
    if not env.get("gpu") and machine.get("gpu"):
        env["gpu"] = machine["gpu"]
    stem = harness.results_stem(env, args.tag, args.out_dir)
    results = harness.new_results(env)
    old = None
    if os.path.exists(stem + ".json") and not args.fresh:
        try:
            old = harness.load_results(stem + ".json")
        except Exception as err:
            print(f"could not read {stem}.json ({err})")
        if old is not None and old.get("schema") == harness.SCHEMA:
            results = old
            print(f"merging into {stem}.json ({len(old.get('points', []))} points; --fresh to start over)")
        else:  # an older or unreadable file is kept: this run writes beside it
            base, n = stem, 2
            while os.path.exists(f"{base}-{n}.json"):
                n += 1
            stem = f"{base}-{n}"
            print(f"{base}.json is not a results file of this version: writing {stem}.json instead")
    results["environment"] = env
    results["ceilings"], results["machine"] = ceilings, machine
    run_record = {"started": datetime.datetime.now().isoformat(timespec="seconds"), "argv": args.argv,
                  "modules": kernels, "quick": args.quick, "smoke": args.smoke, "ceilings": ceilings,
                  "jax_inputs": "chained below 2 x L2 (copies called in turn by one program); above, donated "
                                "where that removes a copy"}
    results.setdefault("runs", []).append(run_record)

    this_run = []
    for i, name in enumerate(kernels, 1):
        print(f"== {name} ({i}/{len(kernels)})", flush=True)
        if isolate:
            extra = ["--module", name, "--ceilings", json.dumps(ceilings)]
            if args.match:
                extra += ["--match", args.match]
            if args.reverse:
                extra.append("--reverse")
            if deadline is not None:
                extra += ["--deadline", str(deadline)]
            # past the time limit a task still running gets one more minute, then the worker is stopped (its
            # points so far are kept): the run's files are written before the device tool's own limit
            timeout = None if deadline is None else max(60.0, deadline - time.time() + 60)
            rc, points = _run_isolated(args, extra, timeout)
            if rc != 0:
                points.append({"module": name, "kind": "kernel", "kernel": name, "pass": "-", "shape": "-",
                               "provider": "worker", "framework": "-", "status": "error",
                               "error": f"worker process exited: {rc} (points before the exit are kept)"})
        else:
            try:
                tasks = module_tasks(name, args.quick, args.smoke)
                points = run_tasks(name, tasks, ceilings, match=args.match, deadline=deadline, reverse=args.reverse)
            except Exception as err:
                traceback.print_exc()
                points = [{"module": name, "kind": "kernel", "kernel": name, "pass": "-", "shape": "-",
                           "provider": "module", "framework": "-", "status": "error",
                           "error": f"{type(err).__name__}: {err}"[:400]}]
        this_run += points
        results["points"] = [p for p in results["points"]  # a module-level failure of an earlier run is stale
                             if not (p.get("module") == name and p.get("provider") in ("worker", "module"))]
        harness.merge_points(results, points)
        run_record["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
        json_path, md_path = harness.write_results(results, stem, mirror,
                                                   changed={report.section_of(p) for p in points})
    if not kernels:
        json_path, md_path = harness.write_results(results, stem, mirror)
    print(report.console_summary(this_run))
    print(f"wrote {json_path}, {md_path} and {stem}-plots/ ({len(this_run)} points in this run, "
          f"{time.time() - start:.0f} s)")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run benchmark sweeps")
    run.add_argument("--kernels", nargs="*", default=None, help=f"subset of {available_kernels()}")
    run.add_argument("--quick", action="store_true", help="fewer shapes")
    run.add_argument("--smoke", action="store_true", help="tiny shapes, few repetitions, CPU allowed")
    run.add_argument("--tag", default=None, help="suffix for the results files")
    run.add_argument("--match", default=None, help="run only the tasks whose label matches this regex")
    run.add_argument("--time-limit", type=float, default=None,
                     help="seconds: tasks not started by then are recorded as skipped")
    run.add_argument("--out-dir", default=None, help="where the results go (default benchmarks/results)")
    run.add_argument("--mirror", default=None, help="also copy the results files here after each module")
    run.add_argument("--fresh", action="store_true", help="do not merge into an existing results file")
    run.add_argument("--reverse", action="store_true",
                     help="run each module's tasks last first (does a point's time depend on what ran before it?)")
    run.add_argument("--render", default=None, metavar="JSON", help="only re-render this results file")
    iso = run.add_mutually_exclusive_group()
    iso.add_argument("--isolate", dest="isolate", action="store_true", default=None,
                     help="one worker process per module (default on a GPU)")
    iso.add_argument("--no-isolate", dest="isolate", action="store_false")
    render = sub.add_parser("render", help="re-render the report and plots of a results file")
    render.add_argument("json")
    merge = sub.add_parser("merge", help="merge results files (later ones win) into one file, report and plots")
    merge.add_argument("out", help="the merged results file to write (.json)")
    merge.add_argument("inputs", nargs="+", help="results files, oldest first")
    sub.add_parser("list", help="list benchmark modules")
    worker = sub.add_parser("_worker", help=argparse.SUPPRESS)
    worker.add_argument("--module")
    worker.add_argument("--quick", action="store_true")
    worker.add_argument("--smoke", action="store_true")
    worker.add_argument("--match", default=None)
    worker.add_argument("--deadline", type=float, default=None)
    worker.add_argument("--reverse", action="store_true")
    worker.add_argument("--ceilings", default="{}")
    worker.add_argument("--ceilings-only", action="store_true")
    worker.add_argument("--points-file", required=True)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.command == "list":
        print("\n".join(available_kernels()))
        return 0
    if args.command == "render":
        from .report import render_files

        print(f"wrote {render_files(args.json)}")
        return 0
    if args.command == "merge":
        if not args.out.endswith(".json"):
            parser.error(f"merge: the output must be a .json file, got {args.out!r}")
        from . import harness

        merged = harness.merge_result_files(args.inputs)
        json_path, md_path = harness.write_results(merged, args.out[:-5])
        print(f"wrote {json_path} and {md_path} ({len(merged['points'])} points from {len(args.inputs)} files)")
        return 0
    if args.command == "_worker":
        return _worker(args)
    return _run(args)


if __name__ == "__main__":
    sys.exit(main())

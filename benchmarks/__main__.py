"""``python -m benchmarks run [--kernels NAME ...] [--quick] [--tag TAG]``: run the sweeps, print a short table,
write benchmarks/results/<gpu>-<date>[-tag].json and .md."""

import argparse
import importlib
import os
import pkgutil
import sys

# jax must not take 75% of the GPU up front: torch providers share the card.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def available_kernels():
    here = os.path.dirname(__file__)
    return sorted(m.name[len("bench_"):] for m in pkgutil.iter_modules([here]) if m.name.startswith("bench_"))


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run benchmark sweeps")
    run.add_argument("--kernels", nargs="*", default=None, help=f"subset of {available_kernels()}")
    run.add_argument("--quick", action="store_true", help="fewer shapes")
    run.add_argument("--tag", default=None, help="suffix for the results files")
    sub.add_parser("list", help="list benchmark modules")
    args = parser.parse_args(argv)
    if args.command == "list":
        print("\n".join(available_kernels()))
        return 0

    import torch

    if not torch.cuda.is_available():
        print("benchmarks need a CUDA GPU", file=sys.stderr)
        return 2
    from .harness import environment, measure_ceilings, run_case, short_table, write_results

    kernels = args.kernels or available_kernels()
    ceilings = measure_ceilings()
    print(f"ceilings: {ceilings}", flush=True)
    cases = []
    for name in kernels:
        cases += importlib.import_module(f".bench_{name}", __package__).cases(quick=args.quick)
    points = []
    for i, case in enumerate(cases, 1):
        point = run_case(case, ceilings)
        points.append(point)
        status = f"{point['median_ms']:.3f} ms" if point["status"] == "ok" else point["status"]
        print(f"[{i}/{len(cases)}] {case.kernel} {case.pass_} {case.shape} {case.provider}: {status}", flush=True)
    json_path, md_path = write_results(environment(), ceilings, points, args.tag)
    print(short_table(points))
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

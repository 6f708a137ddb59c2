"""Benchmark harness: timing, peak memory, ceilings, tasks and the results file.

A benchmark module (``benchmarks/bench_<name>.py``) defines either ``cases(quick, smoke) -> list[Case]`` (one
timed op per case: a kernel, a pass, a shape, a provider) or ``tasks(quick, smoke) -> list[Task]`` (work that
makes its own points, e.g. the end-to-end training steps). A case names the bytes that must move (each input read
once, each output written once) or the flops that must be done, and ``make``: a function that allocates fresh
random inputs and returns a zero-argument callable running the op once.

Timing:
- torch on a GPU: CUDA events around each repetition, L2 flushed (a 256 MB buffer read) before each one, so
  inputs that would fit in L2 are never timed hot (what rotating them would achieve), and a spin kernel queued
  before each, so the host enqueues the whole op while the GPU is busy: the time is device time, as in a
  training step where the host runs ahead (the host time of one call is kept as ``host_ms``: above the device
  time, an op run alone is launch-bound); ~25 ms of warm-up, then ~100 ms of repetitions and at least
  ``min_reps`` of them; all repetition times are kept (median, p20, p80).
- jax: host clock around several queued calls and one ``block_until_ready`` (jax runs on its own stream); inputs
  that fit in L2 are copied a few times and one program calls the op on each copy in turn (so that a short op
  is not timed by the host's dispatch of a program per call); of larger ones, those whose donation removes a
  copy from the compiled program are donated (each call a fresh copy made before the clock starts), as a model's
  intermediates are: an op writing over its operand is not charged with a defensive copy, and an op that only
  reads its operand is not charged with a copy into a donated buffer.
- CPU (``--smoke``: tiny shapes, kernels in Triton's interpreter): host clock, few repetitions. These numbers
  test the code path, not the kernels.

Memory: torch, peak allocated during one run above what was allocated before it (the inputs); jax, XLA's
compiled-program temporaries + outputs. A provider that fails is recorded (status ``oom`` / ``error`` /
``unavailable`` when its package is not importable / ``skipped``), never dropped.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import re
import statistics
import subprocess
import time
import traceback
from typing import Any, Callable

RESULTS_DIR = os.path.join(os.path.dirname(__file__), "results")
SCHEMA = 2

# Set by the runner (benchmarks/__main__.py) before any module builds its cases.
SETTINGS = {"smoke": False, "quick": False}


def smoke() -> bool:
    return bool(SETTINGS["smoke"])


def _torch():
    import torch

    return torch


def device() -> str:
    """Where torch inputs live: ``cuda`` when a GPU is visible, else ``cpu`` (smoke runs, interpreter)."""
    try:
        return "cuda" if _torch().cuda.is_available() else "cpu"
    except Exception:
        return "cpu"


class Skipped(Exception):
    """A provider deliberately not run at this point (recorded with status ``skipped``)."""


@dataclasses.dataclass
class Case:
    kernel: str
    pass_: str  # "fwd" or "fwd+bwd"
    shape: str
    dtype: str
    provider: str
    framework: str  # "torch" or "jax"
    make: Callable[[], Callable[[], Any]]
    bytes: int = 0
    flops: int = 0
    params: dict = dataclasses.field(default_factory=dict)  # the shape's named sizes (the plots' axes)

    @property
    def label(self) -> str:
        return f"{self.kernel} {self.pass_} {self.shape} {self.provider}"

    def meta(self) -> dict:
        point = {k: getattr(self, k) for k in ("kernel", "shape", "dtype", "provider", "framework", "bytes",
                                                "flops")}
        point.update({"kind": "kernel", "pass": self.pass_, "params": dict(self.params)})
        return point


@dataclasses.dataclass
class Task:
    """A unit of work: ``run(ceilings)`` returns its points. ``meta``: the fields a point of this task carries,
    used to record it when the task is skipped or fails as a whole."""

    label: str
    run: Callable[[dict], list]
    meta: dict


def case_task(case: Case) -> Task:
    return Task(case.label, lambda ceilings: [run_case(case, ceilings)], case.meta())


# ---------------------------------------------------------------------------------------------------------
# Failures


def classify(err: BaseException) -> tuple[str, str]:
    """(status, message) of an exception: ``oom``, ``unavailable`` (an ImportError: the provider's package is
    missing), ``skipped`` or ``error``."""
    text = f"{type(err).__name__}: {str(err)[:400]}"
    if isinstance(err, Skipped):
        return "skipped", str(err)[:400]
    if isinstance(err, ImportError):
        return "unavailable", text
    low = str(err).lower()
    if ("out of memory" in low or "resource_exhausted" in low or "resource exhausted" in low
            or type(err).__name__ == "OutOfMemoryError"):
        return "oom", text
    return "error", text


def free_memory() -> None:
    """On a GPU: collect garbage (cycles holding tensors, tracebacks) and return torch's cached blocks to the
    driver, after each point and after an OOM. Nothing to do on the CPU."""
    try:
        torch = _torch()
        if torch.cuda.is_available():
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    except Exception:
        pass


# ---------------------------------------------------------------------------------------------------------
# Timing


def _reps() -> dict:
    if smoke():  # one repetition of a slow (interpreted) op, up to three of a fast one
        return {"warmup_ms": 0.0, "rep_ms": 1.0, "min_reps": 1, "max_reps": 3}
    return {"warmup_ms": 25.0, "rep_ms": 100.0, "min_reps": 10, "max_reps": 1000}


def _prepare(run) -> Callable[[], None]:
    """The runner's untimed set-up for a repetition (restoring inputs an op writes into), or a no-op."""
    return getattr(run, "prepare", None) or (lambda: None)


def _host_ms(run, n: int = 5) -> float:
    """Median host time of enqueuing ``run()`` (the GPU idle and drained before each): Python, autograd and
    launch overhead, plus any host synchronisation inside the op."""
    torch = _torch()
    times = []
    for _ in range(n):
        _prepare(run)()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def _sleep_cycles(host_ms: float) -> int:
    """GPU clock cycles to spin before each timed repetition, so the host has enqueued the whole op before the
    GPU reaches it: twice its host time (at up to 2 GHz; a lower clock only spins longer), at least 50 us and
    at most 10 ms (a host time that long is a synchronisation inside the op, which no head start hides)."""
    return int(min(max(2 * host_ms, 0.05), 10.0) * 2e6)


def _l2_flush(torch):
    """What evicts the inputs from L2 before a repetition: reading a 256 MB buffer (L2 left holding clean
    lines), or with ``LIGER_BENCH_FLUSH=write`` zeroing it, as ``triton.testing.do_bench`` does. Zeroing leaves L2
    full of dirty lines whose write-back the timed op then pays, by an amount that depends on where its buffers
    land: on the H200 an RMSNorm forward at 4096 x 4096 took 0.0200-0.0223 ms after zeroing, depending on the
    allocations before it, and 0.0186-0.0188 after reading, every time
    (benchmarks/results/h200-2026-12-06-order_probe_*.txt)."""
    buf = torch.zeros(64 * 2**20, dtype=torch.float32, device="cuda")
    if os.environ.get("LIGER_BENCH_FLUSH", "read") == "write":
        return buf.zero_
    return lambda: torch.amax(buf)


def _time_cuda(run, warmup_ms, rep_ms, min_reps, max_reps, stats: dict | None = None) -> list[float]:
    """GPU milliseconds of each repetition: CUDA events around it, L2 flushed before it, and the GPU kept busy
    (a spin kernel) while the host enqueues it, so the time is the op's device time, not its launch overhead
    (``stats["host_ms"]`` gets that). An op that synchronises with the host inside still pays for it."""
    torch = _torch()
    prepare = _prepare(run)
    flush = _l2_flush(torch)
    prepare()
    run()  # first call: compilation, autotuning, lazy allocations
    torch.cuda.synchronize()
    host_ms = _host_ms(run)
    cycles = _sleep_cycles(host_ms)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        prepare()
        flush()
        torch.cuda._sleep(cycles)
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(end), 1e-3)
    if estimate > 1000:  # a second per call: a few repetitions are all the time allows
        min_reps = min(min_reps, 3)
    n_warmup = int(warmup_ms / estimate)
    n_reps = max(min_reps, min(max_reps, int(rep_ms / estimate)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_reps)]
    for _ in range(n_warmup):
        prepare()
        run()
    for i in range(n_reps):
        prepare()
        flush()
        torch.cuda._sleep(cycles)
        starts[i].record()
        run()
        ends[i].record()
    torch.cuda.synchronize()
    if stats is not None:
        stats["host_ms"] = round(host_ms, 4)
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def _time_host(run, min_reps, max_reps, rep_ms, sync=None) -> list[float]:
    sync = sync or (lambda out: None)
    prepare = _prepare(run)
    prepare()
    sync(run())
    times = []
    total = 0.0
    while len(times) < min_reps or (total < rep_ms and len(times) < max_reps):
        prepare()
        t0 = time.perf_counter()
        sync(run())
        times.append((time.perf_counter() - t0) * 1e3)
        total += times[-1]
    return times


def time_torch(run, stats: dict | None = None) -> list[float]:
    """Milliseconds of each repetition of ``run()`` (a torch op); on a GPU, device time (``stats`` gets the host
    time of one call as ``host_ms``)."""
    reps = _reps()
    if device() == "cuda":
        return _time_cuda(run, stats=stats, **reps)
    return _time_host(run, reps["min_reps"], reps["max_reps"], reps["rep_ms"])


def time_jax(run) -> list[float]:
    """Milliseconds per call: each repetition queues ``calls`` calls and waits for them all (a donating runner's
    fresh arguments for them are made before the clock starts)."""
    import jax

    prepare = getattr(run, "prepare", None) or (lambda n=1: None)
    per_run = getattr(run, "calls_per_run", 1)  # a chained runner's calls in one program
    prepare(1)
    jax.block_until_ready(run())  # compile
    if smoke():
        return [t / per_run for t in _time_host(run, 1, 3, 1.0, sync=jax.block_until_ready)]
    prepare(3)
    t0 = time.perf_counter()
    for _ in range(3):
        jax.block_until_ready(run())
    estimate = max((time.perf_counter() - t0) * 1e3 / 3, 1e-3)
    calls = max(1, min(10, math.ceil(5.0 / estimate)))
    reps = max(5, min(15, int(3000.0 / (calls * estimate))))
    times = []
    for _ in range(reps):
        prepare(calls)
        start = time.perf_counter()
        out = [run() for _ in range(calls)]
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) * 1e3 / (calls * per_run))
    return times


def torch_peak_extra_mb(run) -> float | None:
    """Peak memory allocated during one ``run()`` above what was allocated before it (None on the CPU)."""
    torch = _torch()
    if device() != "cuda":
        return None
    _prepare(run)()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def summarize_ms(times) -> dict:
    return {"median_ms": round(statistics.median(times), 4), "p20_ms": round(percentile(times, 0.2), 4),
            "p80_ms": round(percentile(times, 0.8), 4), "reps": len(times)}


def matmul_rate(ceilings: dict) -> float | None:
    return ceilings.get("bf16_matmul_TFLOPs") or ceilings.get("matmul_TFLOPs")


def _sig(x: float) -> float:
    """Rounded for the file: 1 decimal from 100 up, else 3 significant digits (CPU smoke rates are tiny)."""
    return round(x, 1) if abs(x) >= 100 else float(f"{x:.3g}")


def add_floor(point: dict, ceilings: dict) -> None:
    """GB/s or TFLOP/s reached, the floor (bytes / copy bandwidth, flops / matmul rate: the larger) and the
    fraction of it reached (floor / median)."""
    median = point["median_ms"]
    floor = 0.0
    if point.get("bytes"):
        point["GBps"] = _sig(point["bytes"] / median / 1e6)
        if ceilings.get("copy_GBps"):
            floor = max(floor, point["bytes"] / (ceilings["copy_GBps"] * 1e6))
    if point.get("flops"):
        point["TFLOPs"] = _sig(point["flops"] / median / 1e9)
        if matmul_rate(ceilings):
            floor = max(floor, point["flops"] / (matmul_rate(ceilings) * 1e9))
    if floor:
        point["floor_ms"] = float(f"{floor:.4g}")  # significant digits: a tiny (smoke) point's floor is not 0
        frac = floor / median
        point["of_floor"] = round(frac, 3) if frac >= 0.01 else float(f"{frac:.2g}")


def run_case(case: Case, ceilings: dict) -> dict:
    point = case.meta()
    run = None
    try:
        run = case.make()
        if case.framework == "torch":
            times = time_torch(run, point)
            peak = torch_peak_extra_mb(run)
        else:
            times = time_jax(run)
            peak = getattr(run, "peak_extra_MB", None)
        point["peak_extra_MB"] = None if peak is None else round(peak, 1)
        point.update(status="ok", **summarize_ms(times))
        add_floor(point, ceilings)
    except Exception as err:  # a failing provider is recorded, not dropped
        point["status"], point["error"] = classify(err)
        if point["status"] == "error":
            traceback.print_exc()
    finally:
        run = None
        free_memory()
    return point


# ---------------------------------------------------------------------------------------------------------
# Ceilings and the environment


def measure_ceilings() -> dict:
    """Copy bandwidth (bytes read + written) and bf16 matmul rate, measured now (on the CPU: small sizes, for
    smoke runs only)."""
    torch = _torch()
    if device() == "cuda":
        src = torch.randn(2 * 1024**3 // 4, device="cuda")
        dst = torch.empty_like(src)
        copy_ms = statistics.median(_time_cuda(lambda: dst.copy_(src), 50, 200, 10, 1000))
        copy_gbps = 2 * src.numel() * 4 / copy_ms / 1e6
        del src, dst
        n = 8192
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        mm_ms = statistics.median(_time_cuda(lambda: a @ b, 50, 200, 10, 1000))
        del a, b
        torch.cuda.empty_cache()
        jax_gbps = _jax_copy_gbps(src_bytes=2 * 1024**3)
    else:
        src = torch.randn(2**20)
        dst = torch.empty_like(src)
        copy_ms = statistics.median(_time_host(lambda: dst.copy_(src), 3, 5, 0.0))
        copy_gbps = 2 * src.numel() * 4 / copy_ms / 1e6
        n = 128
        a = torch.randn(n, n, dtype=torch.bfloat16)
        b = torch.randn(n, n, dtype=torch.bfloat16)
        mm_ms = statistics.median(_time_host(lambda: a @ b, 3, 5, 0.0))
        jax_gbps = None
    # significant digits, not decimals: a busy CPU's bf16 matmul rate (~1e-4 TFLOP/s) must not round to 0
    out = {"copy_GBps": _sig(copy_gbps), "bf16_matmul_TFLOPs": _sig(2 * n**3 / mm_ms / 1e9), "device": device()}
    if jax_gbps:
        out["jax_copy_GBps"] = _sig(jax_gbps)
    return out


def _jax_copy_gbps(src_bytes: int) -> float | None:
    """Bandwidth of an XLA elementwise op (read + write, fresh output) timed by :func:`time_jax`: the jax
    columns' timer on the copy ceiling's bytes, so a jax-vs-torch gap can be told apart from the timing method.
    None where jax has no GPU."""
    try:
        import jax
        import jax.numpy as jnp

        if jax.default_backend() != "gpu":
            return None
        x = jax.random.normal(jax.random.key(11), (src_bytes // 4,), jnp.float32)
        negate = jax.jit(lambda v: -v)
        ms = statistics.median(time_jax(lambda: negate(x)))
        del x
        return 2 * src_bytes / ms / 1e6
    except Exception:  # a ceiling that cannot be measured is left out, not fatal
        traceback.print_exc()
        return None


def torch_machine() -> dict:
    """Properties of the GPU as torch sees it (call where CUDA may be initialised: a worker)."""
    torch = _torch()
    if not torch.cuda.is_available():
        return {}
    out = {"gpu": torch.cuda.get_device_name()}
    try:
        props = torch.cuda.get_device_properties(0)
        out["gpu_memory_GiB"] = round(props.total_memory / 2**30, 1)
        out["sm_count"] = props.multi_processor_count
        l2 = getattr(props, "L2_cache_size", None)
        if l2:
            out["l2_MB"] = round(l2 / 2**20, 1)
        out["cuda"] = torch.version.cuda
    except Exception:
        pass
    return out


def l2_bytes() -> int:
    try:
        torch = _torch()
        if torch.cuda.is_available():
            return int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or 64 * 2**20)
    except Exception:
        pass
    return 64 * 2**20


PACKAGES = ("torch", "triton", "jax", "jaxlib", "flax", "optax", "transformers", "liger-kernel",
            "cut-cross-entropy", "jax-triton", "liger-kernels", "numpy")


def _nvidia_smi() -> dict:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        if out.returncode != 0 or not out.stdout.strip():
            return {}
        fields = [s.strip() for s in out.stdout.strip().splitlines()[0].split(",")]
        return dict(zip(("gpu", "driver", "gpu_memory"), fields))
    except Exception:
        return {}


def environment() -> dict:
    """Date, machine and package versions, without initialising CUDA or jax in this process."""
    from importlib import metadata

    env = {"date": datetime.date.today().isoformat(), "python": platform.python_version(),
           "platform": platform.platform(), "cpu_count": os.cpu_count()}
    for name in PACKAGES:
        try:
            env[name] = metadata.version(name)
        except Exception:
            env[name] = None
    env.update(_nvidia_smi())
    env.setdefault("gpu", None)
    return env


# ---------------------------------------------------------------------------------------------------------
# Results files


def point_key(p: dict) -> tuple:
    return tuple(str(p.get(k)) for k in ("module", "kind", "kernel", "model", "pass", "shape", "provider",
                                          "framework"))


def results_stem(env: dict, tag: str | None, out_dir: str | None = None) -> str:
    gpu = (env.get("gpu") or "cpu").replace("NVIDIA ", "").replace(" ", "-").lower()
    return os.path.join(out_dir or RESULTS_DIR, f"{gpu}-{env['date']}" + (f"-{tag}" if tag else ""))


def load_results(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def new_results(env: dict) -> dict:
    return {"schema": SCHEMA, "environment": env, "ceilings": {}, "machine": {}, "runs": [], "points": []}


def merge_points(results: dict, points: list[dict]) -> None:
    """Add ``points`` to ``results``: a point with the key of an existing one replaces it in place."""
    index = {point_key(p): i for i, p in enumerate(results["points"])}
    for p in points:
        k = point_key(p)
        if k in index:
            results["points"][index[k]] = p
        else:
            index[k] = len(results["points"])
            results["points"].append(p)


def merge_result_files(paths: list[str]) -> dict:
    """One results dict from several files, in order: a later file's point replaces an earlier one with the same
    key, except a point the later run only skipped (its time limit) or did not run. Each point keeps the name of
    the file it came from (``source``); the runs are listed together; the environment and ceilings are the last
    file's (each point carries the floor its own run measured)."""
    if not paths:
        raise ValueError("merge needs at least one results file")
    merged = None
    for path in paths:
        results = load_results(path)
        if merged is None:
            merged = new_results(results.get("environment") or {})
        for key in ("schema", "environment", "ceilings", "machine"):
            if results.get(key):
                merged[key] = results[key]
        merged["runs"] += results.get("runs") or []
        existing = {point_key(p): p for p in merged["points"]}
        fresh = []
        for p in results.get("points") or []:
            old = existing.get(point_key(p))
            if old is not None and old.get("status") == "ok" and p.get("status") == "skipped":
                continue
            fresh.append({**p, "source": p.get("source") or os.path.basename(path),
                          "ceilings": p.get("ceilings") or results.get("ceilings") or {}})
        merge_points(merged, fresh)
    return merged


def write_results(results: dict, stem: str, mirror: str | None = None, changed=None) -> tuple[str, str]:
    """Write ``<stem>.json``, then render ``<stem>.md`` and ``<stem>-plots/*.png`` from it (also copied to
    ``mirror`` when given: the device tool's $OUT). ``changed``: the report sections whose plots need drawing
    again (None: all)."""
    from . import report

    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump(results, f, indent=1)
    md_path = report.render_files(stem + ".json", changed=changed)
    if mirror:
        import shutil

        os.makedirs(mirror, exist_ok=True)
        for path in (stem + ".json", md_path):
            shutil.copy(path, mirror)
        plots = stem + "-plots"
        if os.path.isdir(plots):
            shutil.copytree(plots, os.path.join(mirror, os.path.basename(plots)), dirs_exist_ok=True)
    return stem + ".json", md_path


def short_line(p: dict) -> str:
    """One line of progress output for a point."""
    if p.get("kind") in ("e2e_step",):
        what = f"{p.get('tokens_per_s', 0):.0f} tok/s" if p["status"] == "ok" else p["status"]
        return f"{p.get('model')} {p.get('shape')} {p.get('provider')}: {what}"
    if p.get("kind") == "e2e_longest":
        return f"{p.get('model')} longest {p.get('provider')}: {p.get('longest_fit')} ({p['status']})"
    what = f"{p['median_ms']:.3f} ms" if p["status"] == "ok" else p["status"]
    if p["status"] == "ok" and p.get("of_floor"):
        what += f" ({100 * p['of_floor']:.0f}% of floor)"
    return f"{p.get('kernel')} {p.get('pass')} {p.get('shape')} {p.get('provider')}: {what}"


# ---------------------------------------------------------------------------------------------------------
# Provider helpers for the kernel modules


TORCH_PROVIDERS = ("liger_torch", "torch_eager", "torch_compile", "liger_kernel")
JAX_PROVIDERS = ("liger_jax", "xla")


def provider_cases(kernel, pass_, shape, make_torch, make_jax, torch_names=TORCH_PROVIDERS,
                   jax_names=JAX_PROVIDERS, dtype="bf16", bytes=0, flops=0, params=None) -> list[Case]:
    """The cases of one kernel, pass and shape: one per torch provider, then one per jax provider, with
    ``make_torch(name)`` / ``make_jax(name)`` as each one's ``make``."""
    params = dict(params or {})
    return ([Case(kernel, pass_, shape, dtype, name, "torch", make_torch(name), bytes=bytes, flops=flops,
                  params=params) for name in torch_names]
            + [Case(kernel, pass_, shape, dtype, name, "jax", make_jax(name), bytes=bytes, flops=flops,
                    params=params) for name in jax_names])


def passes() -> tuple[str, ...]:
    """The passes measured: both, or only forward+backward in smoke runs (the longer code path)."""
    return ("fwd+bwd",) if smoke() else ("fwd", "fwd+bwd")


def sweep(fixed: dict, axis: str, values) -> list[dict]:
    """Shapes as dicts: ``fixed`` with ``axis`` set to each of ``values``."""
    return [{**fixed, axis: v} for v in values]


def unique_shapes(*lists) -> list[dict]:
    out = []
    for shapes in lists:
        for s in shapes:
            if s not in out:
                out.append(s)
    return out


def row_cases(kernel, shapes, make_torch, make_jax, tensors_moved, torch_names=TORCH_PROVIDERS,
              axes=("tokens", "hidden")) -> list[Case]:
    """The cases of a kernel over bf16 (rows, width) tensors: for each shape in ``shapes`` ((rows, width) tuples
    or dicts keyed by ``axes``), each pass, the provider cases, ``make_torch(name, rows, width, pass_)`` /
    ``make_jax(...)`` giving each ``make``, with bytes = ``tensors_moved[pass_]`` full tensors of 2-byte
    elements."""
    out = []
    for shape in shapes:
        n, h = (shape[axes[0]], shape[axes[1]]) if isinstance(shape, dict) else shape
        for pass_ in passes():
            out += provider_cases(kernel, pass_, f"{n}x{h}", lambda name: make_torch(name, n, h, pass_),
                                  lambda name: make_jax(name, n, h, pass_), torch_names=torch_names,
                                  bytes=tensors_moved[pass_] * n * h * 2, params={axes[0]: n, axes[1]: h})
    return out


_COMPILE_LIMIT_SET = False


def eager_or_compiled(name, eager):
    """The ``torch_eager`` provider (``eager`` itself) or the ``torch_compile`` one (``torch.compile(eager)``,
    static shapes; not run in smoke mode, where compiling would dominate)."""
    global _COMPILE_LIMIT_SET
    if name == "torch_eager":
        return eager
    if name == "torch_compile":
        if smoke():
            raise Skipped("torch.compile is not run in smoke mode")
        import torch

        if not _COMPILE_LIMIT_SET:  # every shape compiles its own graph: keep dynamo from falling back to eager
            cfg = torch._dynamo.config
            for attr in ("recompile_limit", "cache_size_limit"):
                if hasattr(cfg, attr):
                    setattr(cfg, attr, max(getattr(cfg, attr), 512))
            for attr in ("accumulated_recompile_limit", "accumulated_cache_size_limit"):
                if hasattr(cfg, attr):
                    setattr(cfg, attr, max(getattr(cfg, attr), 4096))
            _COMPILE_LIMIT_SET = True
        return torch.compile(eager, dynamic=False)
    raise KeyError(name)


def torch_fwd_bwd(fn, inputs, grad):
    """Runner for forward + backward of ``fn(*inputs)`` against a fixed output gradient (a tuple of them where
    ``fn`` returns a tuple).

    The gradients are taken with ``torch.autograd.grad``, not accumulated into ``.grad``: in a model, dx flows
    to the previous layer, while AccumulateGrad on a held leaf copies a gradient that aliases a held tensor (ops
    that write dx over dy, ours and Liger-Kernel's, would pay a copy no training step pays). Ops that write into
    their inputs or into the output gradient get them back before each repetition (``run.prepare``, called
    outside the timed region)."""
    import torch

    grads = tuple(grad) if isinstance(grad, (tuple, list)) else (grad,)
    held = [t for t in (*inputs, *grads) if isinstance(t, torch.Tensor)]
    originals = [t.detach().clone() for t in held]
    wrt = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]

    def prepare():
        with torch.no_grad():
            for t, original in zip(held, originals):
                t.copy_(original)

    def run():
        outputs = fn(*inputs)
        torch.autograd.grad(outputs, wrt, grads if isinstance(outputs, (tuple, list)) else grads[0])

    run.prepare = prepare
    return run


def torch_log_prob_pair_maker(provider, n, v, pass_, target_probs=False):
    """A case's ``make`` for a distribution loss ``provider()(input, target)`` over two (n, v) bf16 log-prob
    tensors (the target as probabilities with ``target_probs``); only the input is differentiated (the target is
    a constant, as a teacher's)."""
    def make():
        import torch

        fn = provider()
        x = torch.randn(n, v, device=device(), dtype=torch.bfloat16).log_softmax(-1)
        t = torch.randn(n, v, device=device(), dtype=torch.bfloat16).log_softmax(-1)
        if target_probs:
            t = t.exp()
        x.requires_grad_(pass_ != "fwd")
        return torch_pass_runner(lambda a: fn(a, t), (x,), torch.tensor(1.0, device=device()), pass_)

    return make


def torch_pass_runner(fn, inputs, grad, pass_):
    """``fwd``: a runner of ``fn(*inputs)``; ``fwd+bwd``: ``torch_fwd_bwd(fn, inputs, grad)``."""
    if pass_ == "fwd":
        return lambda: fn(*inputs)
    return torch_fwd_bwd(fn, inputs, grad)


def jax_extra_mb(compiled) -> float | None:
    """Device memory a compiled XLA program needs beyond its arguments (temporaries + outputs that do not reuse a
    donated argument's buffer)."""
    try:
        analysis = compiled.memory_analysis()
        return (analysis.temp_size_in_bytes + analysis.output_size_in_bytes
                - analysis.alias_size_in_bytes) / 2**20
    except Exception:
        return None


def jax_runner(fn, *args):
    """jit and compile ``fn`` for ``args``, and return a zero-argument runner carrying the program's extra
    memory (of one call). Arguments that fit in L2 are copied a few times and one program calls ``fn`` on each
    copy in turn (:func:`chained_jax_runner`); larger ones are donated (:func:`donating_jax_runner`). Both
    donate an argument only where that removes a copy from the program."""
    import jax
    import jax.numpy as jnp

    leaves = jax.tree.leaves(args)
    nbytes = sum(int(getattr(x, "nbytes", 0)) for x in leaves)
    if not smoke() and device() == "cuda" and nbytes >= 2 * l2_bytes():
        return donating_jax_runner(fn, *args)
    if not smoke() and device() == "cuda" and 0 < nbytes < 2 * l2_bytes():
        copies = min(16, math.ceil(4 * l2_bytes() / nbytes))
        return chained_jax_runner(fn, [args] + [jax.tree.map(jnp.copy, args) for _ in range(copies - 1)])
    compiled = jax.jit(fn).lower(*args).compile()

    def run():
        return compiled(*args)

    run.peak_extra_MB = jax_extra_mb(compiled)
    return run


def _donation_with_fewest_copies(compile_donating, n_leaves):
    """``(donated leaf positions, compiled program, its copy bytes)``: each position is donated, greedily in
    order, only if that removes copy bytes from the program ``compile_donating(positions)`` (none are tried when
    the program without donation has no copy)."""
    donated: frozenset = frozenset()
    compiled = compile_donating(donated)
    copies = hlo_copy_bytes(compiled)
    for i in range(n_leaves if copies else 0):
        trial = compile_donating(donated | {i})
        trial_copies = hlo_copy_bytes(trial)
        if trial_copies < copies:
            donated, compiled, copies = donated | {i}, trial, trial_copies
    return donated, compiled, copies


def chained_jax_runner(fn, sets):
    """One program calling ``fn`` on each argument set in turn (``run.calls_per_run`` calls per run). A call of
    tens of microseconds, one program each, is timed by the host's dispatch of the program, not by the GPU; here
    the dispatch is paid once for all. Each call's arguments pass through an optimization barrier together with
    the previous call's outputs, so XLA runs the calls one after another, as a stream would, and cannot fuse
    them into one kernel (its horizontal fusion would merge independent small ops).

    An op that writes over an operand (our kernels' ``input_output_aliases``) makes XLA copy that operand when
    the program's caller keeps it; in a model it is an intermediate and nothing is copied. So argument positions
    are donated (every set's leaf at that position) where that removes copy bytes, and ``run.prepare(n)`` makes
    fresh copies of the donated leaves for ``n`` runs, untimed. jax ties each donated buffer to the first
    unclaimed output of its shape; the program takes the donated leaves position by position and returns its
    outputs output by output (``run.per_call(outputs)`` regroups them by call), so that the ties are those of a
    single call."""
    import jax
    import jax.numpy as jnp

    flat = [jax.tree.flatten(s) for s in sets]
    treedef = flat[0][1]
    leaf_sets = [leaves for leaves, _ in flat]
    n_leaves, n_calls = len(leaf_sets[0]), len(sets)
    out_treedef = []

    def split(donated):
        """(donated leaves, position-major: one list of every set's leaf per position; kept leaves, per set)"""
        return ([[ls[i] for ls in leaf_sets] for i in sorted(donated)],
                [[x for i, x in enumerate(ls) if i not in donated] for ls in leaf_sets])

    def chained_for(donated):
        slot = {i: k for k, i in enumerate(sorted(donated))}  # leaf position -> its list in the donated part

        def chained(donated_by_position, kept_sets):
            calls, previous = [], ()
            for c, kept in enumerate(kept_sets):
                kept = iter(kept)
                leaves = [donated_by_position[slot[i]][c] if i in slot else next(kept) for i in range(n_leaves)]
                previous, leaves = jax.lax.optimization_barrier((previous, leaves))
                previous = fn(*jax.tree.unflatten(treedef, leaves))
                outs, out_treedef[:] = jax.tree.flatten(previous)[0], [jax.tree.structure(previous)]
                calls.append(outs)
            return [list(column) for column in zip(*calls)]  # output by output
        return chained

    lowered_by = {}

    def compile_donating(donated):
        lowered_by[donated] = jax.jit(chained_for(donated), donate_argnums=(0,) if donated else ()).lower(
            *split(donated))
        return lowered_by[donated].compile()

    donated, compiled, copies = _donation_with_fewest_copies(compile_donating, n_leaves)
    donated_leaves, kept_sets = split(donated)
    pool = []

    def prepare(n: int = 1):
        while donated and len(pool) < n:
            pool.append(jax.tree.map(jnp.copy, donated_leaves))
        jax.block_until_ready(pool)

    def run():
        if donated and not pool:
            prepare(1)
        return compiled(pool.pop() if donated else donated_leaves, kept_sets)

    def per_call(columns):
        return [jax.tree.unflatten(out_treedef[0], list(call)) for call in zip(*columns)]

    def one_call(*leaves):
        return fn(*jax.tree.unflatten(treedef, leaves))

    run.prepare = prepare
    run.per_call = per_call
    run.calls_per_run = n_calls
    run.lowered = lowered_by[donated]
    run.donated = tuple(sorted(donated))
    run.copy_bytes = copies
    # the extra memory of one call, with the same arguments donated
    run.peak_extra_MB = jax_extra_mb(jax.jit(one_call, donate_argnums=run.donated, keep_unused=True).lower(
        *leaf_sets[0]).compile())
    return run


_HLO_COPY = re.compile(r"=\s*(\w+)\[([\d,]*)\]\S*\s+copy(?:-start)?\(")
_HLO_BITS = {"pred": 8, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "f16": 16, "bf16": 16, "s32": 32, "u32": 32,
             "f32": 32, "s64": 64, "u64": 64, "f64": 64}


def hlo_copy_bytes(compiled) -> int:
    """Bytes written by the ``copy`` instructions of a compiled XLA program (its optimised HLO)."""
    total = 0
    for dtype, dims in _HLO_COPY.findall(compiled.as_text()):
        count = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += count * _HLO_BITS.get(dtype, 32) // 8
    return total


def donating_jax_runner(fn, *args):
    """A runner whose program takes the arguments it can overwrite donated, each call a fresh copy of them made
    by ``run.prepare(n)`` (untimed; ``n`` copies ready). In a training step an op's operands are intermediates
    that XLA may overwrite: an op that writes its result over an operand (our kernels' ``input_output_aliases``,
    or XLA's own buffer reuse) must not be charged with the copy XLA inserts to keep a caller's buffer intact,
    which is what a plain ``jit`` of a benchmark function with live arguments measures.

    Donation is not free either: jax ties a donated buffer to an output of the same shape, and where the op
    cannot write that output in place (an rms_norm forward reads x while writing y) XLA adds a copy into the
    donated buffer. So each argument array is donated only if that removes copy bytes from the compiled program
    (greedily, in argument order). ``args`` themselves are never donated."""
    import jax
    import jax.numpy as jnp

    leaves, treedef = jax.tree.flatten(args)

    def flat_fn(*flat):
        return fn(*jax.tree.unflatten(treedef, flat))

    def compile_donating(donated):
        return jax.jit(flat_fn, donate_argnums=tuple(sorted(donated)), keep_unused=True).lower(*leaves).compile()

    donated, compiled, copies = _donation_with_fewest_copies(compile_donating, len(leaves))
    pool = []

    def prepare(n: int = 1):
        while len(pool) < n:
            pool.append([jnp.copy(x) if i in donated else x for i, x in enumerate(leaves)])
        jax.block_until_ready(pool)

    def run():
        if not pool:
            prepare(1)
        return compiled(*pool.pop())

    run.prepare = prepare
    run.compiled = compiled  # for scripts/profile_kernels.py's HLO listing
    run.donated = tuple(sorted(donated))
    run.copy_bytes = copies
    run.peak_extra_MB = jax_extra_mb(compiled)
    return run


def jax_pass_runner(f, inputs, cotangent, pass_, returned_grads=None):
    """``fwd``: ``jax_runner(f, *inputs)``; ``fwd+bwd``: the jitted vjp of ``f`` at ``inputs`` applied to
    ``cotangent`` (a tuple of them where ``f`` returns a tuple), inputs and cotangent passed as arguments. The
    program returns the forward's output with the gradients, as a layer in a model must: otherwise XLA drops a
    forward the backward does not need (RoPE is linear; the gated backward recomputes its activation) and the
    jax "fwd+bwd" would be the backward alone, against torch's both passes. ``returned_grads``: the indices of
    the gradients the program returns (all by default); leave out one that is the same array as another (a
    residual add's two inputs): a program's outputs are distinct buffers, so XLA would copy it, which inside a
    model, where both go on to other ops, it does not."""
    import jax

    if pass_ == "fwd":
        return jax_runner(f, *inputs)

    def grads(pullback, d):
        g = pullback(d)
        return g if returned_grads is None else tuple(g[i] for i in returned_grads)

    def grads_first(args, d):
        out, pullback = jax.vjp(f, *args)
        return grads(pullback, d), out

    def output_first(args, d):
        out, pullback = jax.vjp(f, *args)
        return out, grads(pullback, d)

    # jax ties each donated argument to the first unclaimed output of its shape, and XLA copies where that is
    # not the buffer the op writes over: the gated backward writes the gradients over the forward's inputs
    # (gradients first), RoPE's backward over the cotangents and its forward over its inputs (output first).
    # The program with fewer copy bytes is timed.
    runner = jax_runner(grads_first, tuple(inputs), cotangent)
    if getattr(runner, "copy_bytes", 0) > 0:
        other = jax_runner(output_first, tuple(inputs), cotangent)
        if other.copy_bytes < runner.copy_bytes:
            return other
    return runner


def jax_loss_runner(f, args, pass_, argnums=0):
    """A loss's runner: ``fwd`` the loss; ``fwd+bwd`` ``jax.value_and_grad`` at ``argnums``. The loss value is
    returned with the gradients, as a training step logs it (and as torch's ``loss.backward()`` computes it):
    with ``jax.grad`` alone XLA drops a forward whose gradient does not need it (KL's gradient is the
    teacher's), and "fwd+bwd" would time the backward alone."""
    import jax

    if pass_ == "fwd":
        return jax_runner(f, *args)
    value_and_grad = jax.value_and_grad(f, argnums=argnums)
    return jax_runner(lambda *a: value_and_grad(*a)[::-1], *args)  # gradients first, as in jax_pass_runner


def jax_key(*ints):
    """A jax PRNG key from the shape (fresh data per shape, reproducible)."""
    import jax

    return jax.random.key(sum(int(i) * (7919 ** k) for k, i in enumerate(ints)) % (2**31))

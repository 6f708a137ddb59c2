"""Benchmark harness: timing, peak memory, ceilings and the results files.

A benchmark module (``benchmarks/bench_<family>.py``) defines ``cases(quick: bool) -> list[Case]``. Each case
names a kernel, a pass (``fwd`` or ``fwd+bwd``), a shape, a dtype and a provider, the bytes that must move
(each input read once, each output written once) or the flops that must be done, and ``make``: a function
that allocates the inputs and returns a zero-argument callable running the op once. Torch callables are timed
with CUDA events (``triton.testing.do_bench``, which also flushes L2 between repetitions); jax callables with a
host clock around several queued calls and one ``block_until_ready`` (jax runs on its own stream).
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import os
import platform
import statistics
import time
import traceback
from typing import Any, Callable

RESULTS_DIR = os.path.join(os.path.dirname(__file__), "results")


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


def _torch():
    import torch

    return torch


def measure_ceilings() -> dict:
    """Copy bandwidth (bytes read + written) and bf16 matmul rate, measured now on this GPU."""
    torch = _torch()
    import triton.testing

    src = torch.randn(2 * 1024**3 // 4, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=200, return_mode="median")
    copy_gbps = 2 * src.numel() * 4 / copy_ms / 1e6
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=200, return_mode="median")
    tflops = 2 * 8192**3 / mm_ms / 1e9
    del a, b
    torch.cuda.empty_cache()
    return {"copy_GBps": round(copy_gbps, 1), "bf16_matmul_TFLOPs": round(tflops, 1)}


def _time_torch(run) -> list[float]:
    import triton.testing

    return triton.testing.do_bench(run, warmup=25, rep=100, return_mode="all")


def _time_jax(run, calls: int = 10, reps: int = 15) -> list[float]:
    import jax

    jax.block_until_ready(run())  # compile
    for _ in range(3):
        jax.block_until_ready(run())
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        out = [run() for _ in range(calls)]
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) * 1e3 / calls)
    return times


def _torch_peak_mb(run) -> float:
    torch = _torch()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def run_case(case: Case, ceilings: dict) -> dict:
    point = {k: getattr(case, k) for k in ("kernel", "pass_", "shape", "dtype", "provider", "framework",
                                              "bytes", "flops")}
    point["pass"] = point.pop("pass_")
    try:
        run = case.make()
        if case.framework == "torch":
            times = _time_torch(run)
            point["peak_extra_MB"] = round(_torch_peak_mb(run), 1)
        else:
            times = _time_jax(run)
            peak = getattr(run, "peak_extra_MB", None)
            point["peak_extra_MB"] = None if peak is None else round(peak, 1)
        median = statistics.median(times)
        point.update(status="ok", median_ms=round(median, 4), p20_ms=round(_percentile(times, 0.2), 4),
                     p80_ms=round(_percentile(times, 0.8), 4))
        if case.bytes:
            point["GBps"] = round(case.bytes / median / 1e6, 1)
            point["floor_ms"] = round(case.bytes / (ceilings["copy_GBps"] * 1e6), 4)
        if case.flops:
            point["TFLOPs"] = round(case.flops / median / 1e9, 1)
            point["floor_ms"] = max(point.get("floor_ms", 0),
                                    round(case.flops / (ceilings["bf16_matmul_TFLOPs"] * 1e9), 4))
        if point.get("floor_ms"):
            point["of_floor"] = round(point["floor_ms"] / median, 3)
    except Exception as err:  # a failing provider is recorded, not dropped
        oom = "out of memory" in str(err).lower() or "RESOURCE_EXHAUSTED" in str(err)
        point.update(status="oom" if oom else "error", error=f"{type(err).__name__}: {str(err)[:300]}")
        if not oom:
            traceback.print_exc()
    finally:
        run = None
        gc.collect()
        try:
            _torch().cuda.empty_cache()
        except Exception:
            pass
    return point


def environment() -> dict:
    env = {"date": datetime.date.today().isoformat(), "python": platform.python_version()}
    for name in ("torch", "triton", "jax", "jaxlib", "flax", "transformers", "liger_kernel", "cut_cross_entropy",
                 "jax_triton"):
        try:
            module = __import__(name)
            env[name] = getattr(module, "__version__", "?")
        except Exception:
            env[name] = None
    try:
        env["gpu"] = _torch().cuda.get_device_name()
    except Exception:
        env["gpu"] = None
    return env


def write_results(env: dict, ceilings: dict, points: list[dict], tag: str | None = None) -> tuple[str, str]:
    os.makedirs(RESULTS_DIR, exist_ok=True)
    gpu = (env.get("gpu") or "cpu").replace("NVIDIA ", "").replace(" ", "-").lower()
    stem = os.path.join(RESULTS_DIR, f"{gpu}-{env['date']}" + (f"-{tag}" if tag else ""))
    with open(stem + ".json", "w") as f:
        json.dump({"environment": env, "ceilings": ceilings, "points": points}, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(render_markdown(env, ceilings, points))
    return stem + ".json", stem + ".md"


def render_markdown(env: dict, ceilings: dict, points: list[dict]) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in env.items() if v and k not in ("date", "gpu"))
    lines = [f"# Benchmarks on {env.get('gpu')} ({env['date']})", "", versions, "",
             f"Ceilings measured in the same run: copy {ceilings.get('copy_GBps')} GB/s, "
             f"bf16 matmul {ceilings.get('bf16_matmul_TFLOPs')} TFLOP/s.", "",
             "| kernel | pass | shape | dtype | provider | median ms (p20-p80) | GB/s | TFLOP/s | of floor | "
             "peak extra MB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        if p["status"] != "ok":
            lines.append(f"| {p['kernel']} | {p['pass']} | {p['shape']} | {p['dtype']} | {p['provider']} | "
                         f"{p['status']} | | | | |")
            continue
        lines.append(
            f"| {p['kernel']} | {p['pass']} | {p['shape']} | {p['dtype']} | {p['provider']} | "
            f"{p['median_ms']:.3f} ({p['p20_ms']:.3f}-{p['p80_ms']:.3f}) | {p.get('GBps', '')} | "
            f"{p.get('TFLOPs', '')} | {p.get('of_floor', '')} | {p.get('peak_extra_MB', '')} |")
    return "\n".join(lines) + "\n"


def short_table(points: list[dict]) -> str:
    rows = [f"{'kernel':<22}{'pass':<9}{'shape':<18}{'provider':<16}{'ms':>9}{'GB/s':>9}{'floor%':>8}{'MB':>9}"]
    for p in points:
        if p["status"] != "ok":
            rows.append(f"{p['kernel']:<22}{p['pass']:<9}{p['shape']:<18}{p['provider']:<16}{p['status']:>9}")
            continue
        frac = p.get("of_floor")
        rows.append(f"{p['kernel']:<22}{p['pass']:<9}{p['shape']:<18}{p['provider']:<16}{p['median_ms']:>9.3f}"
                    f"{p.get('GBps', 0):>9.0f}{(100 * frac if frac else 0):>8.0f}"
                    f"{(p.get('peak_extra_MB') or 0):>9.0f}")
    return "\n".join(rows)


def jax_extra_mb(jitted, *args) -> float | None:
    """Device memory an XLA program needs beyond its arguments (temporaries + outputs)."""
    try:
        analysis = jitted.lower(*args).compile().memory_analysis()
        return (analysis.temp_size_in_bytes + analysis.output_size_in_bytes) / 2**20
    except Exception:
        return None


def jax_runner(fn, *args):
    """jit ``fn``, and return a zero-argument runner carrying the program's extra memory."""
    import jax

    jitted = jax.jit(fn)

    def run():
        return jitted(*args)

    run.peak_extra_MB = jax_extra_mb(jitted, *args)
    return run


TORCH_PROVIDERS = ("liger_torch", "torch_eager", "torch_compile", "liger_kernel")
JAX_PROVIDERS = ("liger_jax", "xla")


def provider_cases(kernel, pass_, shape, make_torch, make_jax, torch_names=TORCH_PROVIDERS,
                   jax_names=JAX_PROVIDERS, dtype="bf16", bytes=0, flops=0) -> list[Case]:
    """The cases of one kernel, pass and shape: one per torch provider, then one per jax provider, with
    ``make_torch(name)`` / ``make_jax(name)`` as each one's ``make``."""
    return ([Case(kernel, pass_, shape, dtype, name, "torch", make_torch(name), bytes=bytes, flops=flops)
             for name in torch_names]
            + [Case(kernel, pass_, shape, dtype, name, "jax", make_jax(name), bytes=bytes, flops=flops)
               for name in jax_names])


def row_cases(kernel, shapes, make_torch, make_jax, tensors_moved, torch_names=TORCH_PROVIDERS) -> list[Case]:
    """The cases of a kernel over bf16 (rows, width) tensors: for each shape in ``shapes``, each pass, the
    provider cases, ``make_torch(name, rows, width, pass_)`` / ``make_jax(...)`` giving each ``make``, with
    bytes = ``tensors_moved[pass_]`` full tensors of 2-byte elements."""
    out = []
    for n, h in shapes:
        for pass_ in ("fwd", "fwd+bwd"):
            out += provider_cases(kernel, pass_, f"{n}x{h}", lambda name: make_torch(name, n, h, pass_),
                                  lambda name: make_jax(name, n, h, pass_), torch_names=torch_names,
                                  bytes=tensors_moved[pass_] * n * h * 2)
    return out


def eager_or_compiled(name, eager):
    """The ``torch_eager`` provider (``eager`` itself) or the ``torch_compile`` one (``torch.compile(eager)``)."""
    if name == "torch_eager":
        return eager
    if name == "torch_compile":
        import torch

        return torch.compile(eager)
    raise KeyError(name)


def torch_fwd_bwd(fn, inputs, grad):
    """Runner for forward + backward of ``fn(*inputs)`` against a fixed output gradient (a tuple of them where
    ``fn`` returns a tuple)."""
    import torch

    def run():
        for t in inputs:
            t.grad = None
        torch.autograd.backward(fn(*inputs), grad)

    return run


def torch_pass_runner(fn, inputs, grad, pass_):
    """``fwd``: a runner of ``fn(*inputs)``; ``fwd+bwd``: ``torch_fwd_bwd(fn, inputs, grad)``."""
    if pass_ == "fwd":
        return lambda: fn(*inputs)
    return torch_fwd_bwd(fn, inputs, grad)


def jax_pass_runner(f, inputs, cotangent, pass_):
    """``fwd``: ``jax_runner(f, *inputs)``; ``fwd+bwd``: the jitted vjp of ``f`` at ``inputs`` applied to
    ``cotangent`` (a tuple of them where ``f`` returns a tuple), inputs and cotangent passed as arguments."""
    import jax

    if pass_ == "fwd":
        return jax_runner(f, *inputs)
    return jax_runner(lambda args, d: jax.vjp(f, *args)[1](d), tuple(inputs), cotangent)

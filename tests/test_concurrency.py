"""Kernels used from several threads at once, and several processes compiling the same kernels at once into one
shared, fresh Triton cache directory.

On the GPU the processes race to compile and to write the same cache entries (and a second wave then loads them);
in the interpreter nothing is compiled, so there the process test only checks that concurrent processes do not get
in each other's way. The thread tests run each kernel family on its own shapes in its own thread, several rounds,
all threads released together, and compare every result with a reference computed by torch / numpy.
"""

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import liger_core
import liger_torch
from helpers import assert_close

ON_GPU = not liger_core.INTERPRET
ROUNDS = 3
N_THREADS = 4


def _run_threads(jobs):
    """Run each job (a callable of no arguments) in its own thread, all released together; re-raise the first
    failure (with the thread it came from)."""
    barrier = threading.Barrier(len(jobs))
    errors = [None] * len(jobs)

    def body(i):
        try:
            barrier.wait(timeout=60)
            jobs[i]()
        except BaseException as err:  # noqa: BLE001  (handed to the main thread)
            errors[i] = err

    threads = [threading.Thread(target=body, args=(i,), name=f"liger-test-{i}") for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
        assert not t.is_alive(), f"{t.name} did not finish (deadlock?)"
    for i, err in enumerate(errors):
        if err is not None:
            raise AssertionError(f"thread {i} failed: {type(err).__name__}: {err}") from err


def _torch_job(kind, i, device):
    """ROUNDS rounds of one family's forward and backward on shapes that differ per thread."""
    def job():
        gen = torch.Generator().manual_seed(100 + i)
        for r in range(ROUNDS):
            n, h = 3 + i + r, 17 + 8 * i + r
            if kind == "rms_norm":
                x = torch.randn(n, h, generator=gen).to(device).requires_grad_(True)
                w = torch.randn(h, generator=gen).to(device).requires_grad_(True)
                y = liger_torch.rms_norm(x, w)
                xr, wr = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
                yr = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-6) * wr
            elif kind == "cross_entropy":
                x = (torch.randn(n, h, generator=gen) * 3).to(device).requires_grad_(True)
                t = torch.randint(0, h, (n,), generator=gen).to(device)
                t[0] = -100
                y = liger_torch.cross_entropy(x, t)
                xr = x.detach().double().requires_grad_(True)
                yr = F.cross_entropy(xr, t)
                w = wr = None
            elif kind == "swiglu":
                x = torch.randn(n, h, generator=gen).to(device).requires_grad_(True)
                w = torch.randn(n, h, generator=gen).to(device).requires_grad_(True)
                y = liger_torch.swiglu(x, w)
                xr, wr = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
                yr = F.silu(xr) * wr
            else:
                assert kind == "layer_norm"
                x = (torch.randn(n, h, generator=gen) + 1).to(device).requires_grad_(True)
                w = torch.randn(h, generator=gen).to(device).requires_grad_(True)
                y = liger_torch.layer_norm(x, w, None)
                xr, wr = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
                yr = F.layer_norm(xr, (h,), wr, None, 1e-5)
            g = torch.randn(y.shape, generator=gen).to(device)
            y.backward(g.clone())  # rms_norm writes dx over the incoming gradient
            yr.backward(g.double())
            name = f"{kind} thread {i} round {r}"
            assert_close(y, yr, torch.float32, f"{name} y")
            assert_close(x.grad, xr.grad, torch.float32, f"{name} dx")
            if w is not None:
                assert_close(w.grad, wr.grad, torch.float32, f"{name} dw", scale=2.0)
    return job


def test_torch_kernels_from_four_threads(device):
    kinds = ["rms_norm", "cross_entropy", "swiglu", "layer_norm"]
    _run_threads([_torch_job(kinds[i % len(kinds)], i, device) for i in range(N_THREADS)])


def test_torch_same_kernel_from_four_threads_on_gpu_streams():
    """The same compiled kernel from four threads at once, each on its own CUDA stream (the compiled-launch cache
    of the torch executor is shared by all threads)."""
    if not ON_GPU:
        pytest.skip("CUDA streams: GPU only")

    def job(i):
        def run():
            stream = torch.cuda.Stream()
            gen = torch.Generator().manual_seed(200 + i)
            with torch.cuda.stream(stream):
                for r in range(ROUNDS * 4):
                    x = torch.randn(64 + i, 4096, generator=gen).to("cuda", torch.bfloat16)
                    w = torch.randn(4096, generator=gen).to("cuda", torch.bfloat16)
                    y = liger_torch.rms_norm(x, w)
                    ref = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)).to(
                        torch.bfloat16).double() * w.double()
                    stream.synchronize()
                    assert_close(y, ref, torch.bfloat16, f"thread {i} round {r}")
        return run

    _run_threads([job(i) for i in range(N_THREADS)])


def test_jax_kernels_from_four_threads():
    """liger_jax functions (jitted, with gradients) called from four threads at once."""
    import jax
    import jax.numpy as jnp

    import liger_jax

    def job(i):
        def run():
            rng = np.random.default_rng(300 + i)
            n, h = 3 + i, 17 + 8 * i
            f = jax.jit(jax.value_and_grad(lambda x, s: liger_jax.rms_norm(x, s).sum(), argnums=(0, 1)))
            for r in range(ROUNDS):
                x = rng.standard_normal((n, h)).astype(np.float32)
                s = rng.standard_normal(h).astype(np.float32)
                value, (dx, ds) = f(x, s)
                x64 = x.astype(np.float64)
                rstd = 1 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6)
                name = f"jax thread {i} round {r}"
                assert_close(np.asarray(value), (x64 * rstd * s).sum(), torch.float32, f"{name} value", scale=4.0)
                assert_close(np.asarray(ds), (x64 * rstd).sum(0), torch.float32, f"{name} ds", scale=2.0)
                want_dx = rstd * s - x64 * rstd ** 3 * (x64 * s).mean(-1, keepdims=True)
                assert_close(np.asarray(dx), want_dx, torch.float32, f"{name} dx")
                assert jnp.asarray(dx).dtype == jnp.float32
        return run

    _run_threads([job(i) for i in range(N_THREADS)])


# ------------------------------------------------------------------------------------------------ processes
_WORKER = textwrap.dedent("""
    import sys, warnings
    warnings.simplefilter("ignore")
    import torch, torch.nn.functional as F
    import liger_torch
    worker = int(sys.argv[1])
    d = "cpu" if liger_torch.INTERPRET else "cuda"
    gen = torch.Generator().manual_seed(worker)
    worst = 0.0
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(37, 257, generator=gen).to(d, dtype).requires_grad_(True)
        w = torch.randn(257, generator=gen).to(d, dtype)
        y = liger_torch.rms_norm(x, w)
        y.backward(torch.ones_like(y))
        ref = x.detach().double() * torch.rsqrt(x.detach().double().pow(2).mean(-1, keepdim=True) + 1e-6)
        ref = ref.to(dtype).double() * w.double()
        worst = max(worst, float(((y.double() - ref).abs() / (1 + ref.abs())).max()))
        t = torch.randint(0, 257, (37,), generator=gen).to(d)
        logits = (torch.randn(37, 257, generator=gen) * 3).to(d, dtype)
        loss = liger_torch.cross_entropy(logits, t)
        worst = max(worst, abs(float(loss) - float(F.cross_entropy(logits.double(), t))) / (1 + float(loss)))
        a, b = (torch.randn(37, 257, generator=gen).to(d, dtype) for _ in range(2))
        c = liger_torch.swiglu(a, b)
        worst = max(worst, float(((c.double() - F.silu(a.double()) * b.double()).abs()).max()))
    if len(sys.argv) > 2:
        import numpy as np, liger_jax
        x = np.asarray(torch.randn(37, 257, generator=gen))
        y = np.asarray(liger_jax.rms_norm(x, np.ones(257, np.float32)))
        ref = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6)
        worst = max(worst, float(np.abs(y - ref).max()))
    assert worst < 0.05, worst  # bf16 rounding is ~4e-3; a broken kernel is off by O(1)
    if d == "cuda":
        torch.cuda.synchronize()
    print("WORKER-OK", worker, worst)
""")


def _wave(cache_dir: Path, n: int, jax_workers: int) -> None:
    """n workers at once; the first ``jax_workers`` of them also run a liger_jax kernel."""
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache_dir))
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(i), *(["jax"] if i < jax_workers else [])], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
             for i in range(n)]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=400)
            results.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for i, (code, out, err) in enumerate(results):
        assert code == 0 and f"WORKER-OK {i}" in out, f"worker {i}: exit {code}\n{out[-1000:]}\n{err[-3000:]}"


def test_processes_share_a_fresh_triton_cache(tmp_path):
    """Three processes run the same kernels at once with one fresh TRITON_CACHE_DIR: on the GPU all three compile
    and write the same entries concurrently, then a second wave loads them from the warm cache; every result is
    checked against torch."""
    cache = tmp_path / "triton-cache"
    cache.mkdir()
    _wave(cache, 3, jax_workers=3 if ON_GPU else 1)  # CPU: one jax worker is enough (imports dominate there)
    if not ON_GPU:
        return  # the interpreter compiles nothing: nothing was cached, nothing to reload
    entries = [p for p in cache.rglob("*") if p.is_file()]
    assert any(p.suffix in (".cubin", ".ptx") for p in entries), f"no compiled kernel in the cache: {entries[:10]}"
    _wave(cache, 3, jax_workers=3)

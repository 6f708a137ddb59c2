"""GPU sweep of RMSNorm launch configurations, timed with CUDA graphs (no Python launch overhead), plus the
autograd path with and without graphs to show the host overhead. Prints one table.

    python3 scripts/tune_rms_norm.py
"""

import itertools

import torch
import triton.testing

import liger_torch
from liger_core import rms_norm as core
from liger_torch._launch import info, num_sms, run_plan

SHAPES = [(16384, 4096), (4096, 16384), (32768, 2048), (65536, 8192)]


def graph_ms(fn):
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")


def main():
    sms = num_sms(torch.device("cuda"))
    print(f"{'shape':<12}{'what':<34}{'ms':>8}{'of floor':>10}")
    for n, h in SHAPES:
        x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
        w = torch.rand(h, device="cuda", dtype=torch.bfloat16) + 0.5
        dy = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
        floor_fwd = 2 * n * h * 2 / 4.25e12 * 1e3
        floor_bwd = 3 * n * h * 2 / 4.25e12 * 1e3
        _, rstd = run_plan(core.forward_plan(info(x), info(w), eps=1e-6), x=x, weight=w)
        for bm, warps in itertools.product((1, 2), (4, 8)):
            plan = core.forward_plan(info(x), info(w), eps=1e-6, block_m=bm, num_warps=warps)
            t = graph_ms(lambda: run_plan(plan, x=x, weight=w))
            print(f"{n}x{h:<7}fwd bm={bm} warps={warps:<18}{t:>8.4f}{floor_fwd / t:>10.2f}")
        max_bm = max(1, 16384 // h)
        for prefetch, per_sm, bm, warps in itertools.product((False, True), (1, 2), (max_bm // 2, max_bm), (8, 16)):
            if bm == 0:
                continue
            try:
                plan = core.backward_plan(info(dy), info(x), info(w), num_sms=sms, in_place=False,
                                          programs_per_sm=per_sm, block_m=bm, num_warps=warps, prefetch=prefetch)
                t = graph_ms(lambda: run_plan(plan, dy=dy, x=x, weight=w, rstd=rstd))
            except Exception as err:
                print(f"{n}x{h:<7}bwd per_sm={per_sm} bm={bm} warps={warps}: {type(err).__name__}")
                continue
            print(f"{n}x{h:<7}bwd pf={int(prefetch)} per_sm={per_sm} bm={bm} w={warps:<8}{t:>8.4f}{floor_bwd / t:>10.2f}")
        xg = x.clone().requires_grad_(True)
        wg = w.clone().requires_grad_(True)

        def step():
            xg.grad = None
            wg.grad = None
            liger_torch.rms_norm(xg, wg).backward(dy)

        eager = triton.testing.do_bench(step, rep=100, return_mode="median")
        graphed = graph_ms(step)
        print(f"{n}x{h:<7}{'autograd fwd+bwd, CUDA graph':<34}{graphed:>8.4f}{(floor_fwd + floor_bwd) / graphed:>10.2f}")
        print(f"{n}x{h:<7}{'autograd fwd+bwd, eager launch':<34}{eager:>8.4f}{(floor_fwd + floor_bwd) / eager:>10.2f}")


def host_profile(n=1024, h=4096, iters=300):
    """Where the host time of one autograd forward+backward goes (small shape: host-bound)."""
    import cProfile
    import pstats
    import time

    x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)

    def step():
        x.grad = None
        w.grad = None
        liger_torch.rms_norm(x, w).backward(dy)

    for _ in range(20):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    torch.cuda.synchronize()
    print(f"host: {(time.perf_counter() - start) / iters * 1e6:.1f} us per autograd fwd+bwd at {n}x{h}")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(iters):
        step()
    profile.disable()
    torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    import sys

    if "--host" in sys.argv:
        host_profile()
    else:
        main()

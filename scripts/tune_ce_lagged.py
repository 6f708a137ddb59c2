"""GPU sweep of cross-entropy's lagged kernel launch (``liger_core.cross_entropy.LAGGED``: segment columns, lag
bytes, columns a step, warps) against the two-pass kernel, loss and gradient of bf16 logits, in place and out of
place; do_bench medians with L2 flushed. Each launch's loss and gradient are first checked against the two-pass
kernel's on 64 rows.

    python3 scripts/tune_ce_lagged.py [--shapes 8192x128256 8192x65536] [--out FILE]

(This script began as a probe with its own stripped kernel, which also measured tickets against program order
and the reads' eviction policies: benchmarks/results/h100-80gb-hbm3-2026-12-07-tune_ce_lagged{,2,3}.txt, code at
commit 04465fc; docs/perf-log.md, twenty-sixth session.)
"""

import os
import sys

import torch
import triton.testing

from liger_core import cross_entropy
from liger_torch._launch import info, run_plan

import _gpu_tables as gpu_tables  # scripts/, the directory Python puts first on the path

# (segment, lag in MiB of rows, block, num_warps), the default first
CONFIGS = [(8192, 12, 2048, 4), (8192, 8, 2048, 4), (8192, 16, 2048, 4), (8192, 24, 2048, 4), (8192, 12, 1024, 2),
           (16384, 12, 2048, 4)]
COPY_GBPS = float(os.environ.get("COPY_GBPS", "3054"))  # the H100's copy rate of s25 (4277 on the H200)


def plan_with(settings, x, target, in_place, lagged=True):
    """The loss-and-gradient plan with ``LAGGED`` updated by ``settings`` while it is built (then restored)."""
    saved = dict(cross_entropy.LAGGED)
    cross_entropy.LAGGED.update(settings)
    cross_entropy.forward_plan.cache_clear()
    try:
        return cross_entropy.forward_plan(info(x), info(target), reduction="sum", in_place=in_place, lagged=lagged)
    finally:
        cross_entropy.LAGGED.clear()
        cross_entropy.LAGGED.update(saved)
        cross_entropy.forward_plan.cache_clear()


def sweep(n, v, out):
    x0 = torch.randn(n, v, device="cuda", dtype=torch.bfloat16) * 4
    x = x0.clone()
    target = torch.randint(0, v, (n,), device="cuda")
    head = x0[:64].clone()
    ref_loss, ref_grad = run_plan(plan_with({}, head, target[:64], False, lagged=False), logits=head,
                                  target=target[:64])
    copy_gbps = 4277.0 if "H200" in torch.cuda.get_device_name() else COPY_GBPS
    floor_ms = 2 * n * v * 2 / (copy_gbps * 1e9) * 1e3
    out(f"cross_entropy {n}x{v}: floor (one read, one write at {copy_gbps:.0f} GB/s) {floor_ms:.3f} ms")
    out(f"{'kernel':<44}{'ms':>8}{'of floor':>10}")
    cases = [("two-pass", {}, False, in_place) for in_place in (True, False)]
    cases += [(f"lagged seg {s} lag {mib} MiB {block}/{warps}", {"segment": s, "lag_bytes": mib * 2**20,
                                                                  "block": block, "num_warps": warps}, True, in_place)
              for s, mib, block, warps in CONFIGS for in_place in (True, False) if in_place or s == CONFIGS[0][0]]
    for name, settings, lagged, in_place in cases:
        head = x0[:64].clone()
        loss, grad = run_plan(plan_with(settings, head, target[:64], False, lagged=lagged), logits=head,
                              target=target[:64])
        err = max((loss.float() - ref_loss.float()).abs().item(), (grad.float() - ref_grad.float()).abs().max().item())
        plan = plan_with(settings, x, target, in_place, lagged=lagged)
        ms = triton.testing.do_bench(lambda: run_plan(plan, logits=x, target=target), return_mode="median")
        label = f"{name} {'in place' if in_place else 'out of place'}"
        out(f"{label:<44}{ms:>8.3f}{floor_ms / ms:>10.2f}   max diff {err:.1e}")


def main(argv=None) -> int:
    return gpu_tables.sweep_shapes_main("tune_ce_lagged", __doc__, ["8192x128256", "8192x65536"], sweep, argv)


if __name__ == "__main__":
    sys.exit(main())

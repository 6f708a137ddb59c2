"""GPU sweep of the lagged norm backward (``liger_core.rms_norm.LAGGED_BACKWARD``: segment columns, rows a block,
lag bytes, columns a step, warps) against the column-split backward (row sums, then column blocks), RMSNorm and
fused add+RMSNorm on bf16 rows, dx written over dy; do_bench medians with L2 flushed. Each launch's dx and dw are
first checked against the column split's.

    python3 scripts/tune_norm_lagged.py [--shapes 4096x65536 4096x32768] [--out FILE]

(s26 measured a probe with tiles of several rows a step, 80-128 registers: 0.917 ms at best against the column
split's 0.889 at 4096x65536; benchmarks/results/h100-80gb-hbm3-2026-12-07-tune_norm_lagged.txt, code at 70a8a3b.)
"""

import os
import sys

import torch
import triton.testing

from liger_core import fused_add_rms_norm, rms_norm
from liger_torch._launch import info, run_plan

import _gpu_tables as gpu_tables  # scripts/, the directory Python puts first on the path

# (segment, rows, lag in MiB of dy and x, block, num_warps, chain_dw), the default first. A job reads rows x
# segment x 4 bytes; with ~7 jobs an SM in flight, 512 KB jobs (the first table, -tune_norm_lagged2.txt) keep ~470
# MB in flight, far past the L2. Small jobs below, their weight-gradient partials a block (2 / rows of a pass) or
# added in block order into one fp32 row (chain_dw).
CONFIGS = [(8192, 16, 12, 1024, 4, False), (8192, 16, 12, 2048, 4, False), (1024, 8, 12, 1024, 4, False),
           (2048, 4, 12, 2048, 4, False), (1024, 4, 12, 1024, 4, True), (2048, 4, 12, 2048, 4, True),
           (1024, 8, 12, 1024, 4, True), (512, 8, 12, 512, 4, True), (1024, 2, 12, 1024, 4, True),
           (2048, 2, 12, 2048, 4, True)]
FUSED_CONFIGS = [CONFIGS[1], CONFIGS[4], CONFIGS[5], CONFIGS[6]]
COPY_GBPS = float(os.environ.get("COPY_GBPS", "3054"))  # the H100's copy rate of s25 (4277 on the H200)


def plan_with(settings, build):
    """``build()`` with ``LAGGED_BACKWARD`` updated by ``settings`` (then restored; plan caches cleared)."""
    saved = dict(rms_norm.LAGGED_BACKWARD)
    rms_norm.LAGGED_BACKWARD.update(settings)
    rms_norm.backward_plan.cache_clear()
    fused_add_rms_norm.backward_plan.cache_clear()
    try:
        return build()
    finally:
        rms_norm.LAGGED_BACKWARD.clear()
        rms_norm.LAGGED_BACKWARD.update(saved)
        rms_norm.backward_plan.cache_clear()
        fused_add_rms_norm.backward_plan.cache_clear()


def rms_case(n, m):
    x = torch.randn(n, m, device="cuda", dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(m, device="cuda")).to(torch.bfloat16)
    dy0 = torch.randn(n, m, device="cuda", dtype=torch.bfloat16)
    _, rstd = run_plan(rms_norm.forward_plan(info(x), info(w), eps=1e-6), x=x, weight=w)
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def build(lagged):
        return rms_norm.backward_plan(info(dy0), info(x), info(w), num_sms=sms, in_place=True, lagged=lagged)

    return build, dy0, dict(x=x, weight=w, rstd=rstd), 3


def fused_case(n, m):
    h = torch.randn(n, m, device="cuda", dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(m, device="cuda")).to(torch.bfloat16)
    dy0 = torch.randn(n, m, device="cuda", dtype=torch.bfloat16)
    dh = torch.randn(n, m, device="cuda", dtype=torch.bfloat16)
    _, rstd = run_plan(rms_norm.forward_plan(info(h), info(w), eps=1e-6), x=h, weight=w)
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def build(lagged):
        return fused_add_rms_norm.backward_plan(info(dy0), info(dh), info(h), info(w), x_dtype="bfloat16",
                                                residual_dtype="bfloat16", num_sms=sms, in_place=True,
                                                in_place_residual=False, separate_residual_grad=False, lagged=lagged)

    return build, dy0, dict(dh=dh, h=h, weight=w, rstd=rstd), 4


def sweep_family(family, case, configs, n, m, out):
    build, dy0, inputs, tensors = case(n, m)
    copy_gbps = 4277.0 if "H200" in torch.cuda.get_device_name() else COPY_GBPS
    floor_ms = tensors * n * m * 2 / (copy_gbps * 1e9) * 1e3
    out(f"{family} backward {n}x{m}: floor ({tensors} tensors at {copy_gbps:.0f} GB/s) {floor_ms:.3f} ms")
    out(f"{'kernel':<46}{'ms':>8}{'of floor':>10}")
    ref = [t.float() for t in run_plan(plan_with({}, lambda: build(False)), dy=dy0.clone(), **inputs)]
    dy = dy0.clone()
    cases = [("column split", {}, False)] + [
        (f"lagged seg {s} rows {r} lag {mib} MiB {block}/{warps}{' chain' if chain else ''}",
         {"segment": s, "rows": r, "lag_bytes": mib * 2**20, "block": block, "num_warps": warps, "chain_dw": chain},
         True)
        for s, r, mib, block, warps, chain in configs]
    for name, settings, lagged in cases:
        plan = plan_with(settings, lambda: build(lagged))
        got = run_plan(plan, dy=dy0.clone(), **inputs)
        err = max((g.float() - r).abs().max().item() for g, r in zip(got, ref))
        ms = triton.testing.do_bench(lambda: run_plan(plan, dy=dy, **inputs), return_mode="median")
        out(f"{name:<46}{ms:>8.3f}{floor_ms / ms:>10.2f}   max diff {err:.1e}")


def sweep(n, m, out):
    sweep_family("rms_norm", rms_case, CONFIGS, n, m, out)
    sweep_family("fused_add_rms_norm", fused_case, FUSED_CONFIGS, n, m, out)


def main(argv=None) -> int:
    return gpu_tables.sweep_shapes_main("tune_norm_lagged", __doc__, ["4096x65536", "4096x32768"], sweep, argv)


if __name__ == "__main__":
    sys.exit(main())

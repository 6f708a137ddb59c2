"""Probe: the RMSNorm backward on wide rows (32768-65536 columns) reading x and dy once from DRAM, by a lagged job
order (the cross-entropy probe's, scripts/tune_ce_lagged.py, with a weight gradient).

The library's column-split backward reads x and dy twice (a row-dots launch, then dx and dw): 5 tensor passes
where a held row needs 3. Here the rows are cut into blocks of R rows and SEG-column segments; each tile is two
jobs of one grid: a dot job (the tile's partial row dots of dy * w * x * rstd, published with a release count per
row block) and, LAG row blocks later in the job order, a gradient job (loads its tile first, acquire-waits for the
block's count, sums the row dots in segment order, writes dx and the tile's dw partial, one fp32 row per block,
summed afterwards). The second read of a tile should come from L2. Jobs take tickets (SYNC[0]) when they start and
wait only on lower ones, so the order runs on any dispatch and in the sequential interpreter.

Only the llama casting with a weight (offset 0) here: the probe measures the memory traffic.

    python3 scripts/tune_norm_lagged.py [--shapes 4096x65536 4096x32768] [--out FILE]   (GPU)
    python3 -c "import sys; sys.path.insert(0, 'scripts'); import tune_norm_lagged as t; t.check()"  (CPU)
"""

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

from liger_core.tl_math import cast, round_to


@triton.jit
def _load_tile(DY, X, W, RSTD, rows, cols, n_rows, n_cols):
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    offs = rows[:, None] * n_cols + cols[None, :]
    dy = tl.load(DY + offs, mask=mask, other=0.0)
    x = tl.load(X + offs, mask=mask, other=0.0)
    w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    rstd = tl.load(RSTD + rows, mask=rows < n_rows, other=0.0)
    return dy, x, w, rstd


@triton.jit
def _rms_bwd_lagged_kernel(
    DY, X, W, RSTD, n_rows, n_cols,
    DX, DW_PARTIAL, SYNC, PARTS,
    R: tl.constexpr, RB: tl.constexpr, SEG: tl.constexpr, N_SEG: tl.constexpr, N_SEG_P2: tl.constexpr,
    LAG: tl.constexpr, TICKET: tl.constexpr,
):
    if TICKET:
        job = tl.atomic_add(SYNC, 1, sem="relaxed").to(tl.int64)
    else:
        job = tl.program_id(0).to(tl.int64)
    slot = job // (2 * N_SEG)
    kind = job % (2 * N_SEG)
    seg = kind % N_SEG
    block = tl.where(kind < N_SEG, slot, slot - LAG)
    if (block < 0) | (block * R >= n_rows):  # the first LAG slots have no gradient jobs, the last LAG no dots
        return
    cols = seg * SEG + tl.arange(0, SEG)
    first = block * R
    if kind < N_SEG:  # dot job: PARTS[row, seg] for the block's R rows
        rows = first + tl.arange(0, RB)
        dy_next, x_next, w, rstd_next = _load_tile(DY, X, W, RSTD, rows, cols, n_rows, n_cols)
        for rb in range(0, R, RB):
            rows = first + rb + tl.arange(0, RB)
            dy, x, rstd = dy_next, x_next, rstd_next
            dy_next, x_next, _, rstd_next = _load_tile(DY, X, W, RSTD, rows + RB, cols, n_rows,
                                                       tl.where(rb + RB < R, n_cols, 0))
            dots = tl.sum(dy.to(tl.float32) * w[None, :] * x.to(tl.float32), axis=1) * rstd
            tl.store(PARTS + rows * N_SEG + seg, dots, mask=rows < n_rows)
        tl.debug_barrier()  # every thread's stores before the release
        tl.atomic_add(SYNC + 1 + block, 1, sem="release")
    else:  # gradient job
        dw = tl.zeros((SEG,), dtype=tl.float32)
        rows = first + tl.arange(0, RB)
        dy_next, x_next, w, rstd_next = _load_tile(DY, X, W, RSTD, rows, cols, n_rows, n_cols)  # through the wait
        count = tl.atomic_add(SYNC + 1 + block, 0, sem="acquire")
        while count < N_SEG:
            count = tl.atomic_add(SYNC + 1 + block, 0, sem="acquire")
        segs = tl.arange(0, N_SEG_P2)
        for rb in range(0, R, RB):
            rows = first + rb + tl.arange(0, RB)
            dy, x, rstd = dy_next.to(tl.float32), x_next, rstd_next
            dy_next, x_next, _, rstd_next = _load_tile(DY, X, W, RSTD, rows + RB, cols, n_rows,
                                                       tl.where(rb + RB < R, n_cols, 0))
            parts = tl.load(PARTS + rows[:, None] * N_SEG + segs[None, :],
                            mask=(rows < n_rows)[:, None] & (segs < N_SEG)[None, :], other=0.0, cache_modifier=".cg")
            mean_dot = tl.sum(parts, axis=1) / n_cols
            normed = x.to(tl.float32) * rstd[:, None]
            dx = (dy * w[None, :] - normed * mean_dot[:, None]) * rstd[:, None]
            mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
            tl.store(DX + rows[:, None] * n_cols + cols[None, :], cast(dx, DX.dtype.element_ty), mask=mask)
            dw += tl.sum(dy * round_to(normed, x.dtype), axis=0)
        tl.store(DW_PARTIAL + block * n_cols + cols, dw, mask=cols < n_cols)


def lagged_rms_backward(dy, x, weight, rstd, *, r, rb, seg, lag, warps, ticket=True, in_place=True):
    """(dx, dw) of the probe kernel; dy, x (n, N) contiguous, dx written over dy with ``in_place``."""
    n, n_cols = x.shape
    n_seg = triton.cdiv(n_cols, seg)
    n_blocks = triton.cdiv(n, r)
    dx = dy if in_place else torch.empty_like(dy)
    dw_partial = torch.empty(n_blocks, n_cols, device=x.device, dtype=torch.float32)
    sync = torch.zeros(1 + n_blocks, device=x.device, dtype=torch.int32)
    parts = torch.empty(n * n_seg, device=x.device, dtype=torch.float32)
    grid = ((n_blocks + lag) * 2 * n_seg,)
    _rms_bwd_lagged_kernel[grid](dy, x, weight, rstd, n, n_cols, dx, dw_partial, sync, parts, R=r, RB=rb, SEG=seg,
                                 N_SEG=n_seg, N_SEG_P2=triton.next_power_of_2(n_seg), LAG=lag, TICKET=ticket,
                                 num_warps=warps)
    return dx, dw_partial.sum(0).to(weight.dtype)


def _library_backward(dy, x, weight, rstd):
    from liger_core import rms_norm
    from liger_torch._launch import info, run_plan
    plan = rms_norm.backward_plan(info(dy), info(x), info(weight), num_sms=torch.cuda.get_device_properties(
        0).multi_processor_count if x.is_cuda else 4, in_place=True)
    return plan, lambda: run_plan(plan, dy=dy, x=x, weight=weight, rstd=rstd)


def _inputs(n, n_cols, device):
    x = torch.randn(n, n_cols, device=device).to(torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(n_cols, device=device)).to(torch.bfloat16)
    dy = torch.randn(n, n_cols, device=device).to(torch.bfloat16)
    rstd = torch.rsqrt(x.float().pow(2).mean(-1) + 1e-6)
    return dy, x, weight, rstd


def reference(dy, x, weight, rstd):
    """fp64 llama-casting RMSNorm backward from the saved rstd: dx = rstd (g - normed mean(g normed)) with
    g = dy w, normed = x rstd; dw = sum of dy times normed rounded to x's dtype."""
    normed = x.double() * rstd.double()[:, None]
    g = dy.double() * weight.double()
    dx = rstd.double()[:, None] * (g - normed * (g * normed).mean(-1, keepdim=True))
    return dx, (dy.double() * normed.to(x.dtype).double()).sum(0)


CHECK_CASES = [(7, 123, 4, 2, 32, 1, True), (9, 300, 8, 4, 64, 0, False), (1, 77, 2, 2, 128, 3, True),
               (13, 1000, 4, 4, 256, 2, True)]  # (rows, columns, R, RB, segment, lag, ticket)


def check_case(n, n_cols, r, rb, seg, lag, ticket, device="cpu"):
    """The probe against the fp64 formula on one odd shape (in the interpreter on the CPU)."""
    dy, x, weight, rstd = _inputs(n, n_cols, device)
    ref_dx, ref_dw = reference(dy, x, weight, rstd)
    dx, dw = lagged_rms_backward(dy.clone(), x, weight, rstd, r=r, rb=rb, seg=seg, lag=lag, warps=4, ticket=ticket)
    torch.testing.assert_close(dx.double(), ref_dx, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(dw.double(), ref_dw, atol=5e-2, rtol=2e-2)


def check():
    torch.manual_seed(0)
    for case in CHECK_CASES:
        check_case(*case)
    print("ok")


# (R rows a block, RB rows a step, segment columns, lag blocks, warps, ticket), most telling first
CONFIGS = [(16, 4, 1024, 4, 8, True), (8, 4, 1024, 8, 8, True), (32, 4, 1024, 2, 8, True),
           (16, 4, 1024, 4, 8, False), (16, 2, 2048, 4, 8, True), (16, 4, 1024, 8, 8, True),
           (16, 2, 1024, 4, 8, True), (32, 4, 2048, 2, 16, True), (8, 8, 1024, 8, 8, True)]
COPY_GBPS = float(os.environ.get("COPY_GBPS", "3054"))  # the H100's copy rate of s25 (4277 on the H200)


def sweep(n, n_cols, out):
    dy0, x, weight, rstd = _inputs(n, n_cols, "cuda")
    dy = dy0.clone()
    copy_gbps = 4277.0 if "H200" in torch.cuda.get_device_name() else COPY_GBPS
    floor_ms = 3 * n * n_cols * 2 / (copy_gbps * 1e9) * 1e3
    _, library = _library_backward(dy, x, weight, rstd)
    ref_dx, ref_dw = (t.float() for t in library())
    out(f"rms_norm backward {n}x{n_cols}: floor (x, dy read, dx written at {copy_gbps:.0f} GB/s) {floor_ms:.3f} ms")
    out(f"{'kernel':<30}{'ms':>8}{'of floor':>10}")
    dy.copy_(dy0)
    ms = triton.testing.do_bench(library, return_mode="median")
    out(f"{'library (row dots + split)':<30}{ms:>8.3f}{floor_ms / ms:>10.2f}")
    for r, rb, seg, lag, warps, ticket in CONFIGS:
        dy.copy_(dy0)
        dx, dw = lagged_rms_backward(dy, x, weight, rstd, r=r, rb=rb, seg=seg, lag=lag, warps=warps, ticket=ticket)
        err_dx = (dx.float() - ref_dx).abs().max().item()
        err_dw = ((dw.float() - ref_dw).abs() / (ref_dw.abs() + 1)).max().item()
        ms = triton.testing.do_bench(
            lambda: lagged_rms_backward(dy, x, weight, rstd, r=r, rb=rb, seg=seg, lag=lag, warps=warps,
                                        ticket=ticket), return_mode="median")
        name = f"R{r} RB{rb} seg {seg} lag {lag} w{warps}{' tk' if ticket else ''}"
        out(f"{name:<30}{ms:>8.3f}{floor_ms / ms:>10.2f}   vs library: dx {err_dx:.1e} dw {err_dw:.1e}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["4096x65536", "4096x32768"])
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    lines = []

    def out(s):
        print(s, flush=True)
        lines.append(s)

    out(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for shape in args.shapes:
        n, n_cols = (int(s) for s in shape.split("x"))
        sweep(n, n_cols, out)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

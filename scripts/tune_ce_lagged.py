"""Probe: cross-entropy (loss and gradient) with the row's second read served from L2, by a lagged job order.

The library's CE kernel reads each row twice (softmax statistics, then the gradient) from DRAM: one program
sweeps a 256 KB row (bf16, 128256 columns) in ~20 us, and by its second sweep the L2 has turned over. Here a
row is cut into SEG-column segments and each segment is two jobs of one grid: a statistics job (logsumexp of
the segment, published with a release count per row) and, LAG rows later in the job order, a gradient job
(waits for the row's count with acquire, combines the segments' statistics in segment order, writes the
segment's gradient). Between a segment's two reads the whole GPU moves only ~LAG rows, a few MB, so the second
read should come from L2: two DRAM passes instead of three. No program waits on a later one (a job's ticket,
SYNC[0], is taken when it starts; it waits only on lower tickets), so it runs in the sequential interpreter too.

Only the plain loss (no weights, smoothing, softcap, z-loss; reduction sum) here: the probe measures the memory
traffic, not the options.

    python3 scripts/tune_ce_lagged.py [--shapes 8192x128256 8192x32000] [--out FILE]   (GPU)
    python3 -c "import sys; sys.path.insert(0, 'scripts'); import tune_ce_lagged as t; t.check()"  (CPU)
"""

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

from liger_core.cross_entropy import row_softmax_stats
from liger_core.tl_math import cast, exp_ftz


@triton.jit
def _ce_lagged_kernel(
    X, x_row_stride, T, n_rows, n_cols, ignore_index, scale,
    LOSS, GRAD, grad_row_stride, SYNC, PARTS,
    SEG: tl.constexpr, N_SEG: tl.constexpr, N_SEG_P2: tl.constexpr, LAG: tl.constexpr, BLOCK: tl.constexpr,
    TICKET: tl.constexpr, EVICT: tl.constexpr = "", REREAD_EVICT: tl.constexpr = "",
):
    if TICKET:
        job = tl.atomic_add(SYNC, 1, sem="relaxed").to(tl.int64)
    else:
        job = tl.program_id(0).to(tl.int64)
    slot = job // (2 * N_SEG)
    kind = job % (2 * N_SEG)
    seg = kind % N_SEG
    row = tl.where(kind < N_SEG, slot, slot - LAG)
    if (row < 0) | (row >= n_rows):  # the first LAG slots have no gradient jobs, the last LAG no statistics
        return
    start = seg * SEG
    seg_cols = tl.minimum(n_cols - start, SEG)
    t = tl.load(T + row).to(tl.int64)
    x_seg = X + row * x_row_stride + start
    parts = PARTS + row * (N_SEG + 1)
    if kind < N_SEG:  # statistics job (an ignored row has none to publish: its gradient jobs do not wait)
        if t != ignore_index:
            lse_seg, _, _, _ = row_softmax_stats(x_seg, 1, seg_cols, 1.0, 1.0, X, 0, BLOCK, False, False, False, EVICT)
            tl.store(parts + seg, lse_seg)
            if (t >= start) & (t < start + seg_cols):  # the target's logit, before a gradient job writes over it
                tl.store(parts + N_SEG, tl.load(x_seg + (t - start)).to(tl.float32))
            tl.debug_barrier()  # every thread's stores before the release
            tl.atomic_add(SYNC + 1 + row, 1, sem="release")
    else:  # gradient job
        grad_seg = GRAD + row * grad_row_stride + start
        offsets = tl.arange(0, BLOCK)
        x_next = tl.load(x_seg + offsets, mask=offsets < seg_cols, other=0.0,  # in flight through the wait
                         eviction_policy=REREAD_EVICT)
        ignored = t == ignore_index
        lse = tl.full([], 0.0, tl.float32)
        if t != ignore_index:
            count = tl.atomic_add(SYNC + 1 + row, 0, sem="acquire")
            while count < N_SEG:
                count = tl.atomic_add(SYNC + 1 + row, 0, sem="acquire")
            segs = tl.arange(0, N_SEG_P2)
            lse_parts = tl.load(parts + segs, mask=segs < N_SEG, other=float("-inf"), cache_modifier=".cg")
            m = tl.max(lse_parts, axis=0)
            lse = m + tl.log(tl.sum(tl.exp(lse_parts - m), axis=0))
        if seg == 0:
            x_t = tl.load(parts + N_SEG, cache_modifier=".cg", mask=t != ignore_index, other=0.0)
            tl.store(LOSS + row, tl.where(ignored, 0.0, (lse - x_t) * scale))
        row_scale = tl.where(ignored, 0.0, scale)
        for b in range(0, seg_cols, BLOCK):
            cols = b + offsets
            mask = cols < seg_cols
            x = x_next.to(tl.float32)
            x_next = tl.load(x_seg + cols + BLOCK, mask=cols + BLOCK < seg_cols, other=0.0,
                             eviction_policy=REREAD_EVICT)
            grad = (exp_ftz(x - lse) - tl.where(cols + start == t, 1.0, 0.0)) * row_scale
            tl.store(grad_seg + cols, cast(grad, GRAD.dtype.element_ty), mask=mask, cache_modifier=".cs")

def lagged_ce(x, target, *, seg, lag, block, warps, ticket=True, in_place=False, ignore_index=-100, scale=1.0,
              evict="", reread_evict=""):
    """(loss per row fp32, gradient) of the probe kernel; x (n, V) contiguous."""
    n, v = x.shape
    n_seg = triton.cdiv(v, seg)
    grad = x if in_place else torch.empty_like(x)
    loss = torch.empty(n, device=x.device, dtype=torch.float32)
    sync = torch.zeros(1 + n, device=x.device, dtype=torch.int32)
    parts = torch.empty(n * (n_seg + 1), device=x.device, dtype=torch.float32)
    grid = ((n + lag) * 2 * n_seg,)
    _ce_lagged_kernel[grid](x, x.stride(0), target, n, v, ignore_index, scale, loss, grad, grad.stride(0), sync,
                            parts, SEG=seg, N_SEG=n_seg, N_SEG_P2=triton.next_power_of_2(n_seg), LAG=lag,
                            BLOCK=block, TICKET=ticket, EVICT=evict, REREAD_EVICT=reread_evict,
                            num_warps=warps)
    return loss, grad


def reference(x, target, ignore_index=-100, scale=1.0):
    xf = x.double().requires_grad_(True)
    loss = torch.nn.functional.cross_entropy(xf, target, ignore_index=ignore_index, reduction="none") * scale
    loss.sum().backward()
    return loss.detach(), xf.grad


CHECK_CASES = [(7, 123, 32, 2, True, False), (5, 1000, 256, 0, False, True), (1, 77, 128, 3, True, True),
               (9, 300, 64, 1, True, False)]  # (rows, vocab, segment, lag, ticket, in place)


def check_case(n, v, seg, lag, ticket, in_place, device="cpu"):
    """The probe against fp64 torch on one odd shape, a row ignored (in the interpreter on the CPU)."""
    x = (torch.randn(n, v, device=device) * 3).to(torch.bfloat16)
    target = torch.randint(0, v, (n,), device=device)
    target[n // 2] = -100
    ref_loss, ref_grad = reference(x.float(), target, scale=0.5)
    loss, grad = lagged_ce(x.clone(), target, seg=seg, lag=lag, block=32, warps=4, ticket=ticket,
                           in_place=in_place, scale=0.5)
    torch.testing.assert_close(loss.double(), ref_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad.double(), ref_grad, atol=2e-3, rtol=2e-2)


def check():
    torch.manual_seed(0)
    for case in CHECK_CASES:
        check_case(*case)
    print("ok")


def sweep(n, v, out):
    from liger_core import cross_entropy
    from liger_torch._launch import info, run_plan
    x0 = torch.randn(n, v, device="cuda", dtype=torch.bfloat16) * 4
    x = x0.clone()
    target = torch.randint(0, v, (n,), device="cuda")
    ref_loss, ref_grad = reference(x[:64].float(), target[:64])
    copy_gbps = 4277.0 if "H200" in torch.cuda.get_device_name() else COPY_GBPS
    floor_ms = 2 * n * v * 2 / (copy_gbps * 1e9) * 1e3
    out(f"cross_entropy {n}x{v}: floor (one read, one write at {copy_gbps:.0f} GB/s) {floor_ms:.3f} ms")
    out(f"{'kernel':<40}{'ms':>8}{'of floor':>10}")
    for lagged, in_place in ((False, True), (False, False), (True, True), (True, False)):
        plan = cross_entropy.forward_plan(info(x), info(target), reduction="sum", in_place=in_place, lagged=lagged)
        ms = triton.testing.do_bench(lambda: run_plan(plan, logits=x, target=target), return_mode="median")
        name = f"library {'lagged' if lagged else 'two-pass'} {'in place' if in_place else 'out of place'}"
        out(f"{name:<40}{ms:>8.3f}{floor_ms / ms:>10.2f}")
    for seg, lag, block, warps, ticket, in_place, evict, reread in CONFIGS:
        x.copy_(x0)  # the in-place runs leave gradients in x
        loss, grad = lagged_ce(x[:64].clone(), target[:64], seg=seg, lag=lag, block=block, warps=warps,
                               ticket=ticket)
        err = (loss.double() - ref_loss).abs().max().item()
        grad_err = (grad.double() - ref_grad).abs().max().item()
        ms = triton.testing.do_bench(
            lambda: lagged_ce(x, target, seg=seg, lag=lag, block=block, warps=warps, ticket=ticket,
                              in_place=in_place, evict=evict, reread_evict=reread), return_mode="median")
        name = (f"seg {seg} lag {lag} {block}/{warps}{' tk' if ticket else ''}{' ip' if in_place else ''}"
                f" {evict[6:] or '-'}/{reread[6:] or '-'}")
        out(f"{name:<40}{ms:>8.3f}{floor_ms / ms:>10.2f}   max err loss {err:.1e} grad {grad_err:.1e}")


# (segment columns, lag rows, block, warps, ticket, in place, first read's and second read's eviction), most telling first
CONFIGS = [(8192, 64, 2048, 4, True, True, "", "evict_first")]
COPY_GBPS = float(os.environ.get("COPY_GBPS", "3054"))  # the H100's copy rate of s25 (4277 on the H200)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["8192x128256", "8192x32000"])
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    lines = []

    def out(s):
        print(s, flush=True)
        lines.append(s)

    out(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for shape in args.shapes:
        n, v = (int(s) for s in shape.split("x"))
        sweep(n, v, out)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""GPU probe: can cross-entropy's second read of a row come from L2? (issue 4: CE at 85% of the two-pass floor)

The library's CE kernel (one program per row, 2048-element steps, 8 warps) reads each row twice: sweep 1 for
the softmax statistics, sweep 2 for the gradient (last block first). With ~8 programs an SM, ~1000 rows of 256 KB
are in flight, so between a row's two reads the GPU moves far more than L2's 50 MB and sweep 2 comes from DRAM
(three passes of traffic; 1.469 ms at 8192 x 128256 on the H200 against a 0.983 ms two-pass floor). With one
or two rows an SM (a persistent grid of P programs an SM) only 33-66 MB sit between the reads; with sweep 1's
loads marked evict_last, sweep 2's evict_first and the gradient's stores streamed (``.cs``), the re-read may hit
L2. The fifth session's persistent grid lost (1.806 against 1.660), but it had no prefetch in sweep 1 and no
hints. This probe times the loss + in-place gradient (mean over rows, no ignored rows, bf16; sweep 1 is the
library's ``row_softmax_stats``, with its eviction policy set) of:

- ``library``: the library's plan at its default launch (the row kernel, and two launches of a few microseconds
  for the mean's denominator and the sum);
- ``rows``: this probe's kernel, one program per row;
- ``P=k``: this probe's kernel on k programs an SM looping over rows;

at several (block, warps) and hint sets, and checks each against the library's loss and gradient. (First run,
H100 2026-12-07: no L2 reuse worth a persistent grid, but longer steps with streamed stores won on one program a
row; the library took them: cross_entropy._CE_SWEEPS.)

    python3 scripts/tune_ce_l2.py [--shapes 8192x128256] [--out FILE]
"""

import sys

import torch
import triton
import triton.language as tl
import triton.testing

from liger_core import cross_entropy
from liger_core.cross_entropy import row_softmax_stats
from liger_core.tl_math import exp_ftz
from liger_torch._launch import info, run_plan

import _gpu_tables as gpu_tables  # scripts/, the directory Python puts first on the path

COPY_GBPS = 4277.0  # the H200's measured copy bandwidth (benchmarks/results), for the floor column
HINTS = {  # name: (sweep 1 load eviction, sweep 2 load eviction, gradient store cache modifier)
    "none": ("", "", ""),
    "cs": ("", "", ".cs"),
    "last/first/cs": ("evict_last", "evict_first", ".cs"),
}
LAUNCHES = [(2048, 8), (4096, 8), (8192, 16), (8192, 32), (16384, 32)]


@triton.jit
def _ce_probe_kernel(X, row_stride, T, LOSS, n_rows, n_cols, inv_rows,
                     BLOCK: tl.constexpr, PERSISTENT: tl.constexpr, EV1: tl.constexpr, EV2: tl.constexpr,
                     STORE: tl.constexpr, HOLD: tl.constexpr):
    """Mean CE loss per row and its gradient written over the logits, rows ``pid, pid + programs, ...``. The
    row's first HOLD columns (0 or a multiple of BLOCK) are read once into registers and kept for the gradient;
    the rest is swept twice."""
    first = tl.program_id(0)
    step = tl.num_programs(0) if PERSISTENT else n_rows
    offsets = tl.arange(0, BLOCK)  # sweep 2's
    n_blocks = tl.cdiv(tl.maximum(n_cols - HOLD, 0), BLOCK)
    for k in range(0, tl.cdiv(n_rows - first, step)):
        row = (first + k * step).to(tl.int64)
        x_row = X + row * row_stride
        t = tl.load(T + row).to(tl.int64)
        if HOLD > 0:
            held_cols = tl.arange(0, HOLD)
            held = tl.load(x_row + held_cols, mask=held_cols < n_cols, other=0.0)
        # the library's sweep 1 over the columns not held (-inf when the held head covers the row)
        lse = row_softmax_stats(x_row + HOLD, 1, n_cols - HOLD, 1.0, 1.0, X, 0, BLOCK, False, False, False, EV1)[0]
        x_t = tl.load(x_row + t).to(tl.float32)  # before any gradient is written over the row
        if HOLD > 0:
            held_x = tl.where(held_cols < n_cols, held.to(tl.float32), float("-inf"))
            top = tl.maximum(lse, tl.max(held_x, axis=0))
            lse = top + tl.log(exp_ftz(lse - top) + tl.sum(exp_ftz(held_x - top), axis=0))
            held_grad = exp_ftz(held_x - lse) * inv_rows - tl.where(held_cols == t, inv_rows, 0.0)
            tl.store(x_row + held_cols, held_grad.to(X.dtype.element_ty), mask=held_cols < n_cols,
                     cache_modifier=STORE)
        tl.store(LOSS + row, (lse - x_t) * inv_rows)
        for i in range(n_blocks):
            cols = HOLD + (n_blocks - 1 - i) * BLOCK + offsets
            mask = cols < n_cols
            x = tl.load(x_row + cols, mask=mask, other=0.0, eviction_policy=EV2).to(tl.float32)
            grad = exp_ftz(x - lse) * inv_rows - tl.where(cols == t, inv_rows, 0.0)
            tl.store(x_row + cols, grad.to(X.dtype.element_ty), mask=mask, cache_modifier=STORE)


def _probe(x, target, loss, block, warps, programs, hints, hold=0):
    n, v = x.shape
    ev1, ev2, store = HINTS[hints]
    grid = (programs if programs else n,)
    _ce_probe_kernel[grid](x, x.stride(0), target, loss, n, v, 1.0 / n, BLOCK=block, PERSISTENT=bool(programs),
                           EV1=ev1, EV2=ev2, STORE=store, HOLD=hold, num_warps=warps)


def _check(n, v, block, warps, programs, hints, hold=0, device="cuda"):
    """The probe's loss and gradient against the library's, on fresh logits."""
    x = torch.randn(n, v, device=device, dtype=torch.bfloat16) * 4
    target = torch.randint(0, v, (n,), device=device)
    plan = cross_entropy.forward_plan(info(x), info(target), reduction="mean", compute_grad=True)
    ref_loss, ref_grad = run_plan(plan, logits=x.clone(), target=target)
    loss = torch.full((n,), float("nan"), device=x.device, dtype=torch.float32)
    _probe(x, target, loss, block, warps, programs, hints, hold)
    torch.testing.assert_close(loss.sum(), ref_loss.float().reshape(()), rtol=8e-3, atol=0.0)
    # gradients are ~softmax / n: compared times n, so that atol means something
    torch.testing.assert_close(x.float() * n, ref_grad.float() * n, rtol=1.6e-2, atol=1e-5)


def sweep(n, v, out):
    unit_ms = n * v * 2 / (COPY_GBPS * 1e9) * 1e3
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out(f"{n}x{v}: floor {2 * unit_ms:.3f} ms (read the logits once, write the gradient once); {sms} SMs")
    out(f"{'kernel':<10}{'block':>7}{'warps':>6}{'hints':>15}{'ms':>8}{'of floor':>10}")
    x = torch.randn(n, v, device="cuda", dtype=torch.bfloat16) * 4
    target = torch.randint(0, v, (n,), device="cuda")
    plan = cross_entropy.forward_plan(info(x), info(target), reduction="mean", compute_grad=True, in_place=True)
    ms = triton.testing.do_bench(lambda: run_plan(plan, logits=x, target=target), return_mode="median")
    out(f"{'library':<10}{'':>7}{'':>6}{'':>15}{ms:>8.3f}{2 * unit_ms / ms:>10.2f}")
    loss = torch.empty(n, device="cuda", dtype=torch.float32)
    for programs, block, warps, hints, hold in _configs():
        name = (f"P={programs}" if programs else "rows") + (f" h{hold // 1024}k" if hold else "")
        label = f"{name:<10}{block:>7}{warps:>6}{hints:>15}"
        try:
            _check(min(n, 3 * sms * max(programs, 1)), v, block, warps, programs * sms, hints, hold)
            ms = triton.testing.do_bench(
                lambda: _probe(x, target, loss, block, warps, programs * sms, hints, hold), return_mode="median")
            out(f"{label}{ms:>8.3f}{2 * unit_ms / ms:>10.2f}")
        except Exception as e:  # a failed check or launch is a line of the table, not the end of it
            out(f"{label}  failed: {type(e).__name__}: {str(e)[:80]}")


def _configs():
    """(programs an SM or 0 for one a row, block, warps, hints, held columns), most telling first."""
    def launches(programs):
        for block, warps in LAUNCHES:
            if not (programs and block < 4096 or not programs and warps > 16):
                for hints in HINTS:
                    yield programs, block, warps, hints, 0

    yield from launches(1)
    for hold in (16384, 32768, 65536):
        for hints in ("none", "last/first/cs"):
            yield 1, 8192, 32, hints, hold
    yield from launches(0)
    yield from launches(2)  # two 32-warp programs do not fit an SM's registers: the second waits


def main(argv=None) -> int:
    return gpu_tables.sweep_shapes_main("tune_ce_l2", __doc__, ["8192x128256"], sweep, argv)


if __name__ == "__main__":
    sys.exit(main())

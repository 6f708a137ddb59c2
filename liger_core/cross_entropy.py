"""Cross-entropy on logits, with its gradient produced in the forward pass.

One program per row reads the row twice: an online softmax in fp32 over vocab blocks (running max and sum of
exponentials, plus the sums label smoothing needs), then a second sweep that writes the gradient of the
(already reduced) loss with respect to the logits, either over the logits themselves (in place) or into a
fresh buffer. The backward is then a scale of that gradient by the incoming one (:func:`backward_plan`).
For the loss with its gradient on rows of 98304+ columns there is a lagged kernel: the row cut into segments
whose statistics and gradient jobs run in one grid, the gradient jobs ~12 MiB of rows behind, so that the
second read comes from L2 (:func:`_cross_entropy_lagged_kernel`; chosen by width, ``LAGGED``, or by ``lagged=``
in the plans).

Options follow ``torch.nn.functional.cross_entropy``:

- ``ignore_index`` (rows whose target equals it contribute nothing), ``reduction`` in mean|sum|none,
  ``label_smoothing`` and class ``weight``, with torch's formulas: per row
  ``(1 - eps) * w[t] * (lse - z[t]) + eps / V * sum_c w[c] * (lse - z[c])``; ``mean`` divides the sum by the
  sum of ``w[t]`` over non-ignored rows (their count without weights).
- ``lse_square_scale`` (z-loss, PaLM): adds ``lse_square_scale * lse**2`` per non-ignored row (unweighted;
  ``mean`` divides its sum by the number of non-ignored rows). The returned loss includes it; the separate
  ``z_loss`` output is for logging.
- ``softcap`` (Gemma 2): the logits are first mapped to ``softcap * tanh(logits / softcap)``; the gradient
  carries the factor ``1 - tanh**2``.

Deliberate differences from torch: an all-ignored batch (or a zero total class weight) under ``mean`` gives a
loss of 0 and a zero gradient instead of NaN. A target outside ``[0, V)`` that is not ``ignore_index`` makes
that row's loss and gradient NaN inside the kernel; the frontends check eagerly and raise ValueError where
they can (see :func:`invalid_targets_message`).
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from .tl_math import aligned, cast, chunk_columns, exp_ftz, exp_minus_abs_ftz, tanh
from .launch import (
    ITEMSIZE, ArrayInfo, Buf, Launch, NewBuffer, Plan, as_real, by_width, cdiv, check_float, check_int,
    check_last_axis_span, check_nonempty, contiguous_strides, next_power_of_2, sweep_block_and_warps, warps_for,
)
from .rowwise import row_view
from .reduce import sum_partial_pairs_launch, sum_partials_launch

REDUCTIONS = ("mean", "sum", "none")
INT_DTYPES = ("int64", "int32", "int16", "int8", "uint8")
# Targets one program reads per step when counting the non-ignored rows.
_COUNT_BLOCK = 1024
_SCALE_BLOCK = 4096
# Programs of the backward's scale: a few per SM of any current GPU, each striding over many tiles.
_SCALE_PROGRAMS = 1024
# (from columns, (columns per step, num_warps)) of the CE row sweeps, widest first; narrower rows take the library's
# row sweep (2048 at 8 warps). One table whether the gradient is written over the logits or into its own buffer,
# so that both frontends (torch out of place by default, jax in place) launch the same steps and agree bit for
# bit. H100, bf16, one program a row, gradient stores streamed (benchmarks/results/h100-2026-12-07-tune_ce_library
# *.txt, in place, measured with a `tune_ce_l2.py --library` since folded into scripts/tune_row_kernels.py;
# -tune_row_kernels.txt, out of place): 8192x128256 in place 1.816 ms at 8192/16 against 2.084 at 2048/8 (a
# persistent grid was no better: 1.778 at its best), out of place 1.990 against 2.119; 8192x65536 in place 0.861
# against 1.023; 16384x32000 out of place 0.857 at 8192/16 against 0.931 at 4096/8 and 1.025 at 2048/8, in place
# 0.854 against 0.926 at 2048/8 (4096/8's 0.831 would win there by 3%, and lose 8% out of place).
_CE_SWEEPS = ((32000, (8192, 16)),)
# The lagged kernel (_cross_entropy_lagged_kernel) for the loss with its gradient on rows of at least "from_cols"
# columns (None: never): "segment" columns a job, the gradient jobs "lag_bytes" of rows (1 to 256 rows) after the
# statistics jobs (what the L2 must hold between a segment's two reads is bytes), "block" columns a step at
# "num_warps". H100, bf16, in place / out of place, ms (results/h100-80gb-hbm3-2026-12-07-tune_ce_lagged5.txt;
# perf-log, twenty-sixth and twenty-seventh sessions): 8192x128256 1.739 / 1.751 against the two-pass kernel's
# 1.804 / 1.980; 8192x256000 3.446 / 3.471 against 3.883 / 4.077; 8192x65536 0.890 / 0.896 against 0.844 / 0.945
# (in place it loses: from 98304). 8 MiB ran 4-6% slower, 16 MiB 1-3%, 24 MiB at the three-pass level; 16384-column
# segments and 1024 columns at 2 warps 1-9% slower. The launch needs <= 64 registers a thread (8 programs an SM):
# at 79 it ran at 1.93 ms (tests/core/test_vectorized_ptx.py).
LAGGED = {"from_cols": 98304, "segment": 8192, "lag_bytes": 12 * 2**20, "block": 2048, "num_warps": 4}


@triton.jit
def _denominators_kernel(
    T, t_stride,
    W, w_stride,
    n_rows, n_cols, ignore_index,
    DENOM,
    BLOCK: tl.constexpr, HAS_WEIGHT: tl.constexpr,
):
    """DENOM[0] = sum of w[t] over valid rows (their count without weights), DENOM[1] = count of valid rows,
    DENOM[2] = count of invalid targets (neither ignore_index nor in [0, n_cols)), for the frontends' check."""
    count = tl.zeros([BLOCK], dtype=tl.float32)
    n_bad = tl.zeros([BLOCK], dtype=tl.float32)
    weight_sum = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_rows, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        in_range = rows < n_rows
        t = tl.load(T + rows.to(tl.int64) * t_stride, mask=in_range, other=0).to(tl.int64)
        kept = in_range & (t != ignore_index)
        valid = kept & (t >= 0) & (t < n_cols)
        count += valid.to(tl.float32)
        n_bad += (kept & ~valid).to(tl.float32)
        if HAS_WEIGHT:
            safe = tl.where(valid, t, 0)
            weight_sum += tl.load(W + safe * w_stride, mask=valid, other=0.0).to(tl.float32)
    n_valid = tl.sum(count, axis=0)
    if HAS_WEIGHT:
        tl.store(DENOM, tl.sum(weight_sum, axis=0))
    else:
        tl.store(DENOM, n_valid)
    tl.store(DENOM + 1, n_valid)
    tl.store(DENOM + 2, tl.sum(n_bad, axis=0))


@triton.jit
def row_softmax_stats(row_ptr, col_stride, n_cols, scale, softcap, W, w_stride, BLOCK: tl.constexpr,
                      HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                      EVICT: tl.constexpr):
    """One read of a row of logits ``x`` (times ``scale``, through the softcap): ``(logsumexp(x), sum x,
    sum w * x, sum w)`` in fp32 (the sums only with HAS_SMOOTHING; w the class weights with HAS_WEIGHT).

    Latency, not bandwidth, limits this loop (54% of the read floor at 8192 x 128256 on an H200 with a load,
    then two block-wide reductions per block; 71% with the next block's load issued first and one reduction, the
    max). So the next block's load is in flight while the current one is reduced, and nothing is reduced across
    the block inside the loop: each lane keeps its own running max ``m`` and sum ``d`` of exp(x - m), updated
    with one exponential, exp(-|x - m|) (the smaller of the two over the larger: d * it + 1 when x is the new
    max, d + it otherwise). The lanes are combined once, at the end. ``m`` starts at a finite -3e38 rather
    than -inf so that a -inf logit (or a masked lane) gives exp(-inf) = 0, not NaN. ``EVICT`` is the loads'
    eviction policy ("" for none, as the library's kernels pass; scripts/tune_ce_l2.py tries ``evict_last`` for a
    second read from L2). An empty row (``n_cols`` <= 0) gives a logsumexp of -inf."""
    offsets = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], -3.0e38, dtype=tl.float32)
    d = tl.zeros([BLOCK], dtype=tl.float32)
    sum_z = tl.zeros([BLOCK], dtype=tl.float32)
    sum_wz = tl.zeros([BLOCK], dtype=tl.float32)
    sum_w = tl.zeros([BLOCK], dtype=tl.float32)
    x_next = tl.load(row_ptr + offsets * col_stride, mask=offsets < n_cols, other=0.0, eviction_policy=EVICT)
    for start in range(0, n_cols, BLOCK):
        cols = start + offsets
        mask = cols < n_cols
        x = x_next.to(tl.float32) * scale
        next_cols = cols + BLOCK
        x_next = tl.load(row_ptr + next_cols * col_stride, mask=next_cols < n_cols, other=0.0,
                         eviction_policy=EVICT)
        if HAS_SOFTCAP:
            x = softcap * tanh(x / softcap)
        z = tl.where(mask, x, float("-inf"))
        u = exp_minus_abs_ftz(z - m)  # two instructions, not tl.exp's five (tl_math)
        bigger = z > m
        d = tl.where(bigger, d * u + 1.0, d + u)
        m = tl.where(bigger, z, m)
        if HAS_SMOOTHING:
            if HAS_WEIGHT:
                w = tl.load(W + cols * w_stride, mask=mask, other=0.0).to(tl.float32)
                sum_wz += tl.where(mask, w * x, 0.0)
                sum_w += w
            else:
                sum_z += tl.where(mask, x, 0.0)
    m_row = tl.max(m, axis=0)
    lse = m_row + tl.log(tl.sum(d * exp_ftz(m - m_row), axis=0))
    return lse, tl.sum(sum_z, axis=0), tl.sum(sum_wz, axis=0), tl.sum(sum_w, axis=0)


@triton.jit
def row_loss_terms(lse, sum_z, sum_wz, sum_w, x_t, w_t, valid, DENOM, n_cols, label_smoothing, lse_square_scale,
                   MEAN: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_Z: tl.constexpr):
    """A row's ``(loss, z_loss, a, b, c)`` from its softmax statistics: the loss (NaN for an invalid target),
    already divided by the mean's denominators, and d loss / d logits = a * softmax - b * onehot(t) - c * w."""
    if MEAN:
        denom_w = tl.load(DENOM)
        denom_n = tl.load(DENOM + 1)
        # a total class weight of exactly 0 (every target ignored) gives 0, not NaN; a negative total (negative
        # class weights are valid) divides, as torch's
        ce_scale = tl.where(denom_w != 0, 1.0 / tl.where(denom_w != 0, denom_w, 1.0), 0.0)
        z_scale = tl.where(denom_n > 0, 1.0 / tl.where(denom_n > 0, denom_n, 1.0), 0.0)
    else:
        ce_scale = 1.0
        z_scale = 1.0
    eps = label_smoothing
    ce = (1.0 - eps) * w_t * (lse - x_t)
    if HAS_SMOOTHING:
        if HAS_WEIGHT:
            ce += eps / n_cols * (sum_w * lse - sum_wz)
        else:
            ce += eps * lse - eps / n_cols * sum_z
    loss = ce * ce_scale
    z_loss = lse_square_scale * lse * lse * z_scale
    if HAS_Z:
        loss += z_loss
    if HAS_SMOOTHING:
        if HAS_WEIGHT:
            a = ((1.0 - eps) * w_t + eps / n_cols * sum_w) * ce_scale
        else:
            a = ce_scale * 1.0
    else:
        a = w_t * ce_scale
    if HAS_Z:
        a += 2.0 * lse_square_scale * lse * z_scale
    b = (1.0 - eps) * w_t * ce_scale
    c = eps / n_cols * ce_scale
    return tl.where(valid, loss, float("nan")), tl.where(valid, z_loss, float("nan")), a, b, c


@triton.jit
def scaled_by_incoming(a, b, c, G, g_stride, row, HAS_GRAD_SCALE: tl.constexpr):
    """The gradient terms times the row's incoming gradient (HAS_GRAD_SCALE: reduction='none' chunks of fused
    linear cross-entropy), else as they are."""
    if HAS_GRAD_SCALE:
        g = tl.load(G + row * g_stride).to(tl.float32)
        a = a * g
        b = b * g
        c = c * g
    return a, b, c


@triton.jit
def gradient_values(x, cols, mask, t_safe, valid, lse, a, b, c, softcap, W, w_stride, HAS_SOFTCAP: tl.constexpr,
                    HAS_SMOOTHING: tl.constexpr, HAS_WEIGHT: tl.constexpr):
    """d loss / d logits at columns ``cols`` of a row, from its logits ``x`` (fp32, before the softcap) and the
    row's terms (:func:`row_loss_terms`); NaN for an invalid target."""
    if HAS_SOFTCAP:
        th = tanh(x / softcap)
        x = softcap * th
    grad = exp_ftz(x - lse) * a - tl.where(cols == t_safe, b, 0.0)
    if HAS_SMOOTHING:
        if HAS_WEIGHT:
            grad -= c * tl.load(W + cols * w_stride, mask=mask, other=0.0).to(tl.float32)
        else:
            grad -= c
    if HAS_SOFTCAP:
        grad = grad * (1.0 - th * th)
    return tl.where(valid, grad, float("nan"))


@triton.jit
def _cross_entropy_kernel(
    X, x_row_stride, x_col_stride,
    T, t_stride,
    W, w_stride,
    DENOM,
    G, g_stride,
    grad_row_stride, grad_col_stride,
    n_cols, ignore_index, label_smoothing, lse_square_scale, softcap,
    LOSS, Z_LOSS, GRAD,
    BLOCK_V: tl.constexpr, HAS_WEIGHT: tl.constexpr, MEAN: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr, HAS_Z: tl.constexpr, RETURN_Z: tl.constexpr, HAS_GRAD: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr, ALIGN: tl.constexpr,
):
    """The loss (and gradient) of one row per program; an ignored row gets a zero loss and a zero gradient. (A
    persistent grid looping over rows, its gradient sweep run backwards for L2 reuse, was slower at every block
    size and 1-3 programs per SM: results/h200-2026-12-03-tune_ce-persistent.txt. A row split over up to 32 programs
    that exchange their softmax statistics inside the kernel, reading the logits once, was 1.5x slower: the
    segments held through the exchange leave too few bytes in flight per SM; results/h200-2026-12-04-tune_ce_split
    .txt, commit cfe49f6. What did pay for wide rows is reading each segment again from L2, with no program
    waiting on a later one: :func:`_cross_entropy_lagged_kernel`.)"""
    x_row_stride = aligned(x_row_stride, ALIGN)
    grad_row_stride = aligned(grad_row_stride, ALIGN)
    n_cols = aligned(n_cols, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(T + row * t_stride).to(tl.int64)
    if t == ignore_index:
        if HAS_GRAD:
            store_zeros(GRAD + row * grad_row_stride, grad_col_stride, n_cols, BLOCK_V)
        store_zero_losses(LOSS, Z_LOSS, row, RETURN_Z)
        return

    x_row = X + row * x_row_stride
    grad_row = GRAD + row * grad_row_stride
    offsets = tl.arange(0, BLOCK_V)
    valid = (t >= 0) & (t < n_cols)
    t_safe = tl.where(valid, t, 0)

    # Sweep 1: online softmax statistics, and the sums label smoothing needs.
    lse, sum_z, sum_wz, sum_w = row_softmax_stats(x_row, x_col_stride, n_cols, 1.0, softcap, W, w_stride, BLOCK_V,
                                                  HAS_SOFTCAP, HAS_SMOOTHING, HAS_WEIGHT, "")

    x_t = tl.load(x_row + t_safe * x_col_stride).to(tl.float32)
    if HAS_SOFTCAP:
        x_t = softcap * tanh(x_t / softcap)
    if HAS_WEIGHT:
        w_t = tl.load(W + t_safe * w_stride).to(tl.float32)
    else:
        w_t = 1.0
    loss, z_loss, a, b, c = row_loss_terms(lse, sum_z, sum_wz, sum_w, x_t, w_t, valid, DENOM, n_cols,
                                           label_smoothing, lse_square_scale, MEAN, HAS_SMOOTHING, HAS_WEIGHT, HAS_Z)
    tl.store(LOSS + row, loss.to(LOSS.dtype.element_ty))
    if RETURN_Z:
        tl.store(Z_LOSS + row, z_loss.to(Z_LOSS.dtype.element_ty))

    # Sweep 2: d loss / d logits = a * softmax - b * onehot(t) - c * w (times 1 - tanh^2 with a softcap).
    if HAS_GRAD:
        a, b, c = scaled_by_incoming(a, b, c, G, g_stride, row, HAS_GRAD_SCALE)
        n_blocks = tl.cdiv(n_cols, BLOCK_V)
        for i in range(n_blocks):
            cols = chunk_columns(i, n_blocks, BLOCK_V, True)  # last block first: sweep 1's latest, likeliest in L2
            mask = cols < n_cols
            x = tl.load(x_row + cols * x_col_stride, mask=mask, other=0.0).to(tl.float32)
            grad = gradient_values(x, cols, mask, t_safe, valid, lse, a, b, c, softcap, W, w_stride, HAS_SOFTCAP,
                                   HAS_SMOOTHING, HAS_WEIGHT)
            # streamed (.cs): the gradient is read next by another kernel, not by this one, and leaving L2 to the
            # logits' second sweep was 2-8% faster at every block size (H100, tune_ce_l2 "cs")
            tl.store(grad_row + cols * grad_col_stride, cast(grad, GRAD.dtype.element_ty), mask=mask,
                     cache_modifier=".cs")


@triton.jit
def _cross_entropy_lagged_kernel(
    X, x_row_stride, x_col_stride,
    T, t_stride,
    W, w_stride,
    DENOM,
    G, g_stride,
    grad_row_stride, grad_col_stride,
    n_rows, n_cols, ignore_index, label_smoothing, lse_square_scale, softcap,
    LOSS, Z_LOSS, GRAD, SYNC, PARTS, X_T,
    SEG: tl.constexpr, N_SEG: tl.constexpr, N_SEG_P2: tl.constexpr, LAG: tl.constexpr, BLOCK_V: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, MEAN: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
    HAS_Z: tl.constexpr, RETURN_Z: tl.constexpr, HAS_GRAD_SCALE: tl.constexpr, ALIGN: tl.constexpr,
):
    """The loss and gradient of wide rows with the row's second read served from L2 (the two-pass kernel reads
    it twice from DRAM: one program takes ~20 us to sweep a 256 KB row, and by its second sweep the L2 has
    turned over).

    Each row is N_SEG segments of SEG columns, and each segment two jobs of one grid, in a fixed order: a
    statistics job (the segment's logsumexp and smoothing sums into PARTS[row, :, segment], then a release count
    on SYNC[1 + row]) and, LAG rows later in the order, a gradient job (its first block's load issued, it waits
    with acquire for the row's N_SEG counts, combines the segments' statistics in segment order, stores the
    loss with segment 0 and writes the segment's gradient). Between a segment's two reads the GPU streams only
    the ~LAG rows in between. A job takes its place in the order from a ticket (SYNC[0]) when it starts, and
    waits only on jobs with lower tickets, already running or done: no wait can deadlock whatever the order in
    which the hardware starts programs, and the interpreter runs the grid as it is. The target's logit is
    published by its segment's statistics job (X_T[row]): the gradient may be written over the logits."""
    x_row_stride = aligned(x_row_stride, ALIGN)
    grad_row_stride = aligned(grad_row_stride, ALIGN)
    n_cols = aligned(n_cols, ALIGN)
    job = tl.atomic_add(SYNC, 1, sem="relaxed").to(tl.int64)
    slot = job // (2 * N_SEG)
    kind = job % (2 * N_SEG)
    seg = kind % N_SEG
    row = tl.where(kind < N_SEG, slot, slot - LAG)
    if (row < 0) | (row >= n_rows):  # the first LAG slots have no gradient jobs, the last LAG no statistics
        return
    start = seg * SEG
    seg_cols = tl.minimum(n_cols - start, SEG)
    t = tl.load(T + row * t_stride).to(tl.int64)
    x_seg = X + row * x_row_stride + start * x_col_stride
    parts = PARTS + row * (4 * N_SEG)
    if kind < N_SEG:  # statistics job (an ignored row publishes none: its gradient jobs do not wait)
        if t != ignore_index:
            lse, sum_z, sum_wz, sum_w = row_softmax_stats(
                x_seg, x_col_stride, seg_cols, 1.0, softcap, W + start * w_stride, w_stride, BLOCK_V,
                HAS_SOFTCAP, HAS_SMOOTHING, HAS_WEIGHT, "")
            tl.store(parts + seg, lse)
            if HAS_SMOOTHING:
                tl.store(parts + N_SEG + seg, sum_z)
                tl.store(parts + 2 * N_SEG + seg, sum_wz)
                tl.store(parts + 3 * N_SEG + seg, sum_w)
            if (t >= start) & (t < start + seg_cols):  # before any gradient job can write over it
                x_t = tl.load(x_seg + (t - start) * x_col_stride).to(tl.float32)
                if HAS_SOFTCAP:
                    x_t = softcap * tanh(x_t / softcap)
                tl.store(X_T + row, x_t)
            tl.debug_barrier()  # every thread's stores before the release
            tl.atomic_add(SYNC + 1 + row, 1, sem="release")
    elif t == ignore_index:  # gradient job of an ignored row: zeros, from no read and no wait (prompt tokens
        # can be most rows; its statistics jobs published nothing)
        store_zeros(GRAD + row * grad_row_stride + start * grad_col_stride, grad_col_stride, seg_cols, BLOCK_V)
        if seg == 0:
            store_zero_losses(LOSS, Z_LOSS, row, RETURN_Z)
    else:  # gradient job
        grad_seg = GRAD + row * grad_row_stride + start * grad_col_stride
        offsets = tl.arange(0, BLOCK_V)
        # The first block's load is in flight through the wait; the last read of these logits (evict_first).
        x_next = tl.load(x_seg + offsets * x_col_stride, mask=offsets < seg_cols, other=0.0,
                         eviction_policy="evict_first")
        count = tl.atomic_add(SYNC + 1 + row, 0, sem="acquire")
        while count < N_SEG:
            count = tl.atomic_add(SYNC + 1 + row, 0, sem="acquire")
        lse, sum_z, sum_wz, sum_w = combine_segment_stats(parts, N_SEG, N_SEG_P2, HAS_SMOOTHING)
        valid = (t >= 0) & (t < n_cols)
        t_safe = tl.where(valid, t, 0)
        x_t = tl.load(X_T + row, mask=valid, other=0.0, cache_modifier=".cg")
        if HAS_WEIGHT:
            w_t = tl.load(W + t_safe * w_stride).to(tl.float32)
        else:
            w_t = 1.0
        loss, z_loss, a, b, c = row_loss_terms(lse, sum_z, sum_wz, sum_w, x_t, w_t, valid, DENOM, n_cols,
                                               label_smoothing, lse_square_scale, MEAN, HAS_SMOOTHING, HAS_WEIGHT,
                                               HAS_Z)
        a, b, c = scaled_by_incoming(a, b, c, G, g_stride, row, HAS_GRAD_SCALE)
        if seg == 0:
            tl.store(LOSS + row, loss.to(LOSS.dtype.element_ty))
            if RETURN_Z:
                tl.store(Z_LOSS + row, z_loss.to(Z_LOSS.dtype.element_ty))
        for block_start in range(0, seg_cols, BLOCK_V):
            cols = block_start + offsets
            mask = cols < seg_cols
            x = x_next.to(tl.float32)
            x_next = tl.load(x_seg + (cols + BLOCK_V) * x_col_stride, mask=cols + BLOCK_V < seg_cols, other=0.0,
                             eviction_policy="evict_first")
            grad = gradient_values(x, cols + start, mask, t_safe, valid, lse, a, b, c, softcap, W, w_stride,
                                   HAS_SOFTCAP, HAS_SMOOTHING, HAS_WEIGHT)
            tl.store(grad_seg + cols * grad_col_stride, cast(grad, GRAD.dtype.element_ty), mask=mask,
                     cache_modifier=".cs")


@triton.jit
def store_zeros(ptr, col_stride, n_cols, BLOCK: tl.constexpr):
    """Zeros into ``n_cols`` columns of one row (an ignored row's gradient)."""
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        tl.store(ptr + cols * col_stride, tl.zeros([BLOCK], dtype=tl.float32).to(ptr.dtype.element_ty),
                 mask=cols < n_cols)


@triton.jit
def store_zero_losses(LOSS, Z_LOSS, row, RETURN_Z: tl.constexpr):
    """An ignored row's loss (and z-loss): 0."""
    tl.store(LOSS + row, tl.zeros([], dtype=LOSS.dtype.element_ty))
    if RETURN_Z:
        tl.store(Z_LOSS + row, tl.zeros([], dtype=Z_LOSS.dtype.element_ty))


@triton.jit
def combine_segment_stats(parts, N_SEG: tl.constexpr, N_SEG_P2: tl.constexpr, HAS_SMOOTHING: tl.constexpr):
    """A row's ``(logsumexp, sum x, sum w x, sum w)`` from its segments' (``parts``: N_SEG of each, written by
    other programs: loaded from L2, not L1), combined in segment order."""
    segs = tl.arange(0, N_SEG_P2)
    read = segs < N_SEG
    lse_parts = tl.load(parts + segs, mask=read, other=float("-inf"), cache_modifier=".cg")
    m = tl.max(lse_parts, axis=0)
    lse = m + tl.log(tl.sum(exp_ftz(lse_parts - m), axis=0))
    sum_z = 0.0
    sum_wz = 0.0
    sum_w = 0.0
    if HAS_SMOOTHING:
        sum_z = tl.sum(tl.load(parts + N_SEG + segs, mask=read, other=0.0, cache_modifier=".cg"), axis=0)
        sum_wz = tl.sum(tl.load(parts + 2 * N_SEG + segs, mask=read, other=0.0, cache_modifier=".cg"), axis=0)
        sum_w = tl.sum(tl.load(parts + 3 * N_SEG + segs, mask=read, other=0.0, cache_modifier=".cg"), axis=0)
    return lse, sum_z, sum_wz, sum_w


@triton.jit
def _scale_rows_kernel(
    GRAD, row_stride, col_stride,
    G, g_stride,
    n_rows, n_cols, blocks_per_row,
    OUT,
    BLOCK: tl.constexpr, IN_PLACE: tl.constexpr, ALIGN: tl.constexpr,
):
    """OUT[r, :] = GRAD[r, :] * G[r * g_stride] (g_stride 0: one scalar), a fixed number of programs striding over
    the (row, column block) tiles; OUT may be GRAD itself (IN_PLACE).

    In place, a row whose incoming gradient is exactly 1 is already right: its tiles move no bytes, and with one
    scalar of 1 (``loss.backward()`` of a mean or sum) every program returns at once. (A grid of one masked
    program per tile still cost 0.162 ms at 8192 x 128256: results/h200-2026-12-04-tune_kl_div_chunks.txt.)"""
    row_stride = aligned(row_stride, ALIGN)
    n_cols = aligned(n_cols, ALIGN)
    if IN_PLACE:
        if g_stride == 0:
            if tl.load(G).to(tl.float32) == 1.0:
                return
    for tile in range(tl.program_id(0), n_rows * blocks_per_row, tl.num_programs(0)):
        row = (tile // blocks_per_row).to(tl.int64)
        cols = (tile % blocks_per_row) * BLOCK + tl.arange(0, BLOCK)
        g = tl.load(G + row * g_stride).to(tl.float32)
        if IN_PLACE:
            mask = cols < tl.where(g != 1.0, n_cols, 0)
        else:
            mask = cols < n_cols
        offs = row * row_stride + cols * col_stride
        v = tl.load(GRAD + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(OUT + offs, cast(v * g, OUT.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------------------
# Validation


def check_reduction(reduction, allowed=REDUCTIONS) -> None:
    if not isinstance(reduction, str) or reduction not in allowed:
        raise ValueError(f"reduction must be one of {allowed}, got {reduction!r}")


def check_options(*, ignore_index, reduction, label_smoothing, lse_square_scale, softcap) -> None:
    """The scalar options (NaN and inf are out of every range: they would turn the loss NaN silently)."""
    check_int(ignore_index, "ignore_index")
    check_reduction(reduction)
    if not 0.0 <= as_real(label_smoothing, "label_smoothing") <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if not 0.0 <= as_real(lse_square_scale, "lse_square_scale") < float("inf"):
        raise ValueError(f"lse_square_scale must be a finite number >= 0, got {lse_square_scale}")
    if softcap is not None and not 0.0 < as_real(softcap, "softcap") < float("inf"):
        raise ValueError(f"softcap must be None or a finite number > 0, got {softcap}")


def check_target(target: ArrayInfo, rows_shape, name: str = "target") -> None:
    if target.dtype not in INT_DTYPES:
        raise TypeError(f"{name} must have an integer dtype in {INT_DTYPES}, got {target.dtype}")
    if tuple(target.shape) != tuple(rows_shape):
        raise ValueError(f"{name} must have shape {tuple(rows_shape)} (the logits' shape without the class "
                         f"axis), got {target.shape}")


def check_class_weight(weight: ArrayInfo | None, n_classes: int, name: str = "weight") -> None:
    if weight is None:
        return
    check_float(weight, name)
    if tuple(weight.shape) != (n_classes,):
        raise ValueError(f"{name} must have shape ({n_classes},) (one weight per class), got {weight.shape}")
    check_last_axis_span(weight, name)


def target_stride(target: ArrayInfo, name: str = "target") -> int:
    """The stride between consecutive rows' targets (targets are read as one flat strided axis)."""
    if target.ndim == 0:
        return 0
    if target.ndim == 1:
        return target.strides[0]
    if target.numel > 1 and tuple(target.strides) != contiguous_strides(target.shape):
        raise ValueError(f"{name} with more than one dimension must be contiguous, got strides {target.strides}")
    return 1


def invalid_targets_message(vocab: int, ignore_index: int, name: str, first_bad: int, n_bad: int, n: int) -> str:
    """The frontends' message for targets outside [0, vocab): it shows the first bad value (an id from a
    tokenizer larger than the model's vocabulary, a padding value that is not ignore_index, ...)."""
    return (f"{name} has values outside [0, {vocab}) that are not ignore_index={ignore_index} ({n_bad} of {n} "
            f"targets; the first is {first_bad}); every target must be a class index or ignore_index")


def check_inputs(logits: ArrayInfo, target: ArrayInfo, weight: ArrayInfo | None, *, logits_name: str = "logits",
                 target_name: str = "target", weight_name: str = "weight") -> None:
    check_nonempty(logits, logits_name)
    check_float(logits, logits_name)
    check_target(target, logits.shape[:-1], target_name)
    check_class_weight(weight, logits.shape[-1], weight_name)


# ---------------------------------------------------------------------------------------------------------
# Launches and plans


def denominators_launch(target: ArrayInfo, weight: ArrayInfo | None, n_classes: int, ignore_index: int) -> Launch:
    """``denom`` (3,) fp32: [sum of w[target] over valid rows (or their count), count of valid rows, count of
    invalid targets]."""
    n_rows = target.numel
    has_weight = weight is not None
    return Launch(
        kernel=_denominators_kernel,
        grid=(1,),
        args=(Buf("target"), target_stride(target),
              Buf("weight" if has_weight else "target"), weight.strides[0] if has_weight else 0,
              n_rows, n_classes, int(ignore_index)),
        outputs=(NewBuffer("denom", (3,), "float32"),),
        constexprs={"BLOCK": min(_COUNT_BLOCK, next_power_of_2(n_rows)), "HAS_WEIGHT": has_weight},
        num_warps=4,
    )


def rows_launch(logits: ArrayInfo, target: ArrayInfo, weight: ArrayInfo | None, *, ignore_index: int,
                reduction: str, label_smoothing: float, lse_square_scale: float, softcap: float | None,
                return_z_loss: bool, compute_grad: bool, in_place: bool, loss_dtype: str, loss_shape,
                grad_scale: ArrayInfo | None = None, lagged: bool | None = None) -> Launch:
    """The per-row kernel: outputs ``loss_rows`` (already divided by the mean's denominators; needs the
    ``denom`` buffer for ``mean``), ``z_rows`` and ``grad`` (written over the logits with ``in_place``).
    ``lagged``: the lagged kernel (True, or a power of two: its segment's width, for tests and tuning), the
    two-pass one (False), or by width (None: :func:`uses_lagged`)."""
    n_rows, n_cols, row_stride, col_stride = row_view(logits, "logits")
    has_weight = weight is not None
    mean = reduction == "mean"
    # Writing the gradient over the logits is safe only when their rows do not overlap.
    dense = col_stride == 1 and (n_rows == 1 or row_stride >= n_cols)
    if compute_grad and in_place and dense:
        grad = NewBuffer("grad", logits.shape, logits.dtype, alias="logits")
        grad_row_stride, grad_col_stride = row_stride, col_stride
    elif compute_grad:
        grad = NewBuffer("grad", logits.shape, logits.dtype)
        grad_row_stride, grad_col_stride = n_cols, 1
    else:
        grad = NewBuffer("grad_unused", (1,), logits.dtype)
        grad_row_stride, grad_col_stride = 0, 0
    z_out = NewBuffer("z_rows", tuple(loss_shape), loss_dtype) if return_z_loss else NewBuffer(
        "z_unused", (1,), "float32")
    if grad_scale is not None:
        if grad_scale.numel != n_rows:
            raise ValueError(f"grad_output must have one value per row ({n_rows}), got shape {grad_scale.shape}")
        g_stride = 0 if grad_scale.ndim == 0 else target_stride(grad_scale, "grad_output")
    flags = {"HAS_WEIGHT": has_weight, "MEAN": mean, "HAS_SOFTCAP": softcap is not None,
             "HAS_SMOOTHING": float(label_smoothing) > 0.0, "HAS_Z": float(lse_square_scale) > 0.0,
             "RETURN_Z": bool(return_z_loss), "HAS_GRAD_SCALE": grad_scale is not None}
    common_args = (Buf("logits"), row_stride, col_stride,
                   Buf("target"), target_stride(target),
                   # unused pointers point at the targets, never at the logits: an array passed twice to a launch
                   # that writes over it would make XLA copy it
                   Buf("weight" if has_weight else "target"), weight.strides[0] if has_weight else 0,
                   Buf("denom" if mean else "target"),
                   Buf("grad_scale" if grad_scale is not None else "target"),
                   g_stride if grad_scale is not None else 0,
                   grad_row_stride, grad_col_stride)
    options = (int(ignore_index), float(label_smoothing), float(lse_square_scale),
               float(softcap) if softcap is not None else 1.0)
    rows_out = NewBuffer("loss_rows", tuple(loss_shape), loss_dtype)
    if compute_grad and (uses_lagged(n_cols) if lagged is None else lagged is not False):
        segment = LAGGED["segment"] if lagged in (None, True) else lagged
        return _lagged_launch(common_args, options, flags, n_rows, n_cols, logits.dtype, segment,
                              (rows_out, z_out, grad))
    bv, warps = ce_block_and_warps(n_cols)
    return Launch(kernel=_cross_entropy_kernel, grid=(n_rows,), args=common_args + (n_cols,) + options,
                  outputs=(rows_out, z_out, grad),
                  constexprs={"BLOCK_V": bv, "HAS_GRAD": bool(compute_grad), **flags}, num_warps=warps)


def uses_lagged(n_cols: int) -> bool:
    """Whether the loss with its gradient takes the lagged kernel by default (rows of LAGGED["from_cols"]+)."""
    return LAGGED["from_cols"] is not None and n_cols >= LAGGED["from_cols"]


def lag_rows(n_cols: int, dtype: str) -> int:
    """Rows between a segment's statistics job and its gradient job: LAGGED["lag_bytes"] of rows, 1 to 256."""
    return max(1, min(256, int(LAGGED["lag_bytes"]) // (n_cols * ITEMSIZE[dtype])))


def _lagged_launch(common_args: tuple, options: tuple, flags: dict, n_rows: int, n_cols: int, dtype: str,
                   segment: int, outputs: tuple) -> Launch:
    """The lagged kernel's launch: a grid of (n_rows + lag) slots of 2 x segments jobs of ``segment`` columns,
    with its scratch (the tickets and per-row counts, zero-filled; the segments' statistics; the target
    logits)."""
    if not isinstance(segment, int) or segment < 16 or segment & (segment - 1):
        raise ValueError(f"lagged must be None, a bool or a power of two >= 16 (a segment width), got {segment!r}")
    segment = min(segment, next_power_of_2(n_cols))
    n_seg = cdiv(n_cols, segment)
    lag = lag_rows(n_cols, dtype)
    return Launch(
        kernel=_cross_entropy_lagged_kernel,
        grid=((n_rows + lag) * 2 * n_seg,),
        args=common_args + (n_rows, n_cols) + options,
        outputs=outputs + (NewBuffer("ce_sync", (1 + n_rows,), "int32", zeroed=True),
                           NewBuffer("ce_parts", (n_rows * 4 * n_seg,), "float32"),
                           NewBuffer("ce_target_logits", (n_rows,), "float32")),
        constexprs={"SEG": segment, "N_SEG": n_seg, "N_SEG_P2": next_power_of_2(n_seg), "LAG": lag,
                    "BLOCK_V": min(LAGGED["block"], segment), **flags},
        num_warps=LAGGED["num_warps"],
    )


def ce_block_and_warps(n_cols: int) -> tuple[int, int]:
    """(columns per step, num_warps) of the CE row sweeps: longer steps on wider rows (_CE_SWEEPS), where fewer
    steps of more values a thread keep more bytes in flight per SM than 2048-column ones."""
    return by_width(_CE_SWEEPS, n_cols) or sweep_block_and_warps(n_cols)


@functools.lru_cache(maxsize=1024)  # plans are pure functions of hashable arguments
def forward_plan(logits: ArrayInfo, target: ArrayInfo, weight: ArrayInfo | None = None, *,
                 ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                 lse_square_scale: float = 0.0, softcap: float | None = None, return_z_loss: bool = False,
                 compute_grad: bool = True, in_place: bool = False, logits_name: str = "logits",
                 target_name: str = "target", weight_name: str = "weight", given_denom: bool = False,
                 lagged: bool | None = None) -> Plan:
    """Plan for the loss (and its gradient) of logits ``(..., V)`` against integer ``target`` ``(...)``.

    Inputs ``logits``, ``target`` (and ``weight``; and ``denom`` from :func:`denominators_plan` with
    ``given_denom`` and ``mean``, instead of the plan counting the targets itself: a frontend that counts them
    for its target check anyway passes its count). Outputs ``loss`` (shape () for mean/sum, target's shape
    for none; logits' dtype), then ``z_loss`` with ``return_z_loss``, then ``grad`` (d loss / d logits, for an
    incoming gradient of 1; logits' dtype) with ``compute_grad``, written over the logits with ``in_place``
    when they are dense. ``*_name`` are the arguments' names in the caller's API, for error messages.
    ``lagged`` chooses the kernel of the loss with its gradient (:func:`rows_launch`; None: by width).
    """
    check_options(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
                  lse_square_scale=lse_square_scale, softcap=softcap)
    check_inputs(logits, target, weight, logits_name=logits_name, target_name=target_name,
                 weight_name=weight_name)
    n_classes = logits.shape[-1]
    n_rows = target.numel
    launches = []
    if reduction == "mean" and not given_denom:
        launches.append(denominators_launch(target, weight, n_classes, ignore_index))
    rows_dtype, rows_shape = (logits.dtype, target.shape) if reduction == "none" else ("float32", (n_rows,))
    launches.append(rows_launch(
        logits, target, weight, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
        lse_square_scale=lse_square_scale, softcap=softcap, return_z_loss=return_z_loss,
        compute_grad=compute_grad, in_place=in_place, loss_dtype=rows_dtype, loss_shape=rows_shape, lagged=lagged))
    outputs = ["loss_rows"]
    if return_z_loss:
        outputs.append("z_rows")
    if reduction != "none" and return_z_loss:
        launches.append(sum_partial_pairs_launch(("loss_rows", "z_rows"), ("loss", "z_loss"), 1, n_rows, 1,
                                                 (logits.dtype, logits.dtype), out_shape=()))
        outputs = ["loss", "z_loss"]
    elif reduction != "none":
        launches.append(sum_partials_launch("loss_rows", "loss", 1, n_rows, 1, logits.dtype, out_shape=()))
        outputs[0] = "loss"
    if compute_grad:
        outputs.append("grad")
    inputs = ("logits", "target", "weight") if weight is not None else ("logits", "target")
    if reduction == "mean" and given_denom:
        inputs += ("denom",)
    return Plan(inputs=inputs, launches=tuple(launches), outputs=tuple(outputs))


@functools.lru_cache(maxsize=1024)  # plans are pure functions of hashable arguments
def denominators_plan(target: ArrayInfo, weight: ArrayInfo | None, n_classes: int, ignore_index: int) -> Plan:
    """Plan for ``denom`` (3,) fp32, the divisors of a mean over many chunks (see :func:`chunk_plan`), and the
    count of invalid targets."""
    launch = denominators_launch(target, weight, n_classes, ignore_index)
    inputs = ("target", "weight") if weight is not None else ("target",)
    return Plan(inputs=inputs, launches=(launch,), outputs=("denom",))


@functools.lru_cache(maxsize=1024)  # plans are pure functions of hashable arguments
def chunk_plan(logits: ArrayInfo, target: ArrayInfo, weight: ArrayInfo | None, *, ignore_index: int,
               reduction: str, label_smoothing: float, lse_square_scale: float, softcap: float | None,
               return_z_loss: bool, compute_grad: bool, grad_scale: ArrayInfo | None = None,
               lagged: bool | None = None) -> Plan:
    """One chunk of rows of a larger loss (fused linear cross-entropy): fp32 per-row ``loss_rows`` (and
    ``z_rows``), already divided by the whole batch's denominators (input ``denom`` for ``mean``, from
    :func:`denominators_plan`), and ``grad`` written over the chunk's logits. With ``grad_scale`` (one value per
    row, input ``grad_scale``) the gradient is multiplied by it (reduction='none' backward)."""
    launch = rows_launch(
        logits, target, weight, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
        lse_square_scale=lse_square_scale, softcap=softcap, return_z_loss=return_z_loss,
        compute_grad=compute_grad, in_place=True, loss_dtype="float32", loss_shape=(target.numel,),
        grad_scale=grad_scale, lagged=lagged)
    inputs = ["logits", "target"]
    if weight is not None:
        inputs.append("weight")
    if reduction == "mean":
        inputs.append("denom")
    if grad_scale is not None:
        inputs.append("grad_scale")
    outputs = ["loss_rows"] + (["z_rows"] if return_z_loss else []) + (["grad"] if compute_grad else [])
    return Plan(inputs=tuple(inputs), launches=(launch,), outputs=tuple(outputs))


@functools.lru_cache(maxsize=1024)  # plans are pure functions of hashable arguments
def sum_rows_plan(n_rows: int, dtype: str) -> Plan:
    """Plan summing fp32 ``rows`` (n_rows,) in a fixed order into ``total`` (shape (), ``dtype``)."""
    launch = sum_partials_launch("rows", "total", 1, n_rows, 1, dtype, out_shape=())
    return Plan(inputs=("rows",), launches=(launch,), outputs=("total",))


@functools.lru_cache(maxsize=1024)  # plans are pure functions of hashable arguments
def backward_plan(grad: ArrayInfo, grad_output: ArrayInfo, *, reduction: str, in_place: bool = True) -> Plan:
    """Plan for ``dlogits = grad * grad_output``: a scalar for mean/sum, one value per row for none.

    Inputs ``grad`` (from :func:`forward_plan`) and ``grad_output``; output ``dlogits``, written over ``grad``
    with ``in_place``."""
    check_reduction(reduction)
    check_float(grad_output, "grad_output")
    n_rows, n_cols, row_stride, col_stride = row_view(grad, "grad")
    if reduction == "none":
        if tuple(grad_output.shape) != tuple(grad.shape[:-1]):
            raise ValueError(f"grad_output must have shape {grad.shape[:-1]}, got {grad_output.shape}")
        g_stride = 0 if grad_output.ndim == 0 else target_stride(grad_output, "grad_output")
    else:
        if grad_output.numel != 1:
            raise ValueError(f"grad_output must be a scalar for reduction={reduction!r}, got {grad_output.shape}")
        g_stride = 0
    dense = col_stride == 1 and (n_rows == 1 or row_stride >= n_cols)
    in_place = in_place and dense
    if in_place:
        out = NewBuffer("dlogits", grad.shape, grad.dtype, alias="grad")
    else:
        out = NewBuffer("dlogits", grad.shape, grad.dtype)
        if (row_stride, col_stride) != (n_cols, 1):
            raise ValueError("grad must be dense to scale it into a fresh buffer")
    block = min(_SCALE_BLOCK, next_power_of_2(n_cols))
    tiles = n_rows * cdiv(n_cols, block)
    launch = Launch(
        kernel=_scale_rows_kernel,
        grid=(min(tiles, _SCALE_PROGRAMS),),
        args=(Buf("grad"), row_stride, col_stride, Buf("grad_output"), g_stride, n_rows, n_cols, cdiv(n_cols, block)),
        outputs=(out,),
        constexprs={"BLOCK": block, "IN_PLACE": in_place},
        num_warps=warps_for(block, max_warps=8),
    )
    return Plan(inputs=("grad", "grad_output"), launches=(launch,), outputs=("dlogits",))

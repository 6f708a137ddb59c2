"""LayerNorm: y = (x - mean) * rstd * w + b, rstd = 1 / sqrt(var + eps), over the last axis.

Numerics (those of ``torch.nn.LayerNorm`` and ``flax.nnx.LayerNorm``): the statistics and the affine map are
computed in fp32 and the output is rounded once, to the output dtype. The variance is the two-pass
``mean((x - mean)^2)`` of the row held in registers (never negative, no cancellation), with the mean refined
once by the mean of the centered row. Rows over ``rowwise.MAX_HELD_COLUMNS`` are swept in column chunks instead
(but 28672 to 32768 columns are held when x, w and b are 2-byte: ``_CHUNKED_BY_WIDTH``), twice: Welford's running
moments of x less its first value, then y.

Forward saves mean and rstd (fp32, one per row). Backward: one pass per row block gives dx (optionally written
over dy) and per-program fp32 partial sums of dw and db, each reduced in a fixed order by
:mod:`liger_core.reduce` (no atomics: bitwise deterministic); rows over ``rowwise.MAX_HELD_COLUMNS`` are summed
in a first sweep, then walked in column blocks. Weight and bias are both optional.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from .tl_math import aligned, cast, chunk_columns
from .launch import (
    FLOAT_DTYPES, ArrayInfo, Buf, Launch, NewBuffer, Plan, by_width, check_eps, check_float, check_last_axis_span,
    check_nonempty, promote, warps_for,
)
from .reduce import sum_partial_pairs_launch, sum_partials_launch
from .rms_norm import (
    backward_variant, chunk_mask, chunked_rows, first_sweep_start, first_sweep_step, load_backward_rows, load_chunk,
    load_row_values, reload_backward_tile, row_sums_pointers, row_sums_step,
)
from .rowwise import (
    ChunkedSweep, backward_tiles, full_chunks, gradient_output, held_rows_for, norm_forward_launch, row_view,
    rows_in_group,
)

# Launch configuration. Forward as RMSNorm's tuned forward: ~4k elements of x per program. Backward as RMSNorm's
# tuned backward: one persistent program per SM (16 warps x 117 registers fill an SM's register file: a second
# program cannot be resident), 8k-element tiles with the next tile prefetched (not yet swept on the H200 for
# LayerNorm itself; the plans take overrides for tuning).
_FORWARD_TILE = 4096
# Held rows over 8192 columns: two a program (at 16384, 8 warps, 253 registers, no spill). LayerNorm's held row
# takes 174 registers at 8 warps (one program an SM), and one 32 KB row in flight an SM is too little: H200 bf16
# 16384 x 16384 0.314 ms two rows a program against 0.451 one (RMSNorm, 122 registers, two programs an SM: 0.259);
# benchmarks/results/h200-2026-12-06-tune_wide_fwd.txt.
_WIDE_FORWARD_TILE = 32768
# The forward past rowwise.MAX_HELD_COLUMNS, by width, widest first: (from columns, launch). bf16 rows from 28672
# to 32768 columns are held (16 warps, w and b loaded after the reductions; with 4-byte operands they spill and go
# in chunks: rowwise.held_rows_for); narrower ones would pad their block by up to 40% and lose to chunks. H100 bf16
# (benchmarks/results/h100-80gb-hbm3-2026-12-07-tune_ln_held_s24.txt): 4096 x 32768 held 0.196 ms against 0.205 at
# 8192 x 16; 28672 held 0.187 against 0.204; 24576 (whole 8192-column chunks) 0.153 at 8192 x 16 against 0.173
# held and 0.167 at 4096 x 16; 20496 0.137 at 4096 x 16 against 0.154 at 4096 x 8 and 0.163 held. Wider rows
# (h100-2026-12-07-tune_rows_fwd.txt, -tune_ln_fwd.txt): 4096 x 65536 0.433 at 16384 x 16 with prefetch against
# 0.514-0.520 at 4096 x 8; over 32768 columns 8192 x 16 without.
_CHUNKED_BY_WIDTH = (
    (65536, ChunkedSweep(chunk=16384, num_warps=16, prefetch=True)),
    (28672, ChunkedSweep(chunk=8192, num_warps=16, prefetch=False, held_up_to=32768)),
    (24576, ChunkedSweep(chunk=8192, num_warps=16, prefetch=False)),
    (0, ChunkedSweep(chunk=4096, num_warps=16, prefetch=False)),
)
_BACKWARD_TILE = 8192
_BACKWARD_PROGRAMS_PER_SM = 1
# A reloaded wide tile (one row over _BACKWARD_TILE columns) at 8 warps: H200, 4096 x 16384, 0.180 ms against
# 0.202 at 16 warps (benchmarks/results/h200-2026-12-06-tune_wide_bwd.txt; 16384 x 16384: 0.666 against 0.752).
_WIDE_RELOAD_WARPS = 8
# The column-split backward's row sums (rows over rowwise.MAX_HELD_COLUMNS): 4096-column chunks at 8 warps, the next
# chunk's dy and x loads issued first (ptxas: 70 registers, three programs an SM; 8192 columns at 16 warps took 95,
# one program an SM; not yet measured).
_ROW_SUMS = ChunkedSweep(chunk=4096, num_warps=8, prefetch=True)


@triton.jit
def load_parameters(W, w_stride, B, b_stride, cols, col_mask, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """(w, b) of the columns ``cols`` in fp32 (0.0 for a missing one, unused)."""
    w = 0.0
    b = 0.0
    if HAS_WEIGHT:
        w = tl.load(W + cols * w_stride, mask=col_mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b = tl.load(B + cols * b_stride, mask=col_mask, other=0.0).to(tl.float32)
    return w, b


@triton.jit
def _layer_norm_forward_kernel(
    X, x_row_stride, x_col_stride,
    W, w_stride,
    B, b_stride,
    n_rows, n_cols, eps,
    Y, MEAN, RSTD,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    FULL_ROW: tl.constexpr, ALIGN: tl.constexpr,
):
    """FULL_ROW: n_cols == BLOCK_N, so no column is masked and the centred values need no select (a masked row
    is all zeros and stays so)."""
    x_row_stride = aligned(x_row_stride, ALIGN)
    n_cols = aligned(n_cols, ALIGN)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    x = tl.load(X + rows[:, None] * x_row_stride + cols[None, :] * x_col_stride, mask=mask, other=0.0)
    # weight and bias loaded with the row, before its reductions (as liger_core.rms_norm.load_scale), up to 16384
    # columns; past that after them: held across the reductions, their 64 values a thread spilled (ptxas, 32768
    # columns at 16 warps: 92 bytes a thread)
    if BLOCK_N <= 16384:
        w, b = load_parameters(W, w_stride, B, b_stride, cols, col_mask, HAS_WEIGHT, HAS_BIAS)
    xf = x.to(tl.float32)  # all arithmetic in fp32 (the interpreter cannot do bf16 arithmetic)
    mean = tl.sum(xf, axis=1) / n_cols
    centered = xf - mean[:, None]
    if not FULL_ROW:
        centered = tl.where(mask, centered, 0.0)
    # One refinement step: the fp32 sum of a row far from zero carries rounding error that the (small) sum of
    # the centred values removes. The variance about the refined mean is sum(c^2)/n - correction^2 (exact), and
    # the refined centring is folded into the normalisation's FMA below, so the step costs one add per element.
    correction = tl.sum(centered, axis=1) / n_cols
    var = tl.maximum(tl.sum(centered * centered, axis=1) / n_cols - correction * correction, 0.0)
    mean += correction
    rstd = tl.rsqrt(var + eps)
    tl.store(MEAN + rows, mean, mask=row_mask)
    tl.store(RSTD + rows, rstd, mask=row_mask)
    y = centered * rstd[:, None] - (correction * rstd)[:, None]
    if BLOCK_N > 16384:
        w, b = load_parameters(W, w_stride, B, b_stride, cols, col_mask, HAS_WEIGHT, HAS_BIAS)
    if HAS_WEIGHT:
        y = y * w[None, :]
    if HAS_BIAS:
        y = y + b[None, :]
    tl.store(Y + rows[:, None] * n_cols + cols[None, :], cast(y, Y.dtype.element_ty), mask=mask)


@triton.jit
def _layer_norm_chunked_forward_kernel(
    X, x_row_stride, x_col_stride,
    W, w_stride,
    B, b_stride,
    n_rows, n_cols, eps,
    Y, MEAN, RSTD,
    CHUNK: tl.constexpr, ROWS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    PREFETCH: tl.constexpr, FULL_CHUNKS: tl.constexpr, ALIGN: tl.constexpr,
):
    """ROWS rows a program (w and b read once for all), for rows too wide to hold in registers
    (rowwise.MAX_HELD_COLUMNS). The first sweep keeps Welford's running mean and squared deviations per lane (no
    cancellation, and no reduction until the row's end), merged across lanes once (PREFETCH: with the next
    chunk's load in flight, as RMSNorm's); the second reads x again (from L2) and writes y. Both work on x less
    the row's first value: a row far from zero would otherwise leave the running means the rounding error of
    their own size (~1e-4 of the spread for a mean 2000 times it), which the held-row kernel's refinement step
    removes."""
    x_row_stride = aligned(x_row_stride, ALIGN)
    n_cols = aligned(n_cols, ALIGN)
    rows = chunked_rows(n_rows, ROWS)
    x_rows = X + rows[:, None] * x_row_stride
    shift = tl.load(X + rows * x_row_stride).to(tl.float32)
    n_chunks = tl.cdiv(n_cols, CHUNK)
    lane_mean = tl.zeros((ROWS, CHUNK), dtype=tl.float32)
    lane_m2 = tl.zeros((ROWS, CHUNK), dtype=tl.float32)
    x_next = first_sweep_start(x_rows, x_col_stride, n_chunks, n_cols, CHUNK, PREFETCH, FULL_CHUNKS)
    for i in range(n_chunks):
        x, x_next = first_sweep_step(x_rows, x_col_stride, i, n_chunks, n_cols, x_next, CHUNK, PREFETCH, FULL_CHUNKS)
        mask = chunk_mask(chunk_columns(i, n_chunks, CHUNK, False), n_cols, FULL_CHUNKS)[None, :]
        # a lane past the row's end takes its own running mean: delta = 0 leaves both moments as they are (one
        # select, none with FULL_CHUNKS, and the two updates stay FMAs: 7 instructions an element, not 11)
        xf = tl.where(mask, x.to(tl.float32) - shift[:, None], lane_mean)
        delta = xf - lane_mean
        lane_mean += delta * (1.0 / (i + 1))  # a lane's (i + 1)-th value
        lane_m2 += delta * (xf - lane_mean)
    last = n_cols - (n_chunks - 1) * CHUNK  # columns in the last chunk: its lanes past them saw one value less
    lane_count = (n_chunks - 1 + (tl.arange(0, CHUNK) < last).to(tl.int32)).to(tl.float32)[None, :]
    # the lanes' moments as the row's: its mean weighs the lanes' means by their counts, and its squared
    # deviations are the lanes' plus each lane's count x its mean's squared distance from the row's (plain sums, no
    # pairwise merge with a division a lane; an error e in the mean changes the sum by n e^2 only, to first order
    # nothing, since the distances sum to zero about the exact mean)
    mean = tl.sum(lane_mean * lane_count, axis=1) / n_cols
    distance = lane_mean - mean[:, None]
    m2 = tl.sum(lane_m2 + lane_count * distance * distance, axis=1)
    rstd = tl.rsqrt(m2 / n_cols + eps)
    tl.store(MEAN + rows, shift + mean)
    tl.store(RSTD + rows, rstd)
    for i in range(n_chunks):
        cols = chunk_columns(i, n_chunks, CHUNK, True)
        col_mask = chunk_mask(cols, n_cols, FULL_CHUNKS)
        xf = load_chunk(x_rows, x_col_stride, i, n_chunks, n_cols, CHUNK, True, FULL_CHUNKS).to(tl.float32)
        y = (xf - shift[:, None]) * rstd[:, None] - (mean * rstd)[:, None]  # one FMA after the shift
        if HAS_WEIGHT:
            y = y * tl.load(W + cols * w_stride, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if HAS_BIAS:
            y = y + tl.load(B + cols * b_stride, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + rows[:, None] * n_cols + cols[None, :], cast(y, Y.dtype.element_ty), mask=col_mask[None, :])


@triton.jit
def _layer_norm_row_sums_kernel(
    DY, dy_row_stride, dy_col_stride,
    X, x_row_stride, x_col_stride,
    W, w_stride,
    MEAN, RSTD, n_cols,
    ROW_DOT, ROW_MEAN,
    CHUNK: tl.constexpr, HAS_WEIGHT: tl.constexpr, PREFETCH: tl.constexpr, FULL_CHUNKS: tl.constexpr,
    ALIGN: tl.constexpr,
):
    """mean(dxhat * xhat) * rstd and mean(dxhat) * rstd (dxhat = dy * w, xhat = (x - mean) * rstd) of one row a
    program, swept once in CHUNK-column chunks (per-lane sums, one reduction at the end): the row sums that the
    column-split backward (rows over rowwise.MAX_HELD_COLUMNS) needs before any column block can write dx."""
    dy_row_stride = aligned(dy_row_stride, ALIGN)
    x_row_stride = aligned(x_row_stride, ALIGN)
    n_cols = aligned(n_cols, ALIGN)
    rows, dy_rows, x_rows = row_sums_pointers(DY, dy_row_stride, X, x_row_stride)
    mean = tl.load(MEAN + rows)
    rstd = tl.load(RSTD + rows)
    n_chunks = tl.cdiv(n_cols, CHUNK)
    dots = tl.zeros((1, CHUNK), dtype=tl.float32)
    sums = tl.zeros((1, CHUNK), dtype=tl.float32)
    dy_next = first_sweep_start(dy_rows, dy_col_stride, n_chunks, n_cols, CHUNK, PREFETCH, FULL_CHUNKS)
    x_next = first_sweep_start(x_rows, x_col_stride, n_chunks, n_cols, CHUNK, PREFETCH, FULL_CHUNKS)
    for i in range(n_chunks):
        dxhat, x, dy_next, x_next = row_sums_step(dy_rows, dy_col_stride, x_rows, x_col_stride, W, w_stride, 0.0, i,
                                                  n_chunks, n_cols, dy_next, x_next, CHUNK, HAS_WEIGHT, False,
                                                  PREFETCH, FULL_CHUNKS)
        # past the row's end dy is 0, so dxhat is too and the centred x there adds nothing
        dots += dxhat * ((x - mean[:, None]) * rstd[:, None])
        sums += dxhat
    tl.store(ROW_DOT + rows, tl.sum(dots, axis=1) / n_cols * rstd)
    tl.store(ROW_MEAN + rows, tl.sum(sums, axis=1) / n_cols * rstd)


@triton.jit
def _load_backward_rows(DY, dy_row_stride, dy_col_stride, X, x_row_stride, x_col_stride, MEAN, RSTD,
                        first_row, local, row_end, cols, col_mask):
    """RMSNorm's tile loads (dy, x, rstd), plus the rows' means."""
    dy, x, rstd = load_backward_rows(DY, dy_row_stride, dy_col_stride, X, x_row_stride, x_col_stride, RSTD,
                                     first_row, local, row_end, cols, col_mask)
    mean = tl.load(MEAN + first_row + local.to(tl.int64), mask=local < row_end, other=0.0)
    return dy, x, mean, rstd


@triton.jit
def _layer_norm_backward_kernel(
    DY, dy_row_stride, dy_col_stride,
    X, x_row_stride, x_col_stride,
    W, w_stride,
    MEAN, RSTD, ROW_DOT, ROW_MEAN,
    dx_row_stride, dx_col_stride,
    rows_per_group, n_cols, rows_per_program,
    DX, DW_PARTIAL, DB_PARTIAL,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    PREFETCH: tl.constexpr, RELOAD: tl.constexpr, ROW_SUMS: tl.constexpr, ALIGN: tl.constexpr,
):
    """Persistent: each program walks ``rows_per_program`` rows of its group in BLOCK_M-row tiles. With
    PREFETCH the next tile's loads are issued before the current tile is computed (as RMSNorm's backward).
    With RELOAD (wide rows) nothing but the gradient accumulators stays in registers across the row's
    reductions: the weight is loaded with each tile, and dy, x and w are loaded again (from L1/L2) for dx and
    the accumulators, instead of being held (at 16384 columns the held tile spilled).

    With ROW_SUMS (rows over rowwise.MAX_HELD_COLUMNS) a tile is BLOCK_N columns of its rows, the column block of
    grid axis 2, and each row's two sums (times rstd) come from ROW_DOT and ROW_MEAN
    (:func:`_layer_norm_row_sums_kernel`) instead of the tile's own."""
    dy_row_stride = aligned(dy_row_stride, ALIGN)
    x_row_stride = aligned(x_row_stride, ALIGN)
    dx_row_stride = aligned(dx_row_stride, ALIGN)
    n_cols = aligned(n_cols, ALIGN)
    program = tl.program_id(0)
    group = tl.program_id(1).to(tl.int64)
    n_programs = tl.num_programs(0)
    first_row = group * rows_per_group
    row_begin = program * rows_per_program
    row_end = tl.minimum(row_begin + rows_per_program, rows_per_group)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    if HAS_WEIGHT:
        if not RELOAD:
            w = tl.load(W + cols * w_stride, mask=col_mask, other=0.0).to(tl.float32)
        dw_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if HAS_BIAS:
        db_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PREFETCH:
        next_dy, next_x, next_mean, next_rstd = _load_backward_rows(
            DY, dy_row_stride, dy_col_stride, X, x_row_stride, x_col_stride, MEAN, RSTD,
            first_row, row_begin + tl.arange(0, BLOCK_M), row_end, cols, col_mask)
        next_dot = load_row_values(ROW_DOT, first_row, row_begin + tl.arange(0, BLOCK_M), row_end, ROW_SUMS)
        next_dmean = load_row_values(ROW_MEAN, first_row, row_begin + tl.arange(0, BLOCK_M), row_end, ROW_SUMS)
    for start in range(0, rows_per_program, BLOCK_M):
        local = row_begin + start + tl.arange(0, BLOCK_M)
        if PREFETCH:
            dy, x, mean, rstd, dot, dmean = next_dy, next_x, next_mean, next_rstd, next_dot, next_dmean
            next_dy, next_x, next_mean, next_rstd = _load_backward_rows(
                DY, dy_row_stride, dy_col_stride, X, x_row_stride, x_col_stride, MEAN, RSTD,
                first_row, local + BLOCK_M, row_end, cols, col_mask)
            next_dot = load_row_values(ROW_DOT, first_row, local + BLOCK_M, row_end, ROW_SUMS)
            next_dmean = load_row_values(ROW_MEAN, first_row, local + BLOCK_M, row_end, ROW_SUMS)
        else:
            dy, x, mean, rstd = _load_backward_rows(DY, dy_row_stride, dy_col_stride, X, x_row_stride,
                                                    x_col_stride, MEAN, RSTD, first_row, local, row_end, cols,
                                                    col_mask)
            dot = load_row_values(ROW_DOT, first_row, local, row_end, ROW_SUMS)
            dmean = load_row_values(ROW_MEAN, first_row, local, row_end, ROW_SUMS)
        rows = first_row + local.to(tl.int64)
        mask = (local < row_end)[:, None] & col_mask[None, :]
        if RELOAD and HAS_WEIGHT:
            w = tl.load(W + cols * w_stride, mask=col_mask, other=0.0).to(tl.float32)
        dy = dy.to(tl.float32)
        # no mask: a masked element has dy = 0 (so dxhat = 0 and it adds nothing below) and is not stored
        xhat = (x.to(tl.float32) - mean[:, None]) * rstd[:, None]
        if HAS_WEIGHT:
            dxhat = dy * w[None, :]
        else:
            dxhat = dy
        if not RELOAD:
            if HAS_WEIGHT:
                dw_acc += dy * xhat
            if HAS_BIAS:
                db_acc += dy
        # dx = (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)) * rstd, as two FMAs per element: the row
        # constants take rstd in first
        if ROW_SUMS:
            c_dot = dot
            c_mean = dmean
        else:
            c_dot = tl.sum(dxhat * xhat, axis=1) / n_cols * rstd
            c_mean = tl.sum(dxhat, axis=1) / n_cols * rstd
        if RELOAD:
            dy_again, x_again = reload_backward_tile(DY, dy_row_stride, dy_col_stride, X, x_row_stride,
                                                     x_col_stride, rows, cols, mask)
            xhat = (x_again.to(tl.float32) - mean[:, None]) * rstd[:, None]
            if HAS_WEIGHT:
                w_again = tl.load(W + cols * w_stride, mask=col_mask, other=0.0,
                                  cache_modifier=".ca").to(tl.float32)
                dw_acc += dy_again * xhat
                dxhat = dy_again * w_again[None, :]
            else:
                dxhat = dy_again
            if HAS_BIAS:
                db_acc += dy_again
        dx = dxhat * rstd[:, None] - (xhat * c_dot[:, None] + c_mean[:, None])
        tl.store(DX + rows[:, None] * dx_row_stride + cols[None, :] * dx_col_stride,
                 dx.to(DX.dtype.element_ty), mask=mask)
    slot = group * n_programs + program
    if HAS_WEIGHT:
        tl.store(DW_PARTIAL + slot * n_cols + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
    if HAS_BIAS:
        tl.store(DB_PARTIAL + slot * n_cols + cols, tl.sum(db_acc, axis=0), mask=col_mask)


# ---------------------------------------------------------------------------------------------------------
# Launch logic


def _check_param(param: ArrayInfo | None, name: str, n_cols: int) -> None:
    if param is None:
        return
    check_float(param, name)
    if param.shape != (n_cols,):
        raise ValueError(f"{name} must have shape ({n_cols},) to match x's last dimension, got {param.shape}")
    check_last_axis_span(param, name)


def _check_inputs(x: ArrayInfo, weight: ArrayInfo | None, bias: ArrayInfo | None, weight_name: str,
                  bias_name: str) -> None:
    check_nonempty(x, "x")
    check_float(x, "x")
    _check_param(weight, weight_name, x.shape[-1])
    _check_param(bias, bias_name, x.shape[-1])


def promoted_dtype(x: ArrayInfo, weight: ArrayInfo | None, bias: ArrayInfo | None) -> str:
    """The promotion of the dtypes of x and the parameters (flax's output dtype; torch keeps x's dtype)."""
    return promote(*(a.dtype for a in (x, weight, bias) if a is not None))


@functools.lru_cache(maxsize=1024)  # plans are pure functions of hashable shapes: build each once
def forward_plan(x: ArrayInfo, weight: ArrayInfo | None, bias: ArrayInfo | None, *, eps: float,
                 out_dtype: str | None = None, weight_name: str = "weight", bias_name: str = "bias",
                 block_m: int | None = None, num_warps: int | None = None, eps_name: str = "eps",
                 chunk: int | None = None, prefetch: bool | None = None, full_chunks: bool | None = None) -> Plan:
    """Plan for ``y, mean, rstd = layer_norm(x, weight, bias)``; inputs ``x`` (``weight``, ``bias`` when given).

    ``out_dtype`` is y's dtype (default: x's, as in torch). ``weight_name`` / ``bias_name`` name the parameters
    as the caller's API does, for error messages (``eps_name`` the epsilon). Rows wider than
    ``rowwise.MAX_HELD_COLUMNS`` (but for 2-byte rows of 28672-32768 columns) are swept in chunks (``chunk``,
    ``prefetch``, ``full_chunks``, ``block_m`` and ``num_warps`` override the launch:
    :func:`liger_core.rowwise.forward_chunk`, :func:`~.rowwise.full_chunks`)."""
    _check_inputs(x, weight, bias, weight_name, bias_name)
    check_eps(eps, eps_name)
    y_dtype = x.dtype if out_dtype is None else out_dtype
    if y_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be one of {FLOAT_DTYPES}, got {y_dtype}")
    n_rows, n_cols, x_row_stride, x_col_stride = row_view(x, "x")
    has_weight, has_bias = weight is not None, bias is not None
    launch = norm_forward_launch(
        _layer_norm_forward_kernel, _layer_norm_chunked_forward_kernel,
        (Buf("x"), x_row_stride, x_col_stride, Buf("weight" if has_weight else "x"),
         weight.strides[0] if has_weight else 0, Buf("bias" if has_bias else "x"), bias.strides[0] if has_bias else 0),
        (float(eps),),
        (NewBuffer("y", x.shape, y_dtype), NewBuffer("mean", x.shape[:-1], "float32"),
         NewBuffer("rstd", x.shape[:-1], "float32")),
        {"HAS_WEIGHT": has_weight, "HAS_BIAS": has_bias}, n_rows, n_cols, tile_elements=_forward_tile(n_cols),
        chunked=held_rows_for(by_width(_CHUNKED_BY_WIDTH, n_cols), x, weight, bias), block_m=block_m,
        num_warps=num_warps, chunk=chunk, prefetch=prefetch, full_chunks_override=full_chunks, full_row_flag=True)
    inputs = ("x",) + (("weight",) if has_weight else ()) + (("bias",) if has_bias else ())
    return Plan(inputs=inputs, launches=(launch,), outputs=("y", "mean", "rstd"))


def _forward_tile(n_cols: int) -> int:
    return _WIDE_FORWARD_TILE if n_cols > 8192 else _FORWARD_TILE


def _backward_warps(tile_elements: int, reload: bool) -> int:
    return _WIDE_RELOAD_WARPS if reload and tile_elements > _BACKWARD_TILE else warps_for(tile_elements)


@functools.lru_cache(maxsize=1024)
def backward_plan(dy: ArrayInfo, x: ArrayInfo, weight: ArrayInfo | None, bias: ArrayInfo | None, *,
                  num_sms: int, in_place: bool = True, groups: int = 1, programs_per_sm: int | None = None,
                  block_m: int | None = None, num_warps: int | None = None, prefetch: bool | None = None,
                  reload: bool | None = None, column_block: int | None = None) -> Plan:
    """Plan for ``dx, dw, db = layer_norm_backward(dy, x, weight, mean, rstd)``.

    Inputs ``dy``, ``x``, ``mean``, ``rstd`` (and ``weight`` when given; the bias itself is not read, only its
    dtype); outputs ``dx``, then ``dw`` with a weight and ``db`` with a bias. With ``in_place`` and dy of x's
    dtype, dx is written over dy. With ``groups`` > 1 the rows are ``groups`` equal blocks (a folded vmap batch)
    and dw / db have shape (groups, n_cols): one parameter gradient per block. Rows over
    ``rowwise.MAX_HELD_COLUMNS`` are split into column blocks after a first launch that sums each row.
    ``programs_per_sm``, ``block_m``, ``num_warps``, ``prefetch``, ``reload`` and ``column_block`` override the
    launch configuration (for tuning and tests; :func:`liger_core.rms_norm.backward_variant`,
    :func:`liger_core.rowwise.backward_tiles`).
    """
    _check_inputs(x, weight, bias, "weight", "bias")
    if tuple(dy.shape) != tuple(x.shape):
        raise ValueError(f"grad_output must have the shape of x {x.shape}, got {dy.shape}")
    check_float(dy, "grad_output")
    n_rows, n_cols, x_row_stride, x_col_stride = row_view(x, "x")
    _, _, dy_row_stride, dy_col_stride = row_view(dy, "grad_output")
    group_rows = rows_in_group(n_rows, groups)
    tiles = backward_tiles(group_rows, n_cols, _BACKWARD_TILE, num_sms, programs_per_sm or _BACKWARD_PROGRAMS_PER_SM,
                           _ROW_SUMS, block_m=block_m, column_block=column_block)
    block_m, block_n = tiles.block_m, tiles.block_n
    prefetch, reload = backward_variant(tiles, prefetch, reload, reload_wide=True)
    n_programs = tiles.grid.n_programs
    dx, dx_row_stride, dx_col_stride = gradient_output("dx", x.shape, x.dtype, "dy" if in_place else None, dy,
                                                       n_rows, n_cols)
    has_weight, has_bias = weight is not None, bias is not None
    partial_shape = (groups, n_programs, n_cols)
    main = Launch(
        kernel=_layer_norm_backward_kernel,
        grid=(n_programs, groups, tiles.column_blocks),
        args=(Buf("dy"), dy_row_stride, dy_col_stride, Buf("x"), x_row_stride, x_col_stride,
              Buf("weight" if has_weight else "x"), weight.strides[0] if has_weight else 0,
              Buf("mean"), Buf("rstd"), *((Buf("row_dot"), Buf("row_mean")) if tiles.split else (Buf("rstd"),) * 2),
              dx_row_stride, dx_col_stride, group_rows, n_cols, tiles.grid.rows_per_program),
        outputs=(dx, NewBuffer("dw_partial", partial_shape if has_weight else (1,), "float32"),
                 NewBuffer("db_partial", partial_shape if has_bias else (1,), "float32")),
        constexprs={"BLOCK_M": block_m, "BLOCK_N": block_n, "HAS_WEIGHT": has_weight, "HAS_BIAS": has_bias,
                    "PREFETCH": prefetch, "RELOAD": reload, "ROW_SUMS": tiles.split},
        num_warps=num_warps or _backward_warps(block_m * block_n, reload),
    )
    inputs = ("dy", "x") + (("weight",) if has_weight else ()) + ("mean", "rstd")
    launches, outputs = [main], ["dx"]
    if tiles.split:  # the row sums read dy before the main launch may write dx over it
        launches.insert(0, Launch(
            kernel=_layer_norm_row_sums_kernel, grid=(n_rows,),
            args=(Buf("dy"), dy_row_stride, dy_col_stride, Buf("x"), x_row_stride, x_col_stride,
                  Buf("weight" if has_weight else "x"), weight.strides[0] if has_weight else 0,
                  Buf("mean"), Buf("rstd"), n_cols),
            outputs=(NewBuffer("row_dot", (n_rows,), "float32"), NewBuffer("row_mean", (n_rows,), "float32")),
            constexprs={"CHUNK": tiles.row_sums.chunk, "HAS_WEIGHT": has_weight, "PREFETCH": tiles.row_sums.prefetch,
                        "FULL_CHUNKS": full_chunks(n_cols, tiles.row_sums.chunk)},
            num_warps=tiles.row_sums.num_warps))
    if has_weight and has_bias:
        launches.append(sum_partial_pairs_launch(("dw_partial", "db_partial"), ("dw", "db"), groups, n_programs,
                                                 n_cols, (weight.dtype, bias.dtype)))
        outputs += ["dw", "db"]
    elif has_weight:
        launches.append(sum_partials_launch("dw_partial", "dw", groups, n_programs, n_cols, weight.dtype))
        outputs.append("dw")
    elif has_bias:
        launches.append(sum_partials_launch("db_partial", "db", groups, n_programs, n_cols, bias.dtype))
        outputs.append("db")
    return Plan(inputs=inputs, launches=tuple(launches), outputs=tuple(outputs))

"""RMSNorm: y = x * rstd * (offset + w), rstd = 1 / sqrt(mean(x^2) + eps), over the last axis.

Casting modes (what is computed in which precision):
- ``llama``: HF ``LlamaRMSNorm``: normalise in fp32, cast to x's dtype, then multiply by ``offset + w``
  (the output dtype is the promotion of x's and w's dtypes, as in HF).
- ``gemma``: everything in fp32 (HF ``GemmaRMSNorm`` with offset=1.0; also ``flax.nnx.RMSNorm``), output in
  x's dtype.
- ``none``: mean of squares in fp32, the rest in x's dtype.

Forward saves rstd (fp32, one per row); rows over 32768 columns (``_CHUNKED.held_up_to``; 16384 with an fp32 x or
weight) are swept in two passes of column chunks instead of held in registers (``rowwise.ChunkedSweep`` rows a
program). Backward: one pass per row block gives dx (optionally written over dy) and per-program fp32 partial
sums of dw, reduced in a fixed order by :mod:`liger_core.reduce`; rows over ``MAX_HELD_COLUMNS`` are summed in a
first sweep, then walked in column blocks (:func:`liger_core.rowwise.backward_tiles`), or, by ``lagged`` (off by
default: not yet faster on a GPU), read once from DRAM by a lagged job order (:func:`_rms_norm_lagged_backward_kernel`).
Without a weight, y = x * rstd and ``offset`` is unused.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from .launch import (
    ITEMSIZE, ArrayInfo, Buf, Launch, NewBuffer, Plan, cdiv, check_eps, check_finite, check_float, check_last_axis_span,
    check_nonempty, next_power_of_2, promote, warps_for,
)
from .reduce import sum_partials_launch
from .rowwise import (
    BackwardTiles, ChunkedSweep, backward_tiles, full_chunks, gradient_output, held_rows_for, norm_forward_launch,
    row_view, rows_in_group,
)
from .tl_math import aligned, cast, chunk_columns, round_to

CASTING_MODES = {"llama": 0, "gemma": 1, "none": 2}
# Launch configuration, from the H200 sweep in docs/perf-log.md (scripts/tune_rms_norm.py):
# forward: ~4k elements of x per program, 4-8 warps; backward: one persistent program per SM, 16 warps,
# tiles of 8k elements with the next tile prefetched; a single row of 16k+ elements is its own tile, without
# prefetch (two such tiles in registers halve occupancy: 0.21 ms against 0.14 ms at 4096 x 16384).
_FORWARD_TILE = 4096
# The chunked forward (rows over held_up_to columns): 16384-column chunks at 32 warps, the next chunk's load
# issued first (52 registers, one program an SM). H200 bf16 (benchmarks/results/h200-2026-12-06-tune_wide_fwd.txt):
# 4096 x 65536 0.314 ms against 0.337 for 8192-column chunks at 16 warps. Rows up to 32768 columns are held (16
# warps, 121 registers, no spills; only with 2-byte x and weight: rowwise.held_rows_for): 4096 x 32768 H200 0.144
# ms against 0.146 chunked, H100 0.181 against 0.192; 4096 x 20496 H100 0.119 against 0.131
# (benchmarks/results/h100-80gb-hbm3-2026-12-07-tune_rms_fwd.txt).
_CHUNKED = ChunkedSweep(chunk=16384, num_warps=32, prefetch=True, held_up_to=32768)
_BACKWARD_TILE = 8192
_BACKWARD_PROGRAMS_PER_SM = 1
# The column-split backward's row sums (rows over rowwise.MAX_HELD_COLUMNS; shared with fused add+RMSNorm): 8192-column
# chunks at 16 warps, the next chunk's dy and x loads issued first (ptxas: 64 registers, two programs an SM; not
# yet measured).
ROW_DOTS_SWEEP = ChunkedSweep(chunk=8192, num_warps=16, prefetch=True)
# The lagged backward (_rms_norm_lagged_backward_kernel; RMSNorm's and fused add+RMSNorm's) on rows of at least
# "from_cols" columns (None: never) in one group: blocks of "rows" rows cut into "segment"-column jobs, the
# gradient jobs "lag_bytes" of dy and x (1 to 64 blocks, at most all) after the dot jobs, "block" columns a step at
# "num_warps", the blocks' weight gradients chained in block order with "chain_dw" (else partial rows summed
# afterwards). Off by default: at 16 rows x 8192 columns a job it ran 14-40% slower than the column split (H100,
# results/h100-80gb-hbm3-2026-12-07-tune_norm_lagged2.txt: 1.013 ms at best against 0.888 at 4096x65536; its jobs
# kept ~470 MB in flight between a segment's two reads).
LAGGED_BACKWARD = {"from_cols": None, "segment": 8192, "rows": 16, "lag_bytes": 12 * 2**20, "block": 1024,
                   "num_warps": 4, "chain_dw": False}


@triton.jit
def normalize_and_scale(xf, rstd, scale, x_dtype: tl.constexpr, y_dtype: tl.constexpr, CASTING: tl.constexpr,
                        HAS_WEIGHT: tl.constexpr):
    """y of the casting mode from fp32 x (already in x's dtype's values), rstd per row and ``offset + w``.

    Arithmetic stays in fp32, rounded where HF rounds: a product of two bf16/fp16 values is exact in fp32, so
    rounding it once gives the half-precision product (and the interpreter cannot do bf16 arithmetic)."""
    if CASTING == 1:  # gemma: all fp32
        y = xf * rstd[:, None]
        if HAS_WEIGHT:
            y = y * scale[None, :]
    elif CASTING == 0:  # llama: normalise in fp32, round to x's dtype, scale in the output dtype
        y = round_to(xf * rstd[:, None], x_dtype)
        if HAS_WEIGHT:
            y = y * round_to(scale, y_dtype)[None, :]
    else:  # none: the statistic in fp32, the rest in x's dtype
        y = round_to(xf * round_to(rstd, x_dtype)[:, None], x_dtype)
        if HAS_WEIGHT:
            y = y * round_to(scale, x_dtype)[None, :]
    return y


@triton.jit
def plus_offset(w, offset, HAS_OFFSET: tl.constexpr):
    """``offset + w`` (Gemma's 1 + w). Without HAS_OFFSET (offset 0: Llama's) ``w`` itself, so the compiler sees
    a bf16/fp16 weight still exact in its fp32 form and drops the llama casting's rounding of it (the chunked
    RMSNorm forward's second loop: 131 -> 83 SASS instructions for 16 values)."""
    if HAS_OFFSET:
        return w + offset
    else:
        return w


@triton.jit
def load_scale(W, w_stride, cols, col_mask, offset, BLOCK_N: tl.constexpr, HAS_WEIGHT: tl.constexpr,
               HAS_OFFSET: tl.constexpr):
    """``offset + w`` in fp32 (zeros without a weight). The forwards issue this load with the row's, before the
    row's reduction: loaded after it (behind the reduction's barriers), the weight's round trip adds to every
    program's latency, which a small grid with a cold L2 does not hide (4096 x 4096 bf16 on an H100: ~2.5 us of
    ~26)."""
    if HAS_WEIGHT:
        return plus_offset(tl.load(W + cols * w_stride, mask=col_mask, other=0.0).to(tl.float32), offset, HAS_OFFSET)
    return tl.zeros((BLOCK_N,), dtype=tl.float32)


@triton.jit
def _rms_norm_forward_kernel(
    X, x_row_stride, x_col_stride,
    W, w_stride,
    n_rows, n_cols, eps, offset,
    Y, RSTD,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CASTING: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    HAS_OFFSET: tl.constexpr, ALIGN: tl.constexpr,
):
    x_row_stride = aligned(x_row_stride, ALIGN)
    n_cols = aligned(n_cols, ALIGN)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    x = tl.load(X + rows[:, None] * x_row_stride + cols[None, :] * x_col_stride, mask=mask, other=0.0)
    scale = load_scale(W, w_stride, cols, col_mask, offset, BLOCK_N, HAS_WEIGHT, HAS_OFFSET)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / n_cols + eps)
    tl.store(RSTD + rows, rstd, mask=row_mask)
    y_dtype = Y.dtype.element_ty
    y = normalize_and_scale(xf, rstd, scale, x.dtype, y_dtype, CASTING, HAS_WEIGHT)
    tl.store(Y + rows[:, None] * n_cols + cols[None, :], cast(y, y_dtype), mask=mask)


@triton.jit
def chunked_rows(n_rows, ROWS: tl.constexpr):
    """The ROWS rows of a chunked sweep's program, as a column vector. The last program's rows past the end are
    the last row again: computed once more and stored with the same values, so the sweeps need no row mask."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    return tl.minimum(rows, n_rows - 1)


@triton.jit
def chunk_mask(cols, n_cols, FULL: tl.constexpr):
    """Which of a chunk's columns lie in the row. FULL (every chunk whole: n_cols a multiple of CHUNK): all, as a
    constant the compiler folds away, so masked loads, stores and selects lose their compares and zero fills."""
    if FULL:
        return tl.full(cols.shape, 1, tl.int1)
    else:
        return cols < n_cols


@triton.jit
def load_chunk(rows_ptr, col_stride, i, n_chunks, n_cols, CHUNK: tl.constexpr, SECOND_SWEEP: tl.constexpr,
               FULL: tl.constexpr):
    """Step ``i`` of a chunked sweep over a (1, n_cols) row: (1, CHUNK) values in the row's dtype, zeros past its
    end (a step past the last chunk loads nothing: the first sweeps prefetch one step ahead; with FULL chunks
    that is the only mask, one uniform predicate, and what such a step returns is not defined)."""
    cols = chunk_columns(i, n_chunks, CHUNK, SECOND_SWEEP)
    if FULL:
        return tl.load(rows_ptr + cols[None, :] * col_stride, mask=i < n_chunks)
    else:
        return tl.load(rows_ptr + cols[None, :] * col_stride, mask=(cols < n_cols)[None, :], other=0.0)


@triton.jit
def first_sweep_start(rows_ptr, col_stride, n_chunks, n_cols, CHUNK: tl.constexpr, PREFETCH: tl.constexpr,
                      FULL: tl.constexpr):
    """What a first sweep carries into its loop: with PREFETCH chunk 0's load, issued now (else nothing used)."""
    if PREFETCH:
        return load_chunk(rows_ptr, col_stride, 0, n_chunks, n_cols, CHUNK, False, FULL)
    else:
        return tl.zeros((1, CHUNK), dtype=rows_ptr.dtype.element_ty)


@triton.jit
def first_sweep_step(rows_ptr, col_stride, i, n_chunks, n_cols, pending, CHUNK: tl.constexpr,
                     PREFETCH: tl.constexpr, FULL: tl.constexpr):
    """``(chunk i, what to carry)`` of a first sweep. With PREFETCH chunk i is ``pending`` (loaded a step
    earlier) and chunk i + 1's load is issued before chunk i is used: two loads in flight a warp, not one (a
    sweep loop is latency-bound: liger_core.cross_entropy.row_softmax_stats), for more registers."""
    if PREFETCH:
        return pending, load_chunk(rows_ptr, col_stride, i + 1, n_chunks, n_cols, CHUNK, False, FULL)
    else:
        return load_chunk(rows_ptr, col_stride, i, n_chunks, n_cols, CHUNK, False, FULL), pending


@triton.jit
def _rms_norm_chunked_forward_kernel(
    X, x_row_stride, x_col_stride,
    W, w_stride,
    n_rows, n_cols, eps, offset,
    Y, RSTD,
    CHUNK: tl.constexpr, ROWS: tl.constexpr, CASTING: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    HAS_OFFSET: tl.constexpr, PREFETCH: tl.constexpr, FULL_CHUNKS: tl.constexpr, ALIGN: tl.constexpr,
):
    """ROWS rows a program (w read once for all), for rows too wide to hold in registers
    (``_CHUNKED.held_up_to``): a first sweep over CHUNK-column chunks sums the squares (per lane, one reduction
    at the end), a second reads x again (from L2) and writes y, rounded as the held-row kernel rounds. PREFETCH:
    the first sweep, which reads from DRAM, keeps the next chunk's load in flight (first_sweep_step)."""
    x_row_stride = aligned(x_row_stride, ALIGN)
    n_cols = aligned(n_cols, ALIGN)
    rows = chunked_rows(n_rows, ROWS)
    x_rows = X + rows[:, None] * x_row_stride
    n_chunks = tl.cdiv(n_cols, CHUNK)
    squares = tl.zeros((ROWS, CHUNK), dtype=tl.float32)
    x_next = first_sweep_start(x_rows, x_col_stride, n_chunks, n_cols, CHUNK, PREFETCH, FULL_CHUNKS)
    for i in range(n_chunks):
        x, x_next = first_sweep_step(x_rows, x_col_stride, i, n_chunks, n_cols, x_next, CHUNK, PREFETCH, FULL_CHUNKS)
        xf = x.to(tl.float32)
        squares += xf * xf
    rstd = tl.rsqrt(tl.sum(squares, axis=1) / n_cols + eps)
    tl.store(RSTD + rows, rstd)
    y_dtype = Y.dtype.element_ty
    for i in range(n_chunks):
        cols = chunk_columns(i, n_chunks, CHUNK, True)
        col_mask = chunk_mask(cols, n_cols, FULL_CHUNKS)
        x = load_chunk(x_rows, x_col_stride, i, n_chunks, n_cols, CHUNK, True, FULL_CHUNKS)
        scale = load_scale(W, w_stride, cols, col_mask, offset, CHUNK, HAS_WEIGHT, HAS_OFFSET)
        y = normalize_and_scale(x.to(tl.float32), rstd, scale, x.dtype, y_dtype, CASTING, HAS_WEIGHT)
        tl.store(Y + rows[:, None] * n_cols + cols[None, :], cast(y, y_dtype), mask=col_mask[None, :])


@triton.jit
def load_backward_rows(DY, dy_row_stride, dy_col_stride, X, x_row_stride, x_col_stride, RSTD,
                       first_row, local, row_end, cols, col_mask):
    rows = first_row + local.to(tl.int64)
    row_mask = local < row_end
    mask = row_mask[:, None] & col_mask[None, :]
    dy = tl.load(DY + rows[:, None] * dy_row_stride + cols[None, :] * dy_col_stride, mask=mask, other=0.0)
    x = tl.load(X + rows[:, None] * x_row_stride + cols[None, :] * x_col_stride, mask=mask, other=0.0)
    rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
    return dy, x, rstd


@triton.jit
def load_row_values(VALUES, first_row, local, row_end, ENABLED: tl.constexpr):
    """One fp32 value a row of a tile (the column-split backward's row sums), or zeros when not ENABLED."""
    if ENABLED:
        return tl.load(VALUES + first_row + local.to(tl.int64), mask=local < row_end, other=0.0)
    else:
        return tl.zeros(local.shape, dtype=tl.float32)


@triton.jit
def reload_backward_tile(DY, dy_row_stride, dy_col_stride, X, x_row_stride, x_col_stride, rows, cols, mask):
    """A tile's dy (in fp32) and x loaded again after the row's reduction (RELOAD). ".ca" is the default caching
    spelled out: a load identical to the first would be merged with it, keeping the tile live across the
    reduction again."""
    dy = tl.load(DY + rows[:, None] * dy_row_stride + cols[None, :] * dy_col_stride, mask=mask, other=0.0,
                 cache_modifier=".ca")
    x = tl.load(X + rows[:, None] * x_row_stride + cols[None, :] * x_col_stride, mask=mask, other=0.0,
                cache_modifier=".ca")
    return dy.to(tl.float32), x


@triton.jit
def weight_gradient_term(dy, normed, x_dtype: tl.constexpr, CASTING: tl.constexpr):
    """One tile's dy * d(y)/d(w): llama multiplies w by the normalised x already rounded to x's dtype."""
    if CASTING == 0:
        return dy * round_to(normed, x_dtype)
    return dy * normed


@triton.jit
def row_sums_pointers(DY, dy_row_stride, X, x_row_stride):
    """A row-sums sweep's row (this program's, as a (1,) index) and its dy and x rows."""
    rows = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)
    return rows, DY + rows[:, None] * dy_row_stride, X + rows[:, None] * x_row_stride


@triton.jit
def row_sums_step(dy_rows, dy_col_stride, x_rows, x_col_stride, W, w_stride, offset, i, n_chunks, n_cols, dy_next,
                  x_next, CHUNK: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_OFFSET: tl.constexpr,
                  PREFETCH: tl.constexpr, FULL: tl.constexpr):
    """Step ``i`` of a row-sums sweep over dy and x (the column-split backwards'): ``(dy * (offset + w), x)`` in
    fp32, zeros past the row's end, and what to carry (first_sweep_step)."""
    dy, dy_next = first_sweep_step(dy_rows, dy_col_stride, i, n_chunks, n_cols, dy_next, CHUNK, PREFETCH, FULL)
    x, x_next = first_sweep_step(x_rows, x_col_stride, i, n_chunks, n_cols, x_next, CHUNK, PREFETCH, FULL)
    dnormed = dy.to(tl.float32)
    if HAS_WEIGHT:
        cols = chunk_columns(i, n_chunks, CHUNK, False)
        w = tl.load(W + cols * w_stride, mask=chunk_mask(cols, n_cols, FULL), other=0.0).to(tl.float32)
        dnormed = dnormed * plus_offset(w, offset, HAS_OFFSET)[None, :]
    return dnormed, x.to(tl.float32), dy_next, x_next


@triton.jit
def _rms_norm_row_dots_kernel(
    DY, dy_row_stride, dy_col_stride,
    X, x_row_stride, x_col_stride,
    W, w_stride,
    RSTD, n_cols, offset,
    ROW_DOT,
    CHUNK: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_OFFSET: tl.constexpr, PREFETCH: tl.constexpr,
    FULL_CHUNKS: tl.constexpr, ALIGN: tl.constexpr,
):
    """mean(dy * (offset + w) * x * rstd) of one row a program, swept once in CHUNK-column chunks (per-lane
    sums, one reduction at the end): the row sum that the column-split backward (rows over
    rowwise.MAX_HELD_COLUMNS) needs before any of its column blocks can write dx. PREFETCH: the next chunk's
    loads go out before this chunk is used (first_sweep_step)."""
    dy_row_stride = aligned(dy_row_stride, ALIGN)
    x_row_stride = aligned(x_row_stride, ALIGN)
    n_cols = aligned(n_cols, ALIGN)
    rows, dy_rows, x_rows = row_sums_pointers(DY, dy_row_stride, X, x_row_stride)
    n_chunks = tl.cdiv(n_cols, CHUNK)
    dots = tl.zeros((1, CHUNK), dtype=tl.float32)
    dy_next = first_sweep_start(dy_rows, dy_col_stride, n_chunks, n_cols, CHUNK, PREFETCH, FULL_CHUNKS)
    x_next = first_sweep_start(x_rows, x_col_stride, n_chunks, n_cols, CHUNK, PREFETCH, FULL_CHUNKS)
    for i in range(n_chunks):
        dnormed, x, dy_next, x_next = row_sums_step(dy_rows, dy_col_stride, x_rows, x_col_stride, W, w_stride, offset,
                                                    i, n_chunks, n_cols, dy_next, x_next, CHUNK, HAS_WEIGHT,
                                                    HAS_OFFSET, PREFETCH, FULL_CHUNKS)
        dots += dnormed * x  # past the row's end x is 0
    rstd = tl.load(RSTD + rows)
    tl.store(ROW_DOT + rows, tl.sum(dots, axis=1) * rstd / n_cols)


@triton.jit
def rms_norm_backward_kernel(
    DY, dy_row_stride, dy_col_stride,
    DH, dh_row_stride, dh_col_stride,
    X, x_row_stride, x_col_stride,
    W, w_stride,
    RSTD, ROW_DOT,
    dx_row_stride, dx_col_stride,
    dr_row_stride, dr_col_stride,
    rows_per_group, n_cols, offset, rows_per_program,
    DX, DR, DW_PARTIAL,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CASTING: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    HAS_OFFSET: tl.constexpr, HAS_DH: tl.constexpr, SEPARATE_DR: tl.constexpr, PREFETCH: tl.constexpr,
    RELOAD: tl.constexpr, ROW_DOTS: tl.constexpr, ALIGN: tl.constexpr,
):
    """Persistent: each program walks ``rows_per_program`` rows of its group in BLOCK_M-row tiles. With
    PREFETCH the next tile's dy, x and rstd are loaded before the current tile is computed, hiding HBM latency.

    Also the fused add+RMSNorm backward (:mod:`liger_core.fused_add_rms_norm`, X being h = x + residual): with
    HAS_DH the incoming gradient of h (DH, read once at the end of a tile, not prefetched) is added to dx, and
    with SEPARATE_DR the sum is stored a second time, as the residual's gradient in its own dtype.

    With RELOAD (wide rows) only the weight-gradient accumulator stays in registers across a row's reduction:
    the weight is loaded with each tile, and dy, x and w are loaded again (L1/L2 hits) for dx and the
    accumulator instead of being held (at 16384 columns the held tile spilled).

    With ROW_DOTS (rows over rowwise.MAX_HELD_COLUMNS) a tile is BLOCK_N columns of its rows, the column block
    of grid axis 2, and each row's mean(dy * w * x * rstd) comes from ROW_DOT (:func:`_rms_norm_row_dots_kernel`)
    instead of the tile's own sum."""
    dy_row_stride = aligned(dy_row_stride, ALIGN)
    dh_row_stride = aligned(dh_row_stride, ALIGN)
    x_row_stride = aligned(x_row_stride, ALIGN)
    dx_row_stride = aligned(dx_row_stride, ALIGN)
    dr_row_stride = aligned(dr_row_stride, ALIGN)
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
            w = plus_offset(tl.load(W + cols * w_stride, mask=col_mask, other=0.0).to(tl.float32), offset, HAS_OFFSET)
        dw_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PREFETCH:
        next_dy, next_x, next_rstd = load_backward_rows(
            DY, dy_row_stride, dy_col_stride, X, x_row_stride, x_col_stride, RSTD,
            first_row, row_begin + tl.arange(0, BLOCK_M), row_end, cols, col_mask)
        next_dot = load_row_values(ROW_DOT, first_row, row_begin + tl.arange(0, BLOCK_M), row_end, ROW_DOTS)
    for start in range(0, rows_per_program, BLOCK_M):
        local = row_begin + start + tl.arange(0, BLOCK_M)
        if PREFETCH:
            dy, x, rstd, dot = next_dy, next_x, next_rstd, next_dot
            next_dy, next_x, next_rstd = load_backward_rows(
                DY, dy_row_stride, dy_col_stride, X, x_row_stride, x_col_stride, RSTD,
                first_row, local + BLOCK_M, row_end, cols, col_mask)
            next_dot = load_row_values(ROW_DOT, first_row, local + BLOCK_M, row_end, ROW_DOTS)
        else:
            dy, x, rstd = load_backward_rows(DY, dy_row_stride, dy_col_stride, X, x_row_stride, x_col_stride,
                                             RSTD, first_row, local, row_end, cols, col_mask)
            dot = load_row_values(ROW_DOT, first_row, local, row_end, ROW_DOTS)
        rows = first_row + local.to(tl.int64)
        mask = (local < row_end)[:, None] & col_mask[None, :]
        if RELOAD and HAS_WEIGHT:
            w = plus_offset(tl.load(W + cols * w_stride, mask=col_mask, other=0.0).to(tl.float32), offset, HAS_OFFSET)
        dy = dy.to(tl.float32)
        normed = x.to(tl.float32) * rstd[:, None]
        if HAS_WEIGHT:
            if not RELOAD:
                dw_acc += weight_gradient_term(dy, normed, x.dtype, CASTING)
            dnormed = dy * w[None, :]
        else:
            dnormed = dy
        if ROW_DOTS:
            mean_dot = dot
        else:
            mean_dot = tl.sum(dnormed * normed, axis=1) / n_cols
        if RELOAD:
            dy_again, x_again = reload_backward_tile(DY, dy_row_stride, dy_col_stride, X, x_row_stride,
                                                     x_col_stride, rows, cols, mask)
            normed = x_again.to(tl.float32) * rstd[:, None]
            if HAS_WEIGHT:
                w_again = plus_offset(tl.load(W + cols * w_stride, mask=col_mask, other=0.0,
                                              cache_modifier=".ca").to(tl.float32), offset, HAS_OFFSET)
                dw_acc += weight_gradient_term(dy_again, normed, x_again.dtype, CASTING)
                dnormed = dy_again * w_again[None, :]
            else:
                dnormed = dy_again
        dx = (dnormed - normed * mean_dot[:, None]) * rstd[:, None]
        if HAS_DH:
            dh_in = tl.load(DH + rows[:, None] * dh_row_stride + cols[None, :] * dh_col_stride, mask=mask,
                            other=0.0)
            dx += dh_in.to(tl.float32)
        tl.store(DX + rows[:, None] * dx_row_stride + cols[None, :] * dx_col_stride,
                 cast(dx, DX.dtype.element_ty), mask=mask)
        if SEPARATE_DR:
            tl.store(DR + rows[:, None] * dr_row_stride + cols[None, :] * dr_col_stride,
                     cast(dx, DR.dtype.element_ty), mask=mask)
    if HAS_WEIGHT:
        slot = group * n_programs + program
        tl.store(DW_PARTIAL + slot * n_cols + cols, tl.sum(dw_acc, axis=0), mask=col_mask)


@triton.jit
def lagged_step_position(first_row, seg_start, i, n_rows, seg_cols, R: tl.constexpr, BLOCK: tl.constexpr,
                         ROWS_INNER: tl.constexpr):
    """Where step ``i`` of a lagged backward job's sweep over its R rows x seg_cols columns is: ``(row, cols,
    mask)`` (row an int64 scalar; cols int32: 64-bit column vectors take twice the registers). ROWS_INNER
    (gradient jobs): a column block's R rows in turn, so one weight-gradient accumulator a block; else (dot
    jobs) a row's blocks in turn. Recomputed where needed rather than carried across the loop (registers)."""
    if ROWS_INNER:
        r = i % R
        block_start = (i // R) * BLOCK
    else:
        n_blocks = tl.cdiv(seg_cols, BLOCK)
        r = i // n_blocks
        block_start = (i % n_blocks) * BLOCK
    row = first_row + r
    local = block_start + tl.arange(0, BLOCK)
    return row, seg_start + local, (local < seg_cols) & (row < n_rows)


@triton.jit
def lagged_step_loads(DY, dy_row_stride, dy_col_stride, X, x_row_stride, x_col_stride, first_row, seg_start, i,
                      n_rows, seg_cols, R: tl.constexpr, BLOCK: tl.constexpr, ROWS_INNER: tl.constexpr):
    """dy and x of step ``i`` (lagged_step_position); ``n_rows`` 0 loads nothing (past the last step)."""
    row, cols, mask = lagged_step_position(first_row, seg_start, i, n_rows, seg_cols, R, BLOCK, ROWS_INNER)
    dy = tl.load(DY + row * dy_row_stride + cols * dy_col_stride, mask=mask, other=0.0)
    x = tl.load(X + row * x_row_stride + cols * x_col_stride, mask=mask, other=0.0)
    return dy, x


@triton.jit
def _rms_norm_lagged_backward_kernel(
    DY, dy_row_stride, dy_col_stride,
    DH, dh_row_stride, dh_col_stride,
    X, x_row_stride, x_col_stride,
    W, w_stride,
    RSTD,
    dx_row_stride, dx_col_stride,
    dr_row_stride, dr_col_stride,
    n_rows, n_cols, offset,
    DX, DR, DW_PARTIAL, DW, SYNC, PARTS,
    R: tl.constexpr, SEG: tl.constexpr, N_SEG: tl.constexpr, N_SEG_P2: tl.constexpr, LAG: tl.constexpr,
    BLOCK: tl.constexpr, CASTING: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_OFFSET: tl.constexpr,
    HAS_DH: tl.constexpr, SEPARATE_DR: tl.constexpr, CHAIN_DW: tl.constexpr, ALIGN: tl.constexpr,
):
    """The RMSNorm (and fused add+RMSNorm) backward of wide rows reading dy and x once from DRAM: the
    column-split backward reads them twice (its row sums, then dx), and a held row's weight-gradient
    accumulator spills. The rows are blocks of R; each block's SEG-column segments are two jobs of one grid,
    in a fixed order (cross_entropy._cross_entropy_lagged_kernel's): a dot job (sum(dy * (offset + w) * x) of
    the segment, a row at a time, into PARTS[row, segment], then a release count on SYNC[1 + block]) and, LAG
    blocks later in the order, a gradient job (its first loads issued, it waits with acquire for the block's
    N_SEG counts, sums each row's segments in order, writes dx for the segment, column block by column block
    over its R rows, and the block's weight-gradient partial DW_PARTIAL[block, segment's columns]). The second
    read of a segment comes from L2: only ~LAG blocks stream in between. Jobs take their place from a ticket
    (SYNC[0]) and wait only on lower tickets, so no wait can deadlock, and the interpreter runs the grid as it
    is. dx may be written over dy: a block's gradient jobs start writing after all its dot jobs have read.

    With CHAIN_DW the blocks' weight gradients are added in block order into one fp32 row (DW_PARTIAL, n_cols):
    a segment's gradient job waits (acquire) for the previous block's to have added its part (SYNC[1 + n_blocks +
    segment] counts them), adds its own and releases; the last block's job writes DW in the weight's dtype. Small
    blocks then cost no partial rows (without it, DW_PARTIAL[block] rows: 2 / R of a bf16 pass written and read
    again by the sum)."""
    dy_row_stride = aligned(dy_row_stride, ALIGN)
    dh_row_stride = aligned(dh_row_stride, ALIGN)
    x_row_stride = aligned(x_row_stride, ALIGN)
    dx_row_stride = aligned(dx_row_stride, ALIGN)
    dr_row_stride = aligned(dr_row_stride, ALIGN)
    n_cols = aligned(n_cols, ALIGN)
    job = tl.atomic_add(SYNC, 1, sem="relaxed").to(tl.int64)
    slot = job // (2 * N_SEG)
    kind = (job % (2 * N_SEG)).to(tl.int32)
    seg = kind % N_SEG
    block = tl.where(kind < N_SEG, slot, slot - LAG)
    first_row = block * R
    if (block < 0) | (first_row >= n_rows):  # the first LAG slots have no gradient jobs, the last LAG no dots
        return
    seg_start = seg * SEG
    seg_cols = tl.minimum(n_cols - seg_start, SEG)
    n_steps = R * tl.cdiv(seg_cols, BLOCK)
    if kind < N_SEG:  # dot job
        dy_next, x_next = lagged_step_loads(DY, dy_row_stride, dy_col_stride, X, x_row_stride, x_col_stride,
                                            first_row, seg_start, 0, n_rows, seg_cols, R, BLOCK, False)
        dots = tl.zeros((BLOCK,), dtype=tl.float32)
        n_blocks = tl.cdiv(seg_cols, BLOCK)
        for i in range(n_steps):
            dy, x = dy_next, x_next
            dy_next, x_next = lagged_step_loads(DY, dy_row_stride, dy_col_stride, X, x_row_stride, x_col_stride,
                                                first_row, seg_start, tl.minimum(i + 1, n_steps - 1),
                                                tl.where(i + 1 < n_steps, n_rows, 0), seg_cols, R, BLOCK, False)
            row_now, cols_now, _ = lagged_step_position(first_row, seg_start, i, n_rows, seg_cols, R, BLOCK, False)
            dnormed = dy.to(tl.float32)
            if HAS_WEIGHT:
                w = tl.load(W + cols_now * w_stride, mask=cols_now < n_cols, other=0.0).to(tl.float32)
                dnormed = dnormed * plus_offset(w, offset, HAS_OFFSET)
            dots += dnormed * x.to(tl.float32)
            if i % n_blocks == n_blocks - 1:  # the row's last block: its sum, then the next row from zero
                tl.store(PARTS + row_now * N_SEG + seg, tl.sum(dots, axis=0), mask=row_now < n_rows)
                dots = tl.zeros((BLOCK,), dtype=tl.float32)
        tl.debug_barrier()  # every thread's stores before the release
        tl.atomic_add(SYNC + 1 + block, 1, sem="release")
    else:  # gradient job
        dy_next, x_next = lagged_step_loads(DY, dy_row_stride, dy_col_stride, X, x_row_stride, x_col_stride,
                                            first_row, seg_start, 0, n_rows, seg_cols, R, BLOCK,
                                            True)  # in flight through the wait
        count = tl.atomic_add(SYNC + 1 + block, 0, sem="acquire")
        while count < N_SEG:
            count = tl.atomic_add(SYNC + 1 + block, 0, sem="acquire")
        # each of the block's rows: rstd and mean(dy * (offset + w) * x) * rstd, its segments summed in order
        block_rows = first_row + tl.arange(0, R)
        segs = tl.arange(0, N_SEG_P2)
        parts = tl.load(PARTS + block_rows[:, None] * N_SEG + segs[None, :],
                        mask=(block_rows < n_rows)[:, None] & (segs < N_SEG)[None, :], other=0.0,
                        cache_modifier=".cg")
        block_rstd = tl.load(RSTD + block_rows, mask=block_rows < n_rows, other=0.0)
        block_dot = tl.sum(parts, axis=1) * block_rstd / n_cols
        dw_acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for i in range(n_steps):
            dy, x = dy_next.to(tl.float32), x_next
            dy_next, x_next = lagged_step_loads(DY, dy_row_stride, dy_col_stride, X, x_row_stride, x_col_stride,
                                                first_row, seg_start, tl.minimum(i + 1, n_steps - 1),
                                                tl.where(i + 1 < n_steps, n_rows, 0), seg_cols, R, BLOCK, True)
            row_now, cols_now, mask_now = lagged_step_position(first_row, seg_start, i, n_rows, seg_cols, R, BLOCK,
                                                               True)
            here = tl.arange(0, R) == i % R
            rstd = tl.sum(tl.where(here, block_rstd, 0.0), axis=0)
            mean_dot = tl.sum(tl.where(here, block_dot, 0.0), axis=0)
            normed = x.to(tl.float32) * rstd
            if HAS_WEIGHT:
                w = tl.load(W + cols_now * w_stride, mask=cols_now < n_cols, other=0.0).to(tl.float32)
                dw_acc += weight_gradient_term(dy, normed, x.dtype, CASTING)
                dnormed = dy * plus_offset(w, offset, HAS_OFFSET)
            else:
                dnormed = dy
            dx = (dnormed - normed * mean_dot) * rstd
            if HAS_DH:
                dh_in = tl.load(DH + row_now * dh_row_stride + cols_now * dh_col_stride, mask=mask_now, other=0.0)
                dx += dh_in.to(tl.float32)
            tl.store(DX + row_now * dx_row_stride + cols_now * dx_col_stride, cast(dx, DX.dtype.element_ty),
                     mask=mask_now)
            if SEPARATE_DR:
                tl.store(DR + row_now * dr_row_stride + cols_now * dr_col_stride, cast(dx, DR.dtype.element_ty),
                         mask=mask_now)
            if HAS_WEIGHT:
                if i % R == R - 1:  # the column block's last row: its partial, then the next block from zero
                    in_seg = cols_now < seg_start + seg_cols
                    if CHAIN_DW:
                        n_blocks = tl.cdiv(n_rows, R)
                        flag = SYNC + 1 + n_blocks + seg
                        if i == R - 1:  # the previous block's part added first (a lower ticket: no deadlock)
                            added = tl.atomic_add(flag, 0, sem="acquire")
                            while added < block:
                                added = tl.atomic_add(flag, 0, sem="acquire")
                        if block > 0:
                            dw_acc += tl.load(DW_PARTIAL + cols_now, mask=in_seg, other=0.0, cache_modifier=".cg")
                        if block == n_blocks - 1:
                            tl.store(DW + cols_now, cast(dw_acc, DW.dtype.element_ty), mask=in_seg)
                        else:
                            tl.store(DW_PARTIAL + cols_now, dw_acc, mask=in_seg)
                    else:
                        tl.store(DW_PARTIAL + block * n_cols + cols_now, dw_acc, mask=in_seg)
                    dw_acc = tl.zeros((BLOCK,), dtype=tl.float32)
        if CHAIN_DW and HAS_WEIGHT:
            tl.debug_barrier()  # every thread's adds before the release
            tl.atomic_add(SYNC + 1 + tl.cdiv(n_rows, R) + seg, 1, sem="release")


# ---------------------------------------------------------------------------------------------------------
# Launch logic


def _check_inputs(x: ArrayInfo, weight: ArrayInfo | None, casting_mode: str, weight_name: str = "weight") -> None:
    if casting_mode not in CASTING_MODES:
        raise ValueError(f"casting_mode must be one of {tuple(CASTING_MODES)}, got {casting_mode!r}")
    check_nonempty(x, "x")
    check_float(x, "x")
    if weight is not None:
        check_float(weight, weight_name)
        if weight.shape != (x.shape[-1],):
            raise ValueError(f"{weight_name} must have shape ({x.shape[-1]},) to match x's last dimension, "
                             f"got {weight.shape}")
        check_last_axis_span(weight, weight_name)


def output_dtype(x_dtype: str, weight_dtype: str | None, casting_mode: str) -> str:
    if casting_mode == "llama" and weight_dtype is not None:
        return promote(x_dtype, weight_dtype)
    return x_dtype


@functools.lru_cache(maxsize=1024)  # plans are pure functions of hashable shapes: build each once
def forward_plan(x: ArrayInfo, weight: ArrayInfo | None, *, eps: float, offset: float = 0.0,
                 casting_mode: str = "llama", weight_name: str = "weight", block_m: int | None = None,
                 num_warps: int | None = None, eps_name: str = "eps", chunk: int | None = None,
                 prefetch: bool | None = None, full_chunks: bool | None = None) -> Plan:
    """Plan for ``y, rstd = rms_norm(x, weight)``; inputs ``x`` (and ``weight``), outputs ``y``, ``rstd``.

    ``weight_name`` and ``eps_name`` are the weight's and epsilon's names in the caller's API, for error
    messages. Rows wider than 32768 columns (16384 with an fp32 x or weight) are swept in chunks (``chunk`` overrides:
    :func:`liger_core.rowwise.forward_chunk`; ``prefetch`` the chunked sweep's prefetch, ``full_chunks`` its
    masks: :func:`liger_core.rowwise.full_chunks`); ``block_m`` and ``num_warps`` override the launch too."""
    _check_inputs(x, weight, casting_mode, weight_name)
    check_eps(eps, eps_name)
    check_finite(offset, "offset")
    n_rows, n_cols, x_row_stride, x_col_stride = row_view(x, "x")
    has_weight = weight is not None
    y_dtype = output_dtype(x.dtype, weight.dtype if has_weight else None, casting_mode)
    launch = norm_forward_launch(
        _rms_norm_forward_kernel, _rms_norm_chunked_forward_kernel,
        (Buf("x"), x_row_stride, x_col_stride, Buf("weight" if has_weight else "x"),
         weight.strides[0] if has_weight else 0), (float(eps), float(offset)),
        (NewBuffer("y", x.shape, y_dtype), NewBuffer("rstd", x.shape[:-1], "float32")),
        {"CASTING": CASTING_MODES[casting_mode], "HAS_WEIGHT": has_weight, "HAS_OFFSET": offset != 0.0},
        n_rows, n_cols,
        tile_elements=_FORWARD_TILE, chunked=held_rows_for(_CHUNKED, x, weight), block_m=block_m,
        num_warps=num_warps, chunk=chunk, prefetch=prefetch, full_chunks_override=full_chunks)
    inputs = ("x", "weight") if has_weight else ("x",)
    return Plan(inputs=inputs, launches=(launch,), outputs=("y", "rstd"))


def backward_variant(tiles: BackwardTiles, prefetch: bool | None, reload: bool | None, *,
                     reload_wide: bool) -> tuple[bool, bool]:
    """``(prefetch, reload)`` of a norm backward's tiles (shared by RMSNorm, fused add+RMSNorm and LayerNorm):
    tiles up to ``_BACKWARD_TILE`` elements prefetch the next one; wider tiles (one 16384-column row) do not,
    and reload the tile after the row's reduction instead of holding it when the family asks (``reload_wide``).
    Column-split tiles never reload: their row sums come from the first launch, so nothing is held across one.
    H200, 4096 x 16384 bf16 (benchmarks/results/h200-2026-12-06-tune_wide_bwd.txt): LayerNorm's reload at 8 warps
    0.180 ms against 0.276 held (ptxas: its held tile spilled 244 bytes a thread); fused add+RMSNorm held at 16
    warps 0.197 against 0.261 reloaded (its held tile spills 64 bytes, which cost less than the second read).
    ``prefetch`` / ``reload`` override."""
    wide = tiles.block_m * tiles.block_n > _BACKWARD_TILE
    reload = wide and reload_wide if reload is None else reload
    return (not wide if prefetch is None else prefetch), reload and not tiles.split


@functools.lru_cache(maxsize=1024)
def backward_plan(dy: ArrayInfo, x: ArrayInfo, weight: ArrayInfo | None, *, offset: float = 0.0,
                  casting_mode: str = "llama", num_sms: int, in_place: bool = True, groups: int = 1,
                  programs_per_sm: int | None = None, block_m: int | None = None,
                  num_warps: int | None = None, prefetch: bool | None = None,
                  reload: bool | None = None, column_block: int | None = None,
                  lagged: bool | int | None = None) -> Plan:
    """Plan for ``dx, dw = rms_norm_backward(dy, x, weight, rstd)``.

    Inputs ``dy``, ``x``, ``rstd`` (and ``weight``); outputs ``dx`` (and ``dw`` with a weight). With
    ``in_place`` and dy of x's dtype, dx is written over dy. With ``groups`` > 1 the rows are ``groups`` equal
    blocks (a folded vmap batch) and dw has shape (groups, n_cols): one weight gradient per block.
    Rows over ``rowwise.MAX_HELD_COLUMNS`` are split into column blocks after a first launch that sums each
    row (:func:`liger_core.rowwise.backward_tiles`), or, from LAGGED_BACKWARD["from_cols"] columns in one group,
    take the lagged kernel, which reads dy and x once from DRAM (:func:`uses_lagged_backward`; ``lagged`` forces
    it, True or a segment width, or the column split, False). ``programs_per_sm``, ``block_m``, ``num_warps``,
    ``prefetch``, ``reload`` and ``column_block`` override the tuned launch configuration (for tuning and tests).
    """
    _check_inputs(x, weight, casting_mode)
    check_finite(offset, "offset")
    if tuple(dy.shape) != tuple(x.shape):
        raise ValueError(f"grad_output must have the shape of x {x.shape}, got {dy.shape}")
    check_float(dy, "grad_output")
    n_rows, n_cols, x_row_stride, x_col_stride = row_view(x, "x")
    _, _, dy_row_stride, dy_col_stride = row_view(dy, "grad_output")
    group_rows = rows_in_group(n_rows, groups)
    tiles = backward_tiles(group_rows, n_cols, _BACKWARD_TILE, num_sms, programs_per_sm or _BACKWARD_PROGRAMS_PER_SM,
                           ROW_DOTS_SWEEP, block_m=block_m, column_block=column_block)
    prefetch, reload = backward_variant(tiles, prefetch, reload, reload_wide=False)
    n_programs = tiles.grid.n_programs
    dx, dx_row_stride, dx_col_stride = gradient_output("dx", x.shape, x.dtype, "dy" if in_place else None, dy,
                                                       n_rows, n_cols)
    has_weight = weight is not None
    inputs = ("dy", "x", "weight", "rstd") if has_weight else ("dy", "x", "rstd")
    if uses_lagged_backward(n_cols, groups, lagged, column_block):
        launch, n_blocks = lagged_backward_launch(
            (Buf("dy"), dy_row_stride, dy_col_stride, Buf("rstd"), 0, 0, Buf("x"), x_row_stride, x_col_stride,
             Buf("weight" if has_weight else "x"), weight.strides[0] if has_weight else 0, Buf("rstd"),
             dx_row_stride, dx_col_stride, 0, 0),
            n_rows, n_cols, offset, ITEMSIZE[dy.dtype] + ITEMSIZE[x.dtype], (dx, NewBuffer("dr_unused", (1,), x.dtype)),
            {"CASTING": CASTING_MODES[casting_mode], "HAS_WEIGHT": has_weight, "HAS_OFFSET": offset != 0.0,
             "HAS_DH": False, "SEPARATE_DR": False}, lagged or True, weight.dtype if has_weight else None)
        if not has_weight:
            return Plan(inputs=inputs, launches=(launch,), outputs=("dx",))
        launches = (launch,) if n_blocks is None else (
            launch, sum_partials_launch("dw_partial", "dw", 1, n_blocks, n_cols, weight.dtype))
        return Plan(inputs=inputs, launches=launches, outputs=("dx", "dw"))
    partial_shape = (groups, n_programs, n_cols) if has_weight else (1,)
    main = Launch(
        kernel=rms_norm_backward_kernel,
        grid=(n_programs, groups, tiles.column_blocks),
        args=(Buf("dy"), dy_row_stride, dy_col_stride,
              Buf("rstd"), 0, 0,  # no incoming residual gradient (a pointer never written: no XLA copy)
              Buf("x"), x_row_stride, x_col_stride,
              Buf("weight" if has_weight else "x"), weight.strides[0] if has_weight else 0,
              Buf("rstd"), Buf("row_dot" if tiles.split else "rstd"), dx_row_stride, dx_col_stride, 0, 0,
              group_rows, n_cols, float(offset), tiles.grid.rows_per_program),
        outputs=(dx, NewBuffer("dr_unused", (1,), x.dtype), NewBuffer("dw_partial", partial_shape, "float32")),
        constexprs={"BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n, "CASTING": CASTING_MODES[casting_mode],
                    "HAS_WEIGHT": has_weight, "HAS_OFFSET": offset != 0.0, "HAS_DH": False, "SEPARATE_DR": False,
                    "PREFETCH": prefetch,
                    "RELOAD": reload, "ROW_DOTS": tiles.split},
        num_warps=num_warps or warps_for(tiles.block_m * tiles.block_n),
    )
    launches = [main]
    if tiles.split:
        launches.insert(0, row_dots_launch(("dy", dy_row_stride, dy_col_stride), ("x", x_row_stride, x_col_stride),
                                           weight, offset, n_rows, n_cols, tiles.row_sums))
    if not has_weight:
        return Plan(inputs=inputs, launches=tuple(launches), outputs=("dx",))
    launches.append(sum_partials_launch("dw_partial", "dw", groups, n_programs, n_cols, weight.dtype))
    return Plan(inputs=inputs, launches=tuple(launches), outputs=("dx", "dw"))


def uses_lagged_backward(n_cols: int, groups: int, lagged: bool | int | None, column_block: int | None) -> bool:
    """Whether a norm backward takes the lagged kernel: ``lagged`` (True or a segment width: yes; False: no),
    else by width (LAGGED_BACKWARD["from_cols"]+) for one group of rows when no ``column_block`` is forced."""
    if lagged is not None and lagged is not False:
        if groups != 1:
            raise ValueError(f"the lagged backward takes one group of rows, got groups={groups}")
        return True
    if lagged is False or column_block is not None or groups != 1:
        return False
    return LAGGED_BACKWARD["from_cols"] is not None and n_cols >= LAGGED_BACKWARD["from_cols"]


def lagged_backward_launch(lead_args: tuple, n_rows: int, n_cols: int, offset: float, bytes_per_column: int,
                           outputs: tuple, flags: dict, lagged: bool | int,
                           weight_dtype: str | None) -> tuple[Launch, int | None]:
    """``(launch, partial rows)`` of the lagged backward: ``lead_args`` are the kernel's arguments up to the dr
    strides, ``outputs`` its dx and dr buffers, ``bytes_per_column`` what a row's column of dy and x takes;
    ``lagged`` True or a segment width (a power of two >= 16, for tests and tuning). The scratch: the tickets,
    per-block counts and per-segment chain counts (zero-filled), the segments' row dots and the weight gradient's
    fp32 partials. Partial rows None: the launch writes ``dw`` itself (LAGGED_BACKWARD["chain_dw"]); else the
    caller sums that many rows of ``dw_partial`` (sum_partials_launch)."""
    segment = LAGGED_BACKWARD["segment"] if lagged is True else lagged
    if not isinstance(segment, int) or isinstance(segment, bool) or segment < 16 or segment & (segment - 1):
        raise ValueError(f"lagged must be None, a bool or a power of two >= 16 (a segment width), got {lagged!r}")
    segment = min(segment, next_power_of_2(n_cols))
    n_seg = cdiv(n_cols, segment)
    rows = LAGGED_BACKWARD["rows"]
    n_blocks = cdiv(n_rows, rows)
    lag = max(1, min(64, n_blocks, int(LAGGED_BACKWARD["lag_bytes"]) // (rows * n_cols * bytes_per_column)))
    has_weight = flags["HAS_WEIGHT"]
    chain = bool(LAGGED_BACKWARD["chain_dw"]) and has_weight
    if not has_weight:
        partials = NewBuffer("dw_partial", (1,), "float32")
    elif chain:
        partials = NewBuffer("dw_partial", (n_cols,), "float32")
    else:
        partials = NewBuffer("dw_partial", (1, n_blocks, n_cols), "float32")
    launch = Launch(
        kernel=_rms_norm_lagged_backward_kernel,
        grid=((n_blocks + lag) * 2 * n_seg,),
        args=lead_args + (n_rows, n_cols, float(offset)),
        outputs=outputs + (partials, NewBuffer("dw" if chain else "dw_unused", (n_cols,) if chain else (1,),
                                               weight_dtype if chain else "float32"),
                           NewBuffer("norm_sync", (1 + n_blocks + n_seg,), "int32", zeroed=True),
                           NewBuffer("norm_parts", (n_rows * n_seg,), "float32")),
        constexprs={"R": rows, "SEG": segment, "N_SEG": n_seg, "N_SEG_P2": next_power_of_2(n_seg), "LAG": lag,
                    "BLOCK": min(LAGGED_BACKWARD["block"], segment), "CHAIN_DW": chain, **flags},
        num_warps=LAGGED_BACKWARD["num_warps"],
    )
    return launch, (None if chain else n_blocks)


def row_dots_launch(dy: tuple, x: tuple, weight: ArrayInfo | None, offset: float, n_rows: int, n_cols: int,
                    sweep: ChunkedSweep) -> Launch:
    """The column-split backward's first launch (RMSNorm's and fused add+RMSNorm's): each row's
    mean(dy * (offset + w) * x * rstd) into a new fp32 buffer ``row_dot``. ``dy`` and ``x`` are (buffer name,
    row stride, column stride); the rows are swept as ``sweep`` says."""
    has_weight = weight is not None
    return Launch(
        kernel=_rms_norm_row_dots_kernel, grid=(n_rows,),
        args=(Buf(dy[0]), dy[1], dy[2], Buf(x[0]), x[1], x[2],
              Buf("weight" if has_weight else x[0]), weight.strides[0] if has_weight else 0,
              Buf("rstd"), n_cols, float(offset)),
        outputs=(NewBuffer("row_dot", (n_rows,), "float32"),),
        constexprs={"CHUNK": sweep.chunk, "HAS_WEIGHT": has_weight, "HAS_OFFSET": offset != 0.0,
                    "PREFETCH": sweep.prefetch,
                    "FULL_CHUNKS": full_chunks(n_cols, sweep.chunk)},
        num_warps=sweep.num_warps)

"""Fused residual add + RMSNorm: h = x + residual, y = rms_norm(h); returns (y, h) in one pass.

h has the promotion of x's and residual's dtypes (the sum is rounded to it once, as a half-precision add
would be); y follows :mod:`liger_core.rms_norm` with h in the role of x (same casting modes, same offset,
same output dtype). Forward saves rstd (fp32, one per row); the backward reads only h, never x or residual.
Rows over 32768 columns (``_CHUNKED.held_up_to``; 16384 with an fp32 operand) are swept in column chunks, twice:
h and its squares, then y from h.

Backward, one pass per row block: dh_total = d rms_norm / dh + dh_in (dh_in: the incoming gradient of the
returned h), and dx = dresidual = dh_total (rounded to x's and residual's dtypes); dw from per-program fp32
partial sums reduced in a fixed order by :mod:`liger_core.reduce` (bitwise deterministic).
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from .launch import (
    ITEMSIZE, ArrayInfo, Buf, Launch, NewBuffer, Plan, check_eps, check_finite, check_float, check_same_shape,
    promote, warps_for,
)
from .reduce import sum_partials_launch
from .rms_norm import (
    CASTING_MODES, ROW_DOTS_SWEEP, _check_inputs, backward_variant, chunk_mask, chunked_rows, first_sweep_start,
    first_sweep_step, lagged_backward_launch, load_chunk, load_scale, normalize_and_scale, output_dtype,
    rms_norm_backward_kernel, row_dots_launch, uses_lagged_backward,
)
from .rowwise import (
    ChunkedSweep, backward_tiles, gradient_output, held_rows_for, norm_forward_launch, row_view, rows_in_group,
)
from .tl_math import aligned, cast, chunk_columns, round_to

# Launch configuration. Forward as RMSNorm's tuned forward: ~4k elements of x per program. Backward as RMSNorm's
# tuned backward: one persistent program per SM (16 warps at ~110 registers fill an SM's register file),
# 8k-element tiles with the next tile prefetched (not yet swept on the H200 for this kernel itself; the plans
# take overrides for tuning).
_FORWARD_TILE = 4096
# The chunked forward (rows over held_up_to columns): 16384-column chunks at 32 warps, no prefetch (45
# registers). H200 bf16 (benchmarks/results/h200-2026-12-06-tune_wide_fwd.txt): 4096 x 65536 0.546 ms against 0.595
# for 8192-column chunks at 16 warps. Rows up to 32768 columns are held (16 warps, 128 registers, no spills; only
# with 2-byte x, residual and weight: rowwise.held_rows_for):
# 4096 x 32768 H200 0.260 ms against 0.272 chunked, H100 0.356 both; 4096 x 20496 H100 0.224 against 0.242
# (benchmarks/results/h100-80gb-hbm3-2026-12-07-tune_rms_fwd.txt).
_CHUNKED = ChunkedSweep(chunk=16384, num_warps=32, prefetch=False, held_up_to=32768)
_BACKWARD_TILE = 8192
_BACKWARD_PROGRAMS_PER_SM = 1


@triton.jit
def _fused_add_rms_norm_forward_kernel(
    X, x_row_stride, x_col_stride,
    R, r_row_stride, r_col_stride,
    W, w_stride,
    n_rows, n_cols, eps, offset,
    Y, H, RSTD,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CASTING: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    HAS_OFFSET: tl.constexpr, ALIGN: tl.constexpr,
):
    x_row_stride = aligned(x_row_stride, ALIGN)
    r_row_stride = aligned(r_row_stride, ALIGN)
    n_cols = aligned(n_cols, ALIGN)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    x = tl.load(X + rows[:, None] * x_row_stride + cols[None, :] * x_col_stride, mask=mask, other=0.0)
    r = tl.load(R + rows[:, None] * r_row_stride + cols[None, :] * r_col_stride, mask=mask, other=0.0)
    scale = load_scale(W, w_stride, cols, col_mask, offset, BLOCK_N, HAS_WEIGHT, HAS_OFFSET)
    h_dtype = H.dtype.element_ty
    # The fp32 sum of two half-precision values rounded once to h's dtype is the half-precision sum.
    hf = round_to(x.to(tl.float32) + r.to(tl.float32), h_dtype)
    tl.store(H + rows[:, None] * n_cols + cols[None, :], cast(hf, h_dtype), mask=mask)
    rstd = tl.rsqrt(tl.sum(hf * hf, axis=1) / n_cols + eps)
    tl.store(RSTD + rows, rstd, mask=row_mask)

    # The rounding points of liger_core.rms_norm's casting modes, with h in the role of x.
    y_dtype = Y.dtype.element_ty
    y = normalize_and_scale(hf, rstd, scale, h_dtype, y_dtype, CASTING, HAS_WEIGHT)
    tl.store(Y + rows[:, None] * n_cols + cols[None, :], cast(y, y_dtype), mask=mask)


@triton.jit
def _fused_add_rms_norm_chunked_forward_kernel(
    X, x_row_stride, x_col_stride,
    R, r_row_stride, r_col_stride,
    W, w_stride,
    n_rows, n_cols, eps, offset,
    Y, H, RSTD,
    CHUNK: tl.constexpr, ROWS: tl.constexpr, CASTING: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    HAS_OFFSET: tl.constexpr, PREFETCH: tl.constexpr, FULL_CHUNKS: tl.constexpr, ALIGN: tl.constexpr,
):
    """ROWS rows a program (w read once for all), for rows too wide to hold in registers
    (``_CHUNKED.held_up_to``): a first sweep over CHUNK-column chunks writes h and sums its squares (PREFETCH:
    with the next chunk's loads in flight, as RMSNorm's), a second reads h back (from L2) and writes y."""
    x_row_stride = aligned(x_row_stride, ALIGN)
    r_row_stride = aligned(r_row_stride, ALIGN)
    n_cols = aligned(n_cols, ALIGN)
    rows = chunked_rows(n_rows, ROWS)
    h_rows = H + rows[:, None] * n_cols
    h_dtype = H.dtype.element_ty
    n_chunks = tl.cdiv(n_cols, CHUNK)
    squares = tl.zeros((ROWS, CHUNK), dtype=tl.float32)
    x_rows = X + rows[:, None] * x_row_stride
    r_rows = R + rows[:, None] * r_row_stride
    x_next = first_sweep_start(x_rows, x_col_stride, n_chunks, n_cols, CHUNK, PREFETCH, FULL_CHUNKS)
    r_next = first_sweep_start(r_rows, r_col_stride, n_chunks, n_cols, CHUNK, PREFETCH, FULL_CHUNKS)
    for i in range(n_chunks):
        x, x_next = first_sweep_step(x_rows, x_col_stride, i, n_chunks, n_cols, x_next, CHUNK, PREFETCH, FULL_CHUNKS)
        r, r_next = first_sweep_step(r_rows, r_col_stride, i, n_chunks, n_cols, r_next, CHUNK, PREFETCH, FULL_CHUNKS)
        cols = chunk_columns(i, n_chunks, CHUNK, False)
        mask = chunk_mask(cols, n_cols, FULL_CHUNKS)[None, :]
        hf = round_to(x.to(tl.float32) + r.to(tl.float32), h_dtype)
        tl.store(h_rows + cols[None, :], cast(hf, h_dtype), mask=mask)
        squares += hf * hf
    rstd = tl.rsqrt(tl.sum(squares, axis=1) / n_cols + eps)
    tl.store(RSTD + rows, rstd)
    tl.debug_barrier()  # the second sweep reads h back: the program's own stores, possibly by other threads
    y_dtype = Y.dtype.element_ty
    for i in range(n_chunks):
        cols = chunk_columns(i, n_chunks, CHUNK, True)
        col_mask = chunk_mask(cols, n_cols, FULL_CHUNKS)
        hf = load_chunk(h_rows, 1, i, n_chunks, n_cols, CHUNK, True, FULL_CHUNKS).to(tl.float32)
        scale = load_scale(W, w_stride, cols, col_mask, offset, CHUNK, HAS_WEIGHT, HAS_OFFSET)
        y = normalize_and_scale(hf, rstd, scale, h_dtype, y_dtype, CASTING, HAS_WEIGHT)
        tl.store(Y + rows[:, None] * n_cols + cols[None, :], cast(y, y_dtype), mask=col_mask[None, :])


# ---------------------------------------------------------------------------------------------------------
# Launch logic


def _check_pair(x: ArrayInfo, residual: ArrayInfo, weight: ArrayInfo | None, casting_mode: str,
                weight_name: str) -> None:
    _check_inputs(x, weight, casting_mode, weight_name)
    check_float(residual, "residual")
    check_same_shape(x, "x", residual, "residual")


@functools.lru_cache(maxsize=1024)  # plans are pure functions of hashable shapes: build each once
def forward_plan(x: ArrayInfo, residual: ArrayInfo, weight: ArrayInfo | None, *, eps: float,
                 offset: float = 0.0, casting_mode: str = "llama", weight_name: str = "weight",
                 block_m: int | None = None, num_warps: int | None = None, eps_name: str = "eps",
                 chunk: int | None = None, prefetch: bool | None = None, full_chunks: bool | None = None) -> Plan:
    """Plan for ``y, h, rstd = fused_add_rms_norm(x, residual, weight)``.

    Inputs ``x``, ``residual`` (and ``weight``); outputs ``y``, ``h`` (= x + residual) and ``rstd``.
    ``weight_name`` and ``eps_name`` are the weight's and epsilon's names in the caller's API, for error
    messages. Rows wider than 32768 columns (16384 with an fp32 operand) are swept in chunks (``chunk``, ``prefetch``,
    ``full_chunks``, ``block_m`` and ``num_warps`` override the launch: :func:`liger_core.rowwise.forward_chunk`,
    :func:`~.rowwise.full_chunks`)."""
    _check_pair(x, residual, weight, casting_mode, weight_name)
    check_eps(eps, eps_name)
    check_finite(offset, "offset")
    n_rows, n_cols, x_row_stride, x_col_stride = row_view(x, "x")
    _, _, r_row_stride, r_col_stride = row_view(residual, "residual")
    has_weight = weight is not None
    h_dtype = promote(x.dtype, residual.dtype)
    y_dtype = output_dtype(h_dtype, weight.dtype if has_weight else None, casting_mode)
    launch = norm_forward_launch(
        _fused_add_rms_norm_forward_kernel, _fused_add_rms_norm_chunked_forward_kernel,
        (Buf("x"), x_row_stride, x_col_stride, Buf("residual"), r_row_stride, r_col_stride,
         Buf("weight" if has_weight else "x"), weight.strides[0] if has_weight else 0), (float(eps), float(offset)),
        (NewBuffer("y", x.shape, y_dtype), NewBuffer("h", x.shape, h_dtype),
         NewBuffer("rstd", x.shape[:-1], "float32")),
        {"CASTING": CASTING_MODES[casting_mode], "HAS_WEIGHT": has_weight, "HAS_OFFSET": offset != 0.0},
        n_rows, n_cols,
        tile_elements=_FORWARD_TILE, chunked=held_rows_for(_CHUNKED, x, residual, weight), block_m=block_m,
        num_warps=num_warps, chunk=chunk, prefetch=prefetch, full_chunks_override=full_chunks)
    inputs = ("x", "residual", "weight") if has_weight else ("x", "residual")
    return Plan(inputs=inputs, launches=(launch,), outputs=("y", "h", "rstd"))


@functools.lru_cache(maxsize=1024)
def backward_plan(dy: ArrayInfo, dh: ArrayInfo | None, h: ArrayInfo, weight: ArrayInfo | None, *,
                  x_dtype: str, residual_dtype: str, offset: float = 0.0, casting_mode: str = "llama",
                  num_sms: int, in_place: bool = True, in_place_residual: bool | None = None,
                  separate_residual_grad: bool = True,
                  groups: int = 1, programs_per_sm: int | None = None, block_m: int | None = None,
                  num_warps: int | None = None, prefetch: bool | None = None,
                  reload: bool | None = None, column_block: int | None = None,
                  lagged: bool | int | None = None) -> Plan:
    """Plan for ``dx, dresidual, dw = fused_add_rms_norm_backward(dy, dh, h, weight, rstd)``.

    Inputs ``dy`` (gradient of y), ``dh`` (gradient of the returned h; None when it has none), ``h``, ``rstd``
    (and ``weight``). Outputs ``dx`` (x's dtype), then ``dresidual`` (residual's dtype) when
    ``separate_residual_grad`` (else dresidual is dx: a caller may only skip it when the dtypes agree), then
    ``dw`` with a weight. With ``in_place``, dx is written over dy, and with ``in_place_residual`` (default:
    ``in_place``) dresidual over dh, where the dtypes agree and the gradient is dense. ``groups`` as in
    :func:`liger_core.rms_norm.backward_plan`; ``programs_per_sm``, ``block_m``, ``num_warps``, ``prefetch``,
    ``reload`` and ``column_block`` override the launch configuration (for tuning and tests;
    :func:`liger_core.rms_norm.backward_variant`, :func:`liger_core.rowwise.backward_tiles`); ``lagged`` chooses
    the kernel of wide rows (:func:`liger_core.rms_norm.uses_lagged_backward`).
    """
    _check_inputs(h, weight, casting_mode)
    check_finite(offset, "offset")
    if tuple(dy.shape) != tuple(h.shape):
        raise ValueError(f"grad_output must have the shape of x {h.shape}, got {dy.shape}")
    check_float(dy, "grad_output")
    if dh is not None:
        if tuple(dh.shape) != tuple(h.shape):
            raise ValueError(f"grad_residual must have the shape of x {h.shape}, got {dh.shape}")
        check_float(dh, "grad_residual")
    if not separate_residual_grad and x_dtype != residual_dtype:
        raise ValueError(f"x ({x_dtype}) and residual ({residual_dtype}) need separate gradients")
    n_rows, n_cols, h_row_stride, h_col_stride = row_view(h, "h")
    _, _, dy_row_stride, dy_col_stride = row_view(dy, "grad_output")
    dh_row_stride, dh_col_stride = row_view(dh, "grad_residual")[2:] if dh is not None else (0, 0)
    group_rows = rows_in_group(n_rows, groups)
    tiles = backward_tiles(group_rows, n_cols, _BACKWARD_TILE, num_sms, programs_per_sm or _BACKWARD_PROGRAMS_PER_SM,
                           ROW_DOTS_SWEEP, block_m=block_m, column_block=column_block)
    prefetch, reload = backward_variant(tiles, prefetch, reload, reload_wide=False)
    n_programs = tiles.grid.n_programs
    dx, *dx_strides = gradient_output("dx", h.shape, x_dtype, "dy" if in_place else None, dy, n_rows, n_cols)
    if separate_residual_grad:
        over_dh = in_place if in_place_residual is None else in_place_residual
        dr, *dr_strides = gradient_output("dresidual", h.shape, residual_dtype, "dh" if over_dh else None, dh,
                                          n_rows, n_cols)
    else:
        dr, dr_strides = NewBuffer("dresidual", (1,), residual_dtype), (0, 0)
    has_weight = weight is not None
    inputs = ("dy",) + (("dh",) if dh is not None else ()) + ("h",) + (("weight",) if has_weight else ()) + ("rstd",)
    outputs = ["dx"] + (["dresidual"] if separate_residual_grad else [])
    if uses_lagged_backward(n_cols, groups, lagged, column_block):
        launch, n_blocks = lagged_backward_launch(
            (Buf("dy"), dy_row_stride, dy_col_stride, Buf("dh" if dh is not None else "rstd"), dh_row_stride,
             dh_col_stride, Buf("h"), h_row_stride, h_col_stride, Buf("weight" if has_weight else "h"),
             weight.strides[0] if has_weight else 0, Buf("rstd"), *dx_strides, *dr_strides),
            n_rows, n_cols, offset, ITEMSIZE[dy.dtype] + ITEMSIZE[h.dtype], (dx, dr),
            {"CASTING": CASTING_MODES[casting_mode], "HAS_WEIGHT": has_weight, "HAS_OFFSET": offset != 0.0,
             "HAS_DH": dh is not None, "SEPARATE_DR": separate_residual_grad}, lagged or True,
            weight.dtype if has_weight else None)
        launches = [launch]
        if has_weight and n_blocks is not None:
            launches.append(sum_partials_launch("dw_partial", "dw", 1, n_blocks, n_cols, weight.dtype))
        return Plan(inputs=inputs, launches=tuple(launches), outputs=tuple(outputs + ["dw"] * has_weight))
    main = Launch(
        kernel=rms_norm_backward_kernel,
        grid=(n_programs, groups, tiles.column_blocks),
        args=(Buf("dy"), dy_row_stride, dy_col_stride,
              Buf("dh" if dh is not None else "rstd"), dh_row_stride, dh_col_stride,  # rstd: never written
              Buf("h"), h_row_stride, h_col_stride,
              Buf("weight" if has_weight else "h"), weight.strides[0] if has_weight else 0,
              Buf("rstd"), Buf("row_dot" if tiles.split else "rstd"), *dx_strides, *dr_strides,
              group_rows, n_cols, float(offset), tiles.grid.rows_per_program),
        outputs=(dx, dr, NewBuffer("dw_partial", (groups, n_programs, n_cols) if has_weight else (1,), "float32")),
        constexprs={"BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n, "CASTING": CASTING_MODES[casting_mode],
                    "HAS_WEIGHT": has_weight, "HAS_OFFSET": offset != 0.0, "HAS_DH": dh is not None,
                    "SEPARATE_DR": separate_residual_grad,
                    "PREFETCH": prefetch, "RELOAD": reload, "ROW_DOTS": tiles.split},
        num_warps=num_warps or warps_for(tiles.block_m * tiles.block_n),
    )
    launches = [main]
    if tiles.split:  # the row sums read dy and h before the main launch may write dx over dy
        launches.insert(0, row_dots_launch(("dy", dy_row_stride, dy_col_stride), ("h", h_row_stride, h_col_stride),
                                           weight, offset, n_rows, n_cols, tiles.row_sums))
    if has_weight:
        launches.append(sum_partials_launch("dw_partial", "dw", groups, n_programs, n_cols, weight.dtype))
        outputs.append("dw")
    return Plan(inputs=inputs, launches=tuple(launches), outputs=tuple(outputs))

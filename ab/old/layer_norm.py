"""LayerNorm: y = (x - mean) * rstd * w + b, rstd = 1 / sqrt(var + eps), over the last axis.

Numerics (those of ``torch.nn.LayerNorm`` and ``flax.nnx.LayerNorm``): the statistics and the affine map are
computed in fp32 and the output is rounded once, to the output dtype. The variance is the two-pass
``mean((x - mean)^2)`` of the row held in registers (never negative, no cancellation), with the mean refined
once by the mean of the centered row.

Forward saves mean and rstd (fp32, one per row). Backward: one pass per row block gives dx (optionally written
over dy) and per-program fp32 partial sums of dw and db, each reduced in a fixed order by
:mod:`liger_core.reduce` (no atomics: bitwise deterministic). Weight and bias are both optional.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from .tl_math import aligned, cast
from .launch import (
    FLOAT_DTYPES, ArrayInfo, Buf, Launch, NewBuffer, Plan, cdiv, check_eps, check_float, check_nonempty,
    next_power_of_2, promote, warps_for,
)
from .reduce import sum_partials_launch
from .rms_norm import load_backward_rows
from .rowwise import gradient_output, persistent_grid, row_view, rows_in_group, tile

# Launch configuration. Forward as RMSNorm's tuned forward: ~4k elements of x per program. Backward as RMSNorm's
# tuned backward: one persistent program per SM (16 warps x 117 registers fill an SM's register file: a second
# program cannot be resident), 8k-element tiles with the next tile prefetched (not yet swept on the H200 for
# LayerNorm itself; the plans take overrides for tuning).
_FORWARD_TILE = 4096
_BACKWARD_TILE = 8192
_BACKWARD_PROGRAMS_PER_SM = 1


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
    # weight and bias loaded with the row, before its reductions (as liger_core.rms_norm.load_scale)
    if HAS_WEIGHT:
        w = tl.load(W + cols * w_stride, mask=col_mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b = tl.load(B + cols * b_stride, mask=col_mask, other=0.0).to(tl.float32)
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
    if HAS_WEIGHT:
        y = y * w[None, :]
    if HAS_BIAS:
        y = y + b[None, :]
    tl.store(Y + rows[:, None] * n_cols + cols[None, :], cast(y, Y.dtype.element_ty), mask=mask)


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
    MEAN, RSTD,
    dx_row_stride, dx_col_stride,
    rows_per_group, n_cols, rows_per_program,
    DX, DW_PARTIAL, DB_PARTIAL,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    PREFETCH: tl.constexpr, ALIGN: tl.constexpr,
):
    """Persistent: each program walks ``rows_per_program`` rows of its group in BLOCK_M-row tiles. With
    PREFETCH the next tile's loads are issued before the current tile is computed (as RMSNorm's backward)."""
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
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    if HAS_WEIGHT:
        w = tl.load(W + cols * w_stride, mask=col_mask, other=0.0).to(tl.float32)
        dw_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if HAS_BIAS:
        db_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PREFETCH:
        next_dy, next_x, next_mean, next_rstd = _load_backward_rows(
            DY, dy_row_stride, dy_col_stride, X, x_row_stride, x_col_stride, MEAN, RSTD,
            first_row, row_begin + tl.arange(0, BLOCK_M), row_end, cols, col_mask)
    for start in range(0, rows_per_program, BLOCK_M):
        local = row_begin + start + tl.arange(0, BLOCK_M)
        if PREFETCH:
            dy, x, mean, rstd = next_dy, next_x, next_mean, next_rstd
            next_dy, next_x, next_mean, next_rstd = _load_backward_rows(
                DY, dy_row_stride, dy_col_stride, X, x_row_stride, x_col_stride, MEAN, RSTD,
                first_row, local + BLOCK_M, row_end, cols, col_mask)
        else:
            dy, x, mean, rstd = _load_backward_rows(DY, dy_row_stride, dy_col_stride, X, x_row_stride,
                                                    x_col_stride, MEAN, RSTD, first_row, local, row_end, cols,
                                                    col_mask)
        rows = first_row + local.to(tl.int64)
        mask = (local < row_end)[:, None] & col_mask[None, :]
        dy = dy.to(tl.float32)
        # no mask: a masked element has dy = 0 (so dxhat = 0 and it adds nothing below) and is not stored
        xhat = (x.to(tl.float32) - mean[:, None]) * rstd[:, None]
        if HAS_WEIGHT:
            dw_acc += dy * xhat
            dxhat = dy * w[None, :]
        else:
            dxhat = dy
        if HAS_BIAS:
            db_acc += dy
        # dx = (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)) * rstd, as two FMAs per element: the row
        # constants take rstd in first
        c_dot = tl.sum(dxhat * xhat, axis=1) / n_cols * rstd
        c_mean = tl.sum(dxhat, axis=1) / n_cols * rstd
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
                 block_m: int | None = None, num_warps: int | None = None, eps_name: str = "eps") -> Plan:
    """Plan for ``y, mean, rstd = layer_norm(x, weight, bias)``; inputs ``x`` (``weight``, ``bias`` when given).

    ``out_dtype`` is y's dtype (default: x's, as in torch). ``weight_name`` / ``bias_name`` name the parameters
    as the caller's API does, for error messages (``eps_name`` the epsilon)."""
    _check_inputs(x, weight, bias, weight_name, bias_name)
    check_eps(eps, eps_name)
    y_dtype = x.dtype if out_dtype is None else out_dtype
    if y_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be one of {FLOAT_DTYPES}, got {y_dtype}")
    n_rows, n_cols, x_row_stride, x_col_stride = row_view(x, "x")
    block_m_default, block_n = tile(n_cols, n_rows, _FORWARD_TILE)
    block_m = block_m or block_m_default
    has_weight, has_bias = weight is not None, bias is not None
    launch = Launch(
        kernel=_layer_norm_forward_kernel,
        grid=(cdiv(n_rows, block_m),),
        args=(Buf("x"), x_row_stride, x_col_stride,
              Buf("weight" if has_weight else "x"), weight.strides[0] if has_weight else 0,
              Buf("bias" if has_bias else "x"), bias.strides[0] if has_bias else 0,
              n_rows, n_cols, float(eps)),
        outputs=(NewBuffer("y", x.shape, y_dtype), NewBuffer("mean", x.shape[:-1], "float32"),
                 NewBuffer("rstd", x.shape[:-1], "float32")),
        constexprs={"BLOCK_M": block_m, "BLOCK_N": block_n, "HAS_WEIGHT": has_weight, "HAS_BIAS": has_bias,
                    "FULL_ROW": n_cols == block_n},
        num_warps=num_warps or min(8, max(4, next_power_of_2(block_m * block_n // 1024))),
    )
    inputs = ("x",) + (("weight",) if has_weight else ()) + (("bias",) if has_bias else ())
    return Plan(inputs=inputs, launches=(launch,), outputs=("y", "mean", "rstd"))


@functools.lru_cache(maxsize=1024)
def backward_plan(dy: ArrayInfo, x: ArrayInfo, weight: ArrayInfo | None, bias: ArrayInfo | None, *,
                  num_sms: int, in_place: bool = True, groups: int = 1, programs_per_sm: int | None = None,
                  block_m: int | None = None, num_warps: int | None = None, prefetch: bool | None = None) -> Plan:
    """Plan for ``dx, dw, db = layer_norm_backward(dy, x, weight, mean, rstd)``.

    Inputs ``dy``, ``x``, ``mean``, ``rstd`` (and ``weight`` when given; the bias itself is not read, only its
    dtype); outputs ``dx``, then ``dw`` with a weight and ``db`` with a bias. With ``in_place`` and dy of x's
    dtype, dx is written over dy. With ``groups`` > 1 the rows are ``groups`` equal blocks (a folded vmap batch)
    and dw / db have shape (groups, n_cols): one parameter gradient per block. ``programs_per_sm``,
    ``block_m``, ``num_warps`` and ``prefetch`` override the launch configuration (for tuning).
    """
    _check_inputs(x, weight, bias, "weight", "bias")
    if tuple(dy.shape) != tuple(x.shape):
        raise ValueError(f"grad_output must have the shape of x {x.shape}, got {dy.shape}")
    check_float(dy, "grad_output")
    n_rows, n_cols, x_row_stride, x_col_stride = row_view(x, "x")
    _, _, dy_row_stride, dy_col_stride = row_view(dy, "grad_output")
    group_rows = rows_in_group(n_rows, groups)
    block_m_default, block_n = tile(n_cols, group_rows, _BACKWARD_TILE)
    block_m = block_m or block_m_default
    if prefetch is None:
        prefetch = block_m * block_n <= _BACKWARD_TILE
    grid = persistent_grid(group_rows, block_m, num_sms, programs_per_sm or _BACKWARD_PROGRAMS_PER_SM)
    n_programs = grid.n_programs
    dx, dx_row_stride, dx_col_stride = gradient_output("dx", x.shape, x.dtype, "dy" if in_place else None, dy,
                                                       n_rows, n_cols)
    has_weight, has_bias = weight is not None, bias is not None
    partial_shape = (groups, n_programs, n_cols)
    main = Launch(
        kernel=_layer_norm_backward_kernel,
        grid=(n_programs, groups),
        args=(Buf("dy"), dy_row_stride, dy_col_stride, Buf("x"), x_row_stride, x_col_stride,
              Buf("weight" if has_weight else "x"), weight.strides[0] if has_weight else 0,
              Buf("mean"), Buf("rstd"), dx_row_stride, dx_col_stride,
              group_rows, n_cols, grid.rows_per_program),
        outputs=(dx, NewBuffer("dw_partial", partial_shape if has_weight else (1,), "float32"),
                 NewBuffer("db_partial", partial_shape if has_bias else (1,), "float32")),
        constexprs={"BLOCK_M": block_m, "BLOCK_N": block_n, "HAS_WEIGHT": has_weight, "HAS_BIAS": has_bias,
                    "PREFETCH": prefetch},
        num_warps=num_warps or warps_for(block_m * block_n),
    )
    inputs = ("dy", "x") + (("weight",) if has_weight else ()) + ("mean", "rstd")
    launches, outputs = [main], ["dx"]
    if has_weight:
        launches.append(sum_partials_launch("dw_partial", "dw", groups, n_programs, n_cols, weight.dtype))
        outputs.append("dw")
    if has_bias:
        launches.append(sum_partials_launch("db_partial", "db", groups, n_programs, n_cols, bias.dtype))
        outputs.append("db")
    return Plan(inputs=inputs, launches=tuple(launches), outputs=tuple(outputs))

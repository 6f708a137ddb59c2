"""KL divergence as ``torch.nn.functional.kl_div``: ``input`` holds log-probabilities, ``target``
probabilities (or log-probabilities with ``log_target``); pointwise

    log_target=False: target * (log(target) - input)   (0 where target == 0, as torch's xlogy)
    log_target=True:  exp(target) * (target - input)

reduced by ``none`` (pointwise, input's shape), ``sum``, ``mean`` (over all elements) or ``batchmean`` (sum
divided by ``input.shape[0]``, the mathematically correct KL for a batch of distributions).

Forward: one program per row sums the pointwise terms in fp32 over blocks of the last axis (or writes them, for
``none``); the per-row sums are added in a fixed order (:mod:`liger_core.reduce`). Backward: elementwise
``d input = -target * scale * grad`` (``-exp(target)`` with ``log_target``). Only ``input`` is differentiated:
the target (a teacher's distribution, in distillation) gets no gradient.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from .tl_math import aligned, cast
from .launch import (
    ArrayInfo, Buf, Launch, NewBuffer, Plan, cdiv, check_float, check_nonempty, check_same_shape, collapse_rows,
    next_power_of_2, promote, sweep_block_and_warps, warps_for,
)
from .reduce import sum_partials_launch

REDUCTIONS = ("none", "sum", "mean", "batchmean")
_BACKWARD_BLOCK = 4096  # elements per program of the (elementwise) backward


@triton.jit
def _kl_div_forward_kernel(
    X, x_row_stride, x_col_stride,
    Y, y_row_stride, y_col_stride,
    n_cols, scale,
    OUT,
    BLOCK: tl.constexpr, LOG_TARGET: tl.constexpr, ELEMENTWISE: tl.constexpr, ALIGN: tl.constexpr,
):
    x_row_stride = aligned(x_row_stride, ALIGN)
    y_row_stride = aligned(y_row_stride, ALIGN)
    n_cols = aligned(n_cols, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + offsets
        mask = cols < n_cols
        x = tl.load(X + row * x_row_stride + cols * x_col_stride, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(Y + row * y_row_stride + cols * y_col_stride, mask=mask, other=0.0).to(tl.float32)
        if LOG_TARGET:
            loss = tl.exp(y) * (y - x)
        else:
            loss = tl.where(y == 0.0, 0.0, y * (tl.log(tl.where(y == 0.0, 1.0, y)) - x))
        loss = tl.where(mask, loss, 0.0)
        if ELEMENTWISE:
            tl.store(OUT + row * n_cols + cols, cast(loss, OUT.dtype.element_ty), mask=mask)
        else:
            acc += loss
    if not ELEMENTWISE:
        tl.store(OUT + row, tl.sum(acc, axis=0) * scale)


@triton.jit
def _kl_div_backward_kernel(
    Y, y_row_stride, y_col_stride,
    G, g_row_stride, g_col_stride,
    n_cols, scale,
    DX,
    BLOCK: tl.constexpr, LOG_TARGET: tl.constexpr, ALIGN: tl.constexpr,
):
    y_row_stride = aligned(y_row_stride, ALIGN)
    g_row_stride = aligned(g_row_stride, ALIGN)
    n_cols = aligned(n_cols, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    y = tl.load(Y + row * y_row_stride + cols * y_col_stride, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + row * g_row_stride + cols * g_col_stride, mask=mask, other=0.0).to(tl.float32)
    if LOG_TARGET:
        y = tl.exp(y)
    tl.store(DX + row * n_cols + cols, cast(-y * g * scale, DX.dtype.element_ty), mask=mask)


def _rows(info: ArrayInfo, name: str):
    view = collapse_rows(info)
    if view is None:
        raise ValueError(f"{name}'s leading dimensions cannot be folded into rows by strides "
                         f"(shape {info.shape}, strides {info.strides}); make it contiguous first")
    return view


def check_inputs(x: ArrayInfo, target: ArrayInfo, reduction: str, x_name: str = "input",
                 target_name: str = "target") -> None:
    if not isinstance(reduction, str) or reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    check_nonempty(x, x_name)
    check_float(x, x_name)
    check_float(target, target_name)
    check_same_shape(x, x_name, target, target_name)


def _scale(x: ArrayInfo, reduction: str) -> float:
    if reduction == "mean":
        return 1.0 / x.numel
    if reduction == "batchmean":
        return 1.0 / x.shape[0]
    return 1.0


def output_dtype(x: ArrayInfo, target: ArrayInfo) -> str:
    return promote(x.dtype, target.dtype)


@functools.lru_cache(maxsize=1024)  # plans are pure functions of hashable arguments
def forward_plan(x: ArrayInfo, target: ArrayInfo, *, reduction: str = "mean", log_target: bool = False,
                 x_name: str = "input", target_name: str = "target") -> Plan:
    """Plan for the loss: inputs ``input``, ``target``; output ``loss`` (input's shape for none, else ())."""
    check_inputs(x, target, reduction, x_name, target_name)
    n_rows, n_cols, x_row_stride, x_col_stride = _rows(x, x_name)
    _, _, y_row_stride, y_col_stride = _rows(target, target_name)
    block, warps = sweep_block_and_warps(n_cols)
    dtype = output_dtype(x, target)
    elementwise = reduction == "none"
    out = NewBuffer("loss" if elementwise else "loss_rows", x.shape if elementwise else (n_rows,),
                    dtype if elementwise else "float32")
    main = Launch(
        kernel=_kl_div_forward_kernel,
        grid=(n_rows,),
        args=(Buf("input"), x_row_stride, x_col_stride, Buf("target"), y_row_stride, y_col_stride,
              n_cols, _scale(x, reduction)),
        outputs=(out,),
        constexprs={"BLOCK": block, "LOG_TARGET": bool(log_target), "ELEMENTWISE": elementwise},
        num_warps=warps,
    )
    launches = [main]
    if not elementwise:
        launches.append(sum_partials_launch("loss_rows", "loss", 1, n_rows, 1, dtype, out_shape=()))
    return Plan(inputs=("input", "target"), launches=tuple(launches), outputs=("loss",))


@functools.lru_cache(maxsize=1024)  # plans are pure functions of hashable arguments
def row_sums_plan(x: ArrayInfo, target: ArrayInfo, *, log_target: bool = False) -> Plan:
    """The ``sum`` forward up to its fp32 per-row sums ``loss_rows`` (for a row-sharded loss whose shards add
    them up themselves)."""
    plan = forward_plan(x, target, reduction="sum", log_target=log_target)
    return Plan(inputs=plan.inputs, launches=plan.launches[:1], outputs=("loss_rows",))


@functools.lru_cache(maxsize=1024)  # plans are pure functions of hashable arguments
def backward_plan(grad_output: ArrayInfo, x: ArrayInfo, target: ArrayInfo, *, reduction: str,
                  log_target: bool = False) -> Plan:
    """Plan for ``d input``: inputs ``grad_output`` (a scalar, or input's shape for none) and ``target``;
    output ``dinput`` (input's shape and dtype)."""
    check_inputs(x, target, reduction)
    check_float(grad_output, "grad_output")
    n_rows, n_cols, y_row_stride, y_col_stride = _rows(target, "target")
    if reduction == "none":
        check_same_shape(x, "input", grad_output, "grad_output")
        _, _, g_row_stride, g_col_stride = _rows(grad_output, "grad_output")
    else:
        if grad_output.numel != 1:
            raise ValueError(f"grad_output must be a scalar for reduction={reduction!r}, got {grad_output.shape}")
        g_row_stride = g_col_stride = 0
    block = min(_BACKWARD_BLOCK, next_power_of_2(n_cols))
    launch = Launch(
        kernel=_kl_div_backward_kernel,
        grid=(n_rows, cdiv(n_cols, block)),
        args=(Buf("target"), y_row_stride, y_col_stride, Buf("grad_output"), g_row_stride, g_col_stride,
              n_cols, _scale(x, reduction)),
        outputs=(NewBuffer("dinput", x.shape, x.dtype),),
        constexprs={"BLOCK": block, "LOG_TARGET": bool(log_target)},
        num_warps=warps_for(block, max_warps=8),
    )
    return Plan(inputs=("grad_output", "target"), launches=(launch,), outputs=("dinput",))

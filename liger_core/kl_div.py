"""KL divergence as ``torch.nn.functional.kl_div``: ``input`` holds log-probabilities, ``target``
probabilities (or log-probabilities with ``log_target``); pointwise

    log_target=False: target * (log(target) - input)   (0 where target == 0, as torch's xlogy)
    log_target=True:  exp(target) * (target - input)

reduced by ``none`` (pointwise, input's shape), ``sum``, ``mean`` (over all elements) or ``batchmean`` (sum
divided by ``input.shape[0]``, the mathematically correct KL for a batch of distributions).

Forward: a grid of rows x column chunks, each program one chunk of one row (:data:`FORWARD_CHUNK` columns in
steps of 2048), writing the pointwise terms (``none``) or the chunk's fp32 sum; the chunks' sums, then the rows',
are added in a fixed order (:mod:`liger_core.reduce`), so the loss is the same bits run to run. More programs
than rows keep more loads in flight than one program sweeping each row: on the H200 (bf16, ``log_target``,
batchmean, L2 flushed) the forward writing the gradient takes 1.521 ms at 8192 x 128256 (97% of copy bandwidth)
against 1.558 ms for one program per row, 0.396 against 0.408 at 8192 x 32000, 0.391 against 0.400 at
2048 x 128256 (benchmarks/results/h200-2026-12-04-tune_kl_div_chunks.txt).

The gradient is ``d input = -target * scale * grad`` (``-exp(target)`` with ``log_target``). Only ``input`` is
differentiated: the target (a teacher's distribution, in distillation) gets no gradient.

For the reductions to a scalar the forward can write ``-target * scale`` in the same sweep (``compute_grad``):
the backward is then a scale by the incoming gradient, skipped where it is 1 (:func:`scale_grad_plan`), and a
training step moves three N x V arrays (input and target read, gradient written) instead of four (the target
read again by a separate backward). ``none`` keeps the separate backward (:func:`backward_plan`): its incoming
gradient is a full array, to be read anyway.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from .tl_math import aligned, cast, exp_ftz, log_approx, row_and_block
from .launch import (
    ArrayInfo, Buf, Launch, NewBuffer, Plan, cdiv, check_float, check_nonempty, check_same_shape,
    next_power_of_2, promote, rows_by_blocks_grid, sweep_block_and_warps, warps_for,
)
from . import cross_entropy as ce
from .reduce import sum_partials_launch
from .rowwise import row_view

REDUCTIONS = ("none", "sum", "mean", "batchmean")
_BACKWARD_BLOCK = 4096  # elements per program of the (elementwise) backward
# Columns per program of the forward, swept in steps of 2048 at 8 warps (sweep_block_and_warps). H200, bf16
# 8192 x 128256, forward writing the gradient (ms; one program per row 1.558 with log_target, 1.845 without):
# chunks of 4096 / 16384 / 32768 take 1.541 / 1.521 / 1.519 with log_target and 2.088 / 1.903 / 1.863 without
# it, where a log per element makes the kernel partly compute-bound and a sum per few thousand columns costs
# (benchmarks/results/h200-2026-12-04-tune_kl_div_chunks.txt). 16384 is also the best at 8192 x 32000.
FORWARD_CHUNK = 16384


@triton.jit
def _kl_div_forward_kernel(
    X, x_row_stride, x_col_stride,
    Y, y_row_stride, y_col_stride,
    n_rows, n_cols, scale, grad_scale,
    OUT, GRAD,
    BLOCK: tl.constexpr, CHUNK: tl.constexpr, LOG_TARGET: tl.constexpr, ELEMENTWISE: tl.constexpr,
    HAS_GRAD: tl.constexpr, FLAT_GRID: tl.constexpr, ALIGN: tl.constexpr,
):
    """Program (row, chunk) takes columns ``chunk * CHUNK ...`` of its row in steps of ``BLOCK``: writes their
    pointwise terms (``ELEMENTWISE``) or their sum times ``scale`` to ``OUT[chunk, row]`` (fp32, chunk-major: the
    order the partials are summed in); with ``HAS_GRAD`` also ``GRAD = -p * grad_scale`` (dense rows), p the
    target's probabilities."""
    x_row_stride = aligned(x_row_stride, ALIGN)
    y_row_stride = aligned(y_row_stride, ALIGN)
    n_cols = aligned(n_cols, ALIGN)
    row, chunk = row_and_block(tl.cdiv(n_cols, CHUNK), FLAT_GRID)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, CHUNK, BLOCK):
        cols = chunk * CHUNK + start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(X + row * x_row_stride + cols * x_col_stride, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(Y + row * y_row_stride + cols * y_col_stride, mask=mask, other=0.0).to(tl.float32)
        # exp_ftz and log_approx: two instructions each, where tl.exp is five and tl.log ~25 (tl_math)
        if LOG_TARGET:
            p = exp_ftz(y)
            loss = p * (y - x)
        else:
            # y floored at fp32's smallest normal for the log (a denormal probability would give log2 = -inf;
            # its term, below 1e-36, is kept finite); a zero probability's term is 0
            p = y
            log_y = log_approx(tl.where(y < 1.2e-38, 1.2e-38, y))
            loss = tl.where(y == 0.0, 0.0, y * (log_y - x))
        loss = tl.where(mask, loss, 0.0)
        if HAS_GRAD:
            tl.store(GRAD + row * n_cols + cols, cast(-p * grad_scale, GRAD.dtype.element_ty), mask=mask)
        if ELEMENTWISE:
            tl.store(OUT + row * n_cols + cols, cast(loss, OUT.dtype.element_ty), mask=mask)
        else:
            acc += loss
    if not ELEMENTWISE:
        tl.store(OUT + chunk.to(tl.int64) * n_rows + row, tl.sum(acc, axis=0) * scale)


@triton.jit
def _kl_div_backward_kernel(
    Y, y_row_stride, y_col_stride,
    G, g_row_stride, g_col_stride,
    n_cols, scale,
    DX,
    BLOCK: tl.constexpr, LOG_TARGET: tl.constexpr, FLAT_GRID: tl.constexpr, ALIGN: tl.constexpr,
):
    y_row_stride = aligned(y_row_stride, ALIGN)
    g_row_stride = aligned(g_row_stride, ALIGN)
    n_cols = aligned(n_cols, ALIGN)
    row, block = row_and_block(tl.cdiv(n_cols, BLOCK), FLAT_GRID)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    y = tl.load(Y + row * y_row_stride + cols * y_col_stride, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + row * g_row_stride + cols * g_col_stride, mask=mask, other=0.0).to(tl.float32)
    if LOG_TARGET:
        y = exp_ftz(y)
    # (-y * scale) first: the order of the forward's gradient times the scale kernel's g, so that both paths
    # give the same fp32 bits
    tl.store(DX + row * n_cols + cols, cast((-y * scale) * g, DX.dtype.element_ty), mask=mask)


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


def _forward_launches(x: ArrayInfo, target: ArrayInfo, reduction: str, log_target: bool, x_name: str,
                      target_name: str, grad_scale: float | None, chunk: int | None) -> tuple[Launch, ...]:
    """The rows x chunks kernel, writing ``loss`` (``none``) or fp32 ``loss_rows``, then ``grad`` too unless
    ``grad_scale`` is None. Over several chunks it writes their sums ``loss_parts`` (chunks, rows), and a second
    launch adds them up per row."""
    n_rows, n_cols, x_row_stride, x_col_stride = row_view(x, x_name)
    _, _, y_row_stride, y_col_stride = row_view(target, target_name)
    chunk = _forward_chunk(n_cols, chunk)
    step, warps = sweep_block_and_warps(chunk)
    n_chunks = cdiv(n_cols, chunk)
    elementwise = reduction == "none"
    if elementwise:
        out = NewBuffer("loss", x.shape, output_dtype(x, target))
    elif n_chunks == 1:  # the chunks' sums are the rows'
        out = NewBuffer("loss_rows", (n_rows,), "float32")
    else:
        out = NewBuffer("loss_parts", (n_chunks, n_rows), "float32")
    has_grad = grad_scale is not None
    grad = NewBuffer("grad", x.shape, x.dtype) if has_grad else NewBuffer("grad_unused", (1,), x.dtype)
    grid, flat = rows_by_blocks_grid(n_rows, n_chunks)
    main = Launch(
        kernel=_kl_div_forward_kernel,
        grid=grid,
        args=(Buf("input"), x_row_stride, x_col_stride, Buf("target"), y_row_stride, y_col_stride,
              n_rows, n_cols, _scale(x, reduction), float(grad_scale) if has_grad else 0.0),
        outputs=(out, grad),
        constexprs={"BLOCK": step, "CHUNK": chunk, "LOG_TARGET": bool(log_target), "ELEMENTWISE": elementwise,
                    "HAS_GRAD": has_grad, "FLAT_GRID": flat},
        num_warps=warps,
    )
    if elementwise or n_chunks == 1:
        return (main,)
    # chunk-major partials: the sum's grid runs over rows (a row-major layout would put one program per row on
    # the grid's second axis, limited to 65535)
    return (main, sum_partials_launch("loss_parts", "loss_rows", 1, n_chunks, n_rows, "float32"))


def _forward_chunk(n_cols: int, chunk: int | None) -> int:
    """Columns per program: ``chunk`` (a power of two; None for :data:`FORWARD_CHUNK`), no more than the row."""
    if chunk is None:
        chunk = FORWARD_CHUNK
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two, got {chunk}")
    return min(chunk, next_power_of_2(n_cols))


@functools.lru_cache(maxsize=1024)  # plans are pure functions of hashable arguments
def forward_plan(x: ArrayInfo, target: ArrayInfo, *, reduction: str = "mean", log_target: bool = False,
                 x_name: str = "input", target_name: str = "target", compute_grad: bool = False,
                 chunk: int | None = None) -> Plan:
    """Plan for the loss: inputs ``input``, ``target``; output ``loss`` (input's shape for none, else ()), then
    with ``compute_grad`` (not for ``none``) ``grad``, d loss / d input for an incoming gradient of 1 (input's
    shape and dtype; :func:`scale_grad_plan` applies the real one). ``chunk``: columns per program (a power of
    two, for tuning and tests; None for :data:`FORWARD_CHUNK`)."""
    check_inputs(x, target, reduction, x_name, target_name)
    if compute_grad and reduction == "none":
        raise ValueError("compute_grad needs a reduction to a scalar; reduction='none' uses backward_plan")
    launches = _forward_launches(x, target, reduction, log_target, x_name, target_name,
                                 _scale(x, reduction) if compute_grad else None, chunk)
    if reduction == "none":
        return Plan(inputs=("input", "target"), launches=launches, outputs=("loss",))
    n_rows = row_view(x, x_name)[0]
    total = sum_partials_launch("loss_rows", "loss", 1, n_rows, 1, output_dtype(x, target), out_shape=())
    return Plan(inputs=("input", "target"), launches=launches + (total,),
                outputs=("loss", "grad") if compute_grad else ("loss",))


@functools.lru_cache(maxsize=1024)  # plans are pure functions of hashable arguments
def row_sums_plan(x: ArrayInfo, target: ArrayInfo, *, log_target: bool = False,
                  grad_scale: float | None = None, chunk: int | None = None) -> Plan:
    """The ``sum`` forward up to its fp32 per-row sums ``loss_rows`` (for a row-sharded loss whose shards add
    them up themselves), then ``grad = -target * grad_scale`` unless ``grad_scale`` is None (the global
    reduction's divisor: a shard's own size is not the loss's). ``chunk`` as :func:`forward_plan`'s."""
    check_inputs(x, target, "sum")
    launches = _forward_launches(x, target, "sum", log_target, "input", "target", grad_scale, chunk)
    return Plan(inputs=("input", "target"), launches=launches,
                outputs=("loss_rows", "grad") if grad_scale is not None else ("loss_rows",))


@functools.lru_cache(maxsize=1024)  # plans are pure functions of hashable arguments
def scale_grad_plan(grad: ArrayInfo, grad_output: ArrayInfo, *, in_place: bool = True) -> Plan:
    """``dinput = grad * grad_output`` (a scalar): inputs ``grad`` (from :func:`forward_plan` with
    ``compute_grad``) and ``grad_output``; output ``dlogits``, written over ``grad`` with ``in_place``."""
    return ce.backward_plan(grad, grad_output, reduction="mean", in_place=in_place)


@functools.lru_cache(maxsize=1024)  # plans are pure functions of hashable arguments
def backward_plan(grad_output: ArrayInfo, x: ArrayInfo, target: ArrayInfo, *, reduction: str,
                  log_target: bool = False) -> Plan:
    """Plan for ``d input``: inputs ``grad_output`` (a scalar, or input's shape for none) and ``target``;
    output ``dinput`` (input's shape and dtype)."""
    check_inputs(x, target, reduction)
    check_float(grad_output, "grad_output")
    n_rows, n_cols, y_row_stride, y_col_stride = row_view(target, "target")
    if reduction == "none":
        check_same_shape(x, "input", grad_output, "grad_output")
        _, _, g_row_stride, g_col_stride = row_view(grad_output, "grad_output")
    else:
        if grad_output.numel != 1:
            raise ValueError(f"grad_output must be a scalar for reduction={reduction!r}, got {grad_output.shape}")
        g_row_stride = g_col_stride = 0
    block = min(_BACKWARD_BLOCK, next_power_of_2(n_cols))
    grid, flat = rows_by_blocks_grid(n_rows, cdiv(n_cols, block))
    launch = Launch(
        kernel=_kl_div_backward_kernel,
        grid=grid,
        args=(Buf("target"), y_row_stride, y_col_stride, Buf("grad_output"), g_row_stride, g_col_stride,
              n_cols, _scale(x, reduction)),
        outputs=(NewBuffer("dinput", x.shape, x.dtype),),
        constexprs={"BLOCK": block, "LOG_TARGET": bool(log_target), "FLAT_GRID": flat},
        num_warps=warps_for(block, max_warps=8),
    )
    return Plan(inputs=("grad_output", "target"), launches=(launch,), outputs=("dinput",))

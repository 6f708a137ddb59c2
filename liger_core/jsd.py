"""Generalized Jensen-Shannon divergence between a student and a teacher, with its gradient in the forward.

Inputs are log-probabilities over the last (vocabulary) axis, row by row: ``student`` (log Q, differentiated)
and ``teacher`` (log P, a constant: it gets no gradient). With ``M = beta * P + (1 - beta) * Q``, per row

    0 < beta < 1:  JSD_beta = beta * KL(P || M) + (1 - beta) * KL(Q || M)
    beta == 0:     KL(P || Q) = sum P * (log P - log Q)          (forward KL, F.kl_div(student, teacher))
    beta == 1:     KL(Q || P) = sum Q * (log Q - log P)          (reverse KL, F.kl_div(teacher, student))

This is the convention of TRL's ``generalized_jsd_loss`` (GKD) and Liger-Kernel's JSD. Note that JSD_beta
itself goes to 0 at both ends (M becomes Q, resp. P); the endpoints are *defined* as the two KLs, which are the
limits of ``JSD_beta / beta`` (beta -> 0) and ``JSD_beta / (1 - beta)`` (beta -> 1). So the loss is not
continuous in beta at 0 and 1, by design.

The loss is the mean over rows of the per-row sums: over the rows whose ``labels`` are not ``ignore_index``
when labels are given (their count is computed first, by a small kernel, so every row's gradient is already
that of the mean), over all rows otherwise. All rows ignored: loss 0 and a zero gradient (not NaN).

Gradient with respect to the student's log-probabilities ``x = log Q`` (each element an independent input, as
``F.kl_div`` treats its input), per element:

    0 < beta < 1:  (1 - beta) * Q * (x - log M)
    beta == 0:     -P
    beta == 1:     Q * (x - log P + 1)

A zero probability (log-probability -inf) contributes 0 to the loss and the gradient (0 * log 0 = 0).

Kernel: one program per row, one sweep over vocabulary blocks in fp32 that sums the loss and writes the
gradient (for an incoming gradient of 1; the backward scales it, :func:`backward_plan`). For the fused linear
JSD (:mod:`liger_core.fused_linear_jsd`) the kernel reads the two heads' logits ``z`` instead (any float dtype):
a first sweep takes both rows' logsumexp of ``z / T``, so that ``x = log_softmax(z / T)`` is formed in
registers, and a last sweep writes the gradient with respect to the student's logits,
``(g - softmax * sum(g)) / T`` (the softmax normalised by its own sum), over them in place. No fp32
log-probability buffer exists.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from . import cross_entropy as ce
from .launch import (
    ArrayInfo, Buf, Launch, NewBuffer, Plan, as_real, check_float, check_int, check_nonempty, check_same_shape,
    next_power_of_2, promote, sweep_block_and_warps,
)
from .reduce import sum_partials_launch
from .rowwise import row_view
from .tl_math import LN2, aligned, cast, exp_ftz, exp_minus_abs_ftz, log2_approx

_COUNT_BLOCK = 1024


@triton.jit
def _count_kept_kernel(L, l_stride, n_rows, ignore_index, COUNT, BLOCK: tl.constexpr):
    """COUNT[0] = number of rows whose label is not ignore_index (fp32, a fixed-order sum)."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_rows, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        in_range = rows < n_rows
        t = tl.load(L + rows.to(tl.int64) * l_stride, mask=in_range, other=0).to(tl.int64)
        acc += (in_range & (t != ignore_index)).to(tl.float32)
    tl.store(COUNT, tl.sum(acc, axis=0))


@triton.jit
def _pointwise(x, y, beta, grad_scale, MODE: tl.constexpr):
    """(loss, grad_scale * d loss / d x) per element, fp32; x = student log-prob, y = teacher log-prob.
    MODE 0: forward KL (beta 0), 1: reverse KL (beta 1), 2: generalized JSD."""
    # exp_ftz and log_approx, two instructions each where tl.exp is five and tl.log ~25 (tl_math): the loop
    # is bound by instruction issue (~52 instructions per element with tl.exp / tl.log, 30 now). Log-probabilities
    # are <= 0, so exp cannot overflow; a probability below fp32's smallest normal is flushed to 0 and
    # contributes below 1e-36.
    # Where a probability is 0 its factor of the term is replaced by 0 before multiplying, so that 0 * log 0 is
    # 0 and no NaN is formed (a term is still +inf where the divergence is: e.g. P > 0 = Q for beta 0).
    if MODE == 0:
        p = exp_ftz(y)
        loss = p * (tl.where(p == 0.0, 0.0, y) - tl.where(p == 0.0, 0.0, x))
        dx = p * -grad_scale
    elif MODE == 1:
        q = exp_ftz(x)
        loss = q * (tl.where(q == 0.0, 0.0, x) - tl.where(q == 0.0, 0.0, y))
        dx = (loss + q) * grad_scale
    else:
        # x - log M and y - log M from the difference d = y - x (exact for half-precision inputs), never from
        # log M itself: with A = M / max(P, Q) = c0 + c1 * exp(-|d|), which lies in [min(beta, 1 - beta), 1],
        #     x - log M = -log A - max(d, 0),    y - log M = (x - log M) + d.
        # log M is ~-12 at a 128k vocabulary, where one ulp is ~1e-6 and the hardware lg2 is good to 2 ulps: the
        # sum over a row would carry that error (beta near 0 made it visible: the loss is then ~beta while the
        # error is not). log A is in [log min(beta, 1 - beta), 0], where the hardware lg2's error is ~2e-7
        # absolute. Zero probabilities: the logs are clamped (exact: a probability that is not 0 has a log of
        # at least -104), so d stays finite and a zero probability's term is 0 * finite; a NaN passes the clamp
        # (propagate_nan: the GPU's max would return -1000) and reaches the loss and the gradient.
        d = (tl.maximum(y, -1000.0, propagate_nan=tl.PropagateNan.ALL)
             - tl.maximum(x, -1000.0, propagate_nan=tl.PropagateNan.ALL))
        e = exp_minus_abs_ftz(d)
        p_larger = d > 0.0
        a = tl.where(p_larger, beta, 1.0 - beta) + tl.where(p_larger, 1.0 - beta, beta) * e
        t_q = log2_approx(a) * -LN2 - tl.maximum(d, 0.0)  # one FFMA; -log_approx(a) - ... takes two
        p = exp_ftz(y)
        q = exp_ftz(x)
        term_q = q * t_q
        loss = beta * (p * (t_q + d)) + (1.0 - beta) * term_q
        dx = term_q * ((1.0 - beta) * grad_scale)
    return loss, dx


@triton.jit
def _load_pair(x_row, x_col_stride, y_row, y_col_stride, cols, mask, inv_temperature, lse_x, lse_y,
               FROM_LOGITS: tl.constexpr):
    """One block of the student's and teacher's log-probabilities, fp32: loaded as they are, or formed from
    logits as ``z / T - lse``."""
    x = tl.load(x_row + cols * x_col_stride, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_row + cols * y_col_stride, mask=mask, other=0.0).to(tl.float32)
    if FROM_LOGITS:
        x = x * inv_temperature - lse_x
        y = y * inv_temperature - lse_y
    return x, y


@triton.jit
def _jsd_kernel(
    X, x_row_stride, x_col_stride,
    Y, y_row_stride, y_col_stride,
    LABELS, l_stride,
    DENOM,
    grad_row_stride, grad_col_stride,
    n_cols, ignore_index, beta, scale, inv_temperature,
    LOSS, GRAD,
    BLOCK: tl.constexpr, MODE: tl.constexpr, HAS_LABELS: tl.constexpr, HAS_GRAD: tl.constexpr,
    FROM_LOGITS: tl.constexpr, ALIGN: tl.constexpr,
):
    x_row_stride = aligned(x_row_stride, ALIGN)
    y_row_stride = aligned(y_row_stride, ALIGN)
    grad_row_stride = aligned(grad_row_stride, ALIGN)
    n_cols = aligned(n_cols, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * x_row_stride
    y_row = Y + row * y_row_stride
    grad_row = GRAD + row * grad_row_stride
    offsets = tl.arange(0, BLOCK)

    if HAS_LABELS:
        label = tl.load(LABELS + row * l_stride).to(tl.int64)
        if label == ignore_index:
            if HAS_GRAD:
                for start in range(0, n_cols, BLOCK):
                    cols = start + offsets
                    tl.store(grad_row + cols * grad_col_stride,
                             tl.zeros([BLOCK], dtype=tl.float32).to(GRAD.dtype.element_ty), mask=cols < n_cols)
            tl.store(LOSS + row, 0.0)
            return
        denom = tl.load(DENOM)
        row_scale = tl.where(denom > 0, 1.0 / tl.where(denom > 0, denom, 1.0), 0.0)
    else:
        row_scale = scale

    # Sweep 0 (logits): both rows' logsumexp of z / T, online; then x = z / T - lse_x (y alike) in registers.
    lse_x = 0.0
    lse_y = 0.0
    if FROM_LOGITS:
        lse_x = ce.row_softmax_stats(x_row, x_col_stride, n_cols, inv_temperature, 1.0, X, 0, BLOCK,
                                     False, False, False, "")[0]
        lse_y = ce.row_softmax_stats(y_row, y_col_stride, n_cols, inv_temperature, 1.0, Y, 0, BLOCK,
                                     False, False, False, "")[0]

    # Sweep 1: the loss, and the gradient (or, for logits, the row sums of the gradient and of the student's
    # probabilities).
    loss_acc = tl.zeros([BLOCK], dtype=tl.float32)
    g_acc = tl.zeros([BLOCK], dtype=tl.float32)
    q_acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + offsets
        mask = cols < n_cols
        x, y = _load_pair(x_row, x_col_stride, y_row, y_col_stride, cols, mask, inv_temperature, lse_x, lse_y,
                          FROM_LOGITS)
        loss, dx = _pointwise(x, y, beta, 1.0 if FROM_LOGITS else row_scale, MODE)
        loss_acc += tl.where(mask, loss, 0.0)
        if FROM_LOGITS:
            if HAS_GRAD:
                g_acc += tl.where(mask, dx, 0.0)
                q_acc += tl.where(mask, exp_ftz(x), 0.0)
        elif HAS_GRAD:
            tl.store(grad_row + cols * grad_col_stride, cast(dx, GRAD.dtype.element_ty), mask=mask)
    tl.store(LOSS + row, tl.sum(loss_acc, axis=0) * row_scale)

    # Sweep 2 (logits): d loss / d z for x = log_softmax(z / T), written over the student's z: dx - q * sum(dx)
    # with q normalised by its own row sum. x = z / T - lse carries lse's rounding (~1 ulp at lse ~ 20: 2e-6), so
    # the q = exp(x) sum to 1 - 2e-6, not 1, and dx - q * sum(dx) would keep q * (1 - sum(q)) of the +q in dx:
    # where the rest cancels (a reverse KL of 19 nats: q * (19.22 - 18.97)) that was 5e-5 of the gradient.
    if FROM_LOGITS and HAS_GRAD:
        g_sum = tl.sum(g_acc, axis=0) / tl.sum(q_acc, axis=0)
        factor = row_scale * inv_temperature
        for start in range(0, n_cols, BLOCK):
            cols = start + offsets
            mask = cols < n_cols
            x, y = _load_pair(x_row, x_col_stride, y_row, y_col_stride, cols, mask, inv_temperature, lse_x, lse_y,
                              FROM_LOGITS)
            _, dx = _pointwise(x, y, beta, 1.0, MODE)
            dz = (dx - exp_ftz(x) * g_sum) * factor
            tl.store(grad_row + cols * grad_col_stride, cast(dz, GRAD.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------------------
# Validation


def check_options(*, beta, ignore_index) -> None:
    if not 0.0 <= as_real(beta, "beta") <= 1.0:  # NaN fails too
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    check_int(ignore_index, "ignore_index")


def check_inputs(student: ArrayInfo, teacher: ArrayInfo, labels: ArrayInfo | None, *,
                 student_name: str = "student_logprobs", teacher_name: str = "teacher_logprobs",
                 labels_name: str = "labels") -> None:
    check_nonempty(student, student_name)
    check_float(student, student_name)
    check_float(teacher, teacher_name)
    check_same_shape(student, student_name, teacher, teacher_name)
    if labels is not None:
        ce.check_target(labels, student.shape[:-1], labels_name)


def output_dtype(student: ArrayInfo, teacher: ArrayInfo) -> str:
    return promote(student.dtype, teacher.dtype)


def _mode(beta: float) -> int:
    beta = float(beta)
    return 0 if beta == 0.0 else (1 if beta == 1.0 else 2)


# ---------------------------------------------------------------------------------------------------------
# Launches and plans


def count_launch(labels: ArrayInfo, ignore_index: int) -> Launch:
    """``denom`` (1,) fp32: the number of labels that are not ``ignore_index``."""
    n_rows = labels.numel
    return Launch(
        kernel=_count_kept_kernel,
        grid=(1,),
        args=(Buf("labels"), ce.target_stride(labels, "labels"), n_rows, int(ignore_index)),
        outputs=(NewBuffer("denom", (1,), "float32"),),
        constexprs={"BLOCK": min(_COUNT_BLOCK, next_power_of_2(n_rows))},
        num_warps=4,
    )


def rows_launch(student: ArrayInfo, teacher: ArrayInfo, labels: ArrayInfo | None, *, beta: float,
                ignore_index: int, n_total_rows: int, compute_grad: bool, in_place: bool,
                from_logits: bool = False, temperature: float = 1.0) -> Launch:
    """The per-row kernel: fp32 ``loss_rows`` (n_rows,), already divided by the mean's divisor (input ``denom``
    with labels, ``n_total_rows`` without), and ``grad`` (written over ``student`` with ``in_place``).
    ``from_logits``: student and teacher are logits; the loss is that of ``log_softmax(z / temperature)`` and
    ``grad`` is d loss / d student logits."""
    n_rows, n_cols, x_row_stride, x_col_stride = row_view(student, "student")
    _, _, y_row_stride, y_col_stride = row_view(teacher, "teacher")
    dense = x_col_stride == 1 and (n_rows == 1 or x_row_stride >= n_cols)
    if compute_grad and in_place and dense:
        grad = NewBuffer("grad", student.shape, student.dtype, alias="student")
        g_row_stride, g_col_stride = x_row_stride, x_col_stride
    elif compute_grad:
        if from_logits:
            raise ValueError("the logits gradient is written over the student logits: they must be dense")
        grad = NewBuffer("grad", student.shape, student.dtype)
        g_row_stride, g_col_stride = n_cols, 1
    else:
        grad = NewBuffer("grad_unused", (1,), student.dtype)
        g_row_stride, g_col_stride = 0, 0
    has_labels = labels is not None
    block, warps = sweep_block_and_warps(n_cols)
    return Launch(
        kernel=_jsd_kernel,
        grid=(n_rows,),
        # unused pointers point at the teacher, never at the student (which may be written over)
        args=(Buf("student"), x_row_stride, x_col_stride, Buf("teacher"), y_row_stride, y_col_stride,
              Buf("labels" if has_labels else "teacher"), ce.target_stride(labels, "labels") if has_labels else 0,
              Buf("denom" if has_labels else "teacher"),
              g_row_stride, g_col_stride,
              n_cols, int(ignore_index), float(beta), 1.0 / max(int(n_total_rows), 1), 1.0 / float(temperature)),
        outputs=(NewBuffer("loss_rows", (n_rows,), "float32"), grad),
        constexprs={"BLOCK": block, "MODE": _mode(beta), "HAS_LABELS": has_labels,
                    "HAS_GRAD": bool(compute_grad), "FROM_LOGITS": bool(from_logits)},
        num_warps=warps,
    )


@functools.lru_cache(maxsize=1024)  # plans are pure functions of hashable arguments
def forward_plan(student: ArrayInfo, teacher: ArrayInfo, labels: ArrayInfo | None = None, *, beta: float = 0.5,
                 ignore_index: int = -100, compute_grad: bool = True, in_place: bool = False,
                 student_name: str = "student_logprobs", teacher_name: str = "teacher_logprobs",
                 labels_name: str = "labels") -> Plan:
    """Plan for the loss of student / teacher log-probabilities (..., V), with optional integer ``labels`` (...).

    Inputs ``student``, ``teacher`` (and ``labels``). Outputs ``loss`` (shape (), the promoted dtype of the two)
    and, with ``compute_grad``, ``grad`` (d loss / d student for an incoming gradient of 1; student's shape and
    dtype; written over the student with ``in_place`` when it is dense)."""
    check_options(beta=beta, ignore_index=ignore_index)
    check_inputs(student, teacher, labels, student_name=student_name, teacher_name=teacher_name,
                 labels_name=labels_name)
    n_rows = row_view(student, student_name)[0]
    row_view(teacher, teacher_name)
    launches = []
    if labels is not None:
        launches.append(count_launch(labels, ignore_index))
    launches.append(rows_launch(student, teacher, labels, beta=beta, ignore_index=ignore_index,
                                n_total_rows=n_rows, compute_grad=compute_grad, in_place=in_place))
    launches.append(sum_partials_launch("loss_rows", "loss", 1, n_rows, 1, output_dtype(student, teacher),
                                        out_shape=()))
    inputs = ("student", "teacher", "labels") if labels is not None else ("student", "teacher")
    return Plan(inputs=inputs, launches=tuple(launches), outputs=("loss", "grad") if compute_grad else ("loss",))


@functools.lru_cache(maxsize=1024)  # plans are pure functions of hashable arguments
def shard_rows_plan(student: ArrayInfo, teacher: ArrayInfo, labels: ArrayInfo | None, *, beta: float,
                    ignore_index: int, n_total_rows: int, compute_grad: bool) -> Plan:
    """One shard's rows of a row-sharded loss: fp32 ``loss_rows`` already divided by the global divisor (input
    ``denom`` from :func:`count_plan` over all shards with labels, ``n_total_rows`` without) and, with
    ``compute_grad``, ``grad``; the caller sums ``loss_rows`` across shards."""
    launch = rows_launch(student, teacher, labels, beta=beta, ignore_index=ignore_index,
                         n_total_rows=n_total_rows, compute_grad=compute_grad, in_place=False)
    inputs = ("student", "teacher") + (("labels", "denom") if labels is not None else ())
    return Plan(inputs=inputs, launches=(launch,), outputs=("loss_rows", "grad")[:1 + int(compute_grad)])


@functools.lru_cache(maxsize=1024)  # plans are pure functions of hashable arguments
def count_plan(n_rows: int, labels_dtype: str, ignore_index: int) -> Plan:
    """``denom`` (1,) fp32 for the whole (flattened, contiguous) ``labels`` (n_rows,): the mean's divisor
    over many chunks (see :func:`chunk_plan`)."""
    launch = count_launch(ArrayInfo.contiguous((n_rows,), labels_dtype), ignore_index)
    return Plan(inputs=("labels",), launches=(launch,), outputs=("denom",))


@functools.lru_cache(maxsize=1024)  # plans are pure functions of hashable arguments
def chunk_plan(rows: int, vocab: int, student_dtype: str, teacher_dtype: str, labels_dtype: str | None, *,
               beta: float, ignore_index: int, n_total_rows: int, temperature: float, compute_grad: bool) -> Plan:
    """One chunk of contiguous (rows, V) logits ``z`` of a larger batch (fused linear JSD), whose
    ``log_softmax(z / temperature)`` are compared. Inputs ``student``, ``teacher`` (and ``labels`` (rows,) and
    ``denom`` from :func:`count_plan`); outputs fp32 ``loss_rows`` (already divided by the whole batch's
    divisor: ``denom``, or ``n_total_rows`` without labels) and, with ``compute_grad``, ``grad``: d loss / d z,
    written over the student logits."""
    student = ArrayInfo.contiguous((rows, vocab), student_dtype)
    teacher = ArrayInfo.contiguous((rows, vocab), teacher_dtype)
    labels = None if labels_dtype is None else ArrayInfo.contiguous((rows,), labels_dtype)
    launch = rows_launch(student, teacher, labels, beta=beta, ignore_index=ignore_index,
                         n_total_rows=n_total_rows, compute_grad=compute_grad, in_place=True, from_logits=True,
                         temperature=temperature)
    inputs = ("student", "teacher") + (("labels", "denom") if labels is not None else ())
    return Plan(inputs=inputs, launches=(launch,), outputs=("loss_rows", "grad") if compute_grad else ("loss_rows",))


@functools.lru_cache(maxsize=1024)  # plans are pure functions of hashable arguments
def backward_plan(grad: ArrayInfo, grad_output: ArrayInfo, *, in_place: bool = True) -> Plan:
    """``dstudent = grad * grad_output`` (a scalar): inputs ``grad`` (from :func:`forward_plan`) and
    ``grad_output``; output ``dlogits``, written over ``grad`` with ``in_place``."""
    return ce.backward_plan(grad, grad_output, reduction="mean", in_place=in_place)


@functools.lru_cache(maxsize=1024)  # plans are pure functions of hashable arguments
def loss_plan(n_rows: int, dtype: str) -> Plan:
    """Sum of the fp32 per-row losses ``rows`` into ``total`` (shape (), ``dtype``), in a fixed order."""
    return ce.sum_rows_plan(n_rows, dtype)

"""Fused linear JSD for torch: a chunk loop of torch matmuls around :mod:`liger_core.jsd` on logits.

The gradients (of the student's hidden states and head) are computed during the forward, chunk by chunk;
the backward scales them by the incoming scalar (once: a second backward is refused).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from liger_core import fused_linear_cross_entropy as flce_core
from liger_core import fused_linear_jsd as core

from ._custom_ops import absent, compiling, define, empty_like
from ._launch import (
    autocast_dtype, check_tensors, dtype_name, info, once_differentiable, optional_info, refuse_grad, run_plan,
)
from .fused_linear_cross_entropy import accumulate_linear_grads, matmul_weight, scaled_grads, weight_grad_buffers


def _chunk_loop(xs, ws, xt, wt, labels, opts, chunk_size, accum_fp32, need):
    """fp32 per-row losses and, when ``need`` = (student_input, student_weight) flags ask, their gradients for
    an incoming gradient of 1."""
    n = xs.shape[0]
    vocab = ws.shape[0]
    temperature = opts["temperature"]
    compute_grad = any(need)
    rows, fp32_acc = core.chunking(n, vocab, xs.shape[1], dtype_name(xs.dtype), dtype_name(xt.dtype),
                                   dtype_name(ws.dtype), chunk_size, accum_fp32 and need[1])
    denom = None
    if labels is not None:
        (denom,) = run_plan(core.count_plan(n, dtype_name(labels.dtype), opts["ignore_index"]), labels=labels)
    grad_x = torch.empty_like(xs) if need[0] else None
    grad_w = grad_w_tmp = None
    if need[1]:
        grad_w, grad_w_tmp = weight_grad_buffers(ws, xs.dtype, fp32_acc)
    ws = matmul_weight(ws, xs.dtype)
    losses = []
    for start in range(0, n, rows):
        stop = min(start + rows, n)
        xc = xs[start:stop]
        # logits in the activations' dtype (an lm_head's output); the kernel takes their log-softmax in fp32
        student = torch.mm(xc, ws.t())
        teacher = torch.mm(xt[start:stop], wt.t())
        plan = core.chunk_plan(  # cached: built once per chunk length
            stop - start, vocab, dtype_name(student.dtype), dtype_name(teacher.dtype),
            None if labels is None else dtype_name(labels.dtype), beta=opts["beta"],
            ignore_index=opts["ignore_index"], n_total_rows=n, temperature=temperature, compute_grad=compute_grad)
        outs = run_plan(plan, student=student, teacher=teacher,
                        labels=None if labels is None else labels[start:stop], denom=denom)
        losses.append(outs[0])
        if compute_grad:  # outs[1]: d loss / d student logits, over them
            grad_x_chunk = grad_x[start:stop] if grad_x is not None else None
            accumulate_linear_grads(outs[1], xc, ws, grad_x_chunk, grad_w, grad_w_tmp, need, first=start == 0)
        del student, teacher, outs  # before the next chunk's matmuls allocate: one chunk alive, not two
    return torch.cat(losses), grad_x, grad_w


def _forward(xs, ws, xt, wt, labels, opts, chunk_size, accum_fp32, need):
    """``(loss, grads)``: grads = (grad of student_input (its shape), grad of student_weight) for an incoming
    gradient of 1, None where ``need`` says no."""
    xs2 = xs.reshape(-1, xs.shape[-1]).contiguous()
    xt2 = xt.reshape(-1, xt.shape[-1]).contiguous()
    l2 = None if labels is None else labels.reshape(-1).contiguous()
    rows, grad_x, grad_w = _chunk_loop(xs2, ws, xt2, wt, l2, opts, chunk_size, accum_fp32, need)
    (loss,) = run_plan(core.loss_plan(rows.numel(), dtype_name(xs.dtype)), rows=rows)
    return loss, ((grad_x.view(xs.shape) if grad_x is not None else None), grad_w)


class LigerFusedLinearJSDFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, xs, ws, xt, wt, labels, opts, chunk_size, accum_fp32, need):
        loss, ctx.grads = _forward(xs, ws, xt, wt, labels, opts, chunk_size, accum_fp32, need)
        ctx.need, ctx.dtypes = need, (xs.dtype, ws.dtype)
        ctx.backward_done = False
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        if ctx.backward_done:
            raise RuntimeError("liger_torch.fused_linear_jsd: backward through the same loss twice is not "
                               "supported (the gradients computed in the forward are released)")
        ctx.backward_done = True
        dx, dw = scaled_grads(ctx.grads, ctx.need, grad_loss, ctx.dtypes, in_place=True)
        del ctx.grads
        return dx, dw, None, None, None, None, None, None, None


# torch.compile path (see _custom_ops): the same helpers as custom ops; gradients not needed are empty tensors.

_OPTIONS_SCHEMA = ("float beta, int ignore_index, float temperature, int? chunk_size, bool accum_fp32, "
                   "bool need_input, bool need_weight")


def _forward_op(xs, ws, xt, wt, labels, beta, ignore_index, temperature, chunk_size, accum_fp32, *need):
    opts = dict(beta=beta, ignore_index=ignore_index, temperature=temperature)
    loss, grads = _forward(xs, ws, xt, wt, labels, opts, chunk_size, accum_fp32, need)
    return (loss, *(grad if grad is not None else absent(loss) for grad in grads))


def _forward_fake(xs, ws, xt, wt, labels, beta, ignore_index, temperature, chunk_size, accum_fp32, *need):
    loss = empty_like(xs, shape=())
    return (loss, empty_like(xs) if need[0] else absent(loss),
            empty_like(ws, _grad_weight_dtype(xs, ws, xt, chunk_size, accum_fp32)) if need[1] else absent(loss))


def _grad_weight_dtype(xs, ws, xt, chunk_size, accum_fp32):
    """The dtype the chunk loop returns the student head's gradient in (an fp32 accumulator, or the head's)."""
    _, fp32_acc = core.chunking(math.prod(xs.shape[:-1]), ws.shape[0], xs.shape[-1], dtype_name(xs.dtype),
                                dtype_name(xt.dtype), dtype_name(ws.dtype), chunk_size, accum_fp32)
    return torch.float32 if fp32_acc else None


def _setup_context(ctx, inputs, output):
    xs, ws, *_, need_input, need_weight = inputs
    ctx.need, ctx.dtypes = (need_input, need_weight), (xs.dtype, ws.dtype)
    ctx.save_for_backward(*output[1:])
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)  # no zero-filled gradients for them


def _backward_fn(ctx, grad_loss, *_):
    dx, dw = scaled_grads(ctx.saved_tensors, ctx.need, grad_loss, ctx.dtypes, in_place=False)
    return (dx, dw) + (None,) * 10


forward_op = define("fused_linear_jsd_forward",
                    "(Tensor student_input, Tensor student_weight, Tensor teacher_input, Tensor teacher_weight, "
                    f"Tensor? labels, {_OPTIONS_SCHEMA}) -> (Tensor, Tensor, Tensor)", _forward_op, _forward_fake,
                    setup_context=_setup_context, backward=_backward_fn)


def fused_linear_jsd(student_input: torch.Tensor, student_weight: torch.Tensor, teacher_input: torch.Tensor,
                     teacher_weight: torch.Tensor, labels: torch.Tensor | None = None, beta: float = 0.5,
                     ignore_index: int = -100, temperature: float = 1.0, chunk_size: int | None = None,
                     accum_dtype_fp32: bool | None = None):
    """:func:`liger_torch.jsd` of ``log_softmax(student_input @ student_weight.T / temperature)`` (student) and
    ``log_softmax(teacher_input @ teacher_weight.T / temperature)`` (teacher), without materialising either
    (N, V) logits tensor.

    ``student_input`` (..., Hs) with ``student_weight`` (V, Hs); ``teacher_input`` (..., Ht) with the same
    leading shape and ``teacher_weight`` (V, Ht); each head in its input's dtype. ``labels`` (...), ``beta`` and
    ``ignore_index`` as in :func:`liger_torch.jsd` (mean over non-ignored rows). The loss is not multiplied by
    ``temperature**2``. Tokens go through in chunks of ``chunk_size`` rows (default: as many as fit the student's
    (rows, V) logits in ``liger_core.fused_linear_jsd.WORKSPACE_BYTES``, the teacher's as many again); the
    logits are in the inputs' dtypes (as an lm_head's output) and their log-softmax in fp32.
    ``accum_dtype_fp32``: accumulate the student weight's gradient over chunks in fp32 (default: on for bf16/fp16
    weights). Under ``torch.autocast`` all four are cast to the autocast dtype first, except an fp32 student
    weight (a master weight: cast once inside, its gradient accumulated in fp32 straight into the fp32
    gradient). Loss in the student's dtype. Differentiable in ``student_input`` and ``student_weight``; the
    teacher is a constant, and a teacher tensor that requires grad raises ValueError (detach it, or freeze the
    teacher).
    """
    check_tensors(student_input=student_input, student_weight=student_weight, teacher_input=teacher_input,
                  teacher_weight=teacher_weight, labels=labels)
    args = (labels, beta, ignore_index, temperature, chunk_size, accum_dtype_fp32)
    dtype = autocast_dtype(student_input)
    if dtype is None:
        return _fused_linear_jsd(student_input, student_weight, teacher_input, teacher_weight, *args)
    # both heads' logits in the autocast dtype, as F.linear's; an fp32 student head is a master weight
    with torch.autocast(student_input.device.type, enabled=False):
        master = flce_core.is_master_weight(dtype_name(student_weight.dtype), dtype_name(dtype))
        return _fused_linear_jsd(student_input.to(dtype), student_weight if master else student_weight.to(dtype),
                                 teacher_input.to(dtype), teacher_weight.to(dtype), *args, master_weight_ok=True)


def _fused_linear_jsd(student_input, student_weight, teacher_input, teacher_weight, labels, beta, ignore_index,
                      temperature, chunk_size, accum_dtype_fp32, master_weight_ok=False):
    core.check_options(beta=beta, ignore_index=ignore_index, temperature=temperature)
    vocab = core.check_inputs(info(student_input), info(student_weight), info(teacher_input), info(teacher_weight),
                              optional_info(labels), master_weight_ok=master_weight_ok)
    core.chunk_rows(1, vocab, dtype_name(student_input.dtype), chunk_size)  # validates chunk_size
    grad_on = torch.is_grad_enabled()
    refuse_grad("fused_linear_jsd", "the student", teacher_input=teacher_input, teacher_weight=teacher_weight)
    need = tuple(bool(grad_on and t.requires_grad) for t in (student_input, student_weight))
    accum_fp32 = core.accumulate_in_fp32(dtype_name(student_weight.dtype), accum_dtype_fp32)
    opts = dict(beta=float(beta), ignore_index=int(ignore_index), temperature=float(temperature))
    if compiling():
        return forward_op(student_input, student_weight, teacher_input, teacher_weight, labels, opts["beta"],
                          opts["ignore_index"], opts["temperature"], chunk_size, accum_fp32, *need)[0]
    return LigerFusedLinearJSDFunction.apply(student_input, student_weight, teacher_input, teacher_weight, labels,
                                             opts, chunk_size, accum_fp32, need)


class FusedLinearJSD(nn.Module):
    """``loss_fn(student_input, student_weight, teacher_input, teacher_weight, labels=None)`` with the options
    of :func:`fused_linear_jsd` (argument order as in Liger-Kernel's module)."""

    def __init__(self, beta: float = 0.5, ignore_index: int = -100, temperature: float = 1.0,
                 chunk_size: int | None = None, accum_dtype_fp32: bool | None = None):
        super().__init__()
        core.check_options(beta=beta, ignore_index=ignore_index, temperature=temperature)
        flce_core.check_loop_options(chunk_size=chunk_size, accum_dtype_fp32=accum_dtype_fp32)
        self.beta, self.ignore_index, self.temperature = beta, ignore_index, temperature
        self.chunk_size, self.accum_dtype_fp32 = chunk_size, accum_dtype_fp32

    def forward(self, student_input: torch.Tensor, student_weight: torch.Tensor, teacher_input: torch.Tensor,
                teacher_weight: torch.Tensor, labels: torch.Tensor | None = None):
        return fused_linear_jsd(student_input, student_weight, teacher_input, teacher_weight, labels, self.beta,
                                self.ignore_index, self.temperature, self.chunk_size, self.accum_dtype_fp32)

    def extra_repr(self) -> str:
        return f"beta={self.beta}, ignore_index={self.ignore_index}, temperature={self.temperature}"

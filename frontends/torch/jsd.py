"""Generalized JSD for torch: autograd wiring around :mod:`liger_core.jsd`."""

from __future__ import annotations

import torch
from torch import nn

from liger_core import jsd as core

from ._custom_ops import absent, compiling, define, empty_like
from ._launch import check_tensors, info, once_differentiable, optional_info, refuse_grad, rowwise, run_plan


def _labels(labels):
    if labels is None:
        return None
    return labels if labels.ndim <= 1 else labels.contiguous()


def _forward(student, teacher, labels, beta, ignore_index, compute_grad):
    """The loss, then d loss / d student with ``compute_grad``."""
    student, teacher, labels = rowwise(student), rowwise(teacher), _labels(labels)
    plan = core.forward_plan(info(student), info(teacher), optional_info(labels), beta=beta,
                             ignore_index=ignore_index, compute_grad=compute_grad)
    return run_plan(plan, student=student, teacher=teacher, labels=labels)


def _backward(grad, grad_output, in_place):
    """``grad`` scaled by the incoming gradient (in place into ``grad`` with ``in_place``)."""
    plan = core.backward_plan(info(grad), info(grad_output), in_place=in_place)
    (dstudent,) = run_plan(plan, grad=grad, grad_output=grad_output)
    return dstudent


class LigerJSDFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student, teacher, labels, beta, ignore_index, compute_grad):
        outs = _forward(student, teacher, labels, beta, ignore_index, compute_grad)
        if compute_grad:
            ctx.save_for_backward(outs[1])
        ctx.backward_done = False
        return outs[0]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        if ctx.backward_done:
            raise RuntimeError("liger_torch.jsd: backward through the same loss twice is not supported (the "
                               "gradient computed in the forward is scaled in place)")
        ctx.backward_done = True
        (grad,) = ctx.saved_tensors
        return _backward(grad, grad_output, in_place=True), None, None, None, None, None


# torch.compile path (see _custom_ops): the same helpers as custom ops, never in place. Outputs: the loss and
# the gradient (empty when absent).


def _forward_op(student, teacher, labels, beta, ignore_index, compute_grad):
    outs = _forward(student, teacher, labels, beta, ignore_index, compute_grad)
    return outs[0], (outs[1] if compute_grad else absent(outs[0]))


def _forward_fake(student, teacher, labels, beta, ignore_index, compute_grad):
    loss = empty_like(student, core.output_dtype(info(student), info(teacher)), ())
    return loss, (empty_like(student) if compute_grad else absent(loss))


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(output[1])
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)  # no zero-filled gradient for it


def _backward_fn(ctx, grad_output, _):
    (grad,) = ctx.saved_tensors
    return backward_op(grad, grad_output), None, None, None, None, None


forward_op = define("jsd_forward",
                    "(Tensor student, Tensor teacher, Tensor? labels, float beta, int ignore_index, "
                    "bool compute_grad) -> (Tensor, Tensor)", _forward_op, _forward_fake,
                    setup_context=_setup_context, backward=_backward_fn)


def _backward_op(grad, grad_output):
    return _backward(grad, grad_output, in_place=False)


def _backward_fake(grad, grad_output):
    return empty_like(grad)


backward_op = define("jsd_backward", "(Tensor grad, Tensor grad_output) -> Tensor", _backward_op, _backward_fake)


def jsd(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, labels: torch.Tensor | None = None,
        beta: float = 0.5, ignore_index: int = -100):
    """Generalized Jensen-Shannon divergence between student and teacher log-probabilities (..., V).

    With P = teacher probabilities, Q = student probabilities and M = beta * P + (1 - beta) * Q, each row's
    loss is ``beta * KL(P||M) + (1 - beta) * KL(Q||M)`` for 0 < beta < 1, the forward KL ``KL(P||Q)``
    (``F.kl_div(student_logprobs, teacher_logprobs, log_target=True)``) for beta = 0 and the reverse KL
    ``KL(Q||P)`` for beta = 1 (the convention of TRL's GKD loss; see :mod:`liger_core.jsd`). The result is the
    mean over rows whose ``labels`` (integer, shape (...)) are not ``ignore_index`` (all rows without labels); 0
    with a zero gradient if every row is ignored. fp32 arithmetic; the loss has the promoted dtype of the two.

    Only ``student_logprobs`` is differentiated (its gradient is computed in the forward): the teacher is a
    constant, and a ``teacher_logprobs`` that requires grad raises ValueError (detach it).
    """
    check_tensors(student_logprobs=student_logprobs, teacher_logprobs=teacher_logprobs, labels=labels)
    core.check_options(beta=beta, ignore_index=ignore_index)
    core.check_inputs(info(student_logprobs), info(teacher_logprobs), optional_info(labels))
    refuse_grad("jsd", "the student", teacher_logprobs=teacher_logprobs)
    compute_grad = torch.is_grad_enabled() and student_logprobs.requires_grad
    if compiling():
        return forward_op(student_logprobs, teacher_logprobs, labels, float(beta), int(ignore_index), compute_grad)[0]
    return LigerJSDFunction.apply(student_logprobs, teacher_logprobs, labels, float(beta), int(ignore_index),
                                  compute_grad)


class JSD(nn.Module):
    """``loss_fn(student_logprobs, teacher_logprobs, labels=None)``: :func:`jsd` with fixed options."""

    def __init__(self, beta: float = 0.5, ignore_index: int = -100):
        super().__init__()
        core.check_options(beta=beta, ignore_index=ignore_index)
        self.beta, self.ignore_index = beta, ignore_index

    def forward(self, student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        return jsd(student_logprobs, teacher_logprobs, labels, self.beta, self.ignore_index)

    def extra_repr(self) -> str:
        return f"beta={self.beta}, ignore_index={self.ignore_index}"

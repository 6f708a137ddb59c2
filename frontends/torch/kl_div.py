"""KL divergence for torch: autograd wiring around :mod:`liger_core.kl_div`.

Eager, a loss reduced to a scalar gets its gradient in the forward's sweep (when ``input`` requires grad and
``grad_in_forward``, the default) and the backward scales it in place. Under ``torch.compile`` the custom ops
keep the separate backward from the target: a custom op may not scale a saved tensor in place, and scaling into
a fresh buffer moves more bytes (read the gradient, write it) than reading the target again.
"""

from __future__ import annotations

import torch
from torch import nn

from liger_core import kl_div as core
from liger_core.launch import ArrayInfo, check_bool

from ._custom_ops import compiling, define, empty_like
from ._launch import check_tensors, dtype_name, info, once_differentiable, refuse_grad, rowwise, run_plan


def _forward(x, target, reduction, log_target, compute_grad=False):
    """``(x, target as the kernel read them, loss[, d loss / d input for an incoming gradient of 1])``."""
    x, target = rowwise(x), rowwise(target)
    plan = core.forward_plan(info(x), info(target), reduction=reduction, log_target=log_target,
                             compute_grad=compute_grad)
    return (x, target) + tuple(run_plan(plan, input=x, target=target))


def _backward(grad_output, x_info, target, reduction, log_target):
    """d loss / d input; ``x_info`` describes the input (only its shape and dtype matter)."""
    g = rowwise(grad_output) if reduction == "none" else grad_output
    plan = core.backward_plan(info(g), x_info, info(target), reduction=reduction, log_target=log_target)
    (dx,) = run_plan(plan, grad_output=g, target=target)
    return dx


class LigerKLDivFunction(torch.autograd.Function):
    """With ``compute_grad`` (a reduction to a scalar) the forward writes the gradient and the backward scales
    it in place; otherwise the backward computes it from the target."""

    @staticmethod
    def forward(ctx, x, target, reduction, log_target, compute_grad):
        x, target, loss, *grad = _forward(x, target, reduction, log_target, compute_grad)
        ctx.save_for_backward(*(grad or [target]))
        ctx.x_info, ctx.reduction, ctx.log_target, ctx.compute_grad = info(x), reduction, log_target, compute_grad
        ctx.backward_done = False
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        (saved,) = ctx.saved_tensors
        if not ctx.compute_grad:
            return _backward(grad_output, ctx.x_info, saved, ctx.reduction, ctx.log_target), None, None, None, None
        if ctx.backward_done:
            raise RuntimeError("liger_torch.kl_div: backward through the same loss twice is not supported (the "
                               "gradient computed in the forward is scaled in place)")
        ctx.backward_done = True
        (dx,) = run_plan(core.scale_grad_plan(info(saved), info(grad_output)), grad=saved, grad_output=grad_output)
        return dx, None, None, None, None


# torch.compile path (see _custom_ops): the same helpers as custom ops.


def _forward_op(x, target, reduction, log_target):
    return _forward(x, target, reduction, log_target)[2]


def _forward_fake(x, target, reduction, log_target):
    return empty_like(x, core.output_dtype(info(x), info(target)), None if reduction == "none" else ())


def _setup_context(ctx, inputs, output):
    x, target, ctx.reduction, ctx.log_target = inputs
    ctx.save_for_backward(target)
    ctx.x_dtype = x.dtype


def _backward_fn(ctx, grad_output):
    (target,) = ctx.saved_tensors
    return backward_op(grad_output, target, ctx.x_dtype, ctx.reduction, ctx.log_target), None, None, None


forward_op = define("kl_div_forward", "(Tensor input, Tensor target, str reduction, bool log_target) -> Tensor",
                    _forward_op, _forward_fake, setup_context=_setup_context, backward=_backward_fn)


def _backward_op(grad_output, target, x_dtype, reduction, log_target):
    x_info = ArrayInfo.contiguous(target.shape, dtype_name(x_dtype))  # input and target have one shape
    return _backward(grad_output, x_info, rowwise(target), reduction, log_target)


def _backward_fake(grad_output, target, x_dtype, reduction, log_target):
    return empty_like(target, x_dtype)


backward_op = define("kl_div_backward",
                     "(Tensor grad_output, Tensor target, ScalarType x_dtype, str reduction, bool log_target) "
                     "-> Tensor", _backward_op, _backward_fake)


def kl_div(input: torch.Tensor, target: torch.Tensor, reduction: str = "mean", log_target: bool = False, *,
           grad_in_forward: bool = True):
    """``torch.nn.functional.kl_div(input, target, reduction=..., log_target=...)``: ``input`` log-probabilities,
    ``target`` probabilities (log-probabilities with ``log_target``), same shape (no broadcasting).

    Reductions ``none | sum | mean | batchmean`` as torch's (``mean`` averages over all elements; ``batchmean``
    divides the sum by ``input.shape[0]``). All arithmetic in fp32; the result has the promoted dtype of the two.
    Only ``input`` is differentiated: a ``target`` that requires grad raises ValueError (detach it).

    ``grad_in_forward`` (reductions to a scalar, ``input`` requiring grad): the forward writes the gradient in the
    same sweep and the backward only scales it, skipped where the incoming gradient is exactly 1. Three N x V
    arrays move for ``loss.backward()`` instead of four; but five where the loss is weighted (``alpha * loss``:
    the scale reads and writes the gradient again). Pass False for a weighted loss: the backward then computes
    the gradient from the target.
    """
    check_tensors(input=input, target=target)
    core.check_inputs(info(input), info(target), reduction)
    log_target, grad_in_forward = check_bool(log_target, "log_target"), check_bool(grad_in_forward, "grad_in_forward")
    refuse_grad("kl_div", "input", target=target)
    if compiling():
        return forward_op(input, target, reduction, log_target)
    compute_grad = grad_in_forward and torch.is_grad_enabled() and input.requires_grad and reduction != "none"
    return LigerKLDivFunction.apply(input, target, reduction, log_target, compute_grad)


class KLDivLoss(nn.Module):
    """Drop-in for ``torch.nn.KLDivLoss(reduction=..., log_target=...)``."""

    def __init__(self, reduction: str = "mean", log_target: bool = False, *, grad_in_forward: bool = True):
        super().__init__()
        if reduction not in core.REDUCTIONS:
            raise ValueError(f"reduction must be one of {core.REDUCTIONS}, got {reduction!r}")
        check_bool(log_target, "log_target")
        check_bool(grad_in_forward, "grad_in_forward")
        self.reduction = reduction
        self.log_target = log_target
        self.grad_in_forward = grad_in_forward

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return kl_div(input, target, self.reduction, self.log_target, grad_in_forward=self.grad_in_forward)

    def extra_repr(self) -> str:
        return (f"reduction={self.reduction!r}, log_target={self.log_target}, "
                f"grad_in_forward={self.grad_in_forward}")

"""Cross-entropy for torch: autograd wiring around :mod:`liger_core.cross_entropy`.

The forward computes the loss and, when the logits need a gradient, d loss / d logits in the same kernel;
the backward only scales it by the incoming gradient (in place, so it may run once: ``retain_graph`` and a
second backward through the same loss are refused; under ``torch.compile`` the scaling is out of place).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from liger_core import cross_entropy as core
from liger_core.launch import check_bool

from ._custom_ops import absent, compiling, define, empty_like
from ._launch import (
    capturing_cuda_graph, check_tensors, info, once_differentiable, optional_info, refuse_grad, rowwise, run_plan,
)


def start_target_check(target: torch.Tensor, n_classes: int, ignore_index: int, denom: torch.Tensor,
                       name: str = "target") -> Callable[[], None]:
    """Start checking that every target is in [0, n_classes) or ignore_index; the returned function finishes
    the check, raising ValueError for a bad one. ``denom``: the targets' denominators, counted by the caller
    (:func:`liger_core.cross_entropy.denominators_plan`: their [2] is the count of invalid ones).

    On a GPU the count is copied to pinned host memory behind an event, and finishing waits for that event
    only: the loss's kernels, queued in between, keep the GPU busy while the host waits (waiting before
    queueing them left the GPU idle for the host's whole launch path: 0.23 ms per call at 8192 x 128256). The
    kernels read an invalid target as no class (a NaN loss and gradient for its row), so running them first is
    safe; with ``in_place`` the logits are overwritten by the time the error is raised. Skipped while a CUDA
    graph is captured (no host wait is possible then): the NaN rows remain the mark. Only a failing check
    builds the message's details."""
    if capturing_cuda_graph(target):
        return _nothing
    if not target.is_cuda:
        count, counted = denom[2], None
    else:
        count = torch.empty((), dtype=denom.dtype, pin_memory=True)
        count.copy_(denom[2], non_blocking=True)
        counted = torch.cuda.Event()
        counted.record()

    def finish() -> None:
        if counted is not None:
            counted.synchronize()
        if count.item() > 0:
            valid = (target == ignore_index) | ((target >= 0) & (target < n_classes))
            bad = target[~valid]
            raise ValueError(core.invalid_targets_message(n_classes, ignore_index, name, int(bad[0]), bad.numel(),
                                                          target.numel()))
    return finish


def _nothing() -> None:
    return None


def _check_2d(logits: torch.Tensor, target: torch.Tensor, logits_name: str = "logits") -> None:
    if logits.ndim != 2:
        raise ValueError(f"{logits_name} must have shape (N, V) with the classes last, got {tuple(logits.shape)}; "
                         "flatten the leading dimensions (and the targets) first")


def _forward(logits, target, weight, ignore_index, reduction, label_smoothing, lse_square_scale, softcap,
             return_z_loss, in_place, compute_grad):
    """``(logits as the kernel read them, outputs)``: the outputs are the loss, then the z-loss with
    ``return_z_loss``, then d loss / d logits with ``compute_grad`` (written over the logits with ``in_place``)."""
    logits = rowwise(logits)
    plan = core.forward_plan(
        info(logits), info(target), optional_info(weight), ignore_index=ignore_index, reduction=reduction,
        label_smoothing=label_smoothing, lse_square_scale=lse_square_scale, softcap=softcap,
        return_z_loss=return_z_loss, compute_grad=compute_grad, in_place=in_place, given_denom=True)
    # one count of the targets: the check's, and the mean's divisors
    (denom,) = run_plan(core.denominators_plan(info(target), optional_info(weight), logits.shape[-1], ignore_index),
                        target=target, weight=weight)
    finish_check = start_target_check(target, logits.shape[-1], ignore_index, denom)
    outs = run_plan(plan, logits=logits, target=target, weight=weight, denom=denom)
    finish_check()
    return logits, outs


def scale_grad(grad, grad_loss, reduction, in_place):
    """d loss / d logits: ``grad`` scaled by the incoming gradient (in place into ``grad`` with ``in_place``)."""
    plan = core.backward_plan(info(grad), info(grad_loss), reduction=reduction, in_place=in_place)
    (dlogits,) = run_plan(plan, grad=grad, grad_output=grad_loss)
    return dlogits


class LigerCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, weight, ignore_index, reduction, label_smoothing, lse_square_scale,
                softcap, return_z_loss, in_place, compute_grad):
        logits, outs = _forward(logits, target, weight, ignore_index, reduction, label_smoothing, lse_square_scale,
                                softcap, return_z_loss, in_place, compute_grad)
        loss = outs[0]
        if compute_grad:
            grad = outs[-1]
            if grad.data_ptr() == logits.data_ptr():
                # The kernel wrote over the logits behind autograd's back: tell it, so that a graph that saved
                # them for its own backward fails loudly instead of using the overwritten values.
                torch.autograd.graph.increment_version(logits)
            ctx.save_for_backward(grad)
        ctx.reduction = reduction
        ctx.backward_done = False
        if return_z_loss:
            ctx.mark_non_differentiable(outs[1])
            return loss, outs[1]
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, *unused):
        if ctx.backward_done:
            raise RuntimeError("liger_torch.cross_entropy: backward through the same loss twice is not supported "
                               "(the gradient computed in the forward is scaled in place)")
        ctx.backward_done = True
        (grad,) = ctx.saved_tensors
        dlogits = scale_grad(grad, grad_loss, ctx.reduction, in_place=True)
        # In place, ``grad`` is the logits tensor itself; a leaf's AccumulateGrad would copy a gradient that is
        # that (widely referenced) tensor, but takes a fresh alias of the same memory as it is.
        return dlogits.detach(), None, None, None, None, None, None, None, None, None, None


# torch.compile path (see _custom_ops): the same helpers as custom ops, never in place. Outputs: the loss, the
# z-loss and the gradient (empty when absent).


def _forward_op(logits, target, weight, ignore_index, reduction, label_smoothing, lse_square_scale, softcap,
                return_z_loss, compute_grad):
    _, outs = _forward(logits, target, weight, ignore_index, reduction, label_smoothing, lse_square_scale, softcap,
                       return_z_loss, in_place=False, compute_grad=compute_grad)
    loss = outs[0]
    z_loss = outs[1] if return_z_loss else absent(loss)
    return loss, z_loss, (outs[-1] if compute_grad else absent(loss))


def _forward_fake(logits, target, weight, ignore_index, reduction, label_smoothing, lse_square_scale, softcap,
                  return_z_loss, compute_grad):
    loss = empty_like(logits, shape=target.shape if reduction == "none" else ())
    return (loss, empty_like(loss) if return_z_loss else absent(loss),
            empty_like(logits) if compute_grad else absent(loss))


def _setup_context(ctx, inputs, output):
    ctx.reduction = inputs[4]
    ctx.save_for_backward(output[2])
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.set_materialize_grads(False)  # no zero-filled gradients for them


def _backward_fn(ctx, grad_loss, *_):
    (grad,) = ctx.saved_tensors
    return backward_op(grad, grad_loss, ctx.reduction), None, None, None, None, None, None, None, None, None


forward_op = define("cross_entropy_forward",
                    "(Tensor logits, Tensor target, Tensor? weight, int ignore_index, str reduction, "
                    "float label_smoothing, float lse_square_scale, float? softcap, bool return_z_loss, "
                    "bool compute_grad) -> (Tensor, Tensor, Tensor)", _forward_op, _forward_fake,
                    setup_context=_setup_context, backward=_backward_fn)


def _backward_op(grad, grad_loss, reduction):
    return scale_grad(grad, grad_loss, reduction, in_place=False)


def _backward_fake(grad, grad_loss, reduction):
    return empty_like(grad)


backward_op = define("cross_entropy_backward", "(Tensor grad, Tensor grad_loss, str reduction) -> Tensor",
                     _backward_op, _backward_fake)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                  ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                  lse_square_scale: float = 0.0, softcap: float | None = None, return_z_loss: bool = False,
                  in_place: bool = False):
    """``torch.nn.functional.cross_entropy(logits, target, ...)`` for logits (N, V), plus z-loss and softcap.

    - ``lse_square_scale``: adds ``lse_square_scale * logsumexp(logits)**2`` per non-ignored row (z-loss);
      with ``return_z_loss`` returns ``(loss, z_loss)``, ``z_loss`` (not differentiable) being that part of
      ``loss``, reduced alike.
    - ``softcap``: the logits become ``softcap * tanh(logits / softcap)`` first (Gemma 2).
    - ``in_place``: write the gradient over ``logits`` during the forward (saves a (N, V) buffer; ``logits``
      then no longer hold the logits, so only when nothing else reads them later). No effect under
      ``torch.compile``, where nothing is written in place.

    The loss has the logits' dtype (all arithmetic is fp32). Unlike torch, ``mean`` over a batch whose targets
    are all ``ignore_index`` gives 0 (and a zero gradient), not NaN. Targets are checked eagerly: a value
    outside ``[0, V)`` other than ``ignore_index`` raises ValueError; that check counts them with the mean's
    divisors and waits for the count once the loss's kernels are queued (skipped while a CUDA graph is captured:
    such a target's loss is then NaN).
    """
    check_tensors(logits=logits, target=target, weight=weight)
    refuse_grad("cross_entropy", "the logits", weight=weight)  # as torch's: class weights get no gradient
    core.check_options(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
                       lse_square_scale=lse_square_scale, softcap=softcap)
    _check_2d(logits, target)
    core.check_inputs(info(logits), info(target), optional_info(weight))
    args = (logits, target, weight, int(ignore_index), reduction, float(label_smoothing), float(lse_square_scale),
            None if softcap is None else float(softcap), check_bool(return_z_loss, "return_z_loss"))
    compute_grad = torch.is_grad_enabled() and logits.requires_grad
    if compiling():
        loss, z_loss, _ = forward_op(*args, compute_grad)
        return (loss, z_loss) if return_z_loss else loss
    return LigerCrossEntropyFunction.apply(*args, check_bool(in_place, "in_place"), compute_grad)


class CrossEntropyLoss(nn.Module):
    """Drop-in for ``torch.nn.CrossEntropyLoss`` (class weight registered as buffer ``weight``), with the
    extra options of :func:`cross_entropy`."""

    def __init__(self, weight: torch.Tensor | None = None, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0, lse_square_scale: float = 0.0, softcap: float | None = None,
                 return_z_loss: bool = False, in_place: bool = False):
        super().__init__()
        core.check_options(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
                           lse_square_scale=lse_square_scale, softcap=softcap)
        check_bool(return_z_loss, "return_z_loss")
        check_bool(in_place, "in_place")
        self.register_buffer("weight", weight)
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.lse_square_scale = lse_square_scale
        self.softcap = softcap
        self.return_z_loss = return_z_loss
        self.in_place = in_place

    def forward(self, input: torch.Tensor, target: torch.Tensor):
        return cross_entropy(input, target, self.weight, self.ignore_index, self.reduction, self.label_smoothing,
                             self.lse_square_scale, self.softcap, self.return_z_loss, self.in_place)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, lse_square_scale={self.lse_square_scale}, "
                f"softcap={self.softcap}, return_z_loss={self.return_z_loss}, in_place={self.in_place}")

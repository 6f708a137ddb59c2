"""KL divergence for torch: autograd wiring around :mod:`liger_core.kl_div`."""

from __future__ import annotations

import torch
from torch import nn

from liger_core import kl_div as core

from ._launch import check_tensors, info, rowwise, run_plan


class LigerKLDivFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, target, reduction, log_target):
        x, target = rowwise(x), rowwise(target)
        (loss,) = run_plan(core.forward_plan(info(x), info(target), reduction=reduction, log_target=log_target),
                           input=x, target=target)
        ctx.save_for_backward(target)
        ctx.x_info, ctx.reduction, ctx.log_target = info(x), reduction, log_target
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        (target,) = ctx.saved_tensors
        g = rowwise(grad_output) if ctx.reduction == "none" else grad_output
        plan = core.backward_plan(info(g), ctx.x_info, info(target), reduction=ctx.reduction,
                                  log_target=ctx.log_target)
        (dx,) = run_plan(plan, grad_output=g, target=target)
        return dx, None, None, None


def kl_div(input: torch.Tensor, target: torch.Tensor, reduction: str = "mean", log_target: bool = False):
    """``torch.nn.functional.kl_div(input, target, reduction=..., log_target=...)``: ``input`` log-probabilities,
    ``target`` probabilities (log-probabilities with ``log_target``), same shape (no broadcasting).

    Reductions ``none | sum | mean | batchmean`` as torch's (``mean`` averages over all elements; ``batchmean``
    divides the sum by ``input.shape[0]``). All arithmetic in fp32; the result has the promoted dtype of the two.
    Only ``input`` is differentiated: a ``target`` that requires grad raises ValueError (detach it).
    """
    check_tensors(input=input, target=target)
    core.check_inputs(info(input), info(target), reduction)
    if target.requires_grad and torch.is_grad_enabled():
        raise ValueError("target requires grad, but liger_torch.kl_div differentiates input only; pass "
                         "target.detach()")
    return LigerKLDivFunction.apply(input, target, reduction, bool(log_target))


class KLDivLoss(nn.Module):
    """Drop-in for ``torch.nn.KLDivLoss(reduction=..., log_target=...)``."""

    def __init__(self, reduction: str = "mean", log_target: bool = False):
        super().__init__()
        if reduction not in core.REDUCTIONS:
            raise ValueError(f"reduction must be one of {core.REDUCTIONS}, got {reduction!r}")
        self.reduction = reduction
        self.log_target = log_target

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return kl_div(input, target, self.reduction, self.log_target)

    def extra_repr(self) -> str:
        return f"reduction={self.reduction!r}, log_target={self.log_target}"

"""Fused residual add + RMSNorm for torch: autograd wiring around :mod:`liger_core.fused_add_rms_norm`."""

from __future__ import annotations

import torch

from liger_core import fused_add_rms_norm as core

from ._launch import check_tensors, dtype_name, info, num_sms, optional_info, rowwise, run_plan
from .rms_norm import RMSNorm


class LigerFusedAddRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps, offset, casting_mode, in_place):
        x, residual = rowwise(x), rowwise(residual)
        plan = core.forward_plan(info(x), info(residual), optional_info(weight), eps=eps, offset=offset,
                                 casting_mode=casting_mode)
        y, h, rstd = run_plan(plan, x=x, residual=residual, weight=weight)
        ctx.save_for_backward(h, weight, rstd)
        ctx.set_materialize_grads(False)  # an unused y or h costs no zero-filled gradient
        ctx.offset, ctx.casting_mode, ctx.in_place = offset, casting_mode, in_place
        ctx.x_dtype, ctx.residual_dtype = dtype_name(x.dtype), dtype_name(residual.dtype)
        return y, h

    @staticmethod
    def backward(ctx, grad_y, grad_h):
        h, weight, rstd = ctx.saved_tensors
        if grad_y is None and grad_h is None:
            return None, None, None, None, None, None, None
        dy = rowwise(grad_y) if grad_y is not None else torch.zeros_like(h)
        dh = rowwise(grad_h) if grad_h is not None else None
        # Never write both gradients over one buffer (autograd may hand the same tensor for y and h).
        in_place = ctx.in_place and not (dh is not None and dh.data_ptr() == dy.data_ptr())
        plan = core.backward_plan(info(dy), optional_info(dh), info(h), optional_info(weight), x_dtype=ctx.x_dtype,
                                  residual_dtype=ctx.residual_dtype, offset=ctx.offset,
                                  casting_mode=ctx.casting_mode, num_sms=num_sms(h.device), in_place=in_place,
                                  separate_residual_grad=True)  # distinct tensors: later ops may write over one
        grads = run_plan(plan, dy=dy, dh=dh, h=h, weight=weight, rstd=rstd)
        dw = grads[2] if weight is not None else None
        return grads[0], grads[1], dw, None, None, None, None


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6,
                       offset: float = 0.0, casting_mode: str = "llama",
                       in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual; y = rms_norm(h, weight)`` in one pass; returns ``(y, h)`` (h: the new residual).

    Casting modes and ``offset`` as in :func:`liger_torch.rms_norm`, with h in the role of x. With
    ``in_place`` the backward writes dx over the gradient of y and dresidual over the gradient of h when that
    is safe (same dtype, dense); leave it off when either gradient is shared with another branch.
    """
    check_tensors(x=x, residual=residual, weight=weight)
    return LigerFusedAddRMSNormFunction.apply(x, residual, weight, float(eps), float(offset), casting_mode,
                                              bool(in_place))


class FusedAddRMSNorm(RMSNorm):
    """``forward(hidden_states, residual) -> (normed, new_residual)``; the parameter is ``weight`` (the
    state_dict of ``LlamaRMSNorm`` / ``liger_torch.RMSNorm``), the epsilon ``variance_epsilon``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0, casting_mode: str = "llama",
                 in_place: bool = False, init_fn: str = "ones", device=None, dtype=None):
        # Same parameters and attributes as RMSNorm; only the default of in_place differs (see the function).
        super().__init__(hidden_size, eps, offset, casting_mode, in_place, init_fn, device, dtype)

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return fused_add_rms_norm(hidden_states, residual, self.weight, self.variance_epsilon, self.offset,
                                  self.casting_mode, self.in_place)

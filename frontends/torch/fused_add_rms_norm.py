"""Fused residual add + RMSNorm for torch: autograd wiring around :mod:`liger_core.fused_add_rms_norm`."""

from __future__ import annotations

import torch

from liger_core import fused_add_rms_norm as core
from liger_core.launch import check_bool, check_eps, check_finite, promote

from ._custom_ops import absent, compiling, define, empty_like
from ._launch import (
    check_tensors, dtype_name, info, num_sms, once_differentiable, optional_info, rowwise, run_plan, sole_reference,
)
from .rms_norm import RMSNorm


def _forward(x, residual, weight, eps, offset, casting_mode):
    """``(y, h, rstd)``."""
    x, residual = rowwise(x), rowwise(residual)
    plan = core.forward_plan(info(x), info(residual), optional_info(weight), eps=eps, offset=offset,
                             casting_mode=casting_mode)
    return run_plan(plan, x=x, residual=residual, weight=weight)


def _backward(grad_y, grad_h, h, weight, rstd, x_dtype, residual_dtype, offset, casting_mode, in_place):
    """``(dx, dresidual, dw)`` (dw None without a weight); grad_y and grad_h may be None (unused outputs).
    dresidual is dx itself when the dtypes agree, as autograd's add hands one gradient to both inputs (a
    backward that writes over its incoming gradient checks that nothing else holds it)."""
    separate = x_dtype != residual_dtype
    # dx goes over dy, dresidual over dh: only where this backward is their sole holder (autograd may hand
    # one tensor for y and h, or share either with another branch)
    in_place_y = in_place and sole_reference(grad_y)
    in_place_h = (in_place and separate and sole_reference(grad_h)
                  and not (in_place_y and grad_h.data_ptr() == grad_y.data_ptr()))
    dy = rowwise(grad_y) if grad_y is not None else torch.zeros_like(h)
    dh = rowwise(grad_h) if grad_h is not None else None
    plan = core.backward_plan(info(dy), optional_info(dh), info(h), optional_info(weight), x_dtype=x_dtype,
                              residual_dtype=residual_dtype, offset=offset, casting_mode=casting_mode,
                              num_sms=num_sms(h.device), in_place=in_place_y, in_place_residual=in_place_h,
                              separate_residual_grad=separate)
    grads = run_plan(plan, dy=dy, dh=dh, h=h, weight=weight, rstd=rstd)
    dx = grads[0]
    dresidual = grads[1] if separate else dx
    return dx, dresidual, (grads[-1] if weight is not None else None)


class LigerFusedAddRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps, offset, casting_mode, in_place):
        y, h, rstd = _forward(x, residual, weight, eps, offset, casting_mode)
        ctx.save_for_backward(h, weight, rstd)
        ctx.set_materialize_grads(False)  # an unused y or h costs no zero-filled gradient
        ctx.offset, ctx.casting_mode, ctx.in_place = offset, casting_mode, in_place
        ctx.x_dtype, ctx.residual_dtype = dtype_name(x.dtype), dtype_name(residual.dtype)
        return y, h

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y, grad_h):
        h, weight, rstd = ctx.saved_tensors
        if grad_y is None and grad_h is None:
            return None, None, None, None, None, None, None
        dx, dresidual, dw = _backward(grad_y, grad_h, h, weight, rstd, ctx.x_dtype, ctx.residual_dtype, ctx.offset,
                                      ctx.casting_mode, ctx.in_place)
        return dx, dresidual, dw, None, None, None, None


# torch.compile path (see _custom_ops): the same helpers as custom ops, never in place.


def _forward_fake(x, residual, weight, eps, offset, casting_mode):
    h_dtype = promote(dtype_name(x.dtype), dtype_name(residual.dtype))
    y_dtype = core.output_dtype(h_dtype, None if weight is None else dtype_name(weight.dtype), casting_mode)
    return empty_like(x, y_dtype), empty_like(x, h_dtype), empty_like(x, torch.float32, x.shape[:-1])


def _setup_context(ctx, inputs, output):
    x, residual, weight, _, ctx.offset, ctx.casting_mode = inputs
    ctx.save_for_backward(weight, output[1], output[2])
    ctx.x_dtype, ctx.residual_dtype = x.dtype, residual.dtype
    ctx.mark_non_differentiable(output[2])
    ctx.set_materialize_grads(False)  # as in the eager Function


def _backward_fn(ctx, grad_y, grad_h, _):
    weight, h, rstd = ctx.saved_tensors
    if grad_y is None and grad_h is None:
        return None, None, None, None, None, None
    if grad_y is None:  # the op needs a y gradient; an h gradient is optional
        grad_y = torch.zeros_like(h)
    dx, dresidual, dw = backward_op(grad_y, grad_h, h, weight, rstd, ctx.x_dtype, ctx.residual_dtype, ctx.offset,
                                    ctx.casting_mode)
    if ctx.x_dtype == ctx.residual_dtype:  # one gradient for both (an op's outputs may not alias)
        dresidual = dx
    return dx, dresidual, (dw if weight is not None else None), None, None, None


forward_op = define("fused_add_rms_norm_forward",
                    "(Tensor x, Tensor residual, Tensor? weight, float eps, float offset, str casting_mode) "
                    "-> (Tensor, Tensor, Tensor)", _forward, _forward_fake, setup_context=_setup_context,
                    backward=_backward_fn)


def _backward_op(grad_y, grad_h, h, weight, rstd, x_dtype, residual_dtype, offset, casting_mode):
    dx, dresidual, dw = _backward(grad_y, grad_h, h, weight, rstd, dtype_name(x_dtype), dtype_name(residual_dtype),
                                  offset, casting_mode, in_place=False)
    return dx, (dresidual if dresidual is not dx else absent(dx)), (dw if dw is not None else absent(dx))


def _backward_fake(grad_y, grad_h, h, weight, rstd, x_dtype, residual_dtype, offset, casting_mode):
    dresidual = empty_like(h, residual_dtype) if x_dtype != residual_dtype else absent(h)
    return empty_like(h, x_dtype), dresidual, (empty_like(weight) if weight is not None else absent(h))


backward_op = define("fused_add_rms_norm_backward",
                     "(Tensor grad_y, Tensor? grad_h, Tensor h, Tensor? weight, Tensor rstd, ScalarType x_dtype, "
                     "ScalarType residual_dtype, float offset, str casting_mode) -> (Tensor, Tensor, Tensor)",
                     _backward_op, _backward_fake)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6,
                       offset: float = 0.0, casting_mode: str = "llama",
                       in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual; y = rms_norm(h, weight)`` in one pass; returns ``(y, h)`` (h: the new residual).

    Casting modes and ``offset`` as in :func:`liger_torch.rms_norm`, with h in the role of x. With
    ``in_place`` the backward writes dx over the gradient of y (and a separate dresidual over the gradient of
    h) when that is safe: same dtype, dense, held by nothing else. No effect under ``torch.compile``, where
    nothing is written in place. As autograd's add, the backward hands one tensor to x and residual when their
    dtypes agree (one write fewer).
    """
    check_tensors(x=x, residual=residual, weight=weight)
    if compiling():  # the op's plan checks eps when it runs (dynamo would trace the check's math.isfinite)
        y, h, _ = forward_op(x, residual, weight, float(eps), float(offset), casting_mode)
        return y, h
    eps, offset = check_eps(eps), check_finite(offset, "offset")
    return LigerFusedAddRMSNormFunction.apply(x, residual, weight, eps, offset, casting_mode,
                                              check_bool(in_place, "in_place"))


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

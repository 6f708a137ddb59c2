"""LayerNorm for torch: autograd wiring around :mod:`liger_core.layer_norm`."""

from __future__ import annotations

import numbers

import torch
from torch import nn

from liger_core import layer_norm as core
from liger_core.launch import check_bool, check_eps, check_positive_int

from ._custom_ops import absent, compiling, define, empty_like
from ._launch import check_tensors, info, num_sms, once_differentiable, optional_info, rowwise, run_plan


def _forward(x, weight, bias, eps):
    """``(x as the kernel read it, y, mean, rstd)``: x is a row-foldable view of the input, or a copy."""
    x = rowwise(x)
    plan = core.forward_plan(info(x), optional_info(weight), optional_info(bias), eps=eps)
    y, mean, rstd = run_plan(plan, x=x, weight=weight, bias=bias)
    return x, y, mean, rstd


def _backward(dy, x, weight, bias_info, mean, rstd):
    """``(dx, dw, db)`` (None for an absent parameter); x as :func:`_forward` returned it."""
    dy = rowwise(dy)
    # Not in place: the gradient of a LayerNorm output is often shared (e.g. a pre-norm's input branch).
    plan = core.backward_plan(info(dy), info(x), optional_info(weight), bias_info, num_sms=num_sms(x.device),
                              in_place=False)
    grads = list(run_plan(plan, dy=dy, x=x, weight=weight, mean=mean, rstd=rstd))
    dx = grads.pop(0)
    dw = grads.pop(0) if weight is not None else None
    db = grads.pop(0) if bias_info is not None else None
    return dx, dw, db


class LigerLayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        x, y, mean, rstd = _forward(x, weight, bias, eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.bias_info = optional_info(bias)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = _backward(grad_output, x, weight, ctx.bias_info, mean, rstd)
        return dx, dw, db, None


# torch.compile path (see _custom_ops): the same helpers as custom ops.


def _forward_op(x, weight, bias, eps):
    return _forward(x, weight, bias, eps)[1:]


def _forward_fake(x, weight, bias, eps):
    rows = x.shape[:-1]
    return empty_like(x), empty_like(x, torch.float32, rows), empty_like(x, torch.float32, rows)


def _setup_context(ctx, inputs, output):
    x, weight, bias, _ = inputs
    ctx.save_for_backward(x, weight, bias, *output[1:])
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)  # no zero-filled gradients for mean and rstd


def _backward_fn(ctx, dy, *_):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dw, db = backward_op(dy, x, weight, bias, mean, rstd)
    return dx, (dw if weight is not None else None), (db if bias is not None else None), None


forward_op = define("layer_norm_forward",
                    "(Tensor x, Tensor? weight, Tensor? bias, float eps) -> (Tensor, Tensor, Tensor)", _forward_op,
                    _forward_fake, setup_context=_setup_context, backward=_backward_fn)


def _backward_op(dy, x, weight, bias, mean, rstd):
    dx, dw, db = _backward(dy, rowwise(x), weight, optional_info(bias), mean, rstd)
    return dx, (dw if dw is not None else absent(dx)), (db if db is not None else absent(dx))


def _backward_fake(dy, x, weight, bias, mean, rstd):
    return tuple(empty_like(t) if t is not None else absent(x) for t in (x, weight, bias))


backward_op = define("layer_norm_backward",
                     "(Tensor dy, Tensor x, Tensor? weight, Tensor? bias, Tensor mean, Tensor rstd) "
                     "-> (Tensor, Tensor, Tensor)", _backward_op, _backward_fake)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None = None,
               eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dimension: ``(x - mean) * rstd * weight + bias`` (weight and bias optional).

    Computed in fp32, rounded once to x's dtype, as ``torch.nn.functional.layer_norm`` does."""
    check_tensors(x=x, weight=weight, bias=bias)
    if compiling():  # the op's plan checks eps when it runs (dynamo would trace the check's math.isfinite)
        return forward_op(x, weight, bias, float(eps))[0]
    eps = check_eps(eps)
    return LigerLayerNormFunction.apply(x, weight, bias, eps)


class LayerNorm(nn.Module):
    """Drop-in for ``torch.nn.LayerNorm`` over the last dimension (attributes ``normalized_shape``, ``eps``,
    ``elementwise_affine``, ``weight``, ``bias``; same state_dict keys)."""

    def __init__(self, hidden_size, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device=None, dtype=None):
        super().__init__()
        if isinstance(hidden_size, numbers.Integral):
            hidden_size = (hidden_size,)
        hidden_size = tuple(hidden_size)
        if len(hidden_size) != 1:
            raise ValueError(f"hidden_size must be an int or a 1-tuple (only the last dimension is normalised), "
                             f"got {hidden_size}")
        hidden_size = (check_positive_int(hidden_size[0], "hidden_size"),)
        check_eps(eps)
        check_bool(elementwise_affine, "elementwise_affine")
        check_bool(bias, "bias")
        self.normalized_shape = hidden_size
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
            if bias:
                self.bias = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim == 0 or x.shape[-1] != self.normalized_shape[0]:
            raise ValueError(f"x's last dimension must be {self.normalized_shape[0]}, got shape {tuple(x.shape)}")
        return layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"

"""SwiGLU / GeGLU for torch: autograd wiring around :mod:`liger_core.swiglu`, and HF-compatible MLP modules."""

from __future__ import annotations

import torch
from torch import nn

from liger_core import swiglu as core

from ._custom_ops import compiling, define, empty_like
from ._launch import check_tensors, info, rowwise, run_plan


def _overlap(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether the memory spans of x and y intersect."""
    if x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr():
        return False

    def span(t):
        start = t.data_ptr()
        extent = sum((d - 1) * s for d, s in zip(t.shape, t.stride())) + 1
        return start, start + extent * t.element_size()

    (a0, a1), (b0, b1) = span(x), span(y)
    return a0 < b1 and b0 < a1


def _forward(a, b, activation):
    """``(a, b as the kernel read them, c)``: row-foldable views of the inputs, or copies."""
    a, b = rowwise(a), rowwise(b)
    (c,) = run_plan(core.forward_plan(info(a), info(b), activation=activation), a=a, b=b)
    return a, b, c


def _backward(dc, a, b, activation, in_place):
    """``(da, db)``; a and b as :func:`_forward` returned them."""
    dc = rowwise(dc)
    plan = core.backward_plan(info(dc), info(a), info(b), activation=activation, in_place=in_place)
    return run_plan(plan, dc=dc, a=a, b=b)


class LigerGatedActivationFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, activation, in_place):
        a, b, c = _forward(a, b, activation)
        ctx.save_for_backward(a, b)
        ctx.activation, ctx.in_place = activation, in_place
        return c

    @staticmethod
    def backward(ctx, dc):
        a, b = ctx.saved_tensors
        # Writing da over a and db over b frees two activation-sized buffers; only when a and b are distinct
        # memory, and only when the caller said nothing else reads them (the MLP modules own theirs).
        in_place = ctx.in_place and not _overlap(a, b)
        da, db = _backward(dc, a, b, ctx.activation, in_place)
        if in_place:
            # a and b now hold gradients: bump their version so that any other user of the saved tensors
            # (a second backward with retain_graph, another op that saved them) fails loudly, not silently.
            for saved, grad in ((a, da), (b, db)):
                if grad.data_ptr() == saved.data_ptr():
                    torch.autograd.graph.increment_version(saved)
        return da, db, None, None


# torch.compile path (see _custom_ops): the same helpers as custom ops, never in place.


def _forward_op(a, b, activation):
    return _forward(a, b, activation)[2]


def _forward_fake(a, b, activation):
    return empty_like(a)


def _setup_context(ctx, inputs, output):
    a, b, ctx.activation = inputs
    ctx.save_for_backward(a, b)


def _backward_fn(ctx, dc):
    a, b = ctx.saved_tensors
    da, db = backward_op(dc, a, b, ctx.activation)
    return da, db, None


forward_op = define("gated_activation_forward", "(Tensor a, Tensor b, str activation) -> Tensor", _forward_op,
                    _forward_fake, setup_context=_setup_context, backward=_backward_fn)


def _backward_op(dc, a, b, activation):
    return _backward(dc, rowwise(a), rowwise(b), activation, in_place=False)


def _backward_fake(dc, a, b, activation):
    return empty_like(a), empty_like(b)


backward_op = define("gated_activation_backward", "(Tensor dc, Tensor a, Tensor b, str activation) -> (Tensor, Tensor)",
                     _backward_op, _backward_fake)


def _gated(a, b, activation, in_place):
    check_tensors(a=a, b=b)
    if compiling():
        return forward_op(a, b, activation)
    return LigerGatedActivationFunction.apply(a, b, activation, bool(in_place))


def swiglu(a: torch.Tensor, b: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """``silu(a) * b`` (LLaMA's MLP gate). The backward recomputes silu(a); with ``in_place`` it writes da
    over a and db over b, which is only right when nothing else needs a and b afterwards (not under
    ``torch.compile``, where nothing is written in place)."""
    return _gated(a, b, "silu", in_place)


def geglu(a: torch.Tensor, b: torch.Tensor, approximate: str = "tanh", in_place: bool = False) -> torch.Tensor:
    """``gelu(a) * b`` (Gemma's MLP gate); ``approximate`` is ``"tanh"`` (``gelu_pytorch_tanh``) or ``"none"``
    (exact erf), as in ``F.gelu``. ``in_place`` as for :func:`swiglu`."""
    return _gated(a, b, core.gelu_activation(approximate), in_place)


# HF activation names of the gated MLPs (ACT2FN keys) -> the kernel's activation.
_SILU_NAMES = ("silu", "swish")
_GELU_NAMES = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh",
               "gelu": "gelu"}


class _GatedMLP(nn.Module):
    def __init__(self, config, activation: str, bias: bool, in_place: bool):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=bias)
        self.activation = activation
        self.in_place = in_place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # gate_proj(x) and up_proj(x) are this module's own temporaries (the Linear backward saves x, not its
        # output), so the gated backward may write its gradients over them.
        return self.down_proj(_gated(self.gate_proj(x), self.up_proj(x), self.activation, self.in_place))

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}, in_place={self.in_place}"


class SwiGLUMLP(_GatedMLP):
    """Drop-in for HF ``LlamaMLP`` (``gate_proj``, ``up_proj``, ``down_proj``; bias per ``config.mlp_bias``)."""

    def __init__(self, config, in_place: bool = True):
        act = getattr(config, "hidden_act", "silu")
        if act not in _SILU_NAMES:
            raise ValueError(f"config.hidden_act must be one of {_SILU_NAMES} for SwiGLUMLP, got {act!r}")
        super().__init__(config, "silu", bool(getattr(config, "mlp_bias", False)), in_place)


class GeGLUMLP(_GatedMLP):
    """Drop-in for HF ``GemmaMLP``: the activation is ``config.hidden_activation`` (Gemma's key), else
    ``config.hidden_act``, else ``gelu_pytorch_tanh``; bias per ``config.mlp_bias`` (Gemma: none)."""

    def __init__(self, config, in_place: bool = True):
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None) or "gelu_pytorch_tanh"
        if act not in _GELU_NAMES:
            raise ValueError(f"config.hidden_activation must be one of {tuple(_GELU_NAMES)} for GeGLUMLP, "
                             f"got {act!r}")
        super().__init__(config, _GELU_NAMES[act], bool(getattr(config, "mlp_bias", False)), in_place)

"""SwiGLU / GeGLU for torch: autograd wiring around :mod:`liger_core.swiglu`, and HF-compatible MLP modules."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as _module_mod

from liger_core import swiglu as core
from liger_core.launch import check_bool

from ._custom_ops import compiling, define, empty_like
from ._launch import check_tensors, info, once_differentiable, optional_info, rowwise, run_plan


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


def _saved_backward(dc, a, b, activation, in_place):
    """``(da, db)`` from the a and b an autograd Function saved. Writing da over a and db over b frees two
    activation-sized buffers; only when a and b are distinct memory, and only when the caller said nothing else
    reads them (the MLP modules own theirs)."""
    in_place = in_place and not _overlap(a, b)
    da, db = _backward(dc, a, b, activation, in_place)
    if in_place:
        # a and b now hold gradients: bump their version so that any other user of the saved tensors (a second
        # backward with retain_graph, another op that saved them) fails loudly, not silently.
        for saved, grad in ((a, da), (b, db)):
            if grad.data_ptr() == saved.data_ptr():
                torch.autograd.graph.increment_version(saved)
    return da, db


class LigerGatedActivationFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, activation, in_place):
        a, b, c = _forward(a, b, activation)
        ctx.save_for_backward(a, b)
        ctx.activation, ctx.in_place = activation, in_place
        return c

    @staticmethod
    @once_differentiable
    def backward(ctx, dc):
        a, b = ctx.saved_tensors
        da, db = _saved_backward(dc, a, b, ctx.activation, ctx.in_place)
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
    return LigerGatedActivationFunction.apply(a, b, activation, check_bool(in_place, "in_place"))


def swiglu(a: torch.Tensor, b: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """``silu(a) * b`` (LLaMA's MLP gate). The backward recomputes silu(a); with ``in_place`` it writes da
    over a and db over b, which is only right when nothing else needs a and b afterwards (not under
    ``torch.compile``, where nothing is written in place)."""
    return _gated(a, b, "silu", in_place)


def geglu(a: torch.Tensor, b: torch.Tensor, approximate: str = "tanh", in_place: bool = False) -> torch.Tensor:
    """``gelu(a) * b`` (Gemma's MLP gate); ``approximate`` is ``"tanh"`` (``gelu_pytorch_tanh``) or ``"none"``
    (exact erf), as in ``F.gelu``. ``in_place`` as for :func:`swiglu`."""
    return _gated(a, b, core.gelu_activation(approximate), in_place)


# The gated activation and the down projection together: ``(act(a) * b) @ weight.T + bias`` without saving the
# product for the backward (it is recomputed there, one more elementwise pass, for the weight's gradient). An MLP
# then keeps a and b, not a third (N, I) activation: at Llama-3.2-1B's shape, 256 MB a layer at 16k tokens.


class LigerGatedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, weight, bias, activation, in_place):
        a, b, c = _forward(a, b, activation)
        out = torch.nn.functional.linear(c, weight, bias)
        ctx.save_for_backward(a, b, weight)
        ctx.activation, ctx.in_place, ctx.has_bias = activation, in_place, bias is not None
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        a, b, weight = ctx.saved_tensors
        need_ab = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        dout2 = dout.reshape(-1, dout.shape[-1])
        dweight = dbias = None
        c = None
        if ctx.needs_input_grad[2]:
            _, _, c = _forward(a, b, ctx.activation)  # the product, recomputed
            dweight = torch.mm(dout2.t(), c.reshape(-1, c.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[3]:
            dbias = dout2.sum(0)
        da = db = None
        if need_ab:
            # d(product) = dout @ weight, written over the recomputed product where there is one
            dc = torch.mm(dout2, weight, out=c.view(-1, c.shape[-1]) if c is not None else None)
            da, db = _saved_backward(dc.view(a.shape), a, b, ctx.activation, ctx.in_place)
        return da, db, dweight, dbias, None, None


def _can_fuse_linear(c_dtype: torch.dtype, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether :class:`LigerGatedLinearFunction` applies: eager, plain tensors of one dtype, no autocast (which
    would cast inside ``F.linear`` and give the weight a gradient of another dtype). Otherwise the caller takes
    the unfused path (``linear(gated(a, b))``), which is always right."""
    params = (weight,) if bias is None else (weight, bias)
    return (not compiling() and torch.is_grad_enabled() and not torch.is_autocast_enabled(weight.device.type)
            and all(type(p) in (torch.Tensor, nn.Parameter) and p.dtype == c_dtype for p in params))


def _gated_linear(a, b, weight, bias, activation, in_place):
    check_tensors(a=a, b=b, weight=weight, bias=bias)
    core.check_inputs(info(a), info(b), activation)  # a and b first, then the projection
    core.check_linear(info(a), info(weight), optional_info(bias))
    if not torch.is_autocast_enabled(weight.device.type):  # autocast casts them itself, as in F.linear
        for name, p in (("weight", weight), ("bias", bias)):
            if p is not None and p.dtype != a.dtype:
                raise TypeError(f"{name} must have a's dtype {a.dtype} (outside autocast), got {p.dtype}")
    if not _can_fuse_linear(a.dtype, weight, bias):
        return torch.nn.functional.linear(_gated(a, b, activation, in_place), weight, bias)
    return LigerGatedLinearFunction.apply(a, b, weight, bias, activation, check_bool(in_place, "in_place"))


def swiglu_linear(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  in_place: bool = False) -> torch.Tensor:
    """``F.linear(silu(a) * b, weight, bias)`` (a Llama MLP after its gate and up projections) that saves a and
    b but not the product: the backward recomputes it for the weight's gradient. ``in_place`` as for
    :func:`swiglu`. Under ``torch.compile``, under autocast, or with mixed dtypes it is the unfused
    ``F.linear(swiglu(a, b), weight, bias)`` (same numbers)."""
    return _gated_linear(a, b, weight, bias, "silu", in_place)


def geglu_linear(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 approximate: str = "tanh", in_place: bool = False) -> torch.Tensor:
    """:func:`swiglu_linear` with ``gelu(a) * b`` (``approximate`` as for :func:`geglu`)."""
    return _gated_linear(a, b, weight, bias, core.gelu_activation(approximate), in_place)


def plain_linear(module: nn.Module) -> bool:
    """Whether ``module`` is exactly an ``nn.Linear`` that nothing hooks: its forward may then be replaced by a
    direct use of its weight and bias. (PEFT / quantised layers are other classes; DeepSpeed ZeRO-3 gathers
    a partitioned weight in a forward pre-hook; FSDP2 and others hook modules too.)"""
    return (type(module) is nn.Linear and not any(getattr(module, h, None) for h in _MODULE_HOOKS)
            and not any(getattr(_module_mod, h, None) for h in _GLOBAL_HOOKS))


_MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")


def gated_down(a: torch.Tensor, b: torch.Tensor, down: nn.Module, activation: str, in_place: bool) -> torch.Tensor:
    """``down(act(a) * b)``: through :func:`swiglu_linear`'s recomputing path when ``down`` is a plain
    ``nn.Linear`` (eager), else the activation kernel and then the module."""
    if not compiling() and plain_linear(down):
        return _gated_linear(a, b, down.weight, down.bias, activation, in_place)
    return down(_gated(a, b, activation, in_place))


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
        return gated_down(self.gate_proj(x), self.up_proj(x), self.down_proj, self.activation, self.in_place)

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

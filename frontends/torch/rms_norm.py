"""RMSNorm for torch: autograd wiring around :mod:`liger_core.rms_norm`."""

from __future__ import annotations

import contextlib
import contextvars
import weakref

import torch
from torch import nn

from liger_core import rms_norm as core
from liger_core.launch import check_bool, check_eps, check_finite, check_positive_int

from ._custom_ops import absent, compiling, define, empty_like
from ._launch import (
    check_tensors, dtype_name, info, num_sms, once_differentiable, optional_info, rowwise, run_plan, sole_reference,
)


def _forward(x, weight, eps, offset, casting_mode):
    """``(x as the kernel read it, y, rstd)``: x is a row-foldable view of the input, or a copy."""
    x = rowwise(x)
    plan = core.forward_plan(info(x), optional_info(weight), eps=eps, offset=offset, casting_mode=casting_mode)
    y, rstd = run_plan(plan, x=x, weight=weight)
    return x, y, rstd


def _backward(dy, x, weight, rstd, offset, casting_mode, in_place):
    """``(dx, dw)`` (dw None without a weight); x as :func:`_forward` returned it."""
    in_place = in_place and sole_reference(dy)
    dy = rowwise(dy)
    plan = core.backward_plan(info(dy), info(x), optional_info(weight), offset=offset, casting_mode=casting_mode,
                              num_sms=num_sms(x.device), in_place=in_place)
    grads = run_plan(plan, dy=dy, x=x, weight=weight, rstd=rstd)
    return grads[0], (grads[1] if weight is not None else None)


class LigerRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, offset, casting_mode, in_place):
        x, y, rstd = _forward(x, weight, eps, offset, casting_mode)
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset, ctx.casting_mode, ctx.in_place = offset, casting_mode, in_place
        if any(ctx.needs_input_grad[:2]):  # a norm outside the autograd graph saves nothing to replace
            _register_output(y, x, weight, eps, offset, casting_mode)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = _backward(grad_output, x, weight, rstd, ctx.offset, ctx.casting_mode, ctx.in_place)
        return dx, dw, None, None, None, None


# torch.compile path (see _custom_ops): the same helpers as custom ops, never in place.


def _forward_op(x, weight, eps, offset, casting_mode):
    _, y, rstd = _forward(x, weight, eps, offset, casting_mode)
    return y, rstd


def _forward_fake(x, weight, eps, offset, casting_mode):
    y_dtype = core.output_dtype(dtype_name(x.dtype), None if weight is None else dtype_name(weight.dtype),
                                casting_mode)
    return empty_like(x, y_dtype), empty_like(x, torch.float32, x.shape[:-1])


def _setup_context(ctx, inputs, output):
    x, weight, _, ctx.offset, ctx.casting_mode = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)  # no zero-filled gradient for rstd


def _backward_fn(ctx, dy, _):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = backward_op(dy, x, weight, rstd, ctx.offset, ctx.casting_mode)
    return dx, (dw if weight is not None else None), None, None, None


forward_op = define("rms_norm_forward",
                    "(Tensor x, Tensor? weight, float eps, float offset, str casting_mode) -> (Tensor, Tensor)",
                    _forward_op, _forward_fake, setup_context=_setup_context, backward=_backward_fn)


def _backward_op(dy, x, weight, rstd, offset, casting_mode):
    dx, dw = _backward(dy, rowwise(x), weight, rstd, offset, casting_mode, in_place=False)
    return dx, (dw if dw is not None else absent(dx))


def _backward_fake(dy, x, weight, rstd, offset, casting_mode):
    return empty_like(x), (empty_like(weight) if weight is not None else absent(x))


backward_op = define("rms_norm_backward",
                     "(Tensor dy, Tensor x, Tensor? weight, Tensor rstd, float offset, str casting_mode) "
                     "-> (Tensor, Tensor)", _backward_op, _backward_fake)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6, offset: float = 0.0,
             casting_mode: str = "llama", in_place: bool = True) -> torch.Tensor:
    """RMSNorm over the last dimension: ``x * rstd * (offset + weight)``.

    ``casting_mode`` is ``"llama"`` (HF LlamaRMSNorm), ``"gemma"`` (all fp32; use offset=1.0 for Gemma) or
    ``"none"``. With ``in_place`` the backward writes dx over the incoming gradient when that is safe: same
    dtype, dense, and held by nothing else (a post-norm feeding a residual sum, as in Gemma 2/3, receives the
    gradient the residual branch also holds: it then writes a fresh dx). Under ``torch.compile`` nothing is
    written in place (``in_place`` has no effect there; see ``liger_torch._custom_ops``).
    """
    check_tensors(x=x, weight=weight)
    if compiling():  # the op's plan checks eps when it runs (dynamo would trace the check's math.isfinite)
        return forward_op(x, weight, float(eps), float(offset), casting_mode)[0]
    eps, offset = check_eps(eps), check_finite(offset, "offset")
    return LigerRMSNormFunction.apply(x, weight, eps, offset, casting_mode,
                                      check_bool(in_place, "in_place"))


class RMSNorm(nn.Module):
    """Drop-in for ``LlamaRMSNorm`` (attributes ``weight`` and ``variance_epsilon``, same state_dict keys)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0, casting_mode: str = "llama",
                 in_place: bool = True, init_fn: str = "ones", device=None, dtype=None):
        super().__init__()
        if init_fn not in ("ones", "zeros"):
            raise ValueError(f"init_fn must be 'ones' or 'zeros', got {init_fn!r}")
        if casting_mode not in core.CASTING_MODES:
            raise ValueError(f"casting_mode must be one of {tuple(core.CASTING_MODES)}, got {casting_mode!r}")
        hidden_size = check_positive_int(hidden_size, "hidden_size")
        check_eps(eps)
        check_finite(offset, "offset")
        check_bool(in_place, "in_place")
        fill = torch.ones if init_fn == "ones" else torch.zeros
        self.weight = nn.Parameter(fill(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps
        self.offset = offset
        self.casting_mode = casting_mode
        self.in_place = in_place

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon, self.offset, self.casting_mode,
                        self.in_place)

    def extra_repr(self) -> str:
        return (f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, offset={self.offset}, "
                f"casting_mode={self.casting_mode!r}, in_place={self.in_place}")


# ---------------------------------------------------------------------------------------------------------
# Norm outputs recomputed instead of saved
#
# A norm's output y is the input of the next linear layers (q/k/v, gate/up), which save it for their weight
# gradient: N x H values a norm, although y is a cheap function of what the norm itself saves (x and rstd). Inside
# recompute_norm_outputs(), a saved y is replaced by a recipe (through saved-tensor hooks) and recomputed, bitwise
# the same, when the backward first needs it.

_OUTPUTS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("liger_rms_norm_outputs", default=None)


class _NormOutput:
    """How to recompute one RMSNorm output: the input and weight its own backward keeps alive anyway (the forward
    recomputes rstd too: one row reduction, cheaper than keeping a second reference to it)."""

    def __init__(self, y, x, weight, eps, offset, casting_mode):
        self.output = weakref.ref(y)
        self.x, self.weight = x, weight
        self.args = (eps, offset, casting_mode)
        self.x_version = x._version
        self.recomputed = None  # a weak reference: the q/k/v projections' backwards share one recomputation

    def materialize(self) -> torch.Tensor:
        y = self.recomputed() if self.recomputed is not None else None
        if y is None:
            if self.x._version != self.x_version:
                raise RuntimeError("an RMSNorm input was modified in place after the forward; its output, needed "
                                   "by the backward, cannot be recomputed (leave recompute_norm_outputs off; for "
                                   "patched HF models set LIGER_RECOMPUTE_NORM_OUTPUTS=0)")
            if self.weight is not None and self.weight.numel() != self.x.shape[-1]:
                raise RuntimeError(f"an RMSNorm weight has {self.weight.numel()} elements when its output is "
                                   f"recomputed in the backward (hidden size {self.x.shape[-1]}): a parameter "
                                   "sharding framework released it; set LIGER_RECOMPUTE_NORM_OUTPUTS=0 (or leave "
                                   "recompute_norm_outputs off), or keep the norm in the unit of the layers after it")
            with torch.no_grad():
                _, y, _ = _forward(self.x, self.weight, *self.args)
            self.recomputed = weakref.ref(y)
        return y


class _SavedView:
    """What autograd keeps for a saved tensor that is (a view of) a norm output: the recipe and the view."""

    def __init__(self, recipe: _NormOutput, t: torch.Tensor):
        self.recipe, self.view = recipe, (t.size(), t.stride(), t.storage_offset())
        self.version = t._version

    def materialize(self) -> torch.Tensor:
        y = self.recipe.output()
        if y is not None and y._version != self.version:
            raise RuntimeError("an RMSNorm output saved for the backward was modified in place after it was saved")
        return self.recipe.materialize().as_strided(*self.view)


def _register_output(y, x, weight, eps, offset, casting_mode) -> None:
    outputs = _OUTPUTS.get()
    if outputs is not None and type(y) is torch.Tensor and y.numel():
        outputs[y.untyped_storage().data_ptr()] = _NormOutput(y, x, weight, eps, offset, casting_mode)


def _pack(t):
    # A linear layer saves a 2-d view of its 3-d input, not the input itself: match by storage (a live output's
    # storage is shared only by its views) and keep the view's geometry.
    outputs = _OUTPUTS.get()
    if outputs and type(t) is torch.Tensor and t.device.type != "meta":
        recipe = outputs.get(t.untyped_storage().data_ptr())
        y = recipe.output() if recipe is not None else None
        if y is not None and y.dtype == t.dtype and y.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
            return _SavedView(recipe, t)
    return t


def _unpack(saved):
    return saved.materialize() if isinstance(saved, _SavedView) else saved


@contextlib.contextmanager
def recompute_norm_outputs(enabled: bool = True):
    """Within this context, a tensor that autograd saves and that is the output of an ``rms_norm`` call made in
    the context (the input of q/k/v or gate/up projections) is not kept: the backward recomputes it from the
    norm's own saved input (one forward pass of the norm, bitwise the same). Saves N x H values per norm (2 GiB
    over Llama-3.2-1B's 16 layers at 16k tokens). The patched HF causal LMs run their body inside it while
    training (not under torch.compile or gradient checkpointing, which have their own recomputation)."""
    if not enabled or _OUTPUTS.get() is not None:
        yield
        return
    token = _OUTPUTS.set({})
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            yield
    finally:
        _OUTPUTS.reset(token)

"""The loss side of a patched ``*ForCausalLM.forward``.

The patched forward wraps the model class's own forward (``functools.wraps``: ``inspect.signature`` still shows
the original parameters, which ``generate()`` and the ``Trainer`` read). It takes over only when the model is
in training mode and ``labels`` are given:

- ``"fused_linear_cross_entropy"``: the decoder body (``self.model``) runs as in the original, and the loss is
  computed by :func:`liger_torch.fused_linear_cross_entropy` from the last hidden states and
  ``lm_head.weight`` without materialising the logits. **The output's ``logits`` is then None.** Granite's
  ``logits_scaling`` divides the hidden states (``(h / s) W^T = logits / s``); Gemma 2/3's
  ``final_logit_softcapping`` is the kernel's ``softcap``.
- ``"cross_entropy"``: the original forward computes the logits (without labels) and the loss is
  :func:`liger_torch.cross_entropy` on them.

Both follow transformers' ``ForCausalLMLoss``: labels shifted left by one (last position ignored), or
``shift_labels`` as given; ``ignore_index`` (default -100); with ``num_items_in_batch`` the loss is the sum over
tokens divided by it (gradient accumulation then equals one large batch), else the mean over non-ignored tokens;
MoE models add ``router_aux_loss_coef * aux_loss`` when ``output_router_logits``. ``logits_to_keep`` (an int,
the last k positions, or an index tensor) selects hidden states and the matching shifted labels. The loss is
returned in fp32 like transformers' (the fused kernel computes and returns it in fp32).
In eval mode or without labels the original forward runs unchanged.

The fused loss needs the full (V, H) ``lm_head.weight``. Under DDP, FSDP2 with lm_head in the root unit, or
DeepSpeed ZeRO-3 (which gathers a parameter read inside a forward) it is the full tensor already; with lm_head
its own ``fully_shard`` unit the loss runs as lm_head's forward, so that FSDP2 gathers the weight for it. A
weight still sharded (tensor parallelism) or partitioned is an error that names the remedies. Under
``torch.autocast`` the kernel gets the hidden states and weight in the autocast dtype, as lm_head's ``F.linear``
would (bf16 logits; the weight's gradient arrives in its own dtype).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import os

import torch
import torch.nn.functional as F

from .._custom_ops import compiling
from ..cross_entropy import cross_entropy
from ..fused_linear_cross_entropy import fused_linear_cross_entropy
from ..rms_norm import recompute_norm_outputs


def _keep(x: torch.Tensor, logits_to_keep, dim: int) -> torch.Tensor:
    if isinstance(logits_to_keep, int):
        if logits_to_keep == 0:
            return x
        return x.narrow(dim, x.shape[dim] - logits_to_keep, logits_to_keep)
    return x.index_select(dim, logits_to_keep.to(x.device).reshape(-1)) if logits_to_keep.ndim <= 1 else \
        x[(slice(None),) * (dim % x.ndim) + (logits_to_keep,)]


def _targets(labels, shift_labels, ignore_index, logits_to_keep, length, device):
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    shift_labels = shift_labels.to(device)
    if shift_labels.shape[-1] != length:  # full-length labels with logits_to_keep: keep the same positions
        shift_labels = _keep(shift_labels, logits_to_keep, shift_labels.ndim - 1)
    return shift_labels.reshape(-1)


def _divide(loss, num_items_in_batch):
    if num_items_in_batch is None:
        return loss
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def _output_fields():
    """{moe: (output class, its field names)}, read once at import: ``dataclasses.fields`` inside the forward
    would be a graph break under torch.compile."""
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    return {moe: (cls, frozenset(f.name for f in dataclasses.fields(cls)))
            for moe, cls in ((False, CausalLMOutputWithPast), (True, MoeCausalLMOutputWithPast))}


_OUTPUT_FIELDS = _output_fields()


def _output(self, outputs, loss, logits, aux_loss, moe: bool, return_dict):
    cls, names = _OUTPUT_FIELDS[bool(moe)]
    data = {"loss": loss, "logits": logits}
    if "aux_loss" in names:
        data["aux_loss"] = aux_loss
    for name in ("past_key_values", "cache", "hidden_states", "attentions", "router_logits"):
        if name in names and getattr(outputs, name, None) is not None:
            data[name] = getattr(outputs, name)
    result = cls(**data)
    return result if return_dict else result.to_tuple()


def _aux_loss(self, family, outputs, attention_mask):
    router_logits = getattr(outputs, "router_logits", None)
    if router_logits is None:
        return None
    balance = getattr(importlib.import_module(family.module), "load_balancing_loss_func")
    num_experts = getattr(self, "num_experts", None) or getattr(self.config, "num_experts", None) or \
        self.config.num_local_experts
    top_k = getattr(self, "num_experts_per_tok", None) or self.config.num_experts_per_tok
    return balance(router_logits, num_experts, top_k, attention_mask)


@functools.lru_cache(maxsize=None)
def _distributed_classes():
    """(DTensor, FSDPModule), each None where this torch build lacks it."""
    dtensor = fsdp_module = None
    if torch.distributed.is_available():
        try:
            from torch.distributed.tensor import DTensor as dtensor
        except ImportError:
            pass
        try:
            from torch.distributed.fsdp import FSDPModule as fsdp_module
        except ImportError:
            try:  # torch < 2.6: fully_shard's first home
                from torch.distributed._composable.fsdp import FSDPModule as fsdp_module
            except ImportError:
                pass
    return dtensor, fsdp_module


def _through_module(module, fn, *args):
    """``fn(*args)`` run in place of ``module``'s forward, inside ``module(...)``: the hooks that data-parallel
    wrappers put on the module run around it (FSDP2 gathers a ``fully_shard``-ed module's parameters before its
    forward and reduce-scatters their gradients after its backward). The module's own forward is restored as
    soon as ``fn`` starts, so nothing else sees the swap."""
    had_own = "forward" in module.__dict__
    own = module.__dict__.get("forward")

    def restore():
        if had_own:
            module.forward = own
        else:
            module.__dict__.pop("forward", None)

    def redirected(*inner_args):
        restore()
        return fn(*inner_args)

    module.forward = redirected
    try:
        return module(*args)
    finally:
        restore()


def _full_weight(head, weight):
    dtensor, _ = _distributed_classes()
    if dtensor is not None and isinstance(weight, dtensor):
        raise RuntimeError(
            f"liger_torch: lm_head.weight is a DTensor (placements {tuple(weight.placements)}, local shape "
            f"{tuple(weight.to_local().shape)}), but the fused linear cross-entropy of the patched forward needs the "
            "full (vocab, hidden) weight on every rank. Shard lm_head with FSDP2 (fully_shard on the model or on "
            "lm_head; its weight is gathered for the loss), keep lm_head out of tensor parallelism, or patch with "
            "fused_linear_cross_entropy=False (the loss then comes from the logits, e.g. cross_entropy=True)")
    expected = (getattr(head, "out_features", None), getattr(head, "in_features", None))
    if weight.ndim != 2 or (None not in expected and tuple(weight.shape) != expected):
        raise RuntimeError(
            f"liger_torch: lm_head.weight has shape {tuple(weight.shape)}, not the full {expected}: it looks "
            "sharded or flattened by a wrapper that gathers it only inside lm_head's own forward, which the fused "
            "linear cross-entropy bypasses. Use FSDP2 (fully_shard) or DeepSpeed ZeRO-3, whose gathering the "
            "patched forward supports, or patch with fused_linear_cross_entropy=False (the loss then comes from "
            "the logits, e.g. cross_entropy=True)")
    return weight


def _head_loss(head, hidden, target, options):
    weight, bias = _full_weight(head, head.weight), head.bias
    return fused_linear_cross_entropy(hidden, weight, target, bias=bias, **options)


def _lm_head_loss(head, hidden, target, options):
    """The fused linear cross-entropy of ``hidden`` (N, H) with the lm_head's full weight.

    Under FSDP2 with lm_head in the root unit (or DDP, or DeepSpeed ZeRO-3, whose parameters gather when read in
    a forward), ``lm_head.weight`` is already the full tensor here. With lm_head its own ``fully_shard`` unit
    it is a sharded DTensor outside lm_head's forward: the loss then runs as lm_head's forward, so that FSDP2
    gathers the weight for it and reduce-scatters its gradient. Any other sharded weight is an error naming
    the remedies."""
    dtensor, fsdp_module = _distributed_classes()
    if (dtensor is not None and fsdp_module is not None and isinstance(head, fsdp_module)
            and isinstance(head.weight, dtensor)):
        return _through_module(head, lambda h, t: _head_loss(head, h, t, options), hidden, target)
    return _head_loss(head, hidden, target, options)


def _activation_checkpointing(model) -> bool:
    """Whether HF gradient checkpointing is on: ``is_activation_checkpointing`` where transformers has it (its old
    name ``is_gradient_checkpointing`` warns there that it is deprecated), else the old name."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def _run_recomputing_norm_outputs(model, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with the norm outputs recomputed in the backward instead of saved by the projections
    that read them (rms_norm.recompute_norm_outputs), except where something else already recomputes (torch.compile,
    gradient checkpointing) or the environment says LIGER_RECOMPUTE_NORM_OUTPUTS=0."""
    if compiling():  # nothing for dynamo to trace: no hooks, no context manager
        return fn(*args, **kwargs)
    enabled = (torch.is_grad_enabled() and not _activation_checkpointing(model)
               and os.environ.get("LIGER_RECOMPUTE_NORM_OUTPUTS", "1") != "0")
    with recompute_norm_outputs(enabled):
        return fn(*args, **kwargs)


def _fused_forward(self, family, params, kwargs):
    labels = kwargs.pop("labels")
    shift_labels = kwargs.pop("shift_labels", None)
    logits_to_keep = kwargs.pop("logits_to_keep", 0)
    ignore_index = kwargs.pop("ignore_index", -100)
    num_items_in_batch = kwargs.pop("num_items_in_batch", None)
    return_dict = kwargs.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    router = False
    if "output_router_logits" in params:
        router = kwargs.get("output_router_logits")
        if router is None:
            router = bool(getattr(self.config, "output_router_logits", False))
        kwargs["output_router_logits"] = router
    body = getattr(self, self.base_model_prefix)
    outputs = _run_recomputing_norm_outputs(self, body, **kwargs)
    hidden = outputs.last_hidden_state if hasattr(outputs, "last_hidden_state") else outputs[0]
    hidden = _keep(hidden, logits_to_keep, 1)
    target = _targets(labels, shift_labels, ignore_index, logits_to_keep, hidden.shape[1], hidden.device)
    if family.logits_scaling:
        hidden = hidden / self.config.logits_scaling
    softcap = getattr(self.config, "final_logit_softcapping", None) if family.softcap else None
    loss = _lm_head_loss(self.lm_head, hidden.reshape(-1, hidden.shape[-1]), target, dict(
        ignore_index=ignore_index, reduction="sum" if num_items_in_batch is not None else "mean", softcap=softcap))
    loss = _divide(loss.float(), num_items_in_batch)
    aux_loss = _aux_loss(self, family, outputs, kwargs.get("attention_mask")) if router else None
    if aux_loss is not None:
        loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
    return _output(self, outputs, loss, None, aux_loss, "output_router_logits" in params, return_dict)


def _ce_forward(self, family, original, params, kwargs):
    labels = kwargs.pop("labels")
    shift_labels = kwargs.pop("shift_labels", None)
    ignore_index = kwargs.pop("ignore_index", -100)
    num_items_in_batch = kwargs.pop("num_items_in_batch", None)
    return_dict = kwargs.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    out = _run_recomputing_norm_outputs(self, original, self, **kwargs, return_dict=True)
    logits = out.logits
    target = _targets(labels, shift_labels, ignore_index, kwargs.get("logits_to_keep", 0), logits.shape[1],
                      logits.device)
    loss = cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target, ignore_index=ignore_index,
                         reduction="sum" if num_items_in_batch is not None else "mean")
    loss = _divide(loss, num_items_in_batch)
    aux_loss = getattr(out, "aux_loss", None)
    if aux_loss is not None:
        loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
    # a new output with the loss in its field's place: set on the old one it would come last in the tuple
    out = type(out)(loss=loss, **{key: value for key, value in out.items() if key != "loss"})
    return out if return_dict else out.to_tuple()


def make_causal_lm_forward(original, family, mode: str):
    """The patched forward of a ``*ForCausalLM`` class whose forward is ``original``; ``mode`` is
    ``"fused_linear_cross_entropy"`` or ``"cross_entropy"``."""
    original = getattr(original, "_liger_original", original)
    signature = inspect.signature(original)
    params = list(signature.parameters)[1:]
    positional = [n for n, p in list(signature.parameters.items())[1:]
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        if args:
            if len(args) > len(positional) or any(n in kwargs for n in positional[:len(args)]):
                return original(self, *args, **kwargs)
            kwargs.update(zip(positional, args))
        if not self.training or kwargs.get("labels") is None:
            return original(self, **kwargs)
        if mode == "fused_linear_cross_entropy":
            return _fused_forward(self, family, params, kwargs)
        return _ce_forward(self, family, original, params, kwargs)

    forward._liger_original = original
    forward._liger_mode = mode
    return forward

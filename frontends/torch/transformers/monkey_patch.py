"""``apply_liger_kernel_to_<family>``: the kernels in Hugging Face transformers models, before or after building.

Two ways, both per model family:

- **Module level** (``model=None``): the family's modeling module (``transformers.models.llama.modeling_llama``)
  gets kernel subclasses in place of its ``*RMSNorm`` / ``*MLP`` / ``*Experts`` classes and a kernel
  ``apply_rotary_pos_emb``, and its ``*ForCausalLM.forward`` is wrapped (class attribute) with the loss of
  :mod:`._causal_lm`. Models built afterwards use the kernels (``from_pretrained`` included); the CausalLM
  forward also changes for models built before. Every change is journaled: :func:`revert_liger_kernel` and
  the :func:`liger_kernel_patched` context manager undo exactly what was done.
- **Instance** (``model=...``): the submodules of that model (a PEFT-wrapped model too) get the kernel subclass
  as ``__class__``; parameters, buffers, state_dict keys, devices and dtypes stay as they are. RoPE, a module
  function, reaches the instance through its attention layers, whose forward is the class's own with
  ``apply_rotary_pos_emb`` rebound to the kernel. ``revert_liger_kernel(model)`` swaps the classes back. The
  modeling module is not touched.

The kernel subclasses keep the HF constructors, so checkpoints, weight init (``Liger<Name>RMSNorm`` still
matches transformers' name-based init), ``save_pretrained`` and ``generate`` are unchanged.

What is not patched: layers the families do not have as separate modules (attention itself, the MoE router);
the fused-tensor experts of Mixtral / Qwen3-MoE (transformers 5.x stores them as (E, 2I, H) / (E, H, I)
parameters, not per-expert MLP modules) get the SwiGLU kernel in their gating step (``_apply_gate``, used by the
``grouped_mm`` / ``batched_mm`` experts implementations) and in the eager loop, while the expert matmuls stay
transformers'; an activation the kernels lack falls back to the original code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import warnings

import torch

from . import _layers
from ._causal_lm import make_causal_lm_forward
from ._patching import (journal_length, liger_subclass, original_class, patched_families, revert, set_attr,
                        swap_classes, unswap_classes, with_globals)


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    prefix: str
    model_types: tuple[str, ...]
    gate: str = "swiglu"            # the name of the MLP switch: swiglu or geglu
    norm_offset: float = 0.0
    norm_casting: str = "llama"
    mlp: str = "gated"              # gated (gate/up/down_proj), fused (Phi3 gate_up_proj) or none
    experts: bool = False
    logits_scaling: bool = False    # Granite
    softcap: bool = False           # Gemma 2/3 final_logit_softcapping
    module_name: str = ""

    @property
    def module(self) -> str:
        return f"transformers.models.{self.module_name or self.name}.modeling_{self.module_name or self.name}"


_GEMMA = dict(gate="geglu", norm_offset=1.0, norm_casting="gemma")
FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("llama", "Llama", ("llama",)),
    Family("mistral", "Mistral", ("mistral",)),
    Family("mixtral", "Mixtral", ("mixtral",), mlp="none", experts=True),
    Family("gemma", "Gemma", ("gemma",), **_GEMMA),
    # Gemma 2/3 add the post-attention / post-feedforward norms' outputs to the residual, so those norms' output
    # gradient is shared with the residual branch: their backward writes in place only when it holds that
    # gradient alone (liger_torch._launch.sole_reference), as every norm backward does.
    Family("gemma2", "Gemma2", ("gemma2",), softcap=True, **_GEMMA),
    Family("gemma3", "Gemma3", ("gemma3_text", "gemma3"), softcap=True, **_GEMMA),
    Family("qwen2", "Qwen2", ("qwen2",)),
    Family("qwen3", "Qwen3", ("qwen3",)),
    Family("qwen3_moe", "Qwen3Moe", ("qwen3_moe",), experts=True),
    Family("phi3", "Phi3", ("phi3",), mlp="fused"),
    # OLMo 2: (weight * x_normed) in fp32, then cast (gemma casting without offset); post-norms as Gemma 2.
    Family("olmo2", "Olmo2", ("olmo2",), norm_casting="gemma"),
    Family("granite", "Granite", ("granite",), logits_scaling=True),
]}
MODEL_TYPES = {t: f for f in FAMILIES.values() for t in f.model_types}


def _module(family: Family):
    return importlib.import_module(family.module)


def _cls(module, name):
    cls = getattr(module, name, None)
    return None if cls is None else original_class(cls)


def _check(rope, cross_entropy, fused_linear_cross_entropy, layer_norm, family):
    if cross_entropy and fused_linear_cross_entropy:
        raise ValueError("cross_entropy and fused_linear_cross_entropy are exclusive: choose one")
    if layer_norm:
        warnings.warn(f"liger_torch: {family.name} has no LayerNorm modules; layer_norm=True changes nothing",
                      stacklevel=3)


def _replacements(family: Family, module, rms_norm: bool, gate: bool):
    """{original class: kernel subclass} for the family's norm / MLP / experts classes that this version has."""
    out = {}
    if rms_norm and (cls := _cls(module, f"{family.prefix}RMSNorm")) is not None:
        out[cls] = liger_subclass(cls, "rms_norm", (family.norm_offset, family.norm_casting),
                                  {"forward": _layers.rms_norm_forward, "_liger_offset": family.norm_offset,
                                   "_liger_casting_mode": family.norm_casting})
    if gate and (cls := _cls(module, f"{family.prefix}MLP")) is not None and family.mlp != "none":
        forward = _layers.fused_gate_up_mlp_forward if family.mlp == "fused" else _layers.gated_mlp_forward
        out[cls] = liger_subclass(cls, "mlp", (family.mlp,), {"forward": forward})
    if gate and family.experts and (cls := _cls(module, f"{family.prefix}Experts")) is not None:
        out[cls] = liger_subclass(cls, "experts", (), {"forward": _layers.experts_forward,
                                                        "_apply_gate": _layers.experts_apply_gate})
    return out


def _rope_fn(module):
    original = getattr(module, "apply_rotary_pos_emb")
    original = getattr(original, "_liger_original", original)
    return _layers.make_rope(original)


def _apply(family: Family, *, rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True,
           gate=True, layer_norm=False, model=None):
    _check(rope, cross_entropy, fused_linear_cross_entropy, layer_norm, family)
    module = _module(family)
    loss_mode = ("fused_linear_cross_entropy" if fused_linear_cross_entropy else
                 "cross_entropy" if cross_entropy else None)
    causal_lm = _cls(module, f"{family.prefix}ForCausalLM")
    attention = _cls(module, f"{family.prefix}Attention")
    mapping = _replacements(family, module, rms_norm, gate)
    if model is None:
        for original, sub in mapping.items():
            set_attr(family.name, module, original.__name__, sub)
        if rope and hasattr(module, "apply_rotary_pos_emb"):
            set_attr(family.name, module, "apply_rotary_pos_emb", _rope_fn(module))
        if loss_mode and causal_lm is not None:
            current = causal_lm.__dict__.get("forward", causal_lm.forward)
            set_attr(family.name, causal_lm, "forward",
                     make_causal_lm_forward(current, family, loss_mode))
        return None
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a transformers model, PEFT-wrapped or not), got "
                        f"{type(model).__name__}")
    if rope and attention is not None and hasattr(module, "apply_rotary_pos_emb"):
        forward = with_globals(attention.forward, {"apply_rotary_pos_emb": _rope_fn(module)})
        mapping[attention] = liger_subclass(attention, "rope", (), {"forward": forward})
    if loss_mode and causal_lm is not None and not any(isinstance(m, causal_lm) for m in model.modules()):
        warnings.warn(f"liger_torch: {type(model).__name__} holds no {causal_lm.__name__}, whose loss is the one "
                      f"patched: its layers are patched, its loss is HF's own (logits materialised)", stacklevel=3)
    if loss_mode and causal_lm is not None:
        mapping[causal_lm] = liger_subclass(
            causal_lm, f"causal_lm:{loss_mode}", (),
            {"forward": make_causal_lm_forward(causal_lm.forward, family, loss_mode)}, keep_name=True)
    swap_classes(model, mapping)
    return model


def _make_apply(family: Family):
    gate = family.gate

    def apply(rope: bool = True, cross_entropy: bool = False, fused_linear_cross_entropy: bool = True,
              rms_norm: bool = True, layer_norm: bool = False, model=None, **kwargs):
        unknown = set(kwargs) - {gate}
        if unknown:
            raise TypeError(f"apply_liger_kernel_to_{family.name}() got unexpected arguments {sorted(unknown)}")
        return _apply(family, rope=rope, cross_entropy=cross_entropy,
                      fused_linear_cross_entropy=fused_linear_cross_entropy, rms_norm=rms_norm,
                      gate=kwargs.get(gate, True), layer_norm=layer_norm, model=model)

    # A signature that names the family's own gate switch (swiglu= or geglu=), for help() and kwarg filtering.
    params = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=d) for n, d in
              [("rope", True), ("cross_entropy", False), ("fused_linear_cross_entropy", True), ("rms_norm", True),
               (gate, True), ("layer_norm", False), ("model", None)]]
    apply.__signature__ = inspect.Signature(params)
    apply.__name__ = apply.__qualname__ = f"apply_liger_kernel_to_{family.name}"
    what = "GeGLU MLP" if gate == "geglu" else ("SwiGLU experts gate" if family.mlp == "none" else "SwiGLU MLP")
    extras = []
    if family.norm_offset:
        extras.append(f"RMSNorm offset {family.norm_offset}, casting {family.norm_casting!r}")
    if family.softcap:
        extras.append("final_logit_softcapping inside the fused loss")
    if family.logits_scaling:
        extras.append("logits_scaling applied inside the fused loss (hidden / scale)")
    apply.__doc__ = (
        f"Patch {family.prefix} models: RoPE, RMSNorm, {what}, and the causal-LM loss (fused linear "
        f"cross-entropy by default: in training with labels the output's logits are None; or "
        f"cross_entropy=True for the kernel cross-entropy on materialised logits). "
        + ("; ".join(extras) + ". " if extras else "")
        + "model=None patches the modeling module (models built afterwards; undo with revert_liger_kernel), "
          "model=<instance> patches that model in place.")
    return apply


apply_liger_kernel_to_llama = _make_apply(FAMILIES["llama"])
apply_liger_kernel_to_mistral = _make_apply(FAMILIES["mistral"])
apply_liger_kernel_to_mixtral = _make_apply(FAMILIES["mixtral"])
apply_liger_kernel_to_gemma = _make_apply(FAMILIES["gemma"])
apply_liger_kernel_to_gemma2 = _make_apply(FAMILIES["gemma2"])
apply_liger_kernel_to_gemma3 = _make_apply(FAMILIES["gemma3"])
apply_liger_kernel_to_gemma3_text = apply_liger_kernel_to_gemma3
apply_liger_kernel_to_qwen2 = _make_apply(FAMILIES["qwen2"])
apply_liger_kernel_to_qwen3 = _make_apply(FAMILIES["qwen3"])
apply_liger_kernel_to_qwen3_moe = _make_apply(FAMILIES["qwen3_moe"])
apply_liger_kernel_to_phi3 = _make_apply(FAMILIES["phi3"])
apply_liger_kernel_to_olmo2 = _make_apply(FAMILIES["olmo2"])
apply_liger_kernel_to_granite = _make_apply(FAMILIES["granite"])

APPLY_FUNCTIONS = {name: globals()[f"apply_liger_kernel_to_{name}"] for name in FAMILIES}
_OPTION_NAMES = {"rope", "cross_entropy", "fused_linear_cross_entropy", "rms_norm", "swiglu", "geglu", "layer_norm"}


def _family_of(model_type: str) -> Family:
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    if model_type not in MODEL_TYPES:
        raise ValueError(f"liger_torch: no kernels for model_type {model_type!r}; supported: "
                         f"{sorted(MODEL_TYPES)}")
    return MODEL_TYPES[model_type]


def _options(family: Family, kwargs: dict) -> dict:
    """The options the family's apply function takes: the other family's gate switch (swiglu vs geglu) is
    translated, so one set of options serves every family."""
    out = dict(kwargs)
    other = "swiglu" if family.gate == "geglu" else "geglu"
    if other in out:
        value = out.pop(other)
        out.setdefault(family.gate, value)
    return out


# Multimodal model types of a supported family: their text layers are the family's, their loss is not patched.
_LOSS_NOT_PATCHED = {"gemma3": "Gemma3ForConditionalGeneration"}


def apply_liger_kernel(model_or_model_type, **kwargs):
    """Patch by ``config.model_type``: a model instance (PEFT-wrapped too) is patched in place and returned; a
    model_type string or a config patches the family's modeling module (models built afterwards)."""
    target = model_or_model_type
    if isinstance(target, str):
        model_type, model = target, None
    elif isinstance(target, torch.nn.Module):
        config = getattr(target, "config", None)
        if config is None:
            raise ValueError("apply_liger_kernel: the model has no .config to read model_type from")
        model_type, model = config.model_type, target
    elif hasattr(target, "model_type"):
        model_type, model = target.model_type, None
    else:
        raise TypeError(f"apply_liger_kernel takes a model, a config or a model_type string, got "
                        f"{type(target).__name__}")
    family = _family_of(model_type)
    options = _options(family, kwargs)
    if model is None and model_type in _LOSS_NOT_PATCHED and (options.get("fused_linear_cross_entropy", True)
                                                              or options.get("cross_entropy", False)):
        warnings.warn(f"liger_torch: model_type {model_type!r} builds a {_LOSS_NOT_PATCHED[model_type]}, whose "
                      "loss is not patched (only the text-only *ForCausalLM's is): its layers are patched, its "
                      "loss is HF's own (logits materialised)", stacklevel=2)
    return APPLY_FUNCTIONS[family.name](model=model, **options)



def revert_liger_kernel(target=None) -> int:
    """Undo patches. ``None``: every module-level patch; a family name or model_type: that family's; a model
    instance: swap its patched submodules back to the HF classes. Returns how many changes were undone."""
    if target is None:
        return revert()
    if isinstance(target, torch.nn.Module):
        return unswap_classes(target)
    return revert(_family_of(target).name)


@contextlib.contextmanager
def liger_kernel_patched(*model_types: str, **kwargs):
    """Module-level patching of the given families (model_types or family names; all of them when none is
    named) for the duration of the block; on exit exactly these patches are undone, even after an error."""
    start = journal_length()
    try:
        for model_type in model_types or tuple(FAMILIES):
            apply_liger_kernel(model_type, **kwargs)
        yield
    finally:
        revert(since=start)


class AutoLigerKernelForCausalLM:
    """``AutoModelForCausalLM`` that patches the family's modeling module before building (module level: the
    patch stays until :func:`revert_liger_kernel`). Liger options (``rope=``, ``rms_norm=``, ``swiglu=`` /
    ``geglu=``, ``cross_entropy=``, ``fused_linear_cross_entropy=``, ``layer_norm=``) are taken from the
    keyword arguments; the rest go to transformers."""

    @staticmethod
    def _split(kwargs):
        liger = {k: kwargs.pop(k) for k in list(kwargs) if k in _OPTION_NAMES}
        return liger

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        from transformers import AutoConfig, AutoModelForCausalLM

        liger = cls._split(kwargs)
        config = kwargs.get("config")
        if config is None:
            config = AutoConfig.from_pretrained(pretrained_model_name_or_path,
                                                trust_remote_code=kwargs.get("trust_remote_code", False))
        apply_liger_kernel(config.model_type, **liger)
        return AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    @classmethod
    def from_config(cls, config, **kwargs):
        from transformers import AutoModelForCausalLM

        liger = cls._split(kwargs)
        apply_liger_kernel(config.model_type, **liger)
        return AutoModelForCausalLM.from_config(config, **kwargs)


__all__ = ["AutoLigerKernelForCausalLM", "FAMILIES", "apply_liger_kernel", "liger_kernel_patched",
           "patched_families", "revert_liger_kernel", *[f"apply_liger_kernel_to_{n}" for n in FAMILIES],
           "apply_liger_kernel_to_gemma3_text"]

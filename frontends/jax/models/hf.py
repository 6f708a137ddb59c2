"""Hugging Face <-> Flax conversion for :class:`~liger_jax.models.llama.LlamaForCausalLM` (no hub access).

The Flax model mirrors HF's module names, so a state-dict key maps by walking the same path: torch Linear
``weight`` (out, in) -> ``kernel`` (in, out), Embedding ``weight`` -> ``embedding``, RMSNorm ``weight`` ->
``scale``, ``bias`` -> ``bias``.
"""

from __future__ import annotations

import glob
import json
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from .llama import LlamaConfig, LlamaForCausalLM, RMSNorm

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gemma")


def _get(cfg, name, default=None):
    return cfg.get(name, default) if isinstance(cfg, dict) else getattr(cfg, name, default)


def config_from_hf(hf_config) -> LlamaConfig:
    """A :class:`LlamaConfig` from a transformers config object or its dict (transformers 4 or 5 layout)."""
    model_type = _get(hf_config, "model_type", "llama")
    if model_type not in SUPPORTED:
        raise NotImplementedError(f"model_type {model_type!r}; supported: {SUPPORTED}")
    rope = dict(_get(hf_config, "rope_parameters", None) or {})  # transformers 5
    legacy = _get(hf_config, "rope_scaling", None)  # transformers 4
    if legacy and not rope.get("rope_type"):
        rope.update(legacy)
    theta = rope.pop("rope_theta", None) or _get(hf_config, "rope_theta", 10000.0)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    rope_scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}
    attention_bias = bool(_get(hf_config, "attention_bias", False))
    sliding_window = None
    if model_type == "mistral":
        sliding_window = _get(hf_config, "sliding_window", None)
    elif _get(hf_config, "use_sliding_window", False):
        raise NotImplementedError(f"{model_type} with use_sliding_window=True is not supported")
    if _get(hf_config, "use_bidirectional_attention", False):
        raise NotImplementedError(f"{model_type} with use_bidirectional_attention=True is not supported")
    gemma = model_type == "gemma"
    pad = _get(hf_config, "pad_token_id", 0 if gemma else None)
    return LlamaConfig(
        vocab_size=_get(hf_config, "vocab_size"),
        hidden_size=_get(hf_config, "hidden_size"),
        intermediate_size=_get(hf_config, "intermediate_size"),
        num_hidden_layers=_get(hf_config, "num_hidden_layers"),
        num_attention_heads=_get(hf_config, "num_attention_heads"),
        num_key_value_heads=_get(hf_config, "num_key_value_heads", None),
        head_dim=_get(hf_config, "head_dim", None),
        rms_norm_eps=float(_get(hf_config, "rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        rope_scaling=rope_scaling,
        max_position_embeddings=_get(hf_config, "max_position_embeddings", 2048),
        tie_word_embeddings=bool(_get(hf_config, "tie_word_embeddings", gemma)),
        qkv_bias=True if model_type == "qwen2" else attention_bias,
        o_bias=False if model_type == "qwen2" else attention_bias,
        mlp_bias=bool(_get(hf_config, "mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        sliding_window=sliding_window,
        hidden_act=_gemma_activation(hf_config) if gemma else _get(hf_config, "hidden_act", "silu"),
        norm_offset=1.0 if gemma else 0.0,
        norm_casting="gemma" if gemma else "llama",
        scale_embeddings=gemma,
        pad_token_id=pad if pad is not None and 0 <= pad < _get(hf_config, "vocab_size") else None,
        model_type=model_type,
    )


def _gemma_activation(hf_config) -> str:
    """transformers 4 reads ``hidden_activation`` (unset: tanh GELU); 5 reads ``hidden_act`` and takes the
    legacy "gelu" of the original checkpoints to mean the tanh approximation too."""
    act = _get(hf_config, "hidden_activation", None)
    if act:
        return act
    act = _get(hf_config, "hidden_act", None)
    return "gelu_pytorch_tanh" if act in (None, "gelu") else act


def _to_numpy(t):
    if isinstance(t, np.ndarray):
        return t
    import torch

    t = t.detach().cpu()
    return t.float().numpy() if t.dtype in (torch.bfloat16, torch.float16) else t.numpy()


def _target(model: LlamaForCausalLM, key: str):
    """(module, leaf name, transpose) of the Flax parameter for an HF state-dict key."""
    *path, leaf = key.split(".")
    module = model
    for part in path:
        module = module[int(part)] if part.isdigit() else getattr(module, part)
    if leaf == "bias":
        return module, "bias", False
    if leaf != "weight":
        raise KeyError(key)
    if isinstance(module, nnx.Linear):
        return module, "kernel", True
    if isinstance(module, nnx.Embed):
        return module, "embedding", False
    if isinstance(module, RMSNorm):
        return module, "scale", False
    raise KeyError(key)


def _load_folder(path):
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    from safetensors.numpy import load_file

    state = {}
    for file in files:
        state.update(load_file(file))
    return config, state


def from_hf(model_or_path, *, use_kernels=True, dtype=None, param_dtype=jnp.float32, remat: bool = False,
            state_dict=None) -> LlamaForCausalLM:
    """A Flax :class:`LlamaForCausalLM` with the weights of an HF causal LM: a transformers model in memory,
    a local folder (``config.json`` + ``*.safetensors``), or a config with an explicit ``state_dict``."""
    if isinstance(model_or_path, (str, os.PathLike)):
        hf_config, state = _load_folder(model_or_path)
    elif hasattr(model_or_path, "state_dict") and hasattr(model_or_path, "config"):
        hf_config, state = model_or_path.config, model_or_path.state_dict()
    else:
        hf_config, state = model_or_path, state_dict
        if state is None:
            raise ValueError("pass state_dict= with a bare config")
    config = config_from_hf(hf_config)
    model = LlamaForCausalLM(config, use_kernels=use_kernels, dtype=dtype, param_dtype=param_dtype, remat=remat,
                             rngs=nnx.Rngs(0))
    expected = {k for k, _ in _hf_keys(model)}
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the tied copy of model.embed_tokens.weight
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise KeyError(f"state dict does not match the config: missing {sorted(missing)}, "
                       f"unexpected {sorted(unexpected)}")
    for key, value in state.items():
        module, leaf, transpose = _target(model, key)
        param = getattr(module, leaf)
        array = _to_numpy(value)
        array = array.T if transpose else array
        if array.shape != param.shape:
            raise ValueError(f"{key}: shape {array.shape} does not fit the Flax parameter {param.shape}")
        param[...] = jnp.asarray(array, param_dtype)
    return model


def _hf_keys(model: LlamaForCausalLM):
    """(HF key, (module, leaf, transpose)) for every parameter of the Flax model."""
    out = []
    for path, param in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        *mods, leaf = [str(p) for p in path]
        hf_leaf = "bias" if leaf == "bias" else "weight"
        out.append((".".join(mods + [hf_leaf]), None))
    return out


def state_dict_from_flax(model: LlamaForCausalLM) -> dict:
    """The HF state dict (numpy arrays) of a Flax model (a tied model has no ``lm_head.weight``)."""
    state = {}
    for key, _ in _hf_keys(model):
        module, leaf, transpose = _target(model, key)
        array = np.asarray(getattr(module, leaf)[...])
        state[key] = np.ascontiguousarray(array.T) if transpose else array
    return state


def config_to_hf(config: LlamaConfig):
    """The transformers config of a :class:`LlamaConfig` (LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config,
    GemmaConfig)."""
    import transformers

    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
           "gemma": transformers.GemmaConfig}[config.model_type]
    rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling:
        rope.update(config.rope_scaling)
    kw = dict(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
              intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
              num_attention_heads=config.num_attention_heads, num_key_value_heads=config.kv_heads,
              head_dim=config.dim_per_head, rms_norm_eps=config.rms_norm_eps, rope_parameters=rope,
              max_position_embeddings=config.max_position_embeddings,
              tie_word_embeddings=config.tie_word_embeddings, hidden_act=config.hidden_act,
              pad_token_id=config.pad_token_id)
    if config.model_type == "llama":
        kw.update(attention_bias=config.qkv_bias, mlp_bias=config.mlp_bias)
    elif config.model_type in ("qwen3", "gemma"):
        kw.update(attention_bias=config.qkv_bias)
    elif config.model_type == "mistral":
        kw.update(sliding_window=config.sliding_window)
    return cls(**kw)


def to_hf(model: LlamaForCausalLM, hf_model=None):
    """The weights of a Flax model in an HF torch causal LM: loaded into ``hf_model`` when given, else into a
    new one built from :func:`config_to_hf` (fp32, eager attention). Returns the torch model."""
    import torch
    import transformers

    if hf_model is None:
        hf_config = config_to_hf(model.config)
        hf_model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager")
    state = {k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in state_dict_from_flax(model).items()}
    target = hf_model.state_dict()
    if model.config.tie_word_embeddings and "lm_head.weight" in target:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    state = {k: v.to(target[k].dtype) for k, v in state.items()}
    hf_model.load_state_dict(state, strict=True)
    return hf_model

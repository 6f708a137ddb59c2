"""A Llama-family causal LM in Flax NNX (llama, mistral, qwen2, qwen3, gemma) on the liger_jax kernels.

Module and parameter names follow Hugging Face's ``LlamaForCausalLM`` (``model.embed_tokens``,
``model.layers[i].self_attn.q_proj``, ``mlp.gate_proj``, ``input_layernorm``, ``model.norm``, ``lm_head``) with
Flax's leaf names (``kernel`` (in, out), ``bias``, ``embedding``, ``scale``), so the weight mapping in
:mod:`liger_jax.models.hf` is mechanical.

``use_kernels`` routes RMSNorm, RoPE, the gated MLP activation (SwiGLU, or GeGLU for gemma) and the loss through
liger_jax (``True``), none of them (``False``: the pure-XLA baseline) or a chosen subset (a dict /
:class:`Kernels`). Attention always goes through ``jax.nn.dot_product_attention`` (GQA natively, causal, Mistral's
sliding window as a local window). ``attention_implementation`` picks its backend: ``None`` (default) takes cuDNN's
flash attention on a GPU for bf16/fp16 (jax's own default would be XLA's, which materialises the (T x T) scores of
every head: ~190 GiB at Llama-3.2-1B's shape and 4 x 4096 tokens) and XLA elsewhere; "xla" / "cudnn" force one.

Gemma differs from Llama in four places, all config fields: the norms multiply by ``1 + scale`` computed in fp32
(``norm_offset``, ``norm_casting``), the MLP is GeGLU with the tanh approximation (``hidden_act``), the embeddings
are multiplied by sqrt(hidden_size) in the compute dtype (``scale_embeddings``), and the head is tied.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..fused_linear_cross_entropy import fused_linear_cross_entropy
from ..rms_norm import rms_norm
from ..rope import rope
from ..nnx.swiglu import gated_down
from ..swiglu import geglu, swiglu

IGNORE_INDEX = -100
# hidden_act -> GELU approximation of the gated MLP (None: SiLU, i.e. SwiGLU); HF's ACT2FN names
ACTIVATIONS = {"silu": None, "gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu": "none"}


@dataclasses.dataclass(frozen=True)
class Kernels:
    """Which parts run on liger_jax kernels (the rest is plain jnp / XLA)."""

    rms_norm: bool = True
    rope: bool = True
    swiglu: bool = True
    geglu: bool = True  # gemma's gated MLP
    loss: bool = True  # fused linear cross-entropy: logits never materialised

    @classmethod
    def of(cls, use_kernels) -> "Kernels":
        if isinstance(use_kernels, Kernels):
            return use_kernels
        if isinstance(use_kernels, bool):
            return cls(**{f.name: use_kernels for f in dataclasses.fields(cls)})
        if isinstance(use_kernels, dict):
            unknown = set(use_kernels) - {f.name for f in dataclasses.fields(cls)}
            if unknown:
                raise ValueError(f"unknown kernels in use_kernels: {sorted(unknown)}")
            return cls(**{f.name: bool(use_kernels.get(f.name, False)) for f in dataclasses.fields(cls)})
        raise TypeError(f"use_kernels must be a bool, a dict or a Kernels, got {type(use_kernels).__name__}")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None  # None: = num_attention_heads (no GQA)
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None / {"rope_type": "default"} or {"rope_type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"}
    rope_scaling: Any = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # llama/mistral/qwen3: attention_bias; qwen2: True
    o_bias: bool = False  # llama/mistral/qwen3: attention_bias; qwen2: False
    mlp_bias: bool = False
    qk_norm: bool = False  # qwen3: RMSNorm over head_dim of q and k before RoPE
    sliding_window: int | None = None  # mistral: a token sees the last `sliding_window` positions
    hidden_act: str = "silu"  # "silu": SwiGLU; "gelu_pytorch_tanh" (gemma): GeGLU, tanh approximation
    norm_offset: float = 0.0  # gemma: 1.0, the norms multiply by (1 + scale) (and their scales start at zero)
    norm_casting: str = "llama"  # "llama": normalise in fp32, scale in x's dtype; "gemma": all in fp32
    scale_embeddings: bool = False  # gemma: embeddings times sqrt(hidden_size), rounded to the compute dtype
    pad_token_id: int | None = None  # HF's Embedding padding_idx: that row gets no gradient from the lookup
    model_type: str = "llama"
    # jax.nn.dot_product_attention's backend: None picks cuDNN flash attention on a GPU in bf16/fp16, else XLA
    attention_implementation: str | None = None

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def __post_init__(self):
        if self.hidden_act not in ACTIVATIONS:
            raise NotImplementedError(f"hidden_act {self.hidden_act!r}: supported are {sorted(ACTIVATIONS)}")
        if self.attention_implementation not in (None, "xla", "cudnn"):
            raise ValueError(f"attention_implementation must be None, 'xla' or 'cudnn', got "
                             f"{self.attention_implementation!r}")
        if self.norm_casting not in ("llama", "gemma"):
            raise ValueError(f"norm_casting must be 'llama' or 'gemma', got {self.norm_casting!r}")
        if self.num_attention_heads % self.kv_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        rope_type = (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise NotImplementedError(f"rope_type {rope_type!r}: only 'default' and 'llama3' are supported")


def inv_frequencies(config: LlamaConfig) -> np.ndarray:
    """RoPE inverse frequencies (D/2,) as fp32 numpy, with Llama-3 frequency scaling when configured."""
    dim = config.dim_per_head
    exponent = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    inv_freq = (1.0 / (np.float64(config.rope_theta) ** exponent.astype(np.float64))).astype(np.float32)
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type", "default")) == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq.astype(np.float64)
        low_wavelen, high_wavelen = old_len / low, old_len / high
        # long wavelengths (low frequencies) are slowed down by `factor`, short ones are kept, and the band
        # between is interpolated linearly in old_len / wavelen
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        t = (old_len / wavelen - low) / (high - low)
        between = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        scaled = np.where(between, (1 - t) * scaled / factor + t * scaled, scaled)
        inv_freq = scaled.astype(np.float32)
    return inv_freq


def rope_tables(config: LlamaConfig, positions, dtype):
    """cos, sin of shape positions.shape + (D,) (HF convention: the D/2 frequencies repeated twice)."""
    inv_freq = jnp.asarray(inv_frequencies(config))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jax.lax.stop_gradient(jnp.cos(emb).astype(dtype)), jax.lax.stop_gradient(jnp.sin(emb).astype(dtype))


def _rotate_half(x):
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


class RMSNorm(nnx.Module):
    """HF ``LlamaRMSNorm``: ``scale * (x32 * rsqrt(mean(x32^2) + eps)).astype(x.dtype)`` (parameter ``scale``);
    with ``casting_mode="gemma"`` HF ``GemmaRMSNorm``: ``(x32 * rsqrt(...) * (offset + scale32)).astype(x.dtype)``.
    The scale starts at ``1 - offset``, so a fresh norm is the identity map either way."""

    def __init__(self, num_features: int, *, epsilon: float, use_kernel: bool, offset: float = 0.0,
                 casting_mode: str = "llama", param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        self.scale = nnx.Param(jnp.full((num_features,), 1.0 - offset, param_dtype))
        self.epsilon = epsilon
        self.offset = offset
        self.casting_mode = casting_mode
        self.use_kernel = use_kernel

    def __call__(self, x):
        # llama rounds the scale to x's dtype first; gemma keeps it (and everything else) in fp32
        scale = self.scale[...].astype(x.dtype if self.casting_mode == "llama" else jnp.float32)
        if self.use_kernel:
            return rms_norm(x, scale, epsilon=self.epsilon, offset=self.offset, casting_mode=self.casting_mode)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.epsilon)
        if self.casting_mode == "gemma":
            return (y * (self.offset + scale)).astype(x.dtype)
        return (self.offset + scale) * y.astype(x.dtype)


def _norm(config: LlamaConfig, num_features: int, kernels: Kernels, param_dtype) -> RMSNorm:
    return RMSNorm(num_features, epsilon=config.rms_norm_eps, offset=config.norm_offset,
                   casting_mode=config.norm_casting, use_kernel=kernels.rms_norm, param_dtype=param_dtype)


class LlamaAttention(nnx.Module):
    def __init__(self, config: LlamaConfig, kernels: Kernels, *, dtype, param_dtype, rngs: nnx.Rngs):
        h, d = config.hidden_size, config.dim_per_head
        nq, nkv = config.num_attention_heads, config.kv_heads
        lin = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                   kernel_init=nnx.initializers.normal(0.02))
        self.q_proj = nnx.Linear(h, nq * d, use_bias=config.qkv_bias, **lin)
        self.k_proj = nnx.Linear(h, nkv * d, use_bias=config.qkv_bias, **lin)
        self.v_proj = nnx.Linear(h, nkv * d, use_bias=config.qkv_bias, **lin)
        self.o_proj = nnx.Linear(nq * d, h, use_bias=config.o_bias, **lin)
        if config.qk_norm:
            self.q_norm = _norm(config, d, kernels, param_dtype)
            self.k_norm = _norm(config, d, kernels, param_dtype)
        self.qk_norm = config.qk_norm
        self.num_heads, self.num_kv_heads, self.head_dim = nq, nkv, d
        self.sliding_window = config.sliding_window
        self.attention_implementation = config.attention_implementation
        self.use_rope_kernel = kernels.rope

    def __call__(self, x, cos, sin, mask=None):
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos.astype(q.dtype), sin.astype(q.dtype)
        if self.use_rope_kernel:
            q, k = rope(q, k, cos, sin)
        else:
            c, s = cos[:, :, None, :], sin[:, :, None, :]
            q, k = q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s
        window = None
        if self.sliding_window is not None and self.sliding_window < t:
            window = (self.sliding_window - 1, 0)
        out = attention(q, k, v, mask, window, self.head_dim ** -0.5, self.attention_implementation)
        return self.o_proj(out.reshape(b, t, self.num_heads * self.head_dim))


def attention(q, k, v, mask, window, scale, implementation):
    """Causal ``jax.nn.dot_product_attention`` of (B, T, H, D) q and (B, T, H_kv, D) k/v. ``implementation``
    None: cuDNN's flash attention on a GPU for bf16/fp16 inputs (O(T) memory), falling back to XLA where cuDNN
    refuses the call (a head_dim or mask it does not support); XLA on other backends and dtypes."""
    call = functools.partial(jax.nn.dot_product_attention, q, k, v, mask=mask, is_causal=True, scale=scale,
                             local_window_size=window)
    if implementation is not None:
        return call(implementation=implementation)
    if jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16):
        try:
            return call(implementation="cudnn")
        except (ValueError, NotImplementedError, RuntimeError, TypeError):
            pass  # checked while tracing: e.g. a head_dim cuDNN's flash attention does not support
    return call(implementation="xla")


class LlamaMLP(nnx.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))``: SwiGLU (silu) or GeGLU (gelu, gemma)."""

    def __init__(self, config: LlamaConfig, kernels: Kernels, *, dtype, param_dtype, rngs: nnx.Rngs):
        lin = dict(use_bias=config.mlp_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                   kernel_init=nnx.initializers.normal(0.02))
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nnx.Linear(h, i, **lin)
        self.up_proj = nnx.Linear(h, i, **lin)
        self.down_proj = nnx.Linear(i, h, **lin)
        self.approximate = ACTIVATIONS[config.hidden_act]  # None: SiLU
        self.use_kernel = kernels.swiglu if self.approximate is None else kernels.geglu

    def _gate(self, a, b):
        if self.approximate is None:
            return swiglu(a, b) if self.use_kernel else jax.nn.silu(a) * b
        if self.use_kernel:
            return geglu(a, b, approximate=self.approximate)
        return jax.nn.gelu(a, approximate=self.approximate == "tanh") * b

    def __call__(self, x):
        a, b = self.gate_proj(x), self.up_proj(x)
        if self.use_kernel:  # the kernel path keeps a and b, not the gated product (recomputed in the backward)
            return gated_down(self.down_proj, self._gate, a, b)
        return self.down_proj(self._gate(a, b))


class LlamaDecoderLayer(nnx.Module):
    def __init__(self, config: LlamaConfig, kernels: Kernels, *, dtype, param_dtype, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.input_layernorm = _norm(config, config.hidden_size, kernels, param_dtype)
        self.self_attn = LlamaAttention(config, kernels, **kw)
        self.post_attention_layernorm = _norm(config, config.hidden_size, kernels, param_dtype)
        self.mlp = LlamaMLP(config, kernels, **kw)

    def __call__(self, x, cos, sin, mask=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def tap_names(config: LlamaConfig) -> list[str]:
    """Names of the activations ``LlamaModel(..., output_hidden_states=True)`` returns, in order."""
    return ["embeddings"] + [f"layers.{i}" for i in range(config.num_hidden_layers)] + ["norm"]


class LlamaModel(nnx.Module):
    """Embedding, decoder layers, final norm: returns the last hidden states (B, T, H)."""

    def __init__(self, config: LlamaConfig, kernels: Kernels, *, dtype, param_dtype, remat: bool,
                 rngs: nnx.Rngs):
        self.config = config
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, dtype=dtype, param_dtype=param_dtype,
                                      embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
        self.layers = nnx.List([LlamaDecoderLayer(config, kernels, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
                                for _ in range(config.num_hidden_layers)])
        self.norm = _norm(config, config.hidden_size, kernels, param_dtype)
        self.dtype = dtype
        self.remat = remat

    def _embed(self, input_ids):
        x = self.embed_tokens(input_ids)
        if self.dtype is not None:
            x = x.astype(self.dtype)
        if self.config.scale_embeddings:  # HF rounds the factor to the activations' dtype (sqrt(3072) -> 55.5)
            x = x * jnp.asarray(self.config.hidden_size ** 0.5, x.dtype)
        pad = self.config.pad_token_id
        if pad is not None:  # torch's Embedding(padding_idx=pad): the padding row's gradient stays zero
            x = jnp.where((input_ids == pad)[..., None], jax.lax.stop_gradient(x), x)
        return x

    def __call__(self, input_ids, attention_mask=None, position_ids=None, *, output_hidden_states: bool = False,
                 taps=None):
        """The final norm's output (B, T, H); with ``output_hidden_states`` also the activations named by
        :func:`tap_names` (embeddings, each layer's output, the final norm's output). ``taps``: arrays added at
        those points (zeros change nothing; the gradient with respect to them is the activations' gradient)."""
        b, t = input_ids.shape
        hidden = []

        def tap(x):
            if taps is not None:
                x = x + taps[len(hidden)].astype(x.dtype)
            hidden.append(x)
            return x

        x = tap(self._embed(input_ids))
        positions = jnp.arange(t)[None] if position_ids is None else jnp.asarray(position_ids).reshape(-1, t)
        cos, sin = rope_tables(self.config, positions, jnp.float32)
        mask = None
        if attention_mask is not None:  # (B, T) 1 = attend, 0 = padding (keys only, as HF does)
            mask = jnp.asarray(attention_mask).astype(bool)[:, None, None, :]
        for layer in self.layers:
            if self.remat:
                x = nnx.remat(lambda lyr, h, c, s, m: lyr(h, c, s, m))(layer, x, cos, sin, mask)
            else:
                x = layer(x, cos, sin, mask)
            x = tap(x)
        x = tap(self.norm(x))
        return (x, tuple(hidden)) if output_hidden_states else x


def shift_labels(labels, ignore_index: int = IGNORE_INDEX):
    """HF causal-LM shift: position t is scored against labels[t + 1]; the last position is ignored."""
    labels = jnp.asarray(labels)
    pad = jnp.full(labels.shape[:-1] + (1,), ignore_index, labels.dtype)
    return jnp.concatenate([labels[..., 1:], pad], axis=-1)


class LlamaForCausalLM(nnx.Module):
    """Causal LM: ``__call__`` returns logits (B, T, V); ``loss`` the HF-style mean next-token loss."""

    def __init__(self, config: LlamaConfig, *, use_kernels=True, dtype=None, param_dtype=jnp.float32,
                 remat: bool = False, rngs: nnx.Rngs | None = None):
        rngs = nnx.Rngs(0) if rngs is None else rngs
        self.config = config
        self.kernels = Kernels.of(use_kernels)
        self.model = LlamaModel(config, self.kernels, dtype=dtype, param_dtype=param_dtype, remat=remat,
                                rngs=rngs)
        if config.tie_word_embeddings:
            self.lm_head = nnx.data(None)
        else:
            self.lm_head = nnx.Linear(config.hidden_size, config.vocab_size, use_bias=False, dtype=dtype,
                                      param_dtype=param_dtype, kernel_init=nnx.initializers.normal(0.02),
                                      rngs=rngs)

    def _head(self):
        """The output projection as (matrix, transpose): (H, V) for lm_head, the tied (V, H) embedding."""
        if self.lm_head is None:
            return self.model.embed_tokens.embedding[...], True
        return self.lm_head.kernel[...], False

    def __call__(self, input_ids, attention_mask=None, position_ids=None):
        return self.logits(self.model(input_ids, attention_mask, position_ids))

    def logits(self, h):
        """The head on hidden states (B, T, H) -> (B, T, V)."""
        w, transpose = self._head()
        w = w.astype(h.dtype)
        return h @ w.T if transpose else h @ w

    def loss(self, input_ids, labels, attention_mask=None, position_ids=None, *,
             ignore_index: int = IGNORE_INDEX):
        """Mean cross-entropy of ``logits[:, t]`` against ``labels[:, t + 1]`` over the non-ignored labels (HF's
        ``ForCausalLMLoss``). With the loss kernel the logits are never materialised (fused linear CE)."""
        h = self.model(input_ids, attention_mask, position_ids)
        return self.loss_from_hidden(h, labels, ignore_index=ignore_index)

    def loss_from_hidden(self, h, labels, *, ignore_index: int = IGNORE_INDEX):
        """:meth:`loss` from the final hidden states (B, T, H)."""
        targets = shift_labels(labels, ignore_index)
        w, transpose = self._head()
        if self.kernels.loss:  # an fp32 head (param_dtype) stays the master of its fp32 gradient: cast inside
            return fused_linear_cross_entropy(h, w, targets, transpose=transpose, ignore_index=ignore_index,
                                              dtype=h.dtype)
        w = w.astype(h.dtype)
        logits = (h @ w.T if transpose else h @ w).astype(jnp.float32)
        valid = targets != ignore_index
        safe = jnp.where(valid, targets, 0)
        logz = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, safe[..., None], axis=-1)[..., 0]
        return jnp.sum(jnp.where(valid, logz - picked, 0.0)) / jnp.sum(valid)

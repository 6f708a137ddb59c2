"""liger_jax.models: config mapping, weight conversion and model features of the Flax Llama-family model.

Tiny fp32 models (random weights from a fixed torch seed, no downloads), eager HF attention. The full parity
(logits, loss and every parameter gradient vs HF unpatched and patched, each family, with and without kernels)
is tests/parity/test_model_parity.py; here: what it does not cover (config fields, the round trip, padding
masks, remat, the sliding window being in effect). Comparisons with HF use helpers.assert_close's fp32 bound
unwidened: |ours - hf| <= 1e-5 + 1e-5 |hf| elementwise.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from helpers import assert_close

from liger_jax.models import Kernels, LlamaForCausalLM, config_from_hf, from_hf, inv_frequencies, to_hf

TINY = dict(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=64)
B, T = 2, 11


def _hf_model(config_cls=transformers.LlamaConfig, seed=0, **overrides):
    torch.manual_seed(seed)
    config = config_cls(**{**TINY, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():  # norms start at ones: perturb them so a wrong mapping or gradient shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _batch(seed=1, vocab=TINY["vocab_size"]):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100  # a masked prompt
    labels[1, 5] = -100
    return ids, labels


@pytest.fixture(scope="module")
def llama():
    ids, labels = _batch()
    return _hf_model(), ids, labels


def test_qwen2_biases_and_mistral_config():
    """qwen2 has q/k/v biases and no o_proj bias; mistral is llama's graph (window wider than the sequence)."""
    cfg = config_from_hf(transformers.Qwen2Config(**TINY))
    assert (cfg.qkv_bias, cfg.o_bias, cfg.qk_norm) == (True, False, False)
    hf = _hf_model(transformers.Qwen2Config, seed=4)
    with torch.no_grad():
        hf.model.layers[0].self_attn.q_proj.bias.normal_()
    ids, _ = _batch(seed=5)
    model = from_hf(hf, use_kernels=False)
    assert_close(model(jnp.asarray(ids.numpy())), hf(input_ids=ids).logits, torch.float32, "qwen2 logits")
    cfg = config_from_hf(transformers.MistralConfig(**TINY, sliding_window=32))
    assert cfg.sliding_window == 32 and not cfg.qkv_bias


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_to_hf_round_trip(llama, family):
    hf = llama[0] if family == "llama" else _hf_model(transformers.GemmaConfig, head_dim=16)
    back = to_hf(from_hf(hf, use_kernels=False))
    assert type(back) is type(hf)
    ref = hf.state_dict()
    assert back.state_dict().keys() == ref.keys()
    for name, value in back.state_dict().items():
        torch.testing.assert_close(value, ref[name], rtol=0, atol=0, msg=name)


def test_gemma_config():
    """gemma: (1 + w) norms in fp32, GeGLU with tanh GELU (also from the legacy "gelu"), scaled embeddings,
    tied head, padding_idx; transformers 4's ``hidden_activation`` wins when set."""
    cfg = config_from_hf(transformers.GemmaConfig(**TINY, head_dim=16))
    assert (cfg.norm_offset, cfg.norm_casting, cfg.scale_embeddings) == (1.0, "gemma", True)
    assert (cfg.tie_word_embeddings, cfg.hidden_act, cfg.pad_token_id, cfg.dim_per_head) == (
        True, "gelu_pytorch_tanh", 0, 16)
    as_dict = {**TINY, "model_type": "gemma", "head_dim": 16, "hidden_act": "gelu"}  # a config.json
    legacy = config_from_hf(as_dict)
    assert (legacy.hidden_act, legacy.tie_word_embeddings, legacy.pad_token_id) == ("gelu_pytorch_tanh", True, 0)
    assert config_from_hf({**as_dict, "hidden_activation": "gelu"}).hidden_act == "gelu"  # exact erf
    llama = config_from_hf(transformers.LlamaConfig(**TINY))
    assert (llama.norm_offset, llama.norm_casting, llama.scale_embeddings, llama.pad_token_id) == (
        0.0, "llama", False, None)
    model = LlamaForCausalLM(cfg, use_kernels=False)  # a fresh gemma norm is the identity: scale starts at 0
    assert float(np.abs(np.asarray(model.model.norm.scale[...])).max()) == 0.0
    with pytest.raises(NotImplementedError, match="use_bidirectional_attention"):
        config_from_hf({**as_dict, "use_bidirectional_attention": True})


def test_kernels_switches():
    assert Kernels.of(True) == Kernels() and all(vars(Kernels.of(True)).values())
    assert not any(vars(Kernels.of(False)).values())
    only = Kernels.of({"geglu": True})
    assert only.geglu and not (only.swiglu or only.rms_norm or only.rope or only.loss)
    with pytest.raises(ValueError, match="unknown kernels"):
        Kernels.of({"gelu": True})


def test_mistral_sliding_window_is_in_effect():
    """With a window of 4 the first 4 positions see what full causal attention sees, later ones less: the
    window must change their logits (the parity test checks the values against HF)."""
    hf = _hf_model(transformers.MistralConfig, seed=6, sliding_window=4)
    ids = jnp.asarray(_batch(seed=7)[0].numpy())
    windowed = from_hf(hf, use_kernels=False)
    assert windowed.config.sliding_window == 4
    hf.config.sliding_window = None
    full = from_hf(hf, use_kernels=False)
    a, b = np.asarray(windowed(ids)), np.asarray(full(ids))
    np.testing.assert_array_equal(a[:, :4], b[:, :4])
    assert np.abs(a[:, 4:] - b[:, 4:]).max(axis=-1).min() > 1e-4


def test_llama3_rope_frequencies_match_hf():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32, "rope_theta": 500000.0}
    hf_config = transformers.LlamaConfig(**{**TINY, "rope_parameters": scaling})
    expected, _ = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    ours = inv_frequencies(config_from_hf(hf_config))
    assert not np.allclose(ours, inv_frequencies(config_from_hf(transformers.LlamaConfig(**TINY))))
    np.testing.assert_allclose(ours, expected.numpy(), rtol=1e-6)


def test_from_hf_rejects_mismatched_state_dict(llama):
    hf = llama[0]
    state = dict(hf.state_dict())
    state.pop("model.norm.weight")
    with pytest.raises(KeyError, match="model.norm.weight"):
        from_hf(hf.config, state_dict=state)


def test_padding_mask_and_remat(llama):
    """attention_mask (left padding of row 1) matches HF; remat per layer changes nothing."""
    hf, ids, labels = llama
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :2] = 0
    expected = hf(input_ids=ids, attention_mask=mask).logits
    jids, jlabels = jnp.asarray(ids.numpy()), jnp.asarray(labels.numpy())
    model = from_hf(hf, use_kernels=False)
    got = model(jids, attention_mask=jnp.asarray(mask.numpy()))
    assert_close(np.asarray(got)[1, 2:], expected[1, 2:], torch.float32, "padded row")
    assert_close(np.asarray(got)[0], expected[0], torch.float32, "unpadded row")
    grad = nnx.jit(nnx.grad(lambda m: m.loss(jids, jlabels)))
    remat = grad(from_hf(hf, use_kernels=True, remat=True))
    plain = grad(from_hf(hf, use_kernels=True))
    for name in ("norm", "embed_tokens"):
        a, b = (jax.tree.leaves(nnx.state(g["model"][name]))[0] for g in (remat, plain))
        assert_close(np.asarray(a), np.asarray(b), torch.float32, f"remat grad {name}")


def test_attention_backend_choice(monkeypatch):
    """None takes cuDNN flash attention on a GPU for bf16/fp16 (jax's own default is XLA's, which materialises
    every head's T x T scores), falls back to XLA where cuDNN refuses at trace time, and stays on XLA for fp32 or
    other backends; an explicit choice is passed through. (Recorded through a stand-in for
    jax.nn.dot_product_attention: this machine has no cuDNN.)"""
    from liger_jax.models import llama as model_module

    asked = []
    refuse = {"cudnn": False}

    def fake(q, k, v, *, implementation, **kw):
        asked.append(implementation)
        if implementation == "cudnn" and refuse["cudnn"]:
            raise ValueError("cuDNN does not support this head_dim")
        return jnp.zeros(q.shape, q.dtype) + (1.0 if implementation == "cudnn" else 2.0)

    monkeypatch.setattr(model_module.jax.nn, "dot_product_attention", fake)
    q = jnp.ones((1, 3, 4, 8), jnp.bfloat16)
    kv = jnp.ones((1, 3, 2, 8), jnp.bfloat16)
    run = lambda impl, x=q: model_module.attention(x, kv.astype(x.dtype), kv.astype(x.dtype), None, None, 0.3, impl)

    monkeypatch.setattr(model_module.jax, "default_backend", lambda: "gpu")
    assert float(run(None)[0, 0, 0, 0]) == 1.0 and asked == ["cudnn"]
    asked.clear()
    assert float(run(None, q.astype(jnp.float32))[0, 0, 0, 0]) == 2.0 and asked == ["xla"]
    asked.clear()
    refuse["cudnn"] = True
    assert float(run(None)[0, 0, 0, 0]) == 2.0 and asked == ["cudnn", "xla"]
    asked.clear()
    with pytest.raises(ValueError, match="cuDNN"):  # asked for explicitly: no silent fallback
        run("cudnn")
    asked.clear()
    monkeypatch.setattr(model_module.jax, "default_backend", lambda: "cpu")
    refuse["cudnn"] = False
    assert float(run(None)[0, 0, 0, 0]) == 2.0 and asked == ["xla"]
    with pytest.raises(ValueError, match="attention_implementation"):
        model_module.LlamaConfig(attention_implementation="flash")

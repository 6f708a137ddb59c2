"""liger_jax.models: the Flax Llama-family model vs Hugging Face's torch model on the same weights.

Tiny fp32 models (random weights from a fixed torch seed, no downloads), eager HF attention. The Flax model runs
with ``use_kernels=False`` (pure jnp/XLA) and ``use_kernels=True`` (RMSNorm, RoPE, SwiGLU and the fused linear
cross-entropy on the liger_jax kernels). Both frameworks compute in fp32 with different reduction orders, so
every comparison uses helpers.assert_close's fp32 bound unwidened: |ours - hf| <= 1e-5 + 1e-5 |hf| elementwise
for logits, loss and weight gradients (measured worst case on these shapes: ~2% of that bound).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from helpers import assert_close

from liger_jax.models import LlamaForCausalLM, config_from_hf, from_hf, inv_frequencies, to_hf

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


def _torch_run(model, ids, labels):
    model.zero_grad()
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    return out


@pytest.fixture(scope="module")
def llama():
    model = _hf_model()
    ids, labels = _batch()
    out = _torch_run(model, ids, labels)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return model, ids, labels, out.logits.detach(), out.loss.detach(), grads


@pytest.mark.parametrize("use_kernels", [False, True])
def test_logits_loss_and_grads_match_hf(llama, use_kernels):
    hf, ids, labels, logits, loss, grads = llama
    model = from_hf(hf, use_kernels=use_kernels)
    jids, jlabels = jnp.asarray(ids.numpy()), jnp.asarray(labels.numpy())

    assert_close(model(jids), logits, torch.float32, "logits")

    value, g = nnx.value_and_grad(lambda m: m.loss(jids, jlabels))(model)
    assert_close(value, loss, torch.float32, "loss")

    checks = {
        "model.embed_tokens.weight": g["model"]["embed_tokens"]["embedding"][...],
        "model.layers.0.self_attn.q_proj.weight": g["model"]["layers"][0]["self_attn"]["q_proj"]["kernel"][...].T,
        "model.layers.1.mlp.down_proj.weight": g["model"]["layers"][1]["mlp"]["down_proj"]["kernel"][...].T,
        "model.layers.1.input_layernorm.weight": g["model"]["layers"][1]["input_layernorm"]["scale"][...],
        "model.norm.weight": g["model"]["norm"]["scale"][...],
        "lm_head.weight": g["lm_head"]["kernel"][...].T,
    }
    for name, grad in checks.items():
        assert_close(np.asarray(grad), grads[name], torch.float32, name)


def test_tied_qwen3_with_kernels_matches_hf():
    """qwen3: q/k norm over head_dim, attention without bias, tied head (the fused loss on the embedding)."""
    hf = _hf_model(transformers.Qwen3Config, seed=2, head_dim=16, tie_word_embeddings=True)
    ids, labels = _batch(seed=3)
    out = _torch_run(hf, ids, labels)
    model = from_hf(hf, use_kernels=True)
    assert model.lm_head is None
    jids, jlabels = jnp.asarray(ids.numpy()), jnp.asarray(labels.numpy())
    assert_close(model(jids), out.logits, torch.float32, "logits")
    value, g = nnx.value_and_grad(lambda m: m.loss(jids, jlabels))(model)
    assert_close(value, out.loss, torch.float32, "loss")
    # the tied embedding's gradient: input side plus head side
    assert_close(np.asarray(g["model"]["embed_tokens"]["embedding"][...]), hf.model.embed_tokens.weight.grad,
                 torch.float32, "embed (tied)")
    assert_close(np.asarray(g["model"]["layers"][0]["self_attn"]["q_norm"]["scale"][...]),
                 hf.model.layers[0].self_attn.q_norm.weight.grad, torch.float32, "q_norm")


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


def test_to_hf_round_trip(llama):
    hf = llama[0]
    back = to_hf(from_hf(hf, use_kernels=False))
    assert type(back) is type(hf)
    ref = hf.state_dict()
    for name, value in back.state_dict().items():
        torch.testing.assert_close(value, ref[name], rtol=0, atol=0, msg=name)


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
    hf, ids, labels, _, loss, _ = llama
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :2] = 0
    expected = hf(input_ids=ids, attention_mask=mask).logits
    jids, jlabels = jnp.asarray(ids.numpy()), jnp.asarray(labels.numpy())
    model = from_hf(hf, use_kernels=False)
    got = model(jids, attention_mask=jnp.asarray(mask.numpy()))
    assert_close(np.asarray(got)[1, 2:], expected[1, 2:], torch.float32, "padded row")
    assert_close(np.asarray(got)[0], expected[0], torch.float32, "unpadded row")
    remat = from_hf(hf, use_kernels=True, remat=True)
    assert_close(nnx.grad(lambda m: m.loss(jids, jlabels))(remat)["model"]["norm"]["scale"][...],
                 nnx.grad(lambda m: m.loss(jids, jlabels))(from_hf(hf))["model"]["norm"]["scale"][...],
                 torch.float32, "remat grad")

"""Tiny random-init configs of every supported family and helpers to compare patched with unpatched models."""

from __future__ import annotations

import torch

VOCAB = 331  # odd, not a power of two
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, tie_word_embeddings=False)


def config(family: str):
    import transformers as t

    if family == "llama":
        return t.LlamaConfig(**COMMON)
    if family == "mistral":
        return t.MistralConfig(**COMMON, sliding_window=None)
    if family == "mixtral":
        return t.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                               router_aux_loss_coef=0.02)
    if family == "gemma":
        return t.GemmaConfig(**COMMON)
    if family == "gemma2":
        return t.Gemma2Config(**COMMON, final_logit_softcapping=5.0, attn_logit_softcapping=20.0, sliding_window=8,
                              query_pre_attn_scalar=16)
    if family == "gemma3":
        return t.Gemma3TextConfig(**COMMON, final_logit_softcapping=5.0, sliding_window=8, query_pre_attn_scalar=16,
                                  layer_types=["sliding_attention", "full_attention"])
    if family == "qwen2":
        return t.Qwen2Config(**COMMON)
    if family == "qwen3":
        return t.Qwen3Config(**COMMON)
    if family == "qwen3_moe":
        return t.Qwen3MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                mlp_only_layers=[0], output_router_logits=True, router_aux_loss_coef=0.02)
    if family == "phi3":
        return t.Phi3Config(**COMMON)
    if family == "olmo2":
        return t.Olmo2Config(**COMMON)
    if family == "granite":
        return t.GraniteConfig(**COMMON, logits_scaling=4.0, embedding_multiplier=2.0, residual_multiplier=0.5,
                               attention_multiplier=0.25)
    raise ValueError(family)


FAMILIES = ["llama", "mistral", "mixtral", "gemma", "gemma2", "gemma3", "qwen2", "qwen3", "qwen3_moe", "phi3",
            "olmo2", "granite"]


def build(family: str, seed: int, device, **kwargs):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config(family), **kwargs).to(device)


def batch(seed: int, device, batch_size: int = 2, seq: int = 12, ignore: bool = True):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch_size, seq), generator=g)
    labels = ids.clone()
    if ignore:
        labels[0, :3] = -100  # a prompt that is not trained on
        labels[-1, -2:] = -100
    return ids.to(device), labels.to(device)


def liger_module_count(model) -> int:
    return sum("_liger_base" in type(m).__dict__ for m in model.modules())

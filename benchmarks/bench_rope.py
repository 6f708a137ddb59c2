"""RoPE of q and k, forward and forward+backward, at LLaMA-3-8B attention shapes (GQA 32/8 heads, D=128): ours
(torch in HF's (B, H, T, D) layout, jax in Flax's (B, T, H, D)) against HF eager, torch.compile, Liger-Kernel and
XLA."""

from __future__ import annotations

from .harness import (Case, device, eager_or_compiled, jax_key, jax_pass_runner, passes, provider_cases, sweep,
                      torch_pass_runner)

# (batch, seq, q heads, kv heads, head dim): sequence lengths at batch 1, and the batch 4 x 4096 (the
# tokens of T16384 in four sequences, each with its own cos/sin rows)
_LLAMA3_8B = {"batch": 1, "heads_q": 32, "heads_kv": 8, "head_dim": 128}
_BATCH4 = {**_LLAMA3_8B, "batch": 4, "seq": 4096}
SHAPES = sweep(_LLAMA3_8B, "seq", [2048, 4096, 8192, 16384, 32768, 65536]) + [_BATCH4]
QUICK = sweep(_LLAMA3_8B, "seq", [4096, 16384, 65536]) + [_BATCH4]
SMOKE = [{"batch": 1, "seq": 4, "heads_q": 2, "heads_kv": 1, "head_dim": 8}]
KEYS = ("batch", "seq", "heads_q", "heads_kv", "head_dim")
THETA = 500000.0


def hf_rope(q, k, cos, sin):
    """transformers' apply_rotary_pos_emb (unsqueeze_dim=1)."""
    import torch

    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _torch_inputs(b, t, hq, hk, d, requires_grad):
    import torch

    q = torch.randn(b, hq, t, d, device=device(), dtype=torch.bfloat16, requires_grad=requires_grad)
    k = torch.randn(b, hk, t, d, device=device(), dtype=torch.bfloat16, requires_grad=requires_grad)
    inv_freq = 1.0 / (THETA ** (torch.arange(0, d, 2, device=device(), dtype=torch.float32) / d))
    freqs = torch.arange(t, device=device(), dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), -1)
    cos = emb.cos()[None].expand(b, t, d).to(torch.bfloat16).contiguous()
    sin = emb.sin()[None].expand(b, t, d).to(torch.bfloat16).contiguous()
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    return q, k, cos, sin, gq, gk


def _torch_provider(name):
    if name == "liger_torch":
        import liger_torch

        return liger_torch.rope
    if name == "liger_kernel":
        from liger_kernel.ops.rope import LigerRopeFunction

        return LigerRopeFunction.apply
    return eager_or_compiled(name, hf_rope)


def _make_torch(name, shape, pass_):
    def make():
        fn = _torch_provider(name)
        q, k, cos, sin, gq, gk = _torch_inputs(*shape, pass_ != "fwd")
        return torch_pass_runner(lambda a, b: fn(a, b, cos, sin), (q, k), (gq, gk), pass_)

    return make


def _make_jax(name, shape, pass_):
    def make():
        import jax
        import jax.numpy as jnp

        import liger_jax

        b, t, hq, hk, d = shape
        k1, k2, k3, k4 = jax.random.split(jax_key(b, t, hq, hk, d), 4)
        q = jax.random.normal(k1, (b, t, hq, d), jnp.bfloat16)
        k = jax.random.normal(k2, (b, t, hk, d), jnp.bfloat16)
        gq = jax.random.normal(k3, q.shape, jnp.bfloat16)
        gk = jax.random.normal(k4, k.shape, jnp.bfloat16)
        inv_freq = 1.0 / (THETA ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
        freqs = jnp.arange(t, dtype=jnp.float32)[:, None] * inv_freq[None, :]
        emb = jnp.concatenate((freqs, freqs), -1)
        cos = jnp.broadcast_to(jnp.cos(emb)[None], (b, t, d)).astype(jnp.bfloat16)
        sin = jnp.broadcast_to(jnp.sin(emb)[None], (b, t, d)).astype(jnp.bfloat16)
        if name == "liger_jax":
            f = lambda x, y: liger_jax.rope(x, y, cos, sin)
        else:
            def f(x, y):
                def rot(v):
                    return jnp.concatenate((-v[..., d // 2:], v[..., : d // 2]), -1)

                c, s = cos[:, :, None], sin[:, :, None]
                return x * c + rot(x) * s, y * c + rot(y) * s
        return jax_pass_runner(f, (q, k), (gq, gk), pass_)

    return make


def cases(quick: bool = False, smoke: bool = False) -> list[Case]:
    out = []
    for params in SMOKE if smoke else QUICK if quick else SHAPES:
        shape = tuple(params[k] for k in KEYS)
        b, t, hq, hk, d = shape
        qk_bytes = b * t * (hq + hk) * d * 2
        label = f"B{b} T{t} H{hq}/{hk} D{d}"
        for pass_ in passes():
            nbytes = (2 if pass_ == "fwd" else 4) * qk_bytes  # q, k in and out (+ dq, dk in and out)
            out += provider_cases("rope", pass_, label, lambda name: _make_torch(name, shape, pass_),
                                  lambda name: _make_jax(name, shape, pass_), bytes=nbytes, params=params)
    return out

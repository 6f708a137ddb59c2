"""Fused residual add + RMSNorm, forward and forward+backward (gradients through both outputs), at LLM shapes:
ours (torch, jax) against HF eager (``residual = x + residual; LlamaRMSNorm(residual)``), torch.compile,
Liger-Kernel and XLA."""

from __future__ import annotations

from .harness import (Case, device, eager_or_compiled, jax_key, jax_pass_runner, row_cases, sweep,
                      torch_pass_runner, unique_shapes)

# tokens at a Llama-3-8B hidden size, then hidden sizes at 16k tokens, and wider ones (up to the target's 64k
# columns) at 4k
SHAPES = unique_shapes(sweep({"hidden": 4096}, "tokens", [2048, 4096, 8192, 16384, 32768, 65536]),
                       sweep({"tokens": 16384}, "hidden", [1024, 2048, 4096, 8192, 16384]),
                       sweep({"tokens": 4096}, "hidden", [20496, 32768, 65536]))  # held to 32768, then chunks
QUICK = sweep({"hidden": 4096}, "tokens", [4096, 16384, 65536])
SMOKE = sweep({"hidden": 64}, "tokens", [8])
EPS = 1e-6


def hf_fused_add_rms_norm(x, r, w):
    """The residual add of a transformers decoder layer followed by LlamaRMSNorm.forward."""
    import torch

    h = x + r
    dtype = h.dtype
    hf = h.to(torch.float32)
    hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS)
    return w * hf.to(dtype), h


def _torch_inputs(n, h, requires_grad):
    import torch

    x = torch.randn(n, h, device=device(), dtype=torch.bfloat16, requires_grad=requires_grad)
    r = torch.randn(n, h, device=device(), dtype=torch.bfloat16, requires_grad=requires_grad)
    w = (torch.rand(h, device=device(), dtype=torch.bfloat16) + 0.5).requires_grad_(requires_grad)
    gy = torch.randn(n, h, device=device(), dtype=torch.bfloat16)
    gh = torch.randn(n, h, device=device(), dtype=torch.bfloat16)
    return x, r, w, gy, gh


def _torch_provider(name):
    if name == "liger_torch":
        import liger_torch

        return lambda x, r, w: liger_torch.fused_add_rms_norm(x, r, w, EPS)
    if name == "liger_kernel":
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction

        return lambda x, r, w: LigerFusedAddRMSNormFunction.apply(x, r, w, EPS, 0.0, "llama", False)
    return eager_or_compiled(name, hf_fused_add_rms_norm)


def _make_torch(name, n, h, pass_):
    def make():
        fn = _torch_provider(name)
        x, r, w, gy, gh = _torch_inputs(n, h, pass_ != "fwd")
        return torch_pass_runner(fn, (x, r, w), (gy, gh), pass_)  # gradients through both outputs, y and h

    return make


def _make_jax(name, n, h, pass_):
    def make():
        import jax
        import jax.numpy as jnp

        import liger_jax

        k1, k2, k3, k4, k5 = jax.random.split(jax_key(n, h), 5)
        x = jax.random.normal(k1, (n, h), jnp.bfloat16)
        r = jax.random.normal(k2, (n, h), jnp.bfloat16)
        w = (jax.random.uniform(k3, (h,)) + 0.5).astype(jnp.bfloat16)
        gy = jax.random.normal(k4, (n, h), jnp.bfloat16)
        gh = jax.random.normal(k5, (n, h), jnp.bfloat16)
        if name == "liger_jax":
            f = lambda a, b, s: liger_jax.fused_add_rms_norm(a, b, s, epsilon=EPS)
        else:
            def f(a, b, s):
                hs = a + b
                hf = hs.astype(jnp.float32)
                return s * (hf * jax.lax.rsqrt(jnp.mean(hf * hf, -1, keepdims=True) + EPS)).astype(hs.dtype), hs
        # x's and the residual's gradients are one array (the add's): the program returns it once, for both
        return jax_pass_runner(f, (x, r, w), (gy, gh), pass_, returned_grads=(0, 2))

    return make


def cases(quick: bool = False, smoke: bool = False) -> list[Case]:
    # full tensors moved: x, residual, y, h  (+ dy, dh, h again, dx: one gradient for x and the residual, as
    # autograd's add gives and torch.compile writes)
    return row_cases("fused_add_rms_norm", SMOKE if smoke else QUICK if quick else SHAPES, _make_torch, _make_jax,
                     {"fwd": 4, "fwd+bwd": 8})

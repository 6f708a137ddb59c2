"""RMSNorm, forward and forward+backward, at LLM shapes: ours (torch, jax) against HF eager, torch.compile,
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
SMOKE = sweep({"hidden": 64}, "tokens", [8, 16])
EPS = 1e-6


def hf_rms_norm(x, w):
    """transformers' LlamaRMSNorm.forward."""
    import torch

    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return w * h.to(dtype)


def _torch_inputs(n, h, requires_grad):
    import torch

    x = torch.randn(n, h, device=device(), dtype=torch.bfloat16, requires_grad=requires_grad)
    w = (torch.rand(h, device=device(), dtype=torch.bfloat16) + 0.5).requires_grad_(requires_grad)
    g = torch.randn(n, h, device=device(), dtype=torch.bfloat16)
    return x, w, g


def _torch_provider(name):
    if name == "liger_torch":
        import liger_torch

        return lambda x, w: liger_torch.rms_norm(x, w, EPS)
    if name == "liger_kernel":
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        return lambda x, w: LigerRMSNormFunction.apply(x, w, EPS)
    return eager_or_compiled(name, hf_rms_norm)


def _make_torch(name, n, h, pass_):
    def make():
        fn = _torch_provider(name)
        x, w, g = _torch_inputs(n, h, pass_ != "fwd")
        return torch_pass_runner(fn, (x, w), g, pass_)

    return make


def _make_jax(name, n, h, pass_):
    def make():
        import jax
        import jax.numpy as jnp

        import liger_jax

        k1, k2, k3 = jax.random.split(jax_key(n, h), 3)
        x = jax.random.normal(k1, (n, h), jnp.bfloat16)
        w = (jax.random.uniform(k2, (h,)) + 0.5).astype(jnp.bfloat16)
        g = jax.random.normal(k3, (n, h), jnp.bfloat16)
        if name == "liger_jax":
            f = lambda a, s: liger_jax.rms_norm(a, s, epsilon=EPS)
        else:
            def f(a, s):
                af = a.astype(jnp.float32)
                return s * (af * jax.lax.rsqrt(jnp.mean(af * af, -1, keepdims=True) + EPS)).astype(a.dtype)
        return jax_pass_runner(f, (x, w), g, pass_)

    return make


def cases(quick: bool = False, smoke: bool = False) -> list[Case]:
    # full tensors moved: x, y  (+ dy, x again, dx)
    return row_cases("rms_norm", SMOKE if smoke else QUICK if quick else SHAPES, _make_torch, _make_jax,
                     {"fwd": 2, "fwd+bwd": 5})

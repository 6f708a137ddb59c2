"""LayerNorm, forward and forward+backward, at LLM shapes: ours (torch, jax) against torch eager
(``F.layer_norm``), torch.compile, Liger-Kernel and XLA."""

from __future__ import annotations

from .harness import (Case, device, eager_or_compiled, jax_key, jax_pass_runner, row_cases, sweep,
                      torch_pass_runner, unique_shapes)

# tokens at a Llama-3-8B hidden size, then hidden sizes at 16k tokens, and wider ones (up to the target's 64k
# columns) at 4k
SHAPES = unique_shapes(sweep({"hidden": 4096}, "tokens", [2048, 4096, 8192, 16384, 32768, 65536]),
                       sweep({"tokens": 16384}, "hidden", [1024, 2048, 4096, 8192, 16384]),
                       sweep({"tokens": 4096}, "hidden", [20496, 32768, 65536]))  # rows swept in chunks
QUICK = sweep({"hidden": 4096}, "tokens", [4096, 16384, 65536])
SMOKE = sweep({"hidden": 64}, "tokens", [8])
EPS = 1e-5


def eager_layer_norm(x, w, b):
    import torch.nn.functional as F

    return F.layer_norm(x, (x.shape[-1],), w, b, EPS)


def _torch_inputs(n, h, requires_grad):
    import torch

    x = torch.randn(n, h, device=device(), dtype=torch.bfloat16, requires_grad=requires_grad)
    w = (torch.rand(h, device=device(), dtype=torch.bfloat16) + 0.5).requires_grad_(requires_grad)
    b = torch.randn(h, device=device(), dtype=torch.bfloat16).requires_grad_(requires_grad)
    g = torch.randn(n, h, device=device(), dtype=torch.bfloat16)
    return x, w, b, g


def _torch_provider(name):
    if name == "liger_torch":
        import liger_torch

        return lambda x, w, b: liger_torch.layer_norm(x, w, b, EPS)
    if name == "liger_kernel":
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction

        return lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, EPS)
    return eager_or_compiled(name, eager_layer_norm)


def _make_torch(name, n, h, pass_):
    def make():
        fn = _torch_provider(name)
        x, w, b, g = _torch_inputs(n, h, pass_ != "fwd")
        return torch_pass_runner(fn, (x, w, b), g, pass_)

    return make


def _make_jax(name, n, h, pass_):
    def make():
        import jax
        import jax.numpy as jnp

        import liger_jax

        k1, k2, k3, k4 = jax.random.split(jax_key(n, h), 4)
        x = jax.random.normal(k1, (n, h), jnp.bfloat16)
        w = (jax.random.uniform(k2, (h,)) + 0.5).astype(jnp.bfloat16)
        b = jax.random.normal(k3, (h,), jnp.bfloat16)
        g = jax.random.normal(k4, (n, h), jnp.bfloat16)
        if name == "liger_jax":
            f = lambda a, s, c: liger_jax.layer_norm(a, s, c, epsilon=EPS)
        else:
            def f(a, s, c):  # flax.nnx.LayerNorm's formula (statistics and affine map in fp32)
                af = a.astype(jnp.float32)
                mean = jnp.mean(af, -1, keepdims=True)
                var = jnp.mean(jnp.square(af - mean), -1, keepdims=True)
                y = (af - mean) * (jax.lax.rsqrt(var + EPS) * s.astype(jnp.float32)) + c.astype(jnp.float32)
                return y.astype(a.dtype)
        return jax_pass_runner(f, (x, w, b), g, pass_)

    return make


def cases(quick: bool = False, smoke: bool = False) -> list[Case]:
    # full tensors moved: x, y  (+ dy, x again, dx)
    return row_cases("layer_norm", SMOKE if smoke else QUICK if quick else SHAPES, _make_torch, _make_jax,
                     {"fwd": 2, "fwd+bwd": 5})

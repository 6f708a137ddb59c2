"""SwiGLU ``silu(a) * b`` and GeGLU ``gelu_tanh(a) * b``, forward and forward+backward, at LLaMA-8B MLP shapes:
ours (torch, jax) against HF eager, torch.compile, Liger-Kernel and XLA."""

from __future__ import annotations

import functools

from .harness import (Case, device, eager_or_compiled, jax_key, jax_pass_runner, row_cases, sweep,
                      torch_pass_runner, unique_shapes)

# (tokens, intermediate): tokens at Llama-3-8B's intermediate size, then intermediate sizes at 16k tokens
SHAPES = unique_shapes(sweep({"intermediate": 14336}, "tokens", [2048, 4096, 8192, 16384, 32768]),
                       sweep({"tokens": 16384}, "intermediate", [4096, 8192, 14336, 28672]))
QUICK = sweep({"intermediate": 14336}, "tokens", [4096, 16384, 32768])
SMOKE = sweep({"intermediate": 64}, "tokens", [8])
KERNELS = ("swiglu", "geglu")


def hf_gated(kernel):
    """HF's ``act_fn(gate_proj(x)) * up_proj(x)`` around the projections (LlamaMLP / GemmaMLP)."""
    import torch.nn.functional as F

    if kernel == "swiglu":
        return lambda a, b: F.silu(a) * b
    return lambda a, b: F.gelu(a, approximate="tanh") * b


def _torch_inputs(n, h, requires_grad):
    import torch

    a = torch.randn(n, h, device=device(), dtype=torch.bfloat16, requires_grad=requires_grad)
    b = torch.randn(n, h, device=device(), dtype=torch.bfloat16, requires_grad=requires_grad)
    g = torch.randn(n, h, device=device(), dtype=torch.bfloat16)
    return a, b, g


def _torch_provider(kernel, name):
    if name == "liger_torch":
        import liger_torch

        # in_place=False: the benchmark's a and b are leaves that every repetition reuses (the MLP modules
        # use in_place=True on their own temporaries, which also saves two buffers of this size).
        if kernel == "swiglu":
            return lambda a, b: liger_torch.swiglu(a, b)
        return lambda a, b: liger_torch.geglu(a, b, "tanh")
    if name == "liger_kernel":
        if kernel == "swiglu":
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction

            return LigerSiLUMulFunction.apply
        from liger_kernel.ops.geglu import LigerGELUMulFunction

        return LigerGELUMulFunction.apply
    return eager_or_compiled(name, hf_gated(kernel))


def _make_torch(kernel, name, n, h, pass_):
    def make():
        fn = _torch_provider(kernel, name)
        a, b, g = _torch_inputs(n, h, pass_ != "fwd")
        return torch_pass_runner(fn, (a, b), g, pass_)

    return make


def _make_jax(kernel, name, n, h, pass_):
    def make():
        import jax
        import jax.numpy as jnp

        import liger_jax

        k1, k2, k3 = jax.random.split(jax_key(n, h), 3)
        a = jax.random.normal(k1, (n, h), jnp.bfloat16)
        b = jax.random.normal(k2, (n, h), jnp.bfloat16)
        g = jax.random.normal(k3, (n, h), jnp.bfloat16)
        if name == "liger_jax":
            f = liger_jax.swiglu if kernel == "swiglu" else liger_jax.geglu
        elif kernel == "swiglu":
            f = lambda x, y: jax.nn.silu(x) * y
        else:
            f = lambda x, y: jax.nn.gelu(x, approximate=True) * y
        return jax_pass_runner(f, (a, b), g, pass_)

    return make


def cases(quick: bool = False, smoke: bool = False) -> list[Case]:
    out = []
    for kernel in KERNELS:
        # full tensors moved: a, b, c  (+ dc, a, b again, da, db)
        out += row_cases(kernel, SMOKE if smoke else QUICK if quick else SHAPES,
                         functools.partial(_make_torch, kernel), functools.partial(_make_jax, kernel),
                         {"fwd": 3, "fwd+bwd": 8}, axes=("tokens", "intermediate"))
    return out

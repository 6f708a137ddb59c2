"""SwiGLU ``silu(a) * b`` and GeGLU ``gelu_tanh(a) * b``, forward and forward+backward, at LLaMA-8B MLP shapes:
ours (torch, jax) against HF eager, torch.compile, Liger-Kernel and XLA."""

from __future__ import annotations

from .harness import Case, jax_runner, torch_fwd_bwd

SHAPES = [(16384, 14336)]
QUICK = [(16384, 14336)]
KERNELS = ("swiglu", "geglu")


def hf_gated(kernel):
    """HF's ``act_fn(gate_proj(x)) * up_proj(x)`` around the projections (LlamaMLP / GemmaMLP)."""
    import torch.nn.functional as F

    if kernel == "swiglu":
        return lambda a, b: F.silu(a) * b
    return lambda a, b: F.gelu(a, approximate="tanh") * b


def _torch_inputs(n, h, requires_grad):
    import torch

    a = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=requires_grad)
    b = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=requires_grad)
    g = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
    return a, b, g


def _torch_provider(kernel, name):
    import torch

    if name == "liger_torch":
        import liger_torch

        # in_place=False: the benchmark's a and b are leaves that every repetition reuses (the MLP modules
        # use in_place=True on their own temporaries, which also saves two buffers of this size).
        if kernel == "swiglu":
            return lambda a, b: liger_torch.swiglu(a, b)
        return lambda a, b: liger_torch.geglu(a, b, "tanh")
    if name == "torch_eager":
        return hf_gated(kernel)
    if name == "torch_compile":
        return torch.compile(hf_gated(kernel))
    if name == "liger_kernel":
        if kernel == "swiglu":
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction

            return LigerSiLUMulFunction.apply
        from liger_kernel.ops.geglu import LigerGELUMulFunction

        return LigerGELUMulFunction.apply
    raise KeyError(name)


def _make_torch(kernel, name, n, h, pass_):
    def make():
        fn = _torch_provider(kernel, name)
        a, b, g = _torch_inputs(n, h, pass_ != "fwd")
        if pass_ == "fwd":
            return lambda: fn(a, b)
        return torch_fwd_bwd(fn, (a, b), g)

    return make


def _make_jax(kernel, name, n, h, pass_):
    def make():
        import jax
        import jax.numpy as jnp

        import liger_jax

        k1, k2, k3 = jax.random.split(jax.random.key(n + h), 3)
        a = jax.random.normal(k1, (n, h), jnp.bfloat16)
        b = jax.random.normal(k2, (n, h), jnp.bfloat16)
        g = jax.random.normal(k3, (n, h), jnp.bfloat16)
        if name == "liger_jax":
            f = liger_jax.swiglu if kernel == "swiglu" else liger_jax.geglu
        elif kernel == "swiglu":
            f = lambda x, y: jax.nn.silu(x) * y
        else:
            f = lambda x, y: jax.nn.gelu(x, approximate=True) * y
        if pass_ == "fwd":
            return jax_runner(f, a, b)
        return jax_runner(lambda x, y, d: jax.vjp(f, x, y)[1](d), a, b, g)

    return make


def cases(quick: bool = False) -> list[Case]:
    out = []
    for kernel in KERNELS:
        for n, h in QUICK if quick else SHAPES:
            for pass_ in ("fwd", "fwd+bwd"):
                passes = 3 if pass_ == "fwd" else 8  # a, b, c  (+ dc, a, b again, da, db)
                nbytes = passes * n * h * 2
                for name in ("liger_torch", "torch_eager", "torch_compile", "liger_kernel"):
                    out.append(Case(kernel, pass_, f"{n}x{h}", "bf16", name, "torch",
                                    _make_torch(kernel, name, n, h, pass_), bytes=nbytes))
                for name in ("liger_jax", "xla"):
                    out.append(Case(kernel, pass_, f"{n}x{h}", "bf16", name, "jax",
                                    _make_jax(kernel, name, n, h, pass_), bytes=nbytes))
    return out

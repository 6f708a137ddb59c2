"""RMSNorm, forward and forward+backward, at LLM shapes: ours (torch, jax) against HF eager, torch.compile,
Liger-Kernel and XLA."""

from __future__ import annotations

from .harness import Case, jax_runner, torch_fwd_bwd

SHAPES = [(16384, 4096), (4096, 16384), (32768, 2048), (65536, 8192)]
QUICK = [(16384, 4096), (4096, 16384)]
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

    x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=requires_grad)
    w = (torch.rand(h, device="cuda", dtype=torch.bfloat16) + 0.5).requires_grad_(requires_grad)
    g = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
    return x, w, g


def _torch_provider(name):
    import torch

    if name == "liger_torch":
        import liger_torch

        return lambda x, w: liger_torch.rms_norm(x, w, EPS)
    if name == "torch_eager":
        return hf_rms_norm
    if name == "torch_compile":
        return torch.compile(hf_rms_norm)
    if name == "liger_kernel":
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        return lambda x, w: LigerRMSNormFunction.apply(x, w, EPS)
    raise KeyError(name)


def _make_torch(name, n, h, pass_):
    def make():
        fn = _torch_provider(name)
        x, w, g = _torch_inputs(n, h, pass_ != "fwd")
        if pass_ == "fwd":
            return lambda: fn(x, w)
        return torch_fwd_bwd(fn, (x, w), g)

    return make


def _make_jax(name, n, h, pass_):
    def make():
        import jax
        import jax.numpy as jnp

        import liger_jax

        k1, k2, k3 = jax.random.split(jax.random.key(n + h), 3)
        x = jax.random.normal(k1, (n, h), jnp.bfloat16)
        w = (jax.random.uniform(k2, (h,)) + 0.5).astype(jnp.bfloat16)
        g = jax.random.normal(k3, (n, h), jnp.bfloat16)
        if name == "liger_jax":
            f = lambda a, s: liger_jax.rms_norm(a, s, epsilon=EPS)
        else:
            def f(a, s):
                af = a.astype(jnp.float32)
                return s * (af * jax.lax.rsqrt(jnp.mean(af * af, -1, keepdims=True) + EPS)).astype(a.dtype)
        if pass_ == "fwd":
            return jax_runner(f, x, w)
        return jax_runner(lambda a, s, d: jax.vjp(f, a, s)[1](d), x, w, g)

    return make


def cases(quick: bool = False) -> list[Case]:
    out = []
    for n, h in QUICK if quick else SHAPES:
        for pass_ in ("fwd", "fwd+bwd"):
            passes = 2 if pass_ == "fwd" else 5  # x, y  (+ dy, x again, dx)
            nbytes = passes * n * h * 2
            for name in ("liger_torch", "torch_eager", "torch_compile", "liger_kernel"):
                out.append(Case("rms_norm", pass_, f"{n}x{h}", "bf16", name, "torch", _make_torch(name, n, h, pass_),
                                bytes=nbytes))
            for name in ("liger_jax", "xla"):
                out.append(Case("rms_norm", pass_, f"{n}x{h}", "bf16", name, "jax", _make_jax(name, n, h, pass_),
                                bytes=nbytes))
    return out

"""Fused linear JSD (distillation loss on the student's and teacher's lm_head outputs without either (tokens,
vocab) logits), bf16, beta 0.5, temperature 1, forward and forward+backward (student input and head): ours
(torch, jax) against two matmuls + log_softmax + the JSD formula in fp32 (eager, torch.compile), Liger-Kernel's
``LigerFusedLinearJSD`` and the same under XLA. Peak extra memory is the point as much as time."""

from __future__ import annotations

from .bench_jsd import BETA, jax_jsd_formula, jsd_formula
from .harness import (TORCH_PROVIDERS, Case, device, eager_or_compiled, jax_key, jax_loss_runner, passes,
                      provider_cases, sweep, torch_pass_runner, unique_shapes)

SHAPES = unique_shapes(sweep({"hidden": 4096, "vocab": 128256}, "tokens", [1024, 2048, 4096, 8192, 16384]),
                       sweep({"tokens": 4096, "hidden": 4096}, "vocab", [32000, 65536, 128256]))
QUICK = sweep({"hidden": 4096, "vocab": 128256}, "tokens", [2048, 4096, 8192])
SMOKE = [{"tokens": 8, "hidden": 32, "vocab": 96}]


def eager_fused_linear_jsd(xs, ws, xt, wt):
    import torch

    s = torch.log_softmax((xs @ ws.t()).float(), -1)
    with torch.no_grad():
        t = torch.log_softmax((xt @ wt.t()).float(), -1)
    return jsd_formula(s, t, BETA)


def _torch_provider(name):
    if name == "liger_torch":
        import liger_torch

        return lambda xs, ws, xt, wt: liger_torch.fused_linear_jsd(xs, ws, xt, wt, beta=BETA)
    if name == "liger_kernel":
        from liger_kernel.transformers import LigerFusedLinearJSD

        loss = LigerFusedLinearJSD(jsd_beta=BETA, temperature=1.0)
        return lambda xs, ws, xt, wt: loss(xs, ws, xt, wt, None)
    return eager_or_compiled(name, eager_fused_linear_jsd)


def _make_torch(name, n, h, v, pass_):
    def make():
        import torch

        fn = _torch_provider(name)
        dev = device()
        grad = pass_ != "fwd"
        xs = (torch.randn(n, h, device=dev, dtype=torch.bfloat16) * 0.5).requires_grad_(grad)
        ws = (torch.randn(v, h, device=dev, dtype=torch.bfloat16) * h ** -0.5).requires_grad_(grad)
        xt = torch.randn(n, h, device=dev, dtype=torch.bfloat16) * 0.5
        wt = torch.randn(v, h, device=dev, dtype=torch.bfloat16) * h ** -0.5
        return torch_pass_runner(lambda a, b: fn(a, b, xt, wt), (xs, ws), torch.tensor(1.0, device=dev), pass_)

    return make


def _make_jax(name, n, h, v, pass_):
    def make():
        import jax
        import jax.numpy as jnp

        import liger_jax

        k1, k2, k3, k4 = jax.random.split(jax_key(n, h, v), 4)
        xs = (jax.random.normal(k1, (n, h)) * 0.5).astype(jnp.bfloat16)
        ks = (jax.random.normal(k2, (h, v)) * h ** -0.5).astype(jnp.bfloat16)  # Flax (H, V) kernels
        xt = (jax.random.normal(k3, (n, h)) * 0.5).astype(jnp.bfloat16)
        kt = (jax.random.normal(k4, (h, v)) * h ** -0.5).astype(jnp.bfloat16)
        if name == "liger_jax":
            f = lambda a, k, b, c: liger_jax.fused_linear_jsd(a, k, b, c, beta=BETA)
        else:
            def f(a, k, b, c):
                s = jax.nn.log_softmax((a @ k).astype(jnp.float32), -1)
                t = jax.nn.log_softmax((b @ c).astype(jnp.float32), -1)
                return jax_jsd_formula(s, t, BETA)
        # the teacher's tensors are arguments (a closed-over array would be baked into the program)
        return jax_loss_runner(f, (xs, ks, xt, kt), pass_, argnums=(0, 1))

    return make


def cases(quick: bool = False, smoke: bool = False) -> list[Case]:
    out = []
    for shape in SMOKE if smoke else QUICK if quick else SHAPES:
        n, h, v = shape["tokens"], shape["hidden"], shape["vocab"]
        for pass_ in passes():
            # fwd: the student and teacher logits (2 x 2NHV); fwd+bwd: also the student's dx and dW (2 x 2NHV)
            flops = (4 if pass_ == "fwd" else 8) * n * h * v
            out += provider_cases("fused_linear_jsd", pass_, f"{n}x{h}x{v}",
                                  lambda name: _make_torch(name, n, h, v, pass_),
                                  lambda name: _make_jax(name, n, h, v, pass_), torch_names=TORCH_PROVIDERS,
                                  flops=flops, params=shape)
    return out

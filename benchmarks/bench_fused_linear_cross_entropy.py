"""Fused linear cross-entropy (lm_head matmul + cross-entropy without the full logits), bf16, forward and
forward+backward: ours (torch, jax) against matmul + F.cross_entropy (eager, torch.compile), Liger-Kernel,
cut_cross_entropy and matmul + optax under XLA; and one mixed-precision point ("amp": fp32 x and weight, bf16
matmuls under torch.autocast / jax ``dtype=bfloat16``). Peak extra memory is the point as much as time."""

from __future__ import annotations

from .harness import (TORCH_PROVIDERS, Case, device, eager_or_compiled, jax_key, jax_loss_runner, passes,
                      provider_cases, sweep, torch_pass_runner, unique_shapes)

# tokens at Llama-3-8B's (hidden, vocab), then vocabulary sizes at 8k tokens
SHAPES = unique_shapes(sweep({"hidden": 4096, "vocab": 128256}, "tokens", [2048, 4096, 8192, 16384, 32768]),
                       sweep({"tokens": 8192, "hidden": 4096}, "vocab", [32000, 65536, 128256, 256000]))
QUICK = sweep({"hidden": 4096, "vocab": 128256}, "tokens", [4096, 8192, 16384])
# mixed precision: fp32 x and weight (master weights), bf16 matmuls (torch.autocast; jax dtype=bfloat16).
# Without cut_cross_entropy: its backward refuses fp32 weights ("requires embeddings to be bf16 or fp16").
AMP = [{"tokens": 8192, "hidden": 4096, "vocab": 128256, "amp": True}]
SMOKE = [{"tokens": 8, "hidden": 32, "vocab": 96}, {"tokens": 8, "hidden": 32, "vocab": 96, "amp": True}]


def matmul_cross_entropy(x, w, target):
    import torch.nn.functional as F

    return F.cross_entropy((x @ w.t()).float(), target, ignore_index=-100)


def _torch_inputs(n, h, v, requires_grad, dtype):
    import torch

    x = (torch.randn(n, h, device=device(), dtype=dtype) * 0.5).requires_grad_(requires_grad)
    w = (torch.randn(v, h, device=device(), dtype=dtype) * h ** -0.5).requires_grad_(requires_grad)
    target = torch.randint(0, v, (n,), device=device())
    target[::10] = -100
    return x, w, target


def _torch_provider(name, amp=False):
    fn = _provider_fn(name)
    return _autocast(fn) if amp else fn


def _provider_fn(name):
    if name == "liger_torch":
        import liger_torch

        return lambda x, w, t: liger_torch.fused_linear_cross_entropy(x, w, t)
    if name == "liger_kernel":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        loss = LigerFusedLinearCrossEntropyLoss()
        return lambda x, w, t: loss(w, x, t)
    if name == "cut_cross_entropy":
        from cut_cross_entropy import linear_cross_entropy

        return lambda x, w, t: linear_cross_entropy(x, w, t)
    return eager_or_compiled(name, matmul_cross_entropy)


def _autocast(fn):
    import torch

    def under_autocast(*args):
        with torch.autocast(device(), dtype=torch.bfloat16):
            return fn(*args)

    return under_autocast


def _make_torch(name, n, h, v, pass_, amp=False):
    def make():
        import torch

        fn = _torch_provider(name, amp)
        x, w, target = _torch_inputs(n, h, v, pass_ != "fwd", torch.float32 if amp else torch.bfloat16)
        return torch_pass_runner(lambda a, b: fn(a, b, target), (x, w), torch.tensor(1.0, device=device()), pass_)

    return make


def _make_jax(name, n, h, v, pass_, amp=False):
    def make():
        import jax
        import jax.numpy as jnp
        import optax

        import liger_jax

        k1, k2, k3 = jax.random.split(jax_key(n, h, v), 3)
        dtype = jnp.float32 if amp else jnp.bfloat16
        x = (jax.random.normal(k1, (n, h)) * 0.5).astype(dtype)
        kernel = (jax.random.normal(k2, (h, v)) * h ** -0.5).astype(dtype)  # Flax (H, V) layout
        labels = jax.random.randint(k3, (n,), 0, v)
        if name == "liger_jax":
            f = lambda a, k: liger_jax.fused_linear_cross_entropy(a, k, labels, dtype=jnp.bfloat16)
        else:
            f = lambda a, k: jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
                (a.astype(jnp.bfloat16) @ k.astype(jnp.bfloat16)).astype(jnp.float32), labels))
        return jax_loss_runner(f, (x, kernel), pass_, argnums=(0, 1))

    return make


def cases(quick: bool = False, smoke: bool = False) -> list[Case]:
    out = []
    for shape in SMOKE if smoke else (QUICK if quick else SHAPES) + AMP:
        n, h, v, amp = shape["tokens"], shape["hidden"], shape["vocab"], shape.get("amp", False)
        for pass_ in passes():
            # fwd: x @ W^T; fwd+bwd: that plus dx = dlogits @ W and dW = dlogits^T @ x.
            flops = (2 if pass_ == "fwd" else 6) * n * h * v
            out += provider_cases("fused_linear_cross_entropy", pass_, f"{n}x{h}x{v}" + (" amp" if amp else ""),
                                  lambda name: _make_torch(name, n, h, v, pass_, amp),
                                  lambda name: _make_jax(name, n, h, v, pass_, amp),
                                  torch_names=TORCH_PROVIDERS + (() if amp else ("cut_cross_entropy",)), flops=flops,
                                  params=shape)
    return out

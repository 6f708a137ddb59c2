"""Medusa-style multi-head loss: k LM heads over the same hidden states (head i predicts the token i + 1 places
ahead, its labels shifted by i + 1, the tail ignored), each with its own (fused linear) cross-entropy, summed;
forward+backward through the hidden states and every head, bf16, Llama-3-8B's hidden and vocabulary sizes.

Ours (``liger_torch.fused_linear_cross_entropy`` per head; ``liger_jax`` likewise) against matmul +
``F.cross_entropy`` per head (eager, torch.compile), Liger-Kernel's and Cut Cross-Entropy's fused losses per head,
and matmul + softmax cross-entropy under XLA. The eager path keeps k fp32 (tokens, vocab) logits for the
backward: memory is the point, and the throughput at equal work (TFLOP/s; tokens/s in the detail table)."""

from __future__ import annotations

from .harness import (TORCH_PROVIDERS, Case, device, eager_or_compiled, jax_key, jax_loss_runner, provider_cases,
                      sweep, torch_pass_runner, unique_shapes)

_BASE = {"tokens": 8192, "hidden": 4096, "vocab": 128256}
SHAPES = unique_shapes(sweep(_BASE, "heads", [1, 2, 3, 5]),
                       sweep({**_BASE, "heads": 3}, "tokens", [4096, 8192, 16384, 32768]))
QUICK = sweep(_BASE, "heads", [1, 3, 5])
SMOKE = [{"tokens": 8, "hidden": 32, "vocab": 96, "heads": 2}]
IGNORE = -100


def eager_heads(h, weights, targets):
    """What a Medusa training loop does per head: logits = h @ W_i^T, upcast, cross-entropy."""
    import torch.nn.functional as F

    total = 0.0
    for w, t in zip(weights, targets):
        total = total + F.cross_entropy((h @ w.t()).float(), t, ignore_index=IGNORE)
    return total


def _torch_provider(name):
    if name == "liger_torch":
        import liger_torch

        return lambda h, ws, ts: sum(liger_torch.fused_linear_cross_entropy(h, w, t) for w, t in zip(ws, ts))
    if name == "liger_kernel":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        loss = LigerFusedLinearCrossEntropyLoss()
        return lambda h, ws, ts: sum(loss(w, h, t) for w, t in zip(ws, ts))
    if name == "cut_cross_entropy":
        from cut_cross_entropy import linear_cross_entropy

        return lambda h, ws, ts: sum(linear_cross_entropy(h, w, t) for w, t in zip(ws, ts))
    return eager_or_compiled(name, eager_heads)


def _shifted(labels, k):
    """Head k's targets: the labels k + 1 places ahead, the last k + 1 positions ignored."""
    import torch

    return torch.cat([labels[k + 1:], torch.full((k + 1,), IGNORE, dtype=labels.dtype, device=labels.device)])


def _make_torch(name, shape):
    def make():
        import torch

        fn = _torch_provider(name)
        n, hdim, v, k = shape["tokens"], shape["hidden"], shape["vocab"], shape["heads"]
        dev = device()
        h = (torch.randn(n, hdim, device=dev, dtype=torch.bfloat16) * 0.5).requires_grad_(True)
        ws = [(torch.randn(v, hdim, device=dev, dtype=torch.bfloat16) * hdim ** -0.5).requires_grad_(True)
              for _ in range(k)]
        labels = torch.randint(0, v, (n,), device=dev)
        ts = [_shifted(labels, i) for i in range(k)]
        return torch_pass_runner(lambda x, *w: fn(x, list(w), ts), (h, *ws), torch.tensor(1.0, device=dev),
                                 "fwd+bwd")

    return make


def _make_jax(name, shape):
    def make():
        import jax
        import jax.numpy as jnp

        import liger_jax

        n, hdim, v, k = shape["tokens"], shape["hidden"], shape["vocab"], shape["heads"]
        keys = jax.random.split(jax_key(n, hdim, v, k), k + 2)
        h = (jax.random.normal(keys[0], (n, hdim)) * 0.5).astype(jnp.bfloat16)
        kernels = tuple((jax.random.normal(keys[2 + i], (hdim, v)) * hdim ** -0.5).astype(jnp.bfloat16)
                        for i in range(k))
        labels = jax.random.randint(keys[1], (n,), 0, v)
        targets = tuple(jnp.concatenate([labels[i + 1:], jnp.full((i + 1,), IGNORE, labels.dtype)])
                        for i in range(k))

        if name == "liger_jax":
            def f(x, ks, ts):
                return sum(liger_jax.fused_linear_cross_entropy(x, kk, t) for kk, t in zip(ks, ts))
        else:
            def f(x, ks, ts):
                total = 0.0
                for kk, t in zip(ks, ts):
                    logits = (x @ kk).astype(jnp.float32)
                    valid = t != IGNORE
                    picked = jnp.take_along_axis(logits, jnp.where(valid, t, 0)[:, None], -1)[:, 0]
                    rows = jax.nn.logsumexp(logits, -1) - picked
                    total = total + jnp.sum(jnp.where(valid, rows, 0.0)) / jnp.sum(valid)
                return total
        return jax_loss_runner(f, (h, kernels, targets), "fwd+bwd", argnums=(0, 1))

    return make


def cases(quick: bool = False, smoke: bool = False) -> list[Case]:
    out = []
    for shape in SMOKE if smoke else QUICK if quick else SHAPES:
        n, h, v, k = shape["tokens"], shape["hidden"], shape["vocab"], shape["heads"]
        # per head: logits (2NHV), dx and dW (4NHV)
        out += provider_cases("medusa", "fwd+bwd", f"{k} heads {n}x{h}x{v}",
                              lambda name: _make_torch(name, shape), lambda name: _make_jax(name, shape),
                              torch_names=TORCH_PROVIDERS + ("cut_cross_entropy",), flops=6 * n * h * v * k,
                              params=shape)
    return out

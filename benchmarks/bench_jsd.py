"""Generalized Jensen-Shannon divergence (beta = 0.5) between student and teacher log-probs, bf16 (tokens,
vocab), forward and forward+backward: ours (torch, jax) against the formula on fp32-upcast inputs (eager,
torch.compile), Liger-Kernel's ``LigerJSD`` and the formula under XLA."""

from __future__ import annotations

import math

from .harness import (TORCH_PROVIDERS, Case, eager_or_compiled, jax_key, jax_loss_runner, row_cases, sweep,
                      torch_log_prob_pair_maker, unique_shapes)

SHAPES = unique_shapes(sweep({"tokens": 8192}, "vocab", [32000, 65536, 128256, 256000]),
                       sweep({"vocab": 128256}, "tokens", [2048, 4096, 8192, 16384]))
QUICK = sweep({"tokens": 8192}, "vocab", [32000, 128256, 256000])
SMOKE = sweep({"tokens": 8}, "vocab", [96])
BETA = 0.5


def jsd_formula(s, t, beta=BETA):
    """Mean over rows of beta KL(P||M) + (1 - beta) KL(Q||M), M = beta P + (1 - beta) Q (P teacher, Q student),
    in fp32 (as TRL's generalized JSD loss)."""
    import torch

    s, t = s.float(), t.float()
    log_m = torch.logaddexp(t + math.log(beta), s + math.log(1 - beta))
    rows = beta * (t.exp() * (t - log_m)).sum(-1) + (1 - beta) * (s.exp() * (s - log_m)).sum(-1)
    return rows.mean()


def _torch_provider(name):
    if name == "liger_torch":
        import liger_torch

        return lambda s, t: liger_torch.jsd(s, t, beta=BETA)
    if name == "liger_kernel":
        from liger_kernel.transformers import LigerJSD

        loss = LigerJSD(beta=BETA)
        return lambda s, t: loss(s, t)
    return eager_or_compiled(name, jsd_formula)


def _make_torch(name, n, v, pass_):
    return torch_log_prob_pair_maker(lambda: _torch_provider(name), n, v, pass_)


def jax_jsd_formula(s, t, beta=BETA):
    import jax
    import jax.numpy as jnp

    s, t = s.astype(jnp.float32), jax.lax.stop_gradient(t.astype(jnp.float32))
    log_m = jnp.logaddexp(t + math.log(beta), s + math.log(1 - beta))
    rows = beta * jnp.sum(jnp.exp(t) * (t - log_m), -1) + (1 - beta) * jnp.sum(jnp.exp(s) * (s - log_m), -1)
    return jnp.mean(rows)


def _make_jax(name, n, v, pass_):
    def make():
        import jax
        import jax.numpy as jnp

        import liger_jax

        k1, k2 = jax.random.split(jax_key(n, v))
        s = jax.nn.log_softmax(jax.random.normal(k1, (n, v), jnp.float32), -1).astype(jnp.bfloat16)
        t = jax.nn.log_softmax(jax.random.normal(k2, (n, v), jnp.float32), -1).astype(jnp.bfloat16)
        f = (lambda a, b: liger_jax.jsd(a, b, beta=BETA)) if name == "liger_jax" else jax_jsd_formula
        return jax_loss_runner(f, (s, t), pass_)

    return make


def cases(quick: bool = False, smoke: bool = False) -> list[Case]:
    # fwd: student and teacher read once; fwd+bwd: that and the student's gradient written once.
    return row_cases("jsd", SMOKE if smoke else QUICK if quick else SHAPES, _make_torch, _make_jax,
                     {"fwd": 2, "fwd+bwd": 3}, torch_names=TORCH_PROVIDERS, axes=("tokens", "vocab"))

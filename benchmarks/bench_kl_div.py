"""KL divergence as used in distillation (student log-probs against teacher log-probs, ``log_target=True``,
``batchmean``), bf16 (tokens, vocab), forward and forward+backward: ours (torch, jax) against ``F.kl_div`` on
fp32-upcast inputs (eager, torch.compile), Liger-Kernel's ``LigerKLDIVLoss`` and the same formula under XLA."""

from __future__ import annotations

from .harness import (TORCH_PROVIDERS, Case, eager_or_compiled, jax_key, jax_loss_runner, row_cases, sweep,
                      torch_log_prob_pair_maker, unique_shapes)

SHAPES = unique_shapes(sweep({"tokens": 8192}, "vocab", [32000, 65536, 128256, 256000]),
                       sweep({"vocab": 128256}, "tokens", [2048, 4096, 8192, 16384]))
QUICK = sweep({"tokens": 8192}, "vocab", [32000, 128256, 256000])
SMOKE = sweep({"tokens": 8}, "vocab", [96])


def eager_kl_div(x, t, log_target=True):
    import torch.nn.functional as F

    return F.kl_div(x.float(), t.float(), reduction="batchmean", log_target=log_target)


def _torch_provider(name, log_target=True):
    if name == "liger_torch":
        import liger_torch

        return lambda x, t: liger_torch.kl_div(x, t, reduction="batchmean", log_target=log_target)
    if name == "liger_kernel":
        from liger_kernel.transformers import LigerKLDIVLoss

        loss = LigerKLDIVLoss(reduction="batchmean", log_target=log_target)
        return lambda x, t: loss(x, t)
    return eager_or_compiled(name, lambda x, t: eager_kl_div(x, t, log_target))


def _make_torch(name, n, v, pass_, log_target=True):
    return torch_log_prob_pair_maker(lambda: _torch_provider(name, log_target), n, v, pass_,
                                     target_probs=not log_target)


def _make_jax(name, n, v, pass_, log_target=True):
    def make():
        import jax
        import jax.numpy as jnp
        import jax.scipy.special

        import liger_jax

        k1, k2 = jax.random.split(jax_key(n, v))
        x = jax.nn.log_softmax(jax.random.normal(k1, (n, v), jnp.float32), -1).astype(jnp.bfloat16)
        t = jax.nn.log_softmax(jax.random.normal(k2, (n, v), jnp.float32), -1)
        t = (t if log_target else jnp.exp(t)).astype(jnp.bfloat16)
        if name == "liger_jax":
            f = lambda a, b: liger_jax.kl_div(a, b, reduction="batchmean", log_target=log_target)
        else:
            def f(a, b):
                af, bf = a.astype(jnp.float32), b.astype(jnp.float32)
                if log_target:
                    return jnp.sum(jnp.exp(bf) * (bf - af)) / a.shape[0]
                return jnp.sum(jax.scipy.special.xlogy(bf, bf) - bf * af) / a.shape[0]
        return jax_loss_runner(f, (x, t), pass_)  # the teacher passed, never a constant

    return make


def cases(quick: bool = False, smoke: bool = False, log_target: bool = True) -> list[Case]:
    # fwd: student and teacher read once; fwd+bwd: that and the student's gradient written once.
    return row_cases("kl_div" if log_target else "kl_div_probs", SMOKE if smoke else QUICK if quick else SHAPES,
                     lambda *a: _make_torch(*a, log_target=log_target), lambda *a: _make_jax(*a, log_target=log_target),
                     {"fwd": 2, "fwd+bwd": 3}, torch_names=TORCH_PROVIDERS, axes=("tokens", "vocab"))

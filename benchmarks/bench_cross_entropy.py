"""Cross-entropy on bf16 logits, forward and forward+backward, at LLM vocabulary sizes: ours (torch, jax)
against F.cross_entropy on fp32-upcast logits (eager and torch.compile), Liger-Kernel and optax under XLA."""

from __future__ import annotations

from .harness import (TORCH_PROVIDERS, Case, device, eager_or_compiled, jax_key, jax_loss_runner, row_cases, sweep,
                      torch_pass_runner, unique_shapes)

# vocabulary sizes (Llama-2, Mistral-Nemo-ish, Llama-3, Gemma) at 8k tokens, then tokens at Llama-3's vocabulary
SHAPES = unique_shapes(sweep({"tokens": 8192}, "vocab", [32000, 65536, 128256, 256000]),
                       sweep({"vocab": 128256}, "tokens", [2048, 4096, 8192, 16384, 32768]))
QUICK = sweep({"tokens": 8192}, "vocab", [32000, 128256, 256000])
SMOKE = sweep({"tokens": 8}, "vocab", [96])


def hf_cross_entropy(logits, target):
    """What HF models do: upcast the logits to fp32, then F.cross_entropy."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.float(), target, ignore_index=-100)


def _torch_inputs(n, v, requires_grad):
    import torch

    logits = torch.randn(n, v, device=device(), dtype=torch.bfloat16, requires_grad=requires_grad)
    target = torch.randint(0, v, (n,), device=device())
    target[::10] = -100
    return logits, target


def _torch_provider(name):
    if name == "liger_torch":
        import liger_torch

        # in place: the gradient overwrites the logits (what a training step wants, and what Liger-Kernel does)
        return lambda x, t: liger_torch.cross_entropy(x, t, in_place=True)
    if name == "liger_torch_copy":
        import liger_torch

        return lambda x, t: liger_torch.cross_entropy(x, t, in_place=False)
    if name == "liger_kernel":
        from liger_kernel.transformers.functional import liger_cross_entropy

        return lambda x, t: liger_cross_entropy(x, t, ignore_index=-100)
    return eager_or_compiled(name, hf_cross_entropy)


def _make_torch(name, n, v, pass_):
    def make():
        import torch

        fn = _torch_provider(name)
        logits, target = _torch_inputs(n, v, pass_ != "fwd")
        return torch_pass_runner(lambda x: fn(x, target), (logits,), torch.tensor(1.0, device=device()), pass_)

    return make


def _make_jax(name, n, v, pass_):
    def make():
        import jax
        import jax.numpy as jnp
        import optax

        import liger_jax

        k1, k2 = jax.random.split(jax_key(n, v))
        logits = jax.random.normal(k1, (n, v), jnp.bfloat16)
        labels = jax.random.randint(k2, (n,), 0, v)
        if name == "liger_jax":
            f = lambda x: liger_jax.cross_entropy(x, labels)
        else:
            f = lambda x: jnp.mean(optax.softmax_cross_entropy_with_integer_labels(x.astype(jnp.float32), labels))
        return jax_loss_runner(f, (logits,), pass_)

    return make


def cases(quick: bool = False, smoke: bool = False) -> list[Case]:
    # fwd: the logits read once; fwd+bwd: read once and their gradient written once.
    return row_cases("cross_entropy", SMOKE if smoke else QUICK if quick else SHAPES, _make_torch, _make_jax,
                     {"fwd": 1, "fwd+bwd": 2}, torch_names=("liger_torch", "liger_torch_copy") + TORCH_PROVIDERS[1:],
                     axes=("tokens", "vocab"))

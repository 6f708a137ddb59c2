"""The same numpy inputs through liger_torch.rope ((B, H, T, D)) and liger_jax.rope ((B, T, H, D), the transpose):
the same kernel and grid read the two layouts by strides, so outputs and gradients are bitwise equal."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import liger_jax
import liger_torch
from helpers import assert_parity, as_numpy, to_torch


@pytest.mark.parametrize("seq,heads,dim", [(1, (4, 4), 64), (7, (8, 1), 128), (3, (8, 2), 96)])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("with_pos", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rope_parity(seq, heads, dim, interleaved, with_pos, dtype, device, seed):
    rng = np.random.default_rng(seed)
    batch, (hq, hk), dt = 1, heads, jnp.dtype(dtype)
    q = np.asarray(rng.standard_normal((batch, seq, hq, dim)), dt)  # jax layout (B, T, H, D)
    k = np.asarray(rng.standard_normal((batch, seq, hk, dim)), dt)
    rows = 11 if with_pos else seq
    cos = np.asarray(rng.standard_normal((1, rows, dim)), dt)
    sin = np.asarray(rng.standard_normal((1, rows, dim)), dt)
    pos = rng.integers(0, rows, (batch, seq)) if with_pos else None
    gq = np.asarray(rng.standard_normal(q.shape), dt)
    gk = np.asarray(rng.standard_normal(k.shape), dt)

    # torch: HF layout (B, H, T, D), contiguous copies of the transposes
    qt = to_torch(q.transpose(0, 2, 1, 3), device).requires_grad_(True)
    kt = to_torch(k.transpose(0, 2, 1, 3), device).requires_grad_(True)
    pos_t = None if pos is None else torch.from_numpy(pos).to(device)
    outs_t = liger_torch.rope(qt, kt, to_torch(cos, device), to_torch(sin, device), pos_t, interleaved=interleaved)
    torch.autograd.backward(outs_t, (to_torch(gq.transpose(0, 2, 1, 3), device),
                                     to_torch(gk.transpose(0, 2, 1, 3), device)))

    pos_j = None if pos is None else jnp.asarray(pos, jnp.int32)
    f = jax.jit(lambda a, b: liger_jax.rope(a, b, cos, sin, position_ids=pos_j, interleaved=interleaved))
    outs_j, vjp = jax.vjp(f, jnp.asarray(q), jnp.asarray(k))
    grads_j = vjp((jnp.asarray(gq), jnp.asarray(gk)))
    pairs = zip(("q_embed", "k_embed", "dq", "dk"), (*outs_t, qt.grad, kt.grad), (*outs_j, *grads_j))
    for name, a, b in pairs:
        assert_parity(as_numpy(a).transpose(0, 2, 1, 3), np.asarray(b), name)

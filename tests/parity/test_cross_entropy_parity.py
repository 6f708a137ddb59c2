"""The same numpy inputs through liger_torch.cross_entropy and liger_jax.cross_entropy: bitwise equal.

Both frontends launch the same kernels with the same grids (one program per row, the loss summed by the
fixed-order reduction of liger_core.reduce), so on the same backend loss and gradients are identical."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liger_jax
import liger_torch
from helpers import assert_parity, as_numpy, to_torch

OPTIONS = {
    "plain": {},
    "weight_smoothing": {"weight": True, "label_smoothing": 0.1},
    "z_softcap": {"lse_square_scale": 1e-3, "softcap": 5.0},
}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cross_entropy_parity(reduction, option, dtype, device, seed):
    rng = np.random.default_rng(seed)
    n, v = 11, 259
    x = np.asarray(rng.standard_normal((n, v)) * 3, jnp.dtype(dtype))
    labels = rng.integers(0, v, n).astype(np.int32)
    labels[rng.random(n) < 0.3] = -100
    weight = np.asarray(rng.random(v) + 0.5, np.float32)
    g = np.asarray(rng.standard_normal(n) if reduction == "none" else 0.7, jnp.dtype(dtype))
    opts = dict(OPTIONS[option])
    use_weight = opts.pop("weight", False)

    xt = to_torch(x, device).requires_grad_(True)
    loss_t, z_t = liger_torch.cross_entropy(xt, to_torch(labels, device).long(),
                                            to_torch(weight, device) if use_weight else None,
                                            reduction=reduction, return_z_loss=True, **opts)
    loss_t.backward(to_torch(g, device))

    def f(a):
        return liger_jax.cross_entropy(a, jnp.asarray(labels), weight=jnp.asarray(weight) if use_weight else None,
                                       reduction=reduction, return_z_loss=True, **opts)

    (loss_j, z_j), vjp = jax.vjp(jax.jit(f), jnp.asarray(x))
    (dx_j,) = vjp((jnp.asarray(g), jnp.zeros_like(z_j)))
    for name, a, b in (("loss", loss_t, loss_j), ("z_loss", z_t, z_j), ("dx", xt.grad, dx_j)):
        assert_parity(as_numpy(a), np.asarray(b), name)


@pytest.mark.parametrize("v", [32003, 65541])
@pytest.mark.parametrize("option", ["plain", "z_softcap"])
def test_wide_vocab_parity(v, option, device, seed, lagged_from_65536):
    """32003 columns: the row kernel's 8192-column steps at 16 warps (cross_entropy._CE_SWEEPS); 65541: the lagged
    kernel (9 segments, the last 5 columns wide). Both frontends launch them whether the gradient goes over the
    logits (jax) or into its own buffer (torch's default)."""
    from liger_core.cross_entropy import ce_block_and_warps, uses_lagged

    rng = np.random.default_rng(seed)
    n = 3
    assert uses_lagged(v) == (v == 65541) and ce_block_and_warps(v) == (8192, 16)
    x = np.asarray(rng.standard_normal((n, v)) * 3, jnp.float32)
    labels = np.asarray([v - 1, 5, -100], np.int32)  # a target in the partial last step, an ignored row
    g = np.asarray(rng.standard_normal(n), jnp.float32)
    opts = OPTIONS[option]

    xt = to_torch(x, device).requires_grad_(True)
    loss_t = liger_torch.cross_entropy(xt, to_torch(labels, device).long(), reduction="none", **opts)
    loss_t.backward(to_torch(g, device))
    loss_j, vjp = jax.vjp(jax.jit(lambda a: liger_jax.cross_entropy(a, jnp.asarray(labels), reduction="none",
                                                                     **opts)), jnp.asarray(x))
    (dx_j,) = vjp(jnp.asarray(g))
    assert_parity(as_numpy(loss_t), np.asarray(loss_j), "loss")
    assert_parity(as_numpy(xt.grad), np.asarray(dx_j), "dx")


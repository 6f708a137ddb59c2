"""liger_torch.jsd and liger_jax.jsd on the same numpy inputs: bitwise equal (same kernels, same grids)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liger_jax
import liger_torch
from helpers import assert_parity
from test_cross_entropy_parity import as_numpy, to_torch


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("with_labels", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jsd_parity(beta, with_labels, dtype, device, seed):
    rng = np.random.default_rng(seed)
    shape = (6, 259)
    s = np.asarray(jax.nn.log_softmax(rng.standard_normal(shape) * 2, -1), jnp.dtype(dtype))
    t = np.asarray(jax.nn.log_softmax(rng.standard_normal(shape) * 2, -1), jnp.dtype(dtype))
    labels = rng.integers(0, shape[-1], shape[0]).astype(np.int32)
    labels[[1, 4]] = -100
    labels = labels if with_labels else None
    g = np.asarray(0.7, jnp.dtype(dtype))
    st = to_torch(s, device).requires_grad_(True)
    loss_t = liger_torch.jsd(st, to_torch(t, device), None if labels is None else to_torch(labels, device),
                             beta=beta)
    loss_t.backward(to_torch(g, device))
    f = lambda a: liger_jax.jsd(a, jnp.asarray(t), None if labels is None else jnp.asarray(labels), beta=beta)
    loss_j, vjp = jax.vjp(jax.jit(f), jnp.asarray(s))
    (ds_j,) = vjp(jnp.asarray(g))
    assert_parity(as_numpy(loss_t), np.asarray(loss_j), "loss")
    assert_parity(as_numpy(st.grad), np.asarray(ds_j), "dstudent")

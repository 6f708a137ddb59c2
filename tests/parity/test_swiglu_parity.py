"""The same numpy inputs through liger_torch and liger_jax swiglu / geglu: bitwise equal outputs and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liger_jax
import liger_torch
from helpers import assert_parity, as_numpy, to_torch

OPS = {
    "swiglu": (liger_torch.swiglu, liger_jax.swiglu),
    "geglu_tanh": (lambda a, b: liger_torch.geglu(a, b, "tanh"), lambda a, b: liger_jax.geglu(a, b)),
    "geglu_erf": (lambda a, b: liger_torch.geglu(a, b, "none"),
                  lambda a, b: liger_jax.geglu(a, b, approximate="none")),
}


@pytest.mark.parametrize("shape", [(1, 64), (7, 123), (2, 3, 200)])
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_gated_parity(shape, op, dtype, device, seed):
    rng = np.random.default_rng(seed)
    a, b, g = (np.asarray(rng.standard_normal(shape) * s, jnp.dtype(dtype)) for s in (3, 1, 1))
    torch_op, jax_op = OPS[op]
    at = to_torch(a, device).requires_grad_(True)
    bt = to_torch(b, device).requires_grad_(True)
    ct = torch_op(at, bt)
    ct.backward(to_torch(g, device))
    cj, vjp = jax.vjp(jax.jit(jax_op), jnp.asarray(a), jnp.asarray(b))
    daj, dbj = vjp(jnp.asarray(g))
    for name, x, y in (("c", ct, cj), ("da", at.grad, daj), ("db", bt.grad, dbj)):
        assert_parity(as_numpy(x), np.asarray(y), name)

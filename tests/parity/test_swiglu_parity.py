"""The same numpy inputs through liger_torch and liger_jax swiglu / geglu: bitwise equal outputs and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

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


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("op", ["swiglu", "geglu_tanh"])
def test_gated_linear_parity(op, bias, device, seed):
    """swiglu_linear / geglu_linear: torch's (O, I) weight is jax's (I, O) kernel transposed. The gate is the
    same kernel; the matmuls are each framework's own (fp32 here), so the bound is fp32 rounding."""
    from helpers import assert_close

    rng = np.random.default_rng(seed)
    a, b = (np.asarray(rng.standard_normal((7, 123)) * s, np.float32) for s in (3, 1))
    kernel = np.asarray(rng.standard_normal((123, 20)) / 11, np.float32)
    bb = np.asarray(rng.standard_normal(20), np.float32) if bias else None
    g = np.asarray(rng.standard_normal((7, 20)), np.float32)
    torch_op = liger_torch.swiglu_linear if op == "swiglu" else liger_torch.geglu_linear
    jax_op = liger_jax.swiglu_linear if op == "swiglu" else liger_jax.geglu_linear
    leaves = [to_torch(t, device).requires_grad_(True) for t in (a, b, kernel.T.copy())]
    bt = to_torch(bb, device).requires_grad_(True) if bias else None
    yt = torch_op(*leaves, bt)
    yt.backward(to_torch(g, device))
    args = [jnp.asarray(t) for t in (a, b, kernel)] + ([jnp.asarray(bb)] if bias else [])
    yj, vjp = jax.vjp(jax.jit(jax_op), *args)
    grads_j = vjp(jnp.asarray(g))
    torch_grads = [leaves[0].grad, leaves[1].grad, leaves[2].grad.T] + ([bt.grad] if bias else [])
    assert_close(as_numpy(yt), np.asarray(yj), torch.float32, "y", scale=4.0)
    for name, x, y in zip(("da", "db", "dkernel", "dbias"), torch_grads, grads_j):
        assert_close(as_numpy(x), np.asarray(y), torch.float32, name, scale=4.0)

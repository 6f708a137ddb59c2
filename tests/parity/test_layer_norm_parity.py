"""The same numpy inputs through liger_torch.layer_norm and liger_jax.layer_norm: identical outputs and
gradients, bit for bit (same kernels, same grids on the same backend)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liger_jax
import liger_torch
from helpers import assert_parity, as_numpy, to_torch


# 9000: a wide row (one 16384-wide tile); 16400: over 16384 columns (the forward sweeps it in chunks, the
# backward splits it into column blocks;
# one case: the interpreter takes ~15 s for it)
CASES = [(shape, params, dtype) for shape in [(1, 64), (7, 123), (2, 3, 200), (3, 9000)]
         for params in ["scale_bias", "scale", "none"] for dtype in ["float32", "bfloat16", "float16"]]
CASES.append(((2, 16400), "scale_bias", "bfloat16"))


@pytest.mark.parametrize("shape,params,dtype", CASES)
def test_layer_norm_parity(shape, params, dtype, device, seed):
    rng = np.random.default_rng(seed)
    x = np.asarray(rng.standard_normal(shape) * 2 + 0.5, jnp.dtype(dtype))
    w = np.asarray(rng.standard_normal(shape[-1]), jnp.dtype(dtype)) if params != "none" else None
    b = np.asarray(rng.standard_normal(shape[-1]), jnp.dtype(dtype)) if params == "scale_bias" else None
    g = np.asarray(rng.standard_normal(shape), jnp.dtype(dtype))

    xt = to_torch(x, device).requires_grad_(True)
    wt = None if w is None else to_torch(w, device).requires_grad_(True)
    bt = None if b is None else to_torch(b, device).requires_grad_(True)
    yt = liger_torch.layer_norm(xt, wt, bt, eps=1e-5)
    yt.backward(to_torch(g, device))

    args = [jnp.asarray(a) for a in (x, w, b) if a is not None]

    def f(*params):
        a, rest = params[0], list(params[1:])
        s = rest.pop(0) if w is not None else None
        c = rest.pop(0) if b is not None else None
        return liger_jax.layer_norm(a, s, c, epsilon=1e-5)

    yj, vjp = jax.vjp(jax.jit(f), *args)
    grads_j = vjp(jnp.asarray(g))
    grads_t = [t.grad for t in (xt, wt, bt) if t is not None]
    assert_parity(as_numpy(yt), np.asarray(yj), "y")
    for name, a, c in zip(("dx", "dscale", "dbias"), grads_t, grads_j):
        assert_parity(as_numpy(a), np.asarray(c), name)

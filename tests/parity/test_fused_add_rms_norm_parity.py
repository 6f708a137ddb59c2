"""The same numpy inputs through liger_torch.fused_add_rms_norm and liger_jax.fused_add_rms_norm: identical
outputs (y, h) and gradients (dx, dresidual, dscale), bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import liger_jax
import liger_torch
from helpers import assert_parity, as_numpy, to_torch


# 9000: a wide row (one 16384-wide tile); 16400: over 16384 columns (the forward holds it in a 32768-wide block,
# the backward splits it into column blocks; two cases: the interpreter is slow there)
CASES = [(shape, mode, offset, dtypes) for shape in [(1, 64), (7, 123), (2, 3, 200), (3, 9000)]
         for mode, offset in [("llama", 0.0), ("gemma", 1.0), ("none", 0.0)]
         for dtypes in [("float32", "float32"), ("bfloat16", "bfloat16"), ("bfloat16", "float32")]]
CASES += [((2, 16400), "llama", 0.0, ("bfloat16", "bfloat16")), ((2, 16400), "gemma", 1.0, ("bfloat16", "float32"))]


@pytest.mark.parametrize("shape,mode,offset,dtypes", CASES)
def test_fused_add_rms_norm_parity(shape, mode, offset, dtypes, device, seed):
    rng = np.random.default_rng(seed)
    x_dtype, r_dtype = (jnp.dtype(d) for d in dtypes)
    x = np.asarray(rng.standard_normal(shape) * 2, x_dtype)
    r = np.asarray(rng.standard_normal(shape) * 2, r_dtype)
    w = np.asarray(rng.standard_normal(shape[-1]), x_dtype)
    h_dtype = jnp.promote_types(x_dtype, r_dtype)
    gy = np.asarray(rng.standard_normal(shape), jnp.promote_types(h_dtype, x_dtype) if mode == "llama" else h_dtype)
    gh = np.asarray(rng.standard_normal(shape), h_dtype)

    xt, rt, wt = (to_torch(a, device).requires_grad_(True) for a in (x, r, w))
    yt, ht = liger_torch.fused_add_rms_norm(xt, rt, wt, 1e-6, offset, mode)
    torch.autograd.backward([yt, ht], [to_torch(gy, device), to_torch(gh, device)])

    def f(a, b, s):
        return liger_jax.fused_add_rms_norm(a, b, s, epsilon=1e-6, offset=offset, casting_mode=mode)

    (yj, hj), vjp = jax.vjp(jax.jit(f), jnp.asarray(x), jnp.asarray(r), jnp.asarray(w))
    dxj, drj, dwj = vjp((jnp.asarray(gy), jnp.asarray(gh)))
    for name, a, b in (("y", yt, yj), ("h", ht, hj), ("dx", xt.grad, dxj), ("dresidual", rt.grad, drj),
                       ("dscale", wt.grad, dwj)):
        assert as_numpy(a).dtype == np.asarray(b).dtype, name
        assert_parity(as_numpy(a), np.asarray(b), name)

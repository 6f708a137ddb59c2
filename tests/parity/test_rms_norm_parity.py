"""The same numpy inputs through liger_torch and liger_jax: identical outputs and gradients.

Both frontends launch the same kernel with the same grid: bitwise equal in the interpreter, within 2 ulp on
the GPU (see helpers.assert_parity for why)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import liger_jax
import liger_torch
from helpers import assert_parity, to_torch

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# 9000: a wide row (one 16384-wide tile); 16400: over 16384 columns (the forward holds it in a 32768-wide block,
# the backward splits it into column blocks; two cases: the interpreter is slow there)
CASES = [(shape, mode, offset, dtype) for shape in [(1, 64), (7, 123), (2, 3, 200), (3, 9000)]
         for mode, offset in [("llama", 0.0), ("gemma", 1.0), ("none", 0.0)] for dtype in ["float32", "bfloat16"]]
CASES += [((2, 16400), "llama", 0.0, "bfloat16"), ((2, 16400), "gemma", 1.0, "float32")]


@pytest.mark.parametrize("shape,mode,offset,dtype", CASES)
def test_rms_norm_parity(shape, mode, offset, dtype, device, seed):
    rng = np.random.default_rng(seed)
    x = np.asarray(rng.standard_normal(shape), jnp.dtype(dtype))
    w = np.asarray(rng.standard_normal(shape[-1]), jnp.dtype(dtype))
    g = np.asarray(rng.standard_normal(shape), jnp.dtype(dtype))

    xt = to_torch(x, device).requires_grad_(True)
    wt = to_torch(w, device).requires_grad_(True)
    yt = liger_torch.rms_norm(xt, wt, 1e-6, offset, mode)
    yt.backward(to_torch(g, device))

    def f(a, s):
        return liger_jax.rms_norm(a, s, epsilon=1e-6, offset=offset, casting_mode=mode)

    yj, vjp = jax.vjp(jax.jit(f), jnp.asarray(x), jnp.asarray(w))
    dxj, dwj = vjp(jnp.asarray(g))
    for name, a, b in (("y", yt, yj), ("dx", xt.grad, dxj), ("dw", wt.grad, dwj)):
        assert_parity(a, b, name)

"""The same numpy inputs through liger_torch and liger_jax fused linear cross-entropy.

Not bitwise: the chunk logits and the gradient matmuls come from different libraries (torch's CPU/cuBLAS
GEMMs versus XLA's dot), whose summation orders differ, so logits differ in their last bits and everything
downstream by a few ulps. Asserted: fp32 within atol = rtol = 2e-6 for the loss and dx (a few fp32 ulps;
dweight/dbias, sums over all rows, get 4x that); bf16 within one bf16 rounding (1.6e-2 relative), since a
last-bit difference in an fp32 logit can flip its rounding to bf16. The cross-entropy kernel itself is the same
launch in both frontends (bitwise parity of that part is tests/parity/test_cross_entropy_parity.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import liger_jax
import liger_torch
from helpers import as_numpy, to_torch

TOL = {"float32": 2e-6, "bfloat16": 1.6e-2}


# chunk None: the default, one chunk here (no fp32 dW accumulator); 8: four chunks and the accumulator
@pytest.mark.parametrize("chunk_size", [8, None])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_linear_cross_entropy_parity(chunk_size, reduction, dtype, device, seed):
    rng = np.random.default_rng(seed)
    n, h, v = 29, 16, 259
    x = np.asarray(rng.standard_normal((n, h)), jnp.dtype(dtype))
    w = np.asarray(rng.standard_normal((v, h)) * 0.4, jnp.dtype(dtype))  # (V, H): torch layout
    b = np.asarray(rng.standard_normal(v), jnp.dtype(dtype))
    labels = rng.integers(0, v, n).astype(np.int32)
    labels[rng.random(n) < 0.3] = -100
    g = np.asarray(rng.standard_normal(n) if reduction == "none" else 0.7, np.float32)  # the loss is fp32
    opts = dict(reduction=reduction, label_smoothing=0.1, lse_square_scale=1e-3, softcap=5.0, chunk_size=chunk_size)

    xt, wt, bt = (to_torch(a, device).requires_grad_(True) for a in (x, w, b))
    loss_t = liger_torch.fused_linear_cross_entropy(xt, wt, to_torch(labels, device).long(), bt, **opts)
    loss_t.backward(to_torch(g, device))

    f = lambda a, k, c: liger_jax.fused_linear_cross_entropy(a, k, jnp.asarray(labels), c, transpose=True, **opts)
    loss_j, vjp = jax.vjp(jax.jit(f), jnp.asarray(x), jnp.asarray(w), jnp.asarray(b))
    grads_j = vjp(jnp.asarray(g))
    tol = TOL[dtype]
    pairs = (("loss", loss_t, loss_j, 1), ("dx", xt.grad, grads_j[0], 1), ("dweight", wt.grad, grads_j[1], 4),
             ("dbias", bt.grad, grads_j[2], 4))
    for name, a, bj, widen in pairs:
        a = as_numpy(a).astype(np.float64)
        bj = np.asarray(bj).astype(np.float64)
        scale = n if (reduction == "mean" and name != "loss") else 1.0
        np.testing.assert_allclose(a * scale, bj * scale, rtol=widen * tol, atol=widen * tol, err_msg=name)


@pytest.mark.parametrize("chunk_size", [8, None])
def test_fp32_master_weight_parity(chunk_size, device, seed):
    """Mixed precision, each frontend's way: torch.autocast(bf16) over fp32 tensors, and dtype=bfloat16 with
    fp32 arrays in jax. Both cast to bf16 for the matmuls and return fp32 gradients; within bf16 tolerances
    (the weight gradient's chunks go through a bf16 scratch on a CPU, where torch has no bf16 matmul with an
    fp32 output)."""
    rng = np.random.default_rng(seed)
    n, h, v = 29, 16, 259
    x = np.asarray(rng.standard_normal((n, h)), np.float32)
    w = np.asarray(rng.standard_normal((v, h)) * 0.4, np.float32)
    labels = rng.integers(0, v, n).astype(np.int32)
    labels[rng.random(n) < 0.3] = -100

    xt, wt = (to_torch(a, device).requires_grad_(True) for a in (x, w))
    with torch.autocast(xt.device.type, dtype=torch.bfloat16):
        loss_t = liger_torch.fused_linear_cross_entropy(xt, wt, to_torch(labels, device).long(),
                                                        chunk_size=chunk_size)
    (loss_t * 0.7).backward()

    f = lambda a, k: 0.7 * liger_jax.fused_linear_cross_entropy(a, k, jnp.asarray(labels), transpose=True,
                                                                chunk_size=chunk_size, dtype=jnp.bfloat16)
    loss_j, grads_j = jax.jit(jax.value_and_grad(f, (0, 1)))(jnp.asarray(x), jnp.asarray(w))
    tol = TOL["bfloat16"]
    np.testing.assert_allclose(float(loss_t) * 0.7, float(loss_j), rtol=tol, atol=tol, err_msg="loss")
    for name, a, bj, widen in (("dx", xt.grad, grads_j[0], 1), ("dweight", wt.grad, grads_j[1], 4)):
        assert a.dtype == torch.float32 and bj.dtype == jnp.float32, name
        np.testing.assert_allclose(as_numpy(a).astype(np.float64) * n, np.asarray(bj).astype(np.float64) * n,
                                   rtol=widen * tol, atol=widen * tol, err_msg=name)

"""The same numpy inputs through liger_torch and liger_jax fused linear JSD.

Not bitwise: the chunk logits and the gradient matmuls come from different libraries (torch's CPU/cuBLAS GEMMs
versus XLA's dot), and so do the fp32 log-softmaxes of the chunks (torch's versus XLA's, with different
summation orders and exp/log implementations), so the log-probabilities the kernel reads differ in their last
bits and everything downstream by a few ulps. Asserted: fp32 within atol = rtol = 2e-6 for the loss and dx
(gradients compared times the row count, so O(1); measured in the interpreter: at most 2e-7 relative to
1 + |value|, 2026-12-02), dweight, a sum over all rows, 4x that; bf16
within one bf16 rounding (1.6e-2 relative), since a last-bit difference in an fp32 logit can flip its rounding
to bf16. The JSD kernel itself is the same launch in both frontends (bitwise parity of that part is
tests/parity/test_jsd_parity.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liger_jax
import liger_torch
from test_cross_entropy_parity import as_numpy, to_torch

TOL = {"float32": 2e-6, "bfloat16": 1.6e-2}


# chunk None: the default, one chunk here (no fp32 dW accumulator); 8: four chunks and the accumulator
@pytest.mark.parametrize("beta,with_labels,dtype,chunk_size", [
    (0.0, True, "float32", 8), (0.5, False, "float32", 8), (1.0, True, "bfloat16", 8), (0.5, True, "bfloat16", 8),
    (0.5, True, "bfloat16", None)])
def test_fused_linear_jsd_parity(beta, with_labels, dtype, chunk_size, device, seed):
    rng = np.random.default_rng(seed)
    n, hs, ht, v = 29, 16, 12, 259
    xs = np.asarray(rng.standard_normal((n, hs)), jnp.dtype(dtype))
    ws = np.asarray(rng.standard_normal((v, hs)) * 0.4, jnp.dtype(dtype))  # (V, H): torch layout
    xt = np.asarray(rng.standard_normal((n, ht)), jnp.dtype(dtype))
    wt = np.asarray(rng.standard_normal((v, ht)) * 0.5, jnp.dtype(dtype))
    labels = rng.integers(0, v, n).astype(np.int32)
    labels[rng.random(n) < 0.3] = -100
    labels[0] = 1
    labels = labels if with_labels else None
    g = np.asarray(0.7, jnp.dtype(dtype))
    opts = dict(beta=beta, temperature=1.5, chunk_size=chunk_size)

    xst, wst = (to_torch(a, device).requires_grad_(True) for a in (xs, ws))
    loss_t = liger_torch.fused_linear_jsd(xst, wst, to_torch(xt, device), to_torch(wt, device),
                                          None if labels is None else to_torch(labels, device).long(), **opts)
    loss_t.backward(to_torch(g, device))

    jl = None if labels is None else jnp.asarray(labels)
    f = lambda a, k: liger_jax.fused_linear_jsd(a, k, jnp.asarray(xt), jnp.asarray(wt), jl, transpose=True, **opts)
    loss_j, vjp = jax.vjp(jax.jit(f), jnp.asarray(xs), jnp.asarray(ws))
    grads_j = vjp(jnp.asarray(g))
    tol = TOL[dtype]
    count = n if labels is None else int((labels != -100).sum())
    pairs = (("loss", loss_t, loss_j, 1), ("dx", xst.grad, grads_j[0], 1), ("dweight", wst.grad, grads_j[1], 4))
    for name, a, bj, widen in pairs:
        a = as_numpy(a).astype(np.float64)
        bj = np.asarray(bj).astype(np.float64)
        scale = count if name != "loss" else 1.0  # the mean's gradients are ~1/count
        np.testing.assert_allclose(a * scale, bj * scale, rtol=widen * tol, atol=widen * tol, err_msg=name)

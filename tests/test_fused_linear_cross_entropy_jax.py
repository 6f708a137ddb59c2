"""liger_jax.fused_linear_cross_entropy against a float64 matmul + cross-entropy reference, under jit and grad."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liger_jax
from helpers import assert_close, x64
from test_cross_entropy_jax import reference as ce_reference

N, H, V = 37, 24, 259
CHUNK = 8  # 5 chunks, the last one padded


def reference(x, kernel, labels, bias=None, transpose=False, **opts):
    """float64 from the same inputs, the logits rounded to x's dtype as an lm_head's output is."""
    with x64():
        k = kernel.astype(jnp.float64)
        z = x.astype(jnp.float64) @ (k.T if transpose else k)
        if bias is not None:
            z = z + bias.astype(jnp.float64)
        z = z.astype(x.dtype).astype(jnp.float64)
        return ce_reference(z, labels, **opts)


def draw(seed, dtype, n=N, ignore_fraction=0.25):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((n, H)), dtype)
    kernel = jnp.asarray(rng.standard_normal((H, V)) * 0.4, dtype)
    bias = jnp.asarray(rng.standard_normal(V), dtype)
    labels = rng.integers(0, V, n)
    labels[rng.random(n) < ignore_fraction] = -100
    return x, kernel, jnp.asarray(labels, jnp.int32), bias, jnp.asarray(rng.random(V) + 0.5, jnp.float32), rng


# chunk None: one chunk, whose bf16 kernel gradient is one matmul rounded once (no fp32 accumulator)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype,chunk", [(jnp.float32, CHUNK), (jnp.bfloat16, CHUNK), (jnp.bfloat16, None)])
def test_forward_and_grads_under_jit(reduction, dtype, chunk, seed):
    x, kernel, labels, bias, cw, rng = draw(seed, dtype)
    opts = dict(label_smoothing=0.1, lse_square_scale=1e-3, softcap=5.0, reduction=reduction)
    probe = jnp.asarray(rng.standard_normal(N) if reduction == "none" else 0.7, jnp.float32)

    def ours(a, k, b):
        return liger_jax.fused_linear_cross_entropy(a, k, labels, b, ce_weight=cw, chunk_size=chunk,
                                                    return_z_loss=True, **opts)

    loss, z = jax.jit(ours)(x, kernel, bias)
    loss_ref, z_ref = reference(x, kernel, labels, bias, weight=cw, **opts)
    assert loss.dtype == jnp.float32 and loss.shape == loss_ref.shape  # fp32 whatever the inputs
    assert_close(np.asarray(loss.astype(jnp.float32)), np.asarray(loss_ref), dtype, "loss")
    assert_close(np.asarray(z.astype(jnp.float32)), np.asarray(z_ref), dtype, "z_loss")
    grads = jax.jit(jax.grad(lambda a, k, b: jnp.sum(ours(a, k, b)[0].astype(jnp.float32) * probe),
                             argnums=(0, 1, 2)))(x, kernel, bias)
    with x64():
        grads_ref = jax.grad(lambda a, k, b: jnp.sum(reference(a, k, labels, b, weight=cw, **opts)[0] * probe),
                             argnums=(0, 1, 2))(x, kernel, bias)
    scale = N if reduction == "mean" else 1.0
    for name, got, want in zip(("dx", "dkernel", "dbias"), grads, grads_ref):
        assert got.dtype == dtype, name
        widen = 1.0 if name == "dx" else N ** 0.5  # sums of N rounded terms
        assert_close(np.asarray(got.astype(jnp.float32)) * scale, np.asarray(want) * scale, dtype, name,
                     scale=widen if dtype == jnp.float32 else 2 * widen)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fp32_master_kernel(reduction, seed):
    """dtype=bfloat16 with an fp32 kernel (Flax's param_dtype=float32): bf16 matmuls of cast copies, the
    kernel's gradient accumulated in fp32 straight into its fp32 gradient, never rounded to bf16."""
    x, kernel, labels, bias, _, rng = draw(seed, jnp.float32)
    probe = jnp.asarray(rng.standard_normal(N) if reduction == "none" else 0.7, jnp.float32)

    def ours(a, k, b):
        loss = liger_jax.fused_linear_cross_entropy(a, k, labels, b, chunk_size=CHUNK, reduction=reduction,
                                                    dtype=jnp.bfloat16)
        return jnp.sum(loss * probe)

    _, grads = jax.jit(jax.value_and_grad(ours, argnums=(0, 1, 2)))(x, kernel, bias)
    bf16 = [a.astype(jnp.bfloat16) for a in (x, kernel, bias)]
    with x64():
        _, grads_ref = jax.value_and_grad(
            lambda a, k, b: jnp.sum(reference(a, k, labels, b, reduction=reduction)[0] * probe),
            argnums=(0, 1, 2))(*bf16)
        loss_ref = reference(*bf16[:2], labels, bf16[2], reduction=reduction)[0]
    # the loss itself (each row's with reduction='none'), not its sum against the random-sign probe, whose
    # cancellation would leave a small total with the rows' rounding (seed 227989825: -3.78 against -3.71)
    loss = liger_jax.fused_linear_cross_entropy(x, kernel, labels, bias, chunk_size=CHUNK, reduction=reduction,
                                                dtype=jnp.bfloat16)
    assert_close(np.asarray(loss), np.asarray(loss_ref), jnp.bfloat16, "loss")
    scale = N if reduction == "mean" else 1.0
    for name, got, want in zip(("dx", "dkernel", "dbias"), grads, grads_ref):
        assert got.dtype == jnp.float32, name
        widen = 1.0 if name == "dx" else N ** 0.5
        assert_close(np.asarray(got) * scale, np.asarray(want) * scale, jnp.bfloat16, name, scale=2 * widen)
    dk = grads[1]
    assert bool(jnp.any(dk != dk.astype(jnp.bfloat16).astype(jnp.float32))), "the gradient went through bf16"


def test_tied_embedding_layout_and_leading_axes(seed):
    """transpose=True takes a (V, H) matrix (nnx.Embed.embedding); x and labels may have leading axes."""
    x, kernel, labels, _, _, rng = draw(seed, jnp.float32, n=3 * 6)
    x3, l3 = x.reshape(3, 6, H), labels.reshape(3, 6)
    embedding = kernel.T
    f = lambda a, e: liger_jax.fused_linear_cross_entropy(a, e, l3, transpose=True, chunk_size=4)
    loss, (dx, de) = jax.value_and_grad(f, argnums=(0, 1))(x3, embedding)
    with x64():
        ref = lambda a, e: reference(a, e, l3, transpose=True)[0]
        loss_ref, (dx_ref, de_ref) = jax.value_and_grad(ref, argnums=(0, 1))(x3, embedding)
    assert dx.shape == x3.shape and de.shape == embedding.shape
    assert_close(np.asarray(loss), np.asarray(loss_ref), jnp.float32, "loss")
    assert_close(np.asarray(dx) * 18, np.asarray(dx_ref) * 18, jnp.float32, "dx")
    assert_close(np.asarray(de) * 18, np.asarray(de_ref) * 18, jnp.float32, "dembedding", scale=4.0)
    # the same numbers as the (H, V) kernel
    same = liger_jax.fused_linear_cross_entropy(x3, kernel, l3, chunk_size=4)
    assert_close(np.asarray(same), np.asarray(loss_ref), jnp.float32, "loss (H, V)")


def test_all_ignored_gives_zero(seed):
    x, kernel, labels, bias, _, _ = draw(seed, jnp.float32, ignore_fraction=1.0)
    f = lambda a, k, b: liger_jax.fused_linear_cross_entropy(a, k, labels, b, chunk_size=CHUNK, label_smoothing=0.1)
    loss, grads = jax.value_and_grad(f, argnums=(0, 1, 2))(x, kernel, bias)
    assert float(loss) == 0.0
    for grad in grads:
        np.testing.assert_array_equal(np.asarray(grad), 0.0)


def test_bad_label_raises_eagerly_and_is_nan_under_jit(seed):
    x, kernel, labels, _, _, _ = draw(seed, jnp.float32, ignore_fraction=0.0)
    bad = labels.at[5].set(V)
    with pytest.raises(ValueError, match=rf"labels has values outside \[0, {V}\)"):
        liger_jax.fused_linear_cross_entropy(x, kernel, bad)
    loss = jax.jit(lambda a, y: liger_jax.fused_linear_cross_entropy(a, kernel, y, chunk_size=CHUNK))(x, bad)
    assert np.isnan(float(loss))


@pytest.mark.parametrize("args,kwargs,error,match", [
    ((np.ones((4, 8), np.float32), np.ones((7, 10), np.float32), np.zeros(4, np.int32)), {}, ValueError,
     r"kernel must have shape \(H, V\) with H=8"),
    ((np.ones((4, 8), np.float32), np.ones((8, 10), np.float32), np.zeros(4, np.int32)), {"transpose": True},
     ValueError, r"kernel must have shape \(V, H\)"),
    ((np.ones((4, 8), np.float32), np.ones((8, 10), np.float16), np.zeros(4, np.int32)), {}, TypeError,
     "kernel must have x's dtype"),
    ((jnp.ones((4, 8), jnp.bfloat16), np.ones((8, 10), np.float32), np.zeros(4, np.int32)), {}, TypeError,
     "kernel must have x's dtype bfloat16, got float32; .* pass dtype="),
    ((np.ones((4, 8), np.float32), np.ones((8, 10), np.float32), np.zeros(5, np.int32)), {}, ValueError,
     "labels must have shape"),
    ((np.ones((4, 8), np.float32), np.ones((8, 10), np.float32), np.zeros(4, np.int32)),
     {"chunk_size": -2}, ValueError, "chunk_size"),
    ((np.ones((4, 8), np.float32), np.ones((8, 10), np.float32), np.zeros(4, np.int32)),
     {"ce_weight": np.ones(3, np.float32)}, ValueError, "ce_weight must have shape"),
])
def test_bad_input(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        liger_jax.fused_linear_cross_entropy(*args, **kwargs)


def test_vocab_not_a_power_of_two(seed):
    """V = 32003: the chunk's kernel sweeps several column blocks, the last one ragged (bf16, one chunk)."""
    rng = np.random.default_rng(seed)
    n, h, v = 5, 16, 32003
    x = jnp.asarray(rng.standard_normal((n, h)), jnp.bfloat16)
    kernel = jnp.asarray(rng.standard_normal((h, v)) * 0.4, jnp.bfloat16)
    labels = jnp.asarray(rng.integers(0, v, n), jnp.int32).at[1].set(-100)
    f = lambda a, k: liger_jax.fused_linear_cross_entropy(a, k, labels, label_smoothing=0.1)
    loss, (dx, dk) = jax.jit(jax.value_and_grad(lambda a, k: f(a, k) * 0.7, argnums=(0, 1)))(x, kernel)
    with x64():
        ref = lambda a, k: reference(a, k, labels, label_smoothing=0.1)[0] * 0.7
        loss_ref, (dx_ref, dk_ref) = jax.value_and_grad(ref, argnums=(0, 1))(x, kernel)
    assert_close(np.asarray(loss), np.asarray(loss_ref), jnp.bfloat16, "loss")
    kept = 4  # the mean's gradients are ~1/kept: compare them scaled up
    assert_close(np.asarray(dx.astype(jnp.float32)) * kept, np.asarray(dx_ref) * kept, jnp.bfloat16, "dx")
    assert_close(np.asarray(dk.astype(jnp.float32)) * kept, np.asarray(dk_ref) * kept, jnp.bfloat16, "dkernel",
                 scale=2 * n ** 0.5)

"""liger_jax.fused_add_rms_norm against float64 references, under jit, grad, vmap, checkpoint."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liger_jax
from helpers import assert_checkpoint_same_grad, assert_close, assert_grad_deterministic, f32, x64

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
# Triton's interpreter converts fp32 to bf16 by truncation (round toward zero; compiled kernels round to
# nearest even), so each bf16 rounding point may be one ulp off the reference's instead of half an ulp.
SLACK = {"bfloat16": 2.0} if liger_jax.INTERPRET else {}


def slack(dtype):
    return SLACK.get(jnp.dtype(dtype).name, 1.0)


def _rounded(v, dtype):
    """v rounded to dtype in the forward, the identity in the backward (the kernels' gradient)."""
    return v + jax.lax.stop_gradient(v.astype(dtype).astype(jnp.float64) - v)


def reference(x, residual, scale, epsilon=1e-6, offset=0.0, mode="llama"):
    """HF's formulas (residual add in h's dtype, then LlamaRMSNorm / GemmaRMSNorm) in float64; returns (y, h)."""
    with x64():
        h_dtype = jnp.promote_types(x.dtype, residual.dtype)
        h = _rounded(x.astype(jnp.float64) + residual.astype(jnp.float64), h_dtype)
        normed = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + epsilon)
        if scale is None:
            return (normed if mode == "gemma" else _rounded(normed, h_dtype)), h
        s = offset + scale.astype(jnp.float64)
        if mode == "llama":
            out = jnp.promote_types(h_dtype, scale.dtype)
            return _rounded(normed, h_dtype) * _rounded(s, out), h
        return normed * s, h


def draw(seed, shape, dtype, residual_dtype=None):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal(shape) * 2, dtype)
    residual = jnp.asarray(rng.standard_normal(shape) * 2, residual_dtype or dtype)
    scale = jnp.asarray(rng.standard_normal(shape[-1]) * 0.5 + 1, dtype)
    probes = tuple(jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(2))
    return x, residual, scale, probes


def loss_of(norm, probes):
    """A loss through both outputs: y and the new residual h."""
    def loss(x, r, s):
        y, h = norm(x, r, s)
        return jnp.sum(y.astype(jnp.float32) * probes[0]) + jnp.sum(h.astype(jnp.float32) * probes[1])
    return loss


def ref_grads(x, r, s, probes, **kwargs):
    with x64():
        def loss(a, b, c):
            y, h = reference(a, b, c, **kwargs)
            return jnp.sum(y * probes[0]) + jnp.sum(h * probes[1])
        return jax.grad(loss, argnums=(0, 1, 2) if s is not None else (0, 1))(x, r, s)


@pytest.mark.parametrize("shape", [(1, 64), (7, 123), (3, 5, 96)])
@pytest.mark.parametrize("mode,offset", [("llama", 0.0), ("gemma", 1.0), ("none", 0.0)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_and_grads_under_jit(shape, mode, offset, dtype, seed):
    x, r, scale, probes = draw(seed, shape, dtype)
    kwargs = dict(epsilon=1e-6, offset=offset, mode=mode)
    ours = lambda a, b, s: liger_jax.fused_add_rms_norm(a, b, s, epsilon=1e-6, offset=offset, casting_mode=mode)
    y, h = jax.jit(ours)(x, r, scale)
    y_ref, h_ref = reference(x, r, scale, **kwargs)
    assert y.dtype == h.dtype == dtype
    k = slack(dtype)
    assert_close(f32(y), np.asarray(y_ref), dtype, "y", scale=k)
    assert_close(f32(h), np.asarray(h_ref), dtype, "h", scale=k)
    grads = jax.jit(jax.grad(loss_of(ours, probes), argnums=(0, 1, 2)))(x, r, scale)
    wants = ref_grads(x, r, scale, probes, **kwargs)
    rows = x.size // shape[-1]
    for got, want, name in zip(grads, wants, ("dx", "dresidual", "dscale")):
        assert got.dtype == dtype
        # dscale sums one rounded term per row: allow the bound to grow with sqrt(rows).
        bound = k * (max(1.0, rows ** 0.5) if name == "dscale" else 1.0)
        assert_close(f32(got), np.asarray(want), dtype, name, scale=bound)


def test_y_only_and_without_scale(seed):
    """h unused (its cotangent is zero) and no scale."""
    x, r, _, probes = draw(seed, (7, 123), jnp.float32)
    ours = lambda a, b: jnp.sum(liger_jax.fused_add_rms_norm(a, b, None)[0] * probes[0])
    with x64():
        wants = jax.grad(lambda a, b: jnp.sum(reference(a, b, None)[0] * probes[0]), argnums=(0, 1))(x, r)
    for got, want, name in zip(jax.jit(jax.grad(ours, argnums=(0, 1)))(x, r), wants, ("dx", "dresidual")):
        assert_close(np.asarray(got), np.asarray(want), jnp.float32, name)


def test_mixed_dtypes(seed):
    """bf16 x onto an fp32 residual stream: h fp32, dx bf16, dresidual fp32."""
    x, r, scale, probes = draw(seed, (7, 123), jnp.bfloat16, residual_dtype=jnp.float32)
    scale = scale.astype(jnp.float32)
    y, h = liger_jax.fused_add_rms_norm(x, r, scale)
    assert y.dtype == h.dtype == jnp.float32
    y_ref, h_ref = reference(x, r, scale)
    assert_close(np.asarray(y), np.asarray(y_ref), jnp.float32, "y")
    assert_close(np.asarray(h), np.asarray(h_ref), jnp.float32, "h")
    dx, dr, ds = jax.grad(loss_of(liger_jax.fused_add_rms_norm, probes), argnums=(0, 1, 2))(x, r, scale)
    assert dx.dtype == jnp.bfloat16 and dr.dtype == ds.dtype == jnp.float32
    wants = ref_grads(x, r, scale, probes)
    assert_close(f32(dx), np.asarray(wants[0]), jnp.bfloat16, "dx", scale=slack(jnp.bfloat16))
    assert_close(np.asarray(dr), np.asarray(wants[1]), jnp.float32, "dresidual")
    assert_close(np.asarray(ds), np.asarray(wants[2]), jnp.float32, "dscale", scale=3.0)


@pytest.mark.parametrize("in_axes", [(0, 0, None), (1, 1, None), (0, None, None), (0, 0, 0)])
def test_vmap_folds_batch(in_axes, seed):
    """vmap over examples (shared or per-example residual / scale) gives per-example results and gradients."""
    x, r, scale, probes = draw(seed, (3, 7, 40), jnp.float32)
    r = r if in_axes[1] is not None else r[0]
    scales = jnp.stack([scale, 2 * scale, scale + 1]) if in_axes[2] == 0 else scale
    probes = probes if in_axes[0] == 0 else tuple(jnp.swapaxes(p, 0, 1) for p in probes)
    grad = lambda f: jax.grad(lambda a, b, s, p, q: loss_of(f, (p, q))(a, b, s), argnums=(0, 1, 2))
    ours = jax.vmap(grad(liger_jax.fused_add_rms_norm), in_axes=in_axes + (0, 0))
    ref = jax.vmap(grad(reference), in_axes=in_axes + (0, 0))
    with x64():
        wants = ref(x, r, scales, *probes)
    for got, want, name in zip(jax.jit(ours)(x, r, scales, *probes), wants, ("dx", "dresidual", "dscale")):
        assert got.shape == want.shape
        assert_close(np.asarray(got), np.asarray(want), jnp.float32, name, scale=3.0)


def test_nested_vmap_and_grad_of_vmap(seed):
    x, r, scale, probes = draw(seed, (2, 3, 5, 16), jnp.float32)
    grad = lambda f: jax.grad(lambda a, b, s, p, q: loss_of(f, (p, q))(a, b, s), argnums=(0, 1, 2))
    axes = (0, 0, None, 0, 0)
    ours = jax.vmap(jax.vmap(grad(liger_jax.fused_add_rms_norm), in_axes=axes), in_axes=axes)
    ref = jax.vmap(jax.vmap(grad(reference), in_axes=axes), in_axes=axes)
    with x64():
        wants = ref(x, r, scale, *probes)
    for got, want, name in zip(ours(x, r, scale, *probes), wants, ("dx", "dresidual", "dscale")):
        assert got.shape == want.shape
        assert_close(np.asarray(got), np.asarray(want), jnp.float32, name, scale=3.0)
    # grad outside vmap: the scale gradient sums over the batch
    batched = lambda f: lambda a, b, s: jax.vmap(f, in_axes=(0, 0, None))(a, b, s)
    got = jax.grad(loss_of(batched(liger_jax.fused_add_rms_norm), probes), argnums=(0, 1, 2))(x, r, scale)
    with x64():
        wants = jax.grad(lambda a, b, s: sum(jnp.sum(o * p) for o, p in zip(batched(reference)(a, b, s), probes)),
                         argnums=(0, 1, 2))(x, r, scale)
    for g, w, name in zip(got, wants, ("dx", "dresidual", "dscale")):
        assert_close(np.asarray(g), np.asarray(w), jnp.float32, name, scale=3.0)


def test_checkpoint_gives_the_same_gradient(seed):
    x, r, scale, probes = draw(seed, (7, 123), jnp.float32)
    assert_checkpoint_same_grad(loss_of(liger_jax.fused_add_rms_norm, probes), (x, r, scale))


def test_bitwise_deterministic(seed):
    x, r, scale, probes = draw(seed, (64, 257), jnp.float32)
    assert_grad_deterministic(loss_of(liger_jax.fused_add_rms_norm, probes), (x, r, scale))


@pytest.mark.parametrize("x,r,scale,error,match", [
    (np.ones((4, 8), np.float32), np.ones((4, 7), np.float32), None, ValueError, "residual must have the shape"),
    (np.ones((4, 8), np.float32), np.ones((4, 8), np.float32), np.ones(7, np.float32), ValueError,
     "scale must have shape"),
    (np.ones((4, 8), np.float32), np.ones((4, 8), np.int32), None, TypeError, "residual must have a floating"),
    (np.ones((4, 8), np.int32), np.ones((4, 8), np.float32), None, TypeError, "x must have a floating"),
    (np.ones((0, 8), np.float32), np.ones((0, 8), np.float32), None, ValueError, "x must not be empty"),
    (np.ones((4, 8), np.float32), [[1.0] * 8] * 4, None, TypeError, "residual must be a jax or numpy array"),
])
def test_bad_input(x, r, scale, error, match):
    with pytest.raises(error, match=match):
        liger_jax.fused_add_rms_norm(x, r, scale)


def test_bad_casting_mode():
    with pytest.raises(ValueError, match="casting_mode"):
        liger_jax.fused_add_rms_norm(np.ones((2, 8), np.float32), np.ones((2, 8), np.float32), None,
                                     casting_mode="fp8")


@pytest.mark.parametrize("mode", ["llama", "gemma"])
def test_fp16_rounding_points_match_hf(mode, seed):
    """fp16 (rounded to nearest in the interpreter too) pins the rounding points: h is the fp16 add bit for bit,
    y is the HF formula's result bit for bit except where fp32 reduction order flips a rounding (< 1%)."""
    x, r, scale, _ = draw(seed, (64, 257), jnp.float16)
    y, h = liger_jax.fused_add_rms_norm(x, r, scale, casting_mode=mode)
    h_ref = x + r
    np.testing.assert_array_equal(np.asarray(h), np.asarray(h_ref))
    hf = h_ref.astype(jnp.float32)
    normed = hf * jax.lax.rsqrt(jnp.mean(hf * hf, -1, keepdims=True) + 1e-6)
    y_ref = scale * normed.astype(jnp.float16) if mode == "llama" else (normed * scale).astype(jnp.float16)
    y, y_ref = f32(y), f32(y_ref)
    exact = np.mean(y == y_ref)
    assert exact >= 0.99, f"only {exact:.2%} of y is bitwise HF's"
    # llama rounds twice (normed to fp16, then scale * normed): a flipped rounding of normed moves y by up to
    # |scale| ulp(normed) plus y's own half ulp, i.e. up to 2 ulp of y; gemma rounds once (1 ulp).
    ulps = 2 if mode == "llama" else 1
    assert np.all(np.abs(y - y_ref) <= ulps * (np.abs(y_ref) * 2 ** -10 + 2 ** -24))

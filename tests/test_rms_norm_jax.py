"""liger_jax.rms_norm / liger_jax.nnx.RMSNorm against float64 references, under jit, grad, vmap, checkpoint."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liger_jax
from helpers import assert_checkpoint_same_grad, assert_close, assert_grad_deterministic, f32, x64

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def reference(x, scale, epsilon=1e-6, offset=0.0, mode="llama"):
    with x64():
        return _reference(x, scale, epsilon, offset, mode)


def _reference(x, scale, epsilon, offset, mode):
    x64 = x.astype(jnp.float64)
    normed = x64 * jax.lax.rsqrt(jnp.mean(x64 * x64, -1, keepdims=True) + epsilon)
    if scale is None:
        return normed if mode == "gemma" else normed.astype(x.dtype).astype(jnp.float64)
    s = offset + scale.astype(jnp.float64)
    if mode == "llama":
        out = jnp.promote_types(x.dtype, scale.dtype)
        return normed.astype(x.dtype).astype(out).astype(jnp.float64) * s.astype(out).astype(jnp.float64)
    return normed * s


def draw(seed, shape, dtype):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal(shape) * 3, dtype)
    scale = jnp.asarray(rng.standard_normal(shape[-1]) * 0.5 + 1, dtype)
    probe = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    return x, scale, probe


def loss_fn(norm, probe):
    return lambda x, s: jnp.sum(norm(x, s).astype(jnp.float32) * probe)


@pytest.mark.parametrize("shape", [(1, 64), (7, 123), (3, 5, 96)])
@pytest.mark.parametrize("mode,offset", [("llama", 0.0), ("gemma", 1.0), ("none", 0.0)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_and_grads_under_jit(shape, mode, offset, dtype, seed):
    x, scale, probe = draw(seed, shape, dtype)
    ours = lambda a, s: liger_jax.rms_norm(a, s, epsilon=1e-6, offset=offset, casting_mode=mode)
    ref = lambda a, s: reference(a, s, 1e-6, offset, mode)
    y = jax.jit(ours)(x, scale)
    assert y.dtype == (jnp.promote_types(dtype, dtype) if mode == "llama" else dtype)
    assert_close(f32(y), np.asarray(ref(x, scale)), dtype, "y")
    dx, ds = jax.jit(jax.grad(loss_fn(ours, probe), argnums=(0, 1)))(x, scale)
    with x64():
        dx_ref, ds_ref = jax.grad(lambda a, s: jnp.sum(ref(a, s) * probe), argnums=(0, 1))(x, scale)
    assert dx.dtype == dtype and ds.dtype == dtype
    rows = x.size // shape[-1]
    assert_close(f32(dx), np.asarray(dx_ref), dtype, "dx")
    assert_close(f32(ds), np.asarray(ds_ref), dtype, "dscale", scale=max(1.0, rows ** 0.5))


def test_without_scale(seed):
    x, _, probe = draw(seed, (7, 123), jnp.float32)
    ours = lambda a: jnp.sum(liger_jax.rms_norm(a, None) * probe)
    ref = lambda a: jnp.sum(reference(a, None) * probe)
    with x64():
        want = jax.grad(ref)(x)
    assert_close(np.asarray(jax.grad(ours)(x)), np.asarray(want), jnp.float32, "dx")


@pytest.mark.parametrize("in_axes", [(0, None), (1, None), (0, 0)])
def test_vmap_folds_batch(in_axes, seed):
    """vmap over examples (shared or per-example scale) gives the per-example results and gradients."""
    x, scale, probe = draw(seed, (3, 7, 40), jnp.float32)
    scales = jnp.stack([scale, 2 * scale, scale + 1]) if in_axes[1] == 0 else scale
    probe = probe if in_axes[0] == 0 else jnp.swapaxes(probe, 0, 1)
    ours = jax.vmap(jax.grad(lambda a, s, p: jnp.sum(liger_jax.rms_norm(a, s) * p), argnums=(0, 1)),
                    in_axes=in_axes + (0,))
    ref = jax.vmap(jax.grad(lambda a, s, p: jnp.sum(reference(a, s) * p), argnums=(0, 1)), in_axes=in_axes + (0,))
    with x64():
        wants = ref(x, scales, probe)
    for got, want, name in zip(jax.jit(ours)(x, scales, probe), wants, ("dx", "dscale")):
        assert_close(np.asarray(got), np.asarray(want), jnp.float32, name, scale=3.0)


def test_nested_vmap(seed):
    x, scale, probe = draw(seed, (2, 3, 5, 16), jnp.float32)
    grad = lambda f: jax.grad(lambda a, s, p: jnp.sum(f(a, s) * p), argnums=(0, 1))
    ours = jax.vmap(jax.vmap(grad(liger_jax.rms_norm), in_axes=(0, None, 0)), in_axes=(0, None, 0))
    ref = jax.vmap(jax.vmap(grad(reference), in_axes=(0, None, 0)), in_axes=(0, None, 0))
    with x64():
        wants = ref(x, scale, probe)
    for got, want, name in zip(ours(x, scale, probe), wants, ("dx", "dscale")):
        assert got.shape == want.shape
        assert_close(np.asarray(got), np.asarray(want), jnp.float32, name, scale=3.0)


def test_checkpoint_gives_the_same_gradient(seed):
    x, scale, probe = draw(seed, (7, 123), jnp.float32)
    assert_checkpoint_same_grad(loss_fn(liger_jax.rms_norm, probe), (x, scale))


def test_bitwise_deterministic(seed):
    x, scale, probe = draw(seed, (64, 257), jnp.float32)
    assert_grad_deterministic(loss_fn(liger_jax.rms_norm, probe), (x, scale))


@pytest.mark.parametrize("dtype,param_dtype", [(None, jnp.float32), (jnp.bfloat16, jnp.float32),
                                               (None, jnp.bfloat16)])
def test_nnx_module_is_drop_in(dtype, param_dtype, seed):
    from flax import nnx

    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((3, 7, 48)), jnp.bfloat16)
    ours = liger_jax.nnx.RMSNorm(48, epsilon=1e-5, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0))
    theirs = nnx.RMSNorm(48, epsilon=1e-5, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0))
    new_scale = jnp.asarray(rng.standard_normal(48), param_dtype)
    ours.scale.value = new_scale
    theirs.scale.value = new_scale
    assert jax.tree.structure(nnx.state(ours, nnx.Param)) == jax.tree.structure(nnx.state(theirs, nnx.Param))
    y, y_ref = ours(x), theirs(x)
    assert y.dtype == y_ref.dtype
    assert_close(np.asarray(y.astype(jnp.float32)), np.asarray(y_ref.astype(jnp.float32)), y.dtype, "y")
    g = nnx.grad(lambda m: jnp.sum(m(x).astype(jnp.float32) ** 2))
    assert_close(np.asarray(g(ours).scale.value.astype(jnp.float32)),
                 np.asarray(g(theirs).scale.value.astype(jnp.float32)), jnp.bfloat16, "dscale", scale=4.0)


def test_nnx_module_refuses_unsupported_options():
    from flax import nnx

    with pytest.raises(ValueError, match="reduction_axes"):
        liger_jax.nnx.RMSNorm(8, reduction_axes=0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="axis_name"):
        liger_jax.nnx.RMSNorm(8, axis_name="batch", rngs=nnx.Rngs(0))


@pytest.mark.parametrize("x,scale,error,match", [
    (np.ones((4, 8), np.float32), np.ones(7, np.float32), ValueError, "scale must have shape"),
    (np.ones((4, 8), np.int32), None, TypeError, "x must have a floating"),
    (np.ones((0, 8), np.float32), None, ValueError, "x must not be empty"),
    ([[1.0, 2.0]], None, TypeError, "x must be a jax or numpy array"),
])
def test_bad_input(x, scale, error, match):
    with pytest.raises(error, match=match):
        liger_jax.rms_norm(x, scale)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dir", [None, "/tmp/liger-triton-cache-test"])
def test_importing_jax_triton_keeps_tritons_cache_dir(cache_dir):
    """jax_triton sets TRITON_CACHE_DIR="" on import (switching off torch's Triton disk cache); liger_jax's
    lazy import restores the caller's value. A fresh process, so jax_triton is really imported here."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_DIR"}
    if cache_dir is not None:
        env["TRITON_CACHE_DIR"] = cache_dir
    code = ("import os, liger_jax._launch as L; L.jax_triton(); import jax_triton; "
            "print(repr(os.environ.get('TRITON_CACHE_DIR')))")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.strip().splitlines()[-1]
    assert out == repr(cache_dir)

"""liger_jax.kl_div against float64 jnp references and optax, under jit, grad and vmap."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import liger_jax
from helpers import assert_close, x64


def reference(x, t, reduction, log_target):
    with x64():
        x, t = x.astype(jnp.float64), t.astype(jnp.float64)
        pointwise = jnp.exp(t) * (t - x) if log_target else jnp.where(
            t == 0, 0.0, t * (jnp.log(jnp.where(t == 0, 1.0, t)) - x))
        if reduction == "none":
            return pointwise
        total = pointwise.sum()
        return total / {"sum": 1, "mean": x.size, "batchmean": x.shape[0]}[reduction]


def draw(seed, shape, dtype, log_target):
    rng = np.random.default_rng(seed)
    x = jax.nn.log_softmax(jnp.asarray(rng.standard_normal(shape) * 2, jnp.float32), -1).astype(dtype)
    logits = jnp.asarray(rng.standard_normal(shape) * 2, jnp.float32)
    t = jax.nn.log_softmax(logits, -1) if log_target else jax.nn.softmax(logits, -1)
    return x, t.astype(dtype), rng


@pytest.mark.parametrize("reduction", ["none", "sum", "mean", "batchmean"])
@pytest.mark.parametrize("log_target", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("grad_in_forward", [True, False])
def test_forward_and_grads_under_jit(reduction, log_target, dtype, grad_in_forward, seed):
    x, t, rng = draw(seed, (2, 3, 259), dtype, log_target)
    probe = jnp.asarray(rng.standard_normal(x.shape) if reduction == "none" else 0.7, jnp.float32)
    f = lambda a: liger_jax.kl_div(a, t, reduction=reduction, log_target=log_target,
                                   grad_in_forward=grad_in_forward)
    loss = jax.jit(f)(x)
    want = reference(x, t, reduction, log_target)
    assert loss.dtype == dtype and loss.shape == want.shape
    widen = 1.0 if reduction == "none" else x.size ** 0.5
    assert_close(np.asarray(loss.astype(jnp.float32)), np.asarray(want), dtype, "loss", scale=widen)
    grad = jax.jit(jax.grad(lambda a: jnp.sum(f(a).astype(jnp.float32) * probe)))(x)
    with x64():
        grad_ref = jax.grad(lambda a: jnp.sum(reference(a, t, reduction, log_target) * probe))(
            x.astype(jnp.float64))
    count = {"mean": x.size, "batchmean": 2}.get(reduction, 1)
    assert grad.dtype == dtype
    assert_close(np.asarray(grad.astype(jnp.float32)) * count, np.asarray(grad_ref) * count, dtype, "dx")


def test_matches_optax_and_vmap(seed):
    x, t, _ = draw(seed, (4, 300), jnp.float32, False)
    rows = jnp.sum(liger_jax.kl_div(x, t, reduction="none"), -1)
    assert_close(np.asarray(rows), np.asarray(optax.kl_divergence(x, t)), jnp.float32, "rows", scale=3.0)
    per_example = jax.vmap(lambda a, b: liger_jax.kl_div(a, b, reduction="sum"))(x, t)
    assert_close(np.asarray(per_example), np.asarray(optax.kl_divergence(x, t)), jnp.float32, "vmap", scale=3.0)


def test_grad_under_vmap(seed):
    """Per-example losses under vmap: each example's gradient comes from its own forward, scaled by its own
    cotangent."""
    x, t, rng = draw(seed, (3, 4, 131), jnp.float32, False)
    probe = jnp.asarray(rng.standard_normal(3), jnp.float32)
    per_example = jax.vmap(lambda a, b: liger_jax.kl_div(a, b, reduction="batchmean"))
    grad = jax.jit(jax.grad(lambda a: jnp.sum(per_example(a, t) * probe)))(x)
    assert_close(np.asarray(grad), np.asarray(-t * probe[:, None, None] / 4), jnp.float32, "dx")


def test_bad_input():
    with pytest.raises(ValueError, match="reduction"):
        liger_jax.kl_div(np.zeros((2, 3), np.float32), np.zeros((2, 3), np.float32), reduction="avg")
    with pytest.raises(ValueError, match="targets must have the shape of log_predictions"):
        liger_jax.kl_div(np.zeros((2, 3), np.float32), np.zeros((3, 3), np.float32))

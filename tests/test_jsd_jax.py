"""liger_jax.jsd against float64 jnp references, under jit, grad and vmap."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liger_jax
from helpers import assert_close, x64


def reference(s, t, beta, labels=None, ignore_index=-100):
    """float64 generalized JSD (P = teacher, Q = student; beta 0: KL(P||Q), beta 1: KL(Q||P)), mean over rows."""
    with x64():
        s, t = s.astype(jnp.float64), t.astype(jnp.float64)
        p, q = jnp.exp(t), jnp.exp(s)
        if beta == 0.0:
            pointwise = p * (t - s)
        elif beta == 1.0:
            pointwise = q * (s - t)
        else:
            log_m = jnp.log(beta * p + (1 - beta) * q)
            pointwise = beta * p * (t - log_m) + (1 - beta) * q * (s - log_m)
        rows = pointwise.sum(-1)
        if labels is None:
            return rows.mean()
        keep = labels != ignore_index
        return jnp.where(keep.any(), jnp.sum(rows * keep) / jnp.maximum(keep.sum(), 1), 0.0)


def draw(seed, shape, dtype, ignore_fraction=0.3):
    rng = np.random.default_rng(seed)
    s = jax.nn.log_softmax(jnp.asarray(rng.standard_normal(shape) * 2, jnp.float32), -1).astype(dtype)
    t = jax.nn.log_softmax(jnp.asarray(rng.standard_normal(shape) * 2, jnp.float32), -1).astype(dtype)
    labels = rng.integers(0, shape[-1], shape[:-1]).astype(np.int32)
    labels[rng.random(shape[:-1]) < ignore_fraction] = -100
    labels.reshape(-1)[0] = 3
    return s, t, jnp.asarray(labels)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("with_labels", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(2, 3, 1000), (2, 32003)])
def test_forward_and_grad_under_jit(shape, beta, with_labels, dtype, seed):
    s, t, labels = draw(seed, shape, dtype)
    labels = labels if with_labels else None
    f = lambda a: liger_jax.jsd(a, t, labels, beta=beta)
    loss = jax.jit(f)(s)
    want = reference(s, t, beta, labels)
    assert loss.dtype == dtype and loss.shape == ()
    assert_close(np.asarray(loss.astype(jnp.float32)), np.asarray(want), dtype, "loss", scale=4.0)
    grad = jax.jit(jax.grad(lambda a: f(a).astype(jnp.float32) * 0.7))(s)
    with x64():
        grad_ref = jax.grad(lambda a: reference(a, t, beta, labels) * 0.7)(s.astype(jnp.float64))
    count = math.prod(shape[:-1]) if labels is None else int((labels != -100).sum())
    assert grad.dtype == dtype
    assert_close(np.asarray(grad.astype(jnp.float32)) * count, np.asarray(grad_ref) * count, dtype, "dstudent")


def test_differentiated_teacher_is_refused_and_vmap(seed):
    s, t, labels = draw(seed, (3, 4, 259), jnp.float32)
    with pytest.raises(ValueError, match="^teacher_logprobs is differentiated, but liger_jax.jsd differentiates"):
        jax.grad(lambda a, b: liger_jax.jsd(a, b, labels[0], beta=0.3), argnums=(0, 1))(s[0], t[0])
    ds, dt = jax.grad(lambda a, b: liger_jax.jsd(a, jax.lax.stop_gradient(b), labels[0], beta=0.3),
                      argnums=(0, 1))(s[0], t[0])
    assert np.any(np.asarray(ds)) and not np.any(np.asarray(dt))
    per_example = jax.vmap(lambda a, b, c: liger_jax.jsd(a, b, c, beta=0.3))(s, t, labels)
    for i in range(3):
        assert_close(np.asarray(per_example[i]), np.asarray(reference(s[i], t[i], 0.3, labels[i])), jnp.float32,
                     f"example {i}", scale=4.0)


def test_all_ignored_rows(seed):
    s, t, labels = draw(seed, (5, 259), jnp.float32)
    labels = jnp.full_like(labels, 7)
    loss, grad = jax.jit(jax.value_and_grad(lambda a: liger_jax.jsd(a, t, labels, ignore_index=7)))(s)
    assert float(loss) == 0.0
    assert not np.any(np.asarray(grad))


@pytest.mark.parametrize("args,kwargs,error,match", [
    ((np.zeros((2, 3), np.float32), np.zeros((3, 3), np.float32)), {}, ValueError,
     "teacher_logprobs must have the shape of student_logprobs"),
    ((np.zeros((2, 3), np.float32), np.zeros((2, 3), np.float32), np.zeros(3, np.int32)), {}, ValueError,
     "labels must have shape"),
    ((np.zeros((2, 3), np.int32), np.zeros((2, 3), np.float32)), {}, TypeError, "student_logprobs"),
    ((np.zeros((2, 3), np.float32), [[0.0] * 3] * 2), {}, TypeError, "teacher_logprobs"),
    ((np.zeros((2, 3), np.float32), np.zeros((2, 3), np.float32)), {"beta": -0.1}, ValueError, "beta"),
])
def test_bad_input(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        liger_jax.jsd(*args, **kwargs)

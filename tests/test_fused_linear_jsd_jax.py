"""liger_jax.fused_linear_jsd against a float64 jnp reference, under jit and grad, both kernel layouts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liger_jax
from helpers import assert_close, x64
from test_jsd_jax import reference as jsd_reference

N, HS, HT, V = 37, 24, 16, 259
CHUNK = 8  # 5 chunks, the last one padded


def reference(xs, ks, xt, kt, labels=None, beta=0.5, temperature=1.0, ignore_index=-100):
    """float64 from the same inputs ((H, V) kernels), the logits rounded to the inputs' dtypes first."""
    with x64():
        zs = (xs.astype(jnp.float64) @ ks.astype(jnp.float64)).astype(xs.dtype).astype(jnp.float64)
        zt = (xt.astype(jnp.float64) @ kt.astype(jnp.float64)).astype(xt.dtype).astype(jnp.float64)
        s = jax.nn.log_softmax(zs / temperature, -1)
        t = jax.nn.log_softmax(zt / temperature, -1)
        return jsd_reference(s, t, beta, labels, ignore_index)


def draw(seed, dtype, n=N):
    rng = np.random.default_rng(seed)
    xs = jnp.asarray(rng.standard_normal((n, HS)), dtype)
    ks = jnp.asarray(rng.standard_normal((HS, V)) * 0.4, dtype)
    xt = jnp.asarray(rng.standard_normal((n, HT)), dtype)
    kt = jnp.asarray(rng.standard_normal((HT, V)) * 0.5, dtype)
    labels = rng.integers(0, V, n).astype(np.int32)
    labels[rng.random(n) < 0.3] = -100
    labels[0] = 2
    return xs, ks, xt, kt, jnp.asarray(labels)


@pytest.mark.parametrize("beta,with_labels,temperature,transpose", [
    (0.0, False, 1.0, False), (0.5, True, 2.0, True), (1.0, True, 0.7, False)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_forward_and_grads_under_jit(beta, with_labels, temperature, transpose, dtype, seed):
    xs, ks, xt, kt, labels = draw(seed, dtype)
    labels = labels if with_labels else None
    opts = dict(beta=beta, temperature=temperature, chunk_size=CHUNK, transpose=transpose)
    layout = (lambda k: k.T) if transpose else (lambda k: k)  # (V, H) matrices with transpose=True

    def f(a, k):
        return liger_jax.fused_linear_jsd(a, layout(k), xt, layout(kt), labels, **opts)

    loss, (dx, dk) = jax.jit(jax.value_and_grad(lambda a, k: f(a, k).astype(jnp.float32) * 0.7, (0, 1)))(xs, ks)
    assert jax.eval_shape(f, xs, ks).dtype == dtype
    want = reference(xs, ks, xt, kt, labels, beta, temperature)
    with x64():
        dx_ref, dk_ref = jax.grad(lambda a, k: reference(a, k, xt, kt, labels, beta, temperature) * 0.7, (0, 1))(
            xs.astype(jnp.float64), ks.astype(jnp.float64))
    assert_close(np.asarray(loss), np.asarray(want) * 0.7, dtype, "loss", scale=4.0)
    count = N if labels is None else int((labels != -100).sum())
    assert dx.dtype == dtype and dk.dtype == dtype
    widen = 1.0 if dtype == jnp.float32 else 2.0
    assert_close(np.asarray(dx.astype(jnp.float32)) * count, np.asarray(dx_ref) * count, dtype, "dstudent_input",
                 scale=widen)
    assert_close(np.asarray(dk.astype(jnp.float32)) * count, np.asarray(dk_ref) * count, dtype, "dstudent_kernel",
                 scale=widen * N ** 0.5)


def test_fp32_master_kernel(seed):
    """dtype=bfloat16 with fp32 kernels and inputs: bf16 matmuls of cast copies; the student kernel's gradient
    accumulated in fp32 straight into its fp32 gradient (never rounded to bf16)."""
    xs, ks, xt, kt, labels = draw(seed, jnp.float32)
    loss, (dx, dk) = jax.jit(jax.value_and_grad(
        lambda a, k: liger_jax.fused_linear_jsd(a, k, xt, kt, labels, temperature=1.5, chunk_size=CHUNK,
                                                dtype=jnp.bfloat16).astype(jnp.float32) * 0.7, (0, 1)))(xs, ks)
    bf16 = [a.astype(jnp.bfloat16) for a in (xs, ks, xt, kt)]
    want = reference(*bf16, labels, temperature=1.5)
    with x64():
        dx_ref, dk_ref = jax.grad(lambda a, k: reference(a, k, bf16[2], bf16[3], labels, temperature=1.5) * 0.7,
                                  (0, 1))(bf16[0], bf16[1])
    assert_close(np.asarray(loss), np.asarray(want) * 0.7, jnp.bfloat16, "loss", scale=4.0)
    count = int((labels != -100).sum())
    assert dx.dtype == jnp.float32 and dk.dtype == jnp.float32
    assert_close(np.asarray(dx) * count, np.asarray(dx_ref) * count, jnp.bfloat16, "dstudent_input", scale=2.0)
    assert_close(np.asarray(dk) * count, np.asarray(dk_ref) * count, jnp.bfloat16, "dstudent_kernel",
                 scale=2.0 * N ** 0.5)
    assert bool(jnp.any(dk != dk.astype(jnp.bfloat16).astype(jnp.float32))), "the gradient went through bf16"


def test_teacher_in_another_dtype(seed):
    """A bf16 student against an fp32 teacher: the kernel reads each head's logits in its own dtype."""
    xs, ks, _, _, labels = draw(seed, jnp.bfloat16)
    _, _, xt, kt, _ = draw(seed + 1, jnp.float32)
    loss, (dx, dk) = jax.jit(jax.value_and_grad(
        lambda a, k: liger_jax.fused_linear_jsd(a, k, xt, kt, labels, temperature=1.5, chunk_size=CHUNK)
        .astype(jnp.float32), (0, 1)))(xs, ks)
    want = reference(xs, ks, xt, kt, labels, temperature=1.5)
    with x64():
        dx_ref, dk_ref = jax.grad(lambda a, k: reference(a, k, xt, kt, labels, temperature=1.5), (0, 1))(
            xs.astype(jnp.float64), ks.astype(jnp.float64))
    assert_close(np.asarray(loss), np.asarray(want), jnp.bfloat16, "loss", scale=4.0)
    count = int((labels != -100).sum())
    assert_close(np.asarray(dx.astype(jnp.float32)) * count, np.asarray(dx_ref) * count, jnp.bfloat16,
                 "dstudent_input", scale=2.0)
    assert_close(np.asarray(dk.astype(jnp.float32)) * count, np.asarray(dk_ref) * count, jnp.bfloat16,
                 "dstudent_kernel", scale=2 * N ** 0.5)


def test_differentiated_teacher_is_refused_and_all_ignored(seed):
    """The teacher is a constant: differentiating it is a ValueError naming it (not a silent zero gradient);
    stop_gradient'ed, its gradient is zero."""
    xs, ks, xt, kt, labels = draw(seed, jnp.float32)
    for argnums, name in (((0, 1, 2), "teacher_input"), ((1, 3), "teacher_kernel")):
        with pytest.raises(ValueError, match=f"^{name} is differentiated, but liger_jax.fused_linear_jsd"):
            jax.grad(lambda *a: liger_jax.fused_linear_jsd(*a, labels, chunk_size=CHUNK), argnums)(xs, ks, xt, kt)
    stopped = lambda a, k, b, c: liger_jax.fused_linear_jsd(a, k, jax.lax.stop_gradient(b), jax.lax.stop_gradient(c),
                                                             labels, chunk_size=CHUNK)  # noqa: E731
    grads = jax.grad(stopped, (0, 1, 2, 3))(xs, ks, xt, kt)
    assert np.any(np.asarray(grads[0])) and not np.any(np.asarray(grads[2])) and not np.any(np.asarray(grads[3]))
    ignored = jnp.full_like(labels, -100)
    loss, grads = jax.value_and_grad(lambda a, k: liger_jax.fused_linear_jsd(a, k, xt, kt, ignored, chunk_size=CHUNK),
                                     (0, 1))(xs, ks)
    assert float(loss) == 0.0
    assert not np.any(np.asarray(grads[0])) and not np.any(np.asarray(grads[1]))


def test_primal_matches_and_three_dimensional(seed):
    xs, ks, xt, kt, labels = draw(seed, jnp.float32, n=15)
    loss = liger_jax.fused_linear_jsd(xs.reshape(3, 5, HS), ks, xt.reshape(3, 5, HT), kt, labels.reshape(3, 5),
                                      beta=0.25, chunk_size=4)
    assert_close(np.asarray(loss), np.asarray(reference(xs, ks, xt, kt, labels, 0.25)), jnp.float32, "loss",
                 scale=4.0)


@pytest.mark.parametrize("shapes,kwargs,error,match", [
    (((4, 8), (7, 10), (4, 6), (6, 10)), {}, ValueError, r"student_kernel must have shape \(H, V\) with H=8"),
    (((4, 8), (8, 10), (4, 6), (6, 11)), {}, ValueError, "teacher_kernel must have the student's vocabulary"),
    (((4, 8), (8, 10), (3, 6), (6, 10)), {}, ValueError, "teacher_input must have student_input's leading"),
    (((4, 8), (10, 8), (4, 6), (6, 10)), {"transpose": True}, ValueError, r"teacher_kernel must have shape \(V, H\)"),
    (((4, 8), (8, 10), (4, 6), (6, 10)), {"temperature": -1.0}, ValueError, "temperature"),
])
def test_bad_input(shapes, kwargs, error, match):
    arrays = [np.zeros(s, np.float32) for s in shapes]
    with pytest.raises(error, match=match):
        liger_jax.fused_linear_jsd(*arrays, **kwargs)

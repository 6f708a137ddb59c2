"""liger_jax.cross_entropy against optax and float64 jnp references, under jit, grad, vmap, checkpoint."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import liger_jax
from helpers import assert_close, x64

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
OPTIONS = {
    "plain": {},
    "smoothing": {"label_smoothing": 0.1},
    "weight_smoothing": {"weight": True, "label_smoothing": 0.2},
    "z_loss": {"lse_square_scale": 1e-2},
    "softcap": {"softcap": 4.0},
    "everything": {"weight": True, "label_smoothing": 0.1, "lse_square_scale": 1e-3, "softcap": 6.0},
}


def reference(logits, labels, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
              lse_square_scale=0.0, softcap=None):
    """torch's cross_entropy formulas written in jnp, float64; returns (loss, z_loss)."""
    with x64():
        z = logits.astype(jnp.float64)
        if softcap is not None:
            z = softcap * jnp.tanh(z / softcap)
        v = z.shape[-1]
        keep = labels != ignore_index
        safe = jnp.where(keep, labels, 0)
        w = jnp.ones(v, jnp.float64) if weight is None else weight.astype(jnp.float64)
        logp = jax.nn.log_softmax(z, -1)
        w_t = w[safe] * keep
        nll = -jnp.take_along_axis(logp, safe[..., None], -1)[..., 0] * w_t
        smooth = -jnp.sum(logp * w, -1) * keep
        zl = lse_square_scale * jax.nn.logsumexp(z, -1) ** 2 * keep
        if reduction == "none":
            return (1 - label_smoothing) * nll + label_smoothing / v * smooth + zl, zl
        if reduction == "sum":
            return (1 - label_smoothing) * nll.sum() + label_smoothing / v * smooth.sum() + zl.sum(), zl.sum()
        denom_w, denom_n = w_t.sum(), keep.sum()
        # a total weight of exactly 0 (every label ignored) gives 0; a negative one divides, as torch's
        ce = ((1 - label_smoothing) * nll.sum() + label_smoothing / v * smooth.sum()) / jnp.where(
            denom_w != 0, denom_w, jnp.inf)
        zl = zl.sum() / jnp.maximum(denom_n, 1)
        return ce + zl, zl


def draw(seed, shape, v, dtype, ignore_fraction=0.25, ignore_index=-100):
    rng = np.random.default_rng(seed)
    logits = jnp.asarray(rng.standard_normal(shape + (v,)) * 4, dtype)
    labels = rng.integers(0, v, shape)
    labels[rng.random(shape) < ignore_fraction] = ignore_index
    weight = jnp.asarray(rng.random(v) + 0.5, jnp.float32)
    return logits, jnp.asarray(labels, jnp.int32), weight, rng


def _opts(option, weight):
    opts = dict(OPTIONS[option])
    if opts.pop("weight", False):
        opts["weight"] = weight
    return opts


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("option", [o for o in OPTIONS if o != "smoothing"])  # smoothing: in the combinations
@pytest.mark.parametrize("dtype,v", [(jnp.float32, 1000), (jnp.bfloat16, 259), (jnp.float16, 259)])
def test_forward_and_grads_under_jit(v, reduction, option, dtype, seed):
    logits, labels, weight, rng = draw(seed, (2, 4), v, dtype)
    opts = _opts(option, weight)
    probe = jnp.asarray(rng.standard_normal((2, 4)), jnp.float32) if reduction == "none" else jnp.float32(0.7)

    def ours(x):
        loss, z = liger_jax.cross_entropy(x, labels, reduction=reduction, return_z_loss=True, **opts)
        return loss, z

    loss, z = jax.jit(ours)(logits)
    loss_ref, z_ref = reference(logits, labels, reduction=reduction, **opts)
    assert loss.dtype == dtype and loss.shape == loss_ref.shape
    assert_close(np.asarray(loss.astype(jnp.float32)), np.asarray(loss_ref), dtype, "loss")
    assert_close(np.asarray(z.astype(jnp.float32)), np.asarray(z_ref), dtype, "z_loss")
    grad = jax.jit(jax.grad(lambda x: jnp.sum(ours(x)[0].astype(jnp.float32) * probe)))(logits)
    with x64():
        grad_ref = jax.grad(lambda x: jnp.sum(reference(x, labels, reduction=reduction, **opts)[0] * probe))(
            logits.astype(jnp.float64))
    assert grad.dtype == dtype
    scale = 8.0 if reduction == "mean" else 1.0  # the mean's gradient is ~1/rows: compare it scaled up
    assert_close(np.asarray(grad.astype(jnp.float32)) * scale, np.asarray(grad_ref) * scale, dtype, "dlogits")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matches_optax(dtype, seed):
    logits, labels, _, _ = draw(seed, (3, 5), 259, dtype, ignore_fraction=0.0)
    got = jax.jit(lambda x: liger_jax.cross_entropy(x, labels, reduction="none"))(logits)
    want = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    assert_close(np.asarray(got.astype(jnp.float32)), np.asarray(want), dtype, "loss")
    g = jax.grad(lambda x: liger_jax.cross_entropy(x, labels))(logits)
    g_ref = jax.grad(lambda x: jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
        x.astype(jnp.float32), labels)))(logits)
    assert_close(np.asarray(g.astype(jnp.float32)) * 15, np.asarray(g_ref.astype(jnp.float32)) * 15, dtype, "dx")


def test_incoming_gradient_of_exactly_one(seed):
    """Rows whose incoming gradient is exactly 1 skip the backward's scaling (aliased) pass; the others are
    scaled: a per-row gradient mixing ones with other values."""
    logits, labels, _, rng = draw(seed, (7,), 259, jnp.bfloat16)
    probe = rng.standard_normal(7)
    probe[[0, 3, 4]] = 1.0
    probe = jnp.asarray(probe, jnp.float32)
    f = lambda x: jnp.sum(liger_jax.cross_entropy(x, labels, reduction="none").astype(jnp.float32) * probe)
    grad = jax.jit(jax.grad(f))(logits)
    with x64():
        grad_ref = jax.grad(lambda x: jnp.sum(reference(x, labels, reduction="none")[0] * probe))(
            logits.astype(jnp.float64))
    assert_close(np.asarray(grad.astype(jnp.float32)), np.asarray(grad_ref), jnp.bfloat16, "dlogits")


def test_vocab_over_several_blocks(seed):
    logits, labels, weight, _ = draw(seed, (3,), 32003, jnp.float32, ignore_fraction=0.0)  # not a power of two
    logits = logits.at[1, 9000].set(90.0)  # the row max in the second block: the online softmax rescales
    opts = _opts("weight_smoothing", weight)
    f = lambda x: liger_jax.cross_entropy(x, labels, **opts)
    assert_close(np.asarray(f(logits)), np.asarray(reference(logits, labels, **opts)[0]), jnp.float32, "loss")
    with x64():
        g_ref = jax.grad(lambda x: reference(x, labels, **opts)[0])(logits.astype(jnp.float64))
    assert_close(np.asarray(jax.grad(f)(logits)) * 3, np.asarray(g_ref) * 3, jnp.float32, "dx")


def test_lagged_kernel_at_its_default_width(seed, lagged_from_65536):
    """65541 columns: the lagged kernel (liger_core.cross_entropy.uses_lagged; 9 segments, the last 5 columns
    wide, holding a target and a row max), every option, an ignored row, a non-uniform incoming gradient."""
    from liger_core.cross_entropy import uses_lagged

    v = 65541
    assert uses_lagged(v)
    logits, labels, weight, rng = draw(seed, (3,), v, jnp.float32, ignore_fraction=0.0)
    logits = logits.at[1, v - 2].set(60.0)
    labels = labels.at[2].set(v - 1).at[0].set(-100)
    g = jnp.asarray(rng.standard_normal(3), jnp.float32)
    opts = _opts("everything", weight)
    loss, vjp = jax.vjp(jax.jit(lambda x: liger_jax.cross_entropy(x, labels, reduction="none", **opts)), logits)
    assert_close(np.asarray(loss), np.asarray(reference(logits, labels, reduction="none", **opts)[0]), jnp.float32,
                 "loss")
    with x64():
        _, vjp_ref = jax.vjp(lambda x: reference(x, labels, reduction="none", **opts)[0],
                             logits.astype(jnp.float64))
        (dx_ref,) = vjp_ref(g.astype(jnp.float64))
    assert_close(np.asarray(vjp(g)[0]), np.asarray(dx_ref), jnp.float32, "dx")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_labels_ignored(reduction, seed):
    logits, labels, weight, _ = draw(seed, (5,), 259, jnp.float32, ignore_fraction=1.0)
    f = lambda x: jnp.sum(liger_jax.cross_entropy(x, labels, weight=weight, reduction=reduction,
                                                   label_smoothing=0.1, lse_square_scale=1e-2))
    loss, grad = jax.jit(jax.value_and_grad(f))(logits)
    assert float(loss) == 0.0
    np.testing.assert_array_equal(np.asarray(grad), np.zeros(logits.shape, np.float32))


def test_negative_class_weights_divide_the_mean(seed):
    logits, labels, weight, _ = draw(seed, (9,), 123, jnp.float32)
    weight = weight - 1.3  # the labels' total is negative
    assert float(weight[labels[labels != -100]].sum()) < 0
    opts = dict(weight=weight, label_smoothing=0.1)
    loss, grad = jax.value_and_grad(lambda x: liger_jax.cross_entropy(x, labels, **opts))(logits)
    with x64():
        ref, ref_grad = jax.value_and_grad(lambda x: reference(x, labels, **opts)[0])(logits.astype(jnp.float64))
    assert_close(np.asarray(loss), np.asarray(ref), jnp.float32, "loss", scale=3)
    assert_close(np.asarray(grad), np.asarray(ref_grad), jnp.float32, "dlogits")


def test_custom_ignore_index(seed):
    logits, labels, weight, _ = draw(seed, (12,), 100, jnp.float32, ignore_fraction=0.0)
    labels = labels.at[::3].set(7)
    opts = dict(weight=weight, ignore_index=7, label_smoothing=0.1)
    assert_close(np.asarray(liger_jax.cross_entropy(logits, labels, **opts)),
                 np.asarray(reference(logits, labels, **opts)[0]), jnp.float32, "loss")
    g = jax.grad(lambda x: liger_jax.cross_entropy(x, labels, **opts))(logits)
    np.testing.assert_array_equal(np.asarray(g[::3]), 0.0)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_vmap(reduction, seed):
    """vmap over examples: each example keeps its own mean (its own count of non-ignored labels)."""
    logits, labels, _, rng = draw(seed, (3, 6), 200, jnp.float32)
    probe = jnp.asarray(rng.standard_normal((3, 6)), jnp.float32)
    loss_of = lambda fn: lambda x, y, p: jnp.sum(fn(x, y) * (p if reduction == "none" else p[0]))
    ours = loss_of(lambda x, y: liger_jax.cross_entropy(x, y, reduction=reduction, label_smoothing=0.1))
    ref = loss_of(lambda x, y: reference(x, y, reduction=reduction, label_smoothing=0.1)[0])
    got = jax.jit(jax.vmap(jax.value_and_grad(ours)))(logits, labels, probe)
    with x64():
        want = jax.vmap(jax.value_and_grad(ref))(logits.astype(jnp.float64), labels, probe)
    for g, w, name in zip(got, want, ("loss", "dx")):
        assert_close(np.asarray(g) * 6, np.asarray(w) * 6, jnp.float32, name)


def test_checkpoint_and_determinism(seed):
    logits, labels, weight, _ = draw(seed, (4, 8), 300, jnp.float32)
    f = lambda x: liger_jax.cross_entropy(x, labels, weight=weight, softcap=5.0)
    plain = jax.grad(f)(logits)
    remat = jax.jit(jax.grad(jax.checkpoint(f)))(logits)
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(remat))
    np.testing.assert_array_equal(np.asarray(jax.grad(f)(logits)), np.asarray(plain))


def test_bad_label_raises_eagerly_and_is_nan_under_jit(seed):
    logits, labels, _, _ = draw(seed, (6,), 50, jnp.float32, ignore_fraction=0.0)
    bad = labels.at[3].set(50)
    with pytest.raises(ValueError, match=r"labels has values outside \[0, 50\)"):
        liger_jax.cross_entropy(logits, bad)
    with pytest.raises(ValueError, match="outside"):
        liger_jax.cross_entropy(logits, np.asarray(labels.at[0].set(-3)))
    jitted = jax.jit(lambda x, y: liger_jax.cross_entropy(x, y, reduction="none"))(logits, bad)
    assert np.isnan(np.asarray(jitted)[3]) and not np.isnan(np.delete(np.asarray(jitted), 3)).any()
    assert np.isnan(float(jax.jit(lambda x, y: liger_jax.cross_entropy(x, y))(logits, bad)))


@pytest.mark.parametrize("logits,labels,kwargs,error,match", [
    (np.ones((4, 10), np.float32), np.zeros(5, np.int32), {}, ValueError, "labels must have shape"),
    (np.ones((4, 10), np.float32), np.zeros(4, np.float32), {}, TypeError, "labels must have an integer"),
    (np.ones((4, 10), np.int32), np.zeros(4, np.int32), {}, TypeError, "logits must have a floating"),
    (np.ones((4, 10), np.float32), np.zeros(4, np.int32), {"weight": np.ones(3, np.float32)}, ValueError,
     "weight must have shape"),
    (np.ones((4, 10), np.float32), np.zeros(4, np.int32), {"reduction": "batchmean"}, ValueError, "reduction"),
    (np.ones((4, 10), np.float32), np.zeros(4, np.int32), {"softcap": -1.0}, ValueError, "softcap"),
    ([[1.0]], np.zeros(1, np.int32), {}, TypeError, "logits must be a jax or numpy array"),
])
def test_bad_input(logits, labels, kwargs, error, match):
    with pytest.raises(error, match=match):
        liger_jax.cross_entropy(logits, labels, **kwargs)

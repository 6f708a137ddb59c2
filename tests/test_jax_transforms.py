"""The kernels under the transforms a training loop stacks: ``nnx.scan`` over layers with ``nnx.remat``, and
``jax.vmap`` over a leading batch of the functions whose vmap the family tests do not already cover (the fused
linear losses; value and gradient of kl_div and jsd). Each against a float64 jnp reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import liger_jax
from helpers import assert_close, x64
from test_fused_linear_jsd_jax import reference as fljsd_reference
from test_jsd_jax import reference as jsd_reference

B, T, NH, D = 2, 3, 2, 4
H, I, V, LAYERS = NH * D, 12, 11, 2
EPS = 1e-6


# ---------------------------------------------------------------------------------------------------------
# jnp references of the kernels (float64 under x64)


def _rms(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + EPS) * scale


def _layer_norm(x, scale, bias):
    mean = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean((x - mean) ** 2, -1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + EPS) * scale + bias


def _rope(q, k, cos, sin):
    def rot(x):
        half = x.shape[-1] // 2
        return jnp.concatenate([-x[..., half:], x[..., :half]], -1)

    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return q * c + rot(q) * s, k * c + rot(k) * s


def _ce(logits, labels, ignore_index=-100):
    keep = labels != ignore_index
    logp = jax.nn.log_softmax(logits, -1)
    picked = jnp.take_along_axis(logp, jnp.where(keep, labels, 0)[..., None], -1)[..., 0]
    return -jnp.sum(jnp.where(keep, picked, 0.0)) / jnp.maximum(keep.sum(), 1)


# ---------------------------------------------------------------------------------------------------------
# nnx.scan over a stack of layers, with and without nnx.remat


class Block(nnx.Module):
    """Pre-norm layer on the nnx modules and functional kernels; ``ref`` runs the same parameters through jnp."""

    def __init__(self, mlp_cls, rngs):
        self.attn_norm = liger_jax.nnx.RMSNorm(H, rngs=rngs)
        self.mlp_norm = liger_jax.nnx.LayerNorm(H, rngs=rngs)
        self.post_scale = nnx.Param(1.0 + 0.1 * jax.random.normal(rngs.params(), (H,)))
        self.mlp = mlp_cls(H, I, rngs=rngs)

    def __call__(self, carry, cos, sin, ref):
        x, residual = carry
        h = _rms(x, self.attn_norm.scale[...]) if ref else self.attn_norm(x)
        q = h.reshape(B, T, NH, D)
        k = q[:, :, :1] * 0.5  # one kv head (GQA)
        q, k = _rope(q, k, cos, sin) if ref else liger_jax.rope(q, k, cos, sin)
        mixed = (q + k).reshape(B, T, H)
        if ref:
            normed = _layer_norm(mixed, self.mlp_norm.scale[...], self.mlp_norm.bias[...])
            mlp = self.mlp
            gate = jax.nn.silu if isinstance(mlp, liger_jax.nnx.SwiGLUMLP) else jax.nn.gelu
            y = mlp.down_proj(gate(mlp.gate_proj(normed)) * mlp.up_proj(normed))
            h = y + residual
            return _rms(h, self.post_scale[...]), h
        return liger_jax.fused_add_rms_norm(self.mlp(self.mlp_norm(mixed)), residual, self.post_scale[...])


class Model(nnx.Module):
    def __init__(self, mlp_cls, rngs):
        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def layers(rngs):
            return Block(mlp_cls, rngs)

        self.layers = layers(rngs)
        self.head = nnx.Param(jax.random.normal(rngs.params(), (H, V)) * 0.5)


def _loss(model, x, cos, sin, labels, ref, remat):
    def layer(carry, block):
        call = lambda blk, c: blk(c, cos, sin, ref)  # noqa: E731
        return (nnx.remat(call) if remat else call)(block, carry)

    out, _ = nnx.scan(layer, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)((x, jnp.zeros_like(x)), model.layers)
    head = model.head[...]
    if ref:
        return 2 * _ce(out @ head, labels)
    return (liger_jax.cross_entropy(out @ head, labels)
            + liger_jax.fused_linear_cross_entropy(out, head, labels, chunk_size=4))


@pytest.mark.parametrize("mlp_cls,remat", [(liger_jax.nnx.SwiGLUMLP, True), (liger_jax.nnx.GeGLUMLP, False)])
def test_scan_over_layers(mlp_cls, remat, seed):
    keys = jax.random.split(jax.random.key(seed), 3)
    model = Model(mlp_cls, nnx.Rngs(seed))
    x = jax.random.normal(keys[0], (B, T, H))
    angles = jnp.arange(T)[:, None] * jnp.linspace(0.1, 1.0, D // 2)[None]
    cos, sin = jnp.cos(jnp.tile(angles, (1, 2))), jnp.sin(jnp.tile(angles, (1, 2)))
    labels = jax.random.randint(keys[1], (B, T), 0, V).at[0, 0].set(-100)

    loss, grads = nnx.jit(nnx.value_and_grad(_loss), static_argnums=(5, 6))(model, x, cos, sin, labels, False,
                                                                             remat)
    graphdef, state = nnx.split(model)
    with x64():
        f64 = lambda t: jax.tree.map(lambda a: a.astype(jnp.float64), t)  # noqa: E731
        ref = lambda s, *args: _loss(nnx.merge(graphdef, s), *args, True, False)  # noqa: E731
        want_loss, want = jax.value_and_grad(ref)(f64(state), *f64((x, cos, sin)), labels)
    assert_close(np.asarray(loss), np.asarray(want_loss), jnp.float32, "loss", scale=4.0)
    got_leaves = jax.tree.leaves_with_path(nnx.state(grads))
    want_leaves = jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves) == 8  # 3 norm scales, a bias, 3 MLP kernels (stacked), the head
    for (path, g), w in zip(got_leaves, want_leaves):
        assert g.shape == w.shape, jax.tree_util.keystr(path)
        assert float(jnp.abs(w).max()) > 0, jax.tree_util.keystr(path)
        assert_close(np.asarray(g), np.asarray(w), jnp.float32, jax.tree_util.keystr(path), scale=10.0)


# ---------------------------------------------------------------------------------------------------------
# jax.vmap over a leading batch


def _check_all(got, want, name, scale=4.0):
    for i, (g, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
        assert g.shape == w.shape, f"{name} {i}: {g.shape} vs {w.shape}"
        assert_close(np.asarray(g, np.float32), np.asarray(w), jnp.float32, f"{name} {i}", scale=scale)


def _labels(key, shape, vocab):
    labels = jax.random.randint(key, shape, 0, vocab)
    ignored = jax.random.uniform(jax.random.fold_in(key, 1), shape) < 0.3
    return jnp.where(ignored, -100, labels).at[..., 0].set(1)  # each example keeps a label


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_vmap_fused_linear_cross_entropy(reduction, seed):
    """Per-example loss and gradients (the mean per example); the shared kernel gets one gradient each."""
    k = jax.random.split(jax.random.key(seed), 4)
    x, kernel, bias = jax.random.normal(k[0], (3, 5, H)), jax.random.normal(k[1], (H, V)), jax.random.normal(k[2], (V,))
    labels = _labels(k[3], (3, 5), V)
    probe = jax.random.normal(k[0], (5,))

    def ours(a, w, b, t):
        loss = liger_jax.fused_linear_cross_entropy(a, w, t, b, reduction=reduction, chunk_size=2)
        return loss if reduction == "mean" else jnp.sum(loss * probe)

    def ref(a, w, b, t):
        logits = a @ w + b
        if reduction == "mean":
            return _ce(logits, t)
        logp = jax.nn.log_softmax(logits, -1)
        rows = -jnp.take_along_axis(logp, jnp.where(t == -100, 0, t)[:, None], -1)[:, 0]
        return jnp.sum(jnp.where(t == -100, 0.0, rows) * probe)

    batched = lambda f: jax.vmap(jax.value_and_grad(f, argnums=(0, 1, 2)), in_axes=(0, None, None, 0))  # noqa: E731
    got = jax.jit(batched(ours))(x, kernel, bias, labels)
    with x64():
        want = jax.jit(batched(ref))(*(a.astype(jnp.float64) for a in (x, kernel, bias)), labels)
    _check_all(got, want, f"flce {reduction}")


def test_vmap_fused_linear_jsd(seed):
    k = jax.random.split(jax.random.key(seed), 5)
    xs, xt = jax.random.normal(k[0], (3, 4, H)), jax.random.normal(k[1], (3, 4, 6))
    ws, wt = jax.random.normal(k[2], (H, V)) * 0.5, jax.random.normal(k[3], (6, V)) * 0.5
    labels = _labels(k[4], (3, 4), V)
    ours = lambda a, w, b, t: liger_jax.fused_linear_jsd(a, w, b, wt, t, beta=0.4, chunk_size=3)  # noqa: E731
    got = jax.jit(jax.vmap(jax.value_and_grad(ours, argnums=(0, 1)), in_axes=(0, None, 0, 0)))(xs, ws, xt, labels)
    for i in range(3):
        ref = lambda a, w: fljsd_reference(a, w, xt[i], wt, labels[i], beta=0.4)  # noqa: E731
        with x64():
            want = jax.value_and_grad(ref, argnums=(0, 1))(xs[i].astype(jnp.float64), ws.astype(jnp.float64))
        _check_all(jax.tree.map(lambda a: a[i], got), want, f"fljsd example {i}")


def test_vmap_value_and_grad_of_kl_div_and_jsd(seed):
    k = jax.random.split(jax.random.key(seed), 3)
    s = jax.nn.log_softmax(jax.random.normal(k[0], (3, 4, 9)), -1)
    t = jax.nn.log_softmax(jax.random.normal(k[1], (3, 4, 9)), -1)
    labels = _labels(k[2], (3, 4), 9)

    kl = jax.vmap(jax.value_and_grad(lambda a, b: liger_jax.kl_div(a, b, reduction="batchmean", log_target=True)))
    kl_ref = jax.vmap(jax.value_and_grad(lambda a, b: jnp.sum(jnp.exp(b) * (b - a)) / a.shape[0]))
    got = jax.jit(kl)(s, t)
    with x64():
        want = jax.jit(kl_ref)(s.astype(jnp.float64), t.astype(jnp.float64))
    _check_all(got, want, "kl_div")

    js = jax.vmap(jax.value_and_grad(lambda a, b, c: liger_jax.jsd(a, b, c, beta=0.3)))
    got = jax.jit(js)(s, t, labels)
    for i in range(3):
        with x64():
            want = jax.value_and_grad(lambda a: jsd_reference(a, t[i], 0.3, labels[i]))(s[i].astype(jnp.float64))
        _check_all(jax.tree.map(lambda a: a[i], got), want, f"jsd example {i}")

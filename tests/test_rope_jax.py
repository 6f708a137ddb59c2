"""liger_jax.rope ((B, T, H, D) layout) against float64 jnp formulas, under jit, grad, vmap and checkpoint."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liger_jax
from helpers import assert_close, x64

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def rotate(x, interleaved):
    if interleaved:
        return jnp.stack((-x[..., 1::2], x[..., ::2]), axis=-1).reshape(x.shape)
    half = x.shape[-1] // 2
    return jnp.concatenate((-x[..., half:], x[..., :half]), axis=-1)


def _table(t, position_ids, batch):
    t = t if t.ndim == 3 else t[None]
    t = jnp.broadcast_to(t, (batch,) + t.shape[1:])
    if position_ids is None:
        return t
    pos = position_ids if position_ids.ndim == 2 else position_ids[None]
    pos = jnp.broadcast_to(pos, (batch, pos.shape[-1]))
    return jnp.take_along_axis(t, pos[:, :, None], axis=1)


def _reference(q, k, cos, sin, position_ids=None, interleaved=False):
    q, k = q.astype(jnp.float64), k.astype(jnp.float64)
    c = _table(cos.astype(jnp.float64), position_ids, q.shape[0])[:, :, None]
    s = _table(sin.astype(jnp.float64), position_ids, q.shape[0])[:, :, None]
    return q * c + rotate(q, interleaved) * s, k * c + rotate(k, interleaved) * s


def reference(*args, **kwargs):
    with x64():
        return _reference(*args, **kwargs)


def term_sizes(q, k, cos, sin, cotangents, position_ids=None, interleaved=False):
    """|cos term| + |sin term| of q_embed, k_embed, dq and dk for the cotangents, in float64: each product is
    rounded to the dtype before the two are added (as in HF's formula), so a result's rounding error scales with
    its terms, which may cancel to a far smaller sum (test_rope_torch.term_sizes, for jax)."""

    def results(c, s):
        f = lambda a, b: _reference(a, b, c, s, position_ids, interleaved)
        outs, vjp = jax.vjp(f, q.astype(jnp.float64), k.astype(jnp.float64))
        return (*outs, *vjp(tuple(g.astype(jnp.float64) for g in cotangents)))

    with x64():
        parts = [jax.jit(results)(c, s) for c, s in ((cos, jnp.zeros_like(sin)), (jnp.zeros_like(cos), sin))]
        return [np.abs(np.asarray(a)) + np.abs(np.asarray(b)) for a, b in zip(*parts)]


def tables(rng, batch, seq, dim, dtype):
    inv_freq = 1.0 / (10000 ** (np.arange(0, dim, 2) / dim))
    pos = np.arange(seq)[None] + rng.integers(0, 50, (batch, 1))
    emb = np.concatenate([pos[..., None] * inv_freq] * 2, axis=-1)
    return jnp.asarray(np.cos(emb), dtype), jnp.asarray(np.sin(emb), dtype)


def draw(rng, batch, seq, hq, hk, dim, dtype):
    q = jnp.asarray(rng.standard_normal((batch, seq, hq, dim)), dtype)
    k = jnp.asarray(rng.standard_normal((batch, seq, hk, dim)), dtype)
    return q, k


def check(q, k, cos, sin, dtype, rng, position_ids=None, interleaved=False):
    out_dtype = jnp.promote_types(q.dtype, cos.dtype)
    # Probes exact in the output dtype: the cotangent reaching the kernel is the probe rounded to that dtype,
    # and an fp32 probe would leave the float64 reference a different (unrounded) cotangent (seen: 10 ulps).
    pq = jnp.asarray(rng.standard_normal(q.shape), jnp.float32).astype(out_dtype).astype(jnp.float32)
    pk = jnp.asarray(rng.standard_normal(k.shape), jnp.float32).astype(
        jnp.promote_types(k.dtype, cos.dtype)).astype(jnp.float32)
    f = lambda a, b: liger_jax.rope(a, b, cos, sin, position_ids=position_ids, interleaved=interleaved)
    qo, ko = jax.jit(f)(q, k)
    assert qo.dtype == out_dtype and ko.dtype == jnp.promote_types(k.dtype, cos.dtype)

    def loss(fn, dtype):
        return lambda a, b: sum(jnp.sum(o.astype(dtype) * p) for o, p in zip(fn(a, b), (pq, pk)))

    dq, dk = jax.jit(jax.grad(loss(f, jnp.float32), argnums=(0, 1)))(q, k)
    assert dq.dtype == q.dtype and dk.dtype == k.dtype
    with x64():  # one jitted program: op-by-op float64 would compile every primitive separately
        ref = lambda a, b: _reference(a, b, cos, sin, position_ids, interleaved)
        want, (dq_ref, dk_ref) = jax.jit(lambda a, b: (ref(a, b), jax.grad(loss(ref, jnp.float64),
                                                                            argnums=(0, 1))(a, b)))(q, k)
    sizes = term_sizes(q, k, cos, sin, (pq, pk), position_ids, interleaved)
    names = ("q_embed", "k_embed", "dq", "dk")
    for got, ref, size, name in zip((qo, ko, dq, dk), (*want, dq_ref, dk_ref), sizes, names):
        assert_close(np.asarray(got.astype(jnp.float32)), np.asarray(ref), dtype, name, magnitude=size)


CASES = [((1, 1, 64), (4, 4)), ((1, 7, 128), (8, 2)), ((2, 3, 96), (8, 1)), ((2, 123, 64), (6, 3))]


@pytest.mark.parametrize("shape,heads", CASES, ids=[f"{s}-{h}" for s, h in CASES])
@pytest.mark.parametrize("dtype,interleaved", [(d, False) for d in DTYPES] + [(jnp.bfloat16, True)])
def test_forward_and_grads(shape, heads, interleaved, dtype, seed):
    rng = np.random.default_rng(seed)
    (batch, seq, dim), (hq, hk) = shape, heads
    q, k = draw(rng, batch, seq, hq, hk, dim, dtype)
    cos, sin = tables(rng, batch, seq, dim, dtype)
    check(q, k, cos, sin, dtype, rng, interleaved=interleaved)


@pytest.mark.parametrize("pos_shape,table_batch", [("bt", 1), ("bt", 2), ("1t", 2), ("t", 0)])
def test_position_ids_gather_rows(pos_shape, table_batch, seed):
    rng = np.random.default_rng(seed)
    batch, seq, dim, table = 2, 4, 64, 23
    q, k = draw(rng, batch, seq, 4, 1, dim, jnp.bfloat16)
    cos, sin = tables(rng, max(table_batch, 1), table, dim, jnp.bfloat16)
    if table_batch == 0:
        cos, sin = cos[0], sin[0]
    shape = {"bt": (batch, seq), "1t": (1, seq), "t": (seq,)}[pos_shape]
    position_ids = jnp.asarray(rng.integers(0, table, shape), jnp.int32)
    check(q, k, cos, sin, jnp.bfloat16, rng, position_ids=position_ids)


def test_arbitrary_cos_sin_and_mixed_dtypes(seed):
    """Halves of cos/sin that differ (the backward is the exact transpose); bf16 q/k with fp32 tables."""
    rng = np.random.default_rng(seed)
    q, k = draw(rng, 2, 5, 3, 1, 16, jnp.bfloat16)
    cos = jnp.asarray(rng.standard_normal((2, 5, 16)), jnp.float32)
    sin = jnp.asarray(rng.standard_normal((2, 5, 16)), jnp.float32)
    check(q, k, cos, sin, jnp.bfloat16, rng)
    check(q.astype(jnp.float32), k.astype(jnp.float32), cos, sin, jnp.float32, rng, interleaved=True)


@pytest.mark.parametrize("batched", ["qk", "qk_cos", "qk_pos", "q_only"])
def test_vmap_folds_batch(batched, seed):
    rng = np.random.default_rng(seed)
    n, batch, seq, dim, table = 2, 2, 2, 32, 9
    q = jnp.asarray(rng.standard_normal((n, batch, seq, 4, dim)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((n, batch, seq, 2, dim)), jnp.float32)
    pq = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    pk = jnp.asarray(rng.standard_normal(k.shape), jnp.float32)
    cos, sin = tables(rng, batch, seq if batched != "qk_pos" else table, dim, jnp.float32)
    pos = None
    axes = [0, 0 if batched != "q_only" else None, None, None, None]
    if batched == "q_only":
        k = k[0]
    if batched == "qk_cos":
        cos = jnp.stack([cos, 2 * cos])
        sin = jnp.stack([sin, sin - 1])
        axes[2] = axes[3] = 0
    if batched == "qk_pos":
        pos = jnp.asarray(rng.integers(0, table, (n, batch, seq)), jnp.int32)
        axes[4] = 0

    def grads(fn):
        def loss(a, b, c, s, p, wq, wk):
            qo, ko = fn(a, b, c, s, p)
            return jnp.sum(qo * wq) + jnp.sum(ko * wk)
        in_axes = tuple(axes) + (0, 0 if batched != "q_only" else None)
        return jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=in_axes)

    ours = grads(lambda a, b, c, s, p: liger_jax.rope(a, b, c, s, position_ids=p))
    wk = pk if batched != "q_only" else pk[0]
    got = jax.jit(ours)(q, k, cos, sin, pos, pq, wk)
    with x64():
        want = jax.jit(grads(lambda a, b, c, s, p: _reference(a, b, c, s, p)))(q, k, cos, sin, pos, pq, wk)
        fwd = jax.jit(jax.vmap(lambda a, b, c, s, p: _reference(a, b, c, s, p), in_axes=tuple(axes)))(
            q, k, cos, sin, pos)
    out = jax.vmap(lambda a, b, c, s, p: liger_jax.rope(a, b, c, s, position_ids=p), in_axes=tuple(axes))(
        q, k, cos, sin, pos)
    for g, w, name in zip(tuple(out) + tuple(got), tuple(fwd) + tuple(want), ("q_embed", "k_embed", "dq", "dk")):
        assert g.shape == w.shape, name
        assert_close(np.asarray(g), np.asarray(w), jnp.float32, name)


def test_checkpoint_and_determinism(seed):
    rng = np.random.default_rng(seed)
    q, k = draw(rng, 1, 3, 4, 2, 64, jnp.float32)
    cos, sin = tables(rng, 1, 3, 64, jnp.float32)

    def f(a, b):
        qo, ko = liger_jax.rope(a, b, cos, sin)
        return jnp.sum(qo ** 2) + jnp.sum(ko)

    plain = jax.grad(f, argnums=(0, 1))(q, k)
    remat = jax.jit(jax.grad(jax.checkpoint(f), argnums=(0, 1)))(q, k)
    again = jax.jit(jax.grad(jax.checkpoint(f), argnums=(0, 1)))(q, k)
    for a, b, c in zip(plain, remat, again):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(b), np.asarray(c))


def test_only_q_embed_used_gives_zero_dk(seed):
    rng = np.random.default_rng(seed)
    q, k = draw(rng, 1, 3, 4, 2, 64, jnp.float32)
    cos, sin = tables(rng, 1, 3, 64, jnp.float32)
    dq, dk = jax.grad(lambda a, b: jnp.sum(liger_jax.rope(a, b, cos, sin)[0]), argnums=(0, 1))(q, k)
    np.testing.assert_array_equal(np.asarray(dk), np.zeros(k.shape, np.float32))
    with x64():
        want = jax.jit(jax.grad(lambda a: jnp.sum(_reference(a, k, cos, sin)[0])))(q)
    assert_close(np.asarray(dq), np.asarray(want), jnp.float32, "dq")


def test_gradient_wrt_cos_is_refused(seed):
    rng = np.random.default_rng(seed)
    q, k = draw(rng, 1, 3, 4, 2, 64, jnp.float32)
    cos, sin = tables(rng, 1, 3, 64, jnp.float32)
    with pytest.raises(ValueError, match="^cos is differentiated, but liger_jax.rope differentiates q and k only"):
        jax.grad(lambda c: jnp.sum(liger_jax.rope(q, k, c, sin)[0]))(cos)
    with pytest.raises(ValueError, match="^sin is differentiated"):
        jax.grad(lambda s: jnp.sum(liger_jax.rope(q, k, cos, s)[1]))(sin)
    jax.grad(lambda c: jnp.sum(liger_jax.rope(q, k, jax.lax.stop_gradient(c), sin)[0]))(cos)


def _args(**over):
    f = lambda *s: np.ones(s, np.float32)
    base = dict(q=f(2, 7, 4, 64), k=f(2, 7, 2, 64), cos=f(2, 7, 64), sin=f(2, 7, 64))
    base.update(over)
    return base


@pytest.mark.parametrize("over,error,match", [
    (dict(cos=np.ones((2, 6, 64), np.float32), sin=np.ones((2, 6, 64), np.float32)), ValueError,
     "cos has 6 positions but q has 7 tokens"),
    (dict(q=np.ones((2, 7, 4, 63), np.float32), k=np.ones((2, 7, 2, 63), np.float32),
          cos=np.ones((2, 7, 63), np.float32), sin=np.ones((2, 7, 63), np.float32)), ValueError, "must be even"),
    (dict(k=np.ones((3, 7, 2, 64), np.float32)), ValueError, "k must have q's batch size"),
    (dict(k=np.ones((2, 5, 2, 64), np.float32)), ValueError, "k must have q's sequence length"),
    (dict(k=np.ones((2, 7, 2, 32), np.float32)), ValueError, "k must have q's head_dim"),
    (dict(q=np.ones((2, 7, 64), np.float32)), ValueError, "q must be 4-d"),
    (dict(sin=np.ones((2, 7, 64), np.float16)), TypeError, "sin must have cos's dtype"),
    (dict(q=np.ones((2, 7, 4, 64), np.int32)), TypeError, "q must have a floating"),
    (dict(position_ids=np.zeros((2, 6), np.int32)), ValueError, "position_ids must have shape"),
    (dict(position_ids=np.zeros((2, 7), np.float32)), TypeError, "position_ids must have an integer"),
    (dict(cos=[1.0]), TypeError, "cos must be a jax or numpy array"),
])
def test_bad_input(over, error, match):
    args = _args(**over)
    pos = args.pop("position_ids", None)
    with pytest.raises(error, match=match):
        liger_jax.rope(**args, position_ids=pos)


@pytest.mark.parametrize("groups_per_program", [1, 8])
def test_traced_out_of_range_position_gives_nan_not_a_stray_read(groups_per_program, monkeypatch, request, seed):
    """Under jit the frontend cannot see the positions: the kernel reads row 0 and NaNs that token's outputs,
    whether a program rotates one head group or converts its cos/sin tile once for several."""
    import liger_core.rope

    monkeypatch.setattr(liger_core.rope, "_MIN_PROGRAMS", 1)
    monkeypatch.setattr(liger_core.rope, "_GROUPS_PER_PROGRAM", groups_per_program)
    liger_core.rope._plan.cache_clear()  # plans are cached by their arguments, not by module settings
    request.addfinalizer(liger_core.rope._plan.cache_clear)  # no plan of these settings outlives the test
    rng = np.random.default_rng(seed)
    q, k = draw(rng, 1, 4, 4, 2, 16, jnp.float32)
    cos, sin = tables(rng, 1, 6, 16, jnp.float32)
    good = jnp.asarray([[0, 5, 2, 3]])
    bad = good.at[0, 1].set(6)  # one past the tables
    f = jax.jit(lambda p: liger_jax.rope(q, k, cos, sin, position_ids=p))
    want, got = f(good), f(bad)
    for w, g in zip(want, got):
        assert np.isnan(np.asarray(g[:, 1])).all()
        np.testing.assert_array_equal(np.asarray(g[:, [0, 2, 3]]), np.asarray(w[:, [0, 2, 3]]))

"""Property-based sweeps (hypothesis) of the liger_jax functions test_properties_more.py does not cover: rope,
kl_div, jsd, fused_linear_cross_entropy and fused_linear_jsd.

As in test_properties_more.py, each example draws shapes (1 row or token, odd and prime sizes), a dtype and the
function's options; the arrays' values come from a numpy generator seeded by a drawn integer (hypothesis'
falsifying example reproduces the whole input). The forward and every gradient (``jax.vjp`` with a random
cotangent, drawn in the output's dtype so that the float64 reference sees the very cotangent the kernel sees)
are compared against the float64 references of the per-function jax test modules, within helpers' dtype
tolerance, widened only where those modules widen it (the reason is restated at each use). The functions run
their kernels through pure_callback (slow in the interpreter): the sweeps draw test_properties_more's FEW
examples (a third of the profile's, at least 3; more with LIGER_HYPOTHESIS_EXAMPLES).
"""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import liger_jax
from helpers import assert_close, f32, x64
from test_fused_linear_cross_entropy_jax import reference as flce_reference
from test_fused_linear_jsd_jax import reference as fljsd_reference
from test_jsd_jax import reference as jsd_reference
from test_kl_div_jax import reference as kl_reference
from test_properties_more import FEW
from test_properties_torch import HIDDEN, SEEDS, ce_options
from test_rope_jax import reference as rope_reference
from test_rope_jax import tables as rope_tables, term_sizes as rope_term_sizes

JDTYPES = st.sampled_from([jnp.float32, jnp.bfloat16, jnp.float16])
JLEAD = st.sampled_from([(1,), (2,), (5,), (9,), (2, 3), (1, 1)])
FUSED_HIDDEN = [1, 3, 8, 17, 48]
FUSED_VOCAB = [1, 2, 7, 31, 97, 257]
CHUNKS = st.sampled_from([None, 1, 2, 3, 5])


def cotangent(rng, shape, dtype):
    """A random cotangent, exact in the output's dtype (jax.vjp wants that dtype)."""
    return jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)


def f64(a):
    return np.asarray(a, np.float64) if a.dtype != jnp.bfloat16 else f32(a).astype(np.float64)


def labels_with_ignored(rng, lead, v, ignore_index, ignored):
    """Labels in [0, v) of shape lead, ``ignore_index`` exactly on the rows ``ignored`` (a flat bool list)."""
    labels = rng.integers(0, v, lead)
    if 0 <= ignore_index < v:  # an in-vocab ignore_index: only the rows drawn as ignored carry it
        labels[labels == ignore_index] = (ignore_index + 1) % v
        if v == 1:
            ignored = [True] * len(ignored)
    labels[np.asarray(ignored, bool).reshape(lead)] = ignore_index
    return jnp.asarray(labels, jnp.int32)


# ------------------------------------------------------------------------------------------------------- rope
@st.composite
def rope_case(draw):
    batch, seq = draw(st.integers(1, 2)), draw(st.integers(1, 5))
    dim = draw(st.sampled_from([2, 6, 10, 22, 64]))  # even; half of it odd except 64
    hkv = draw(st.integers(1, 2))
    ratio = draw(st.sampled_from([1, 2, 3, 4]))  # GQA: hq = ratio * hkv
    pos = draw(st.sampled_from([None, None, "bt", "1t", "t"]))
    table_batch = draw(st.sampled_from([0, 1, batch]))  # 0: a (T, D) table
    return dict(batch=batch, seq=seq, dim=dim, hkv=hkv, hq=hkv * ratio, pos=pos, table_batch=table_batch,
                interleaved=draw(st.booleans()), rotation=draw(st.booleans()),
                fp32_tables=draw(st.sampled_from([False, False, True])))


@FEW
@given(case=rope_case(), dtype=JDTYPES, seed=SEEDS)
def test_jax_rope(case, dtype, seed):
    rng = np.random.default_rng(seed)
    b, t, d = case["batch"], case["seq"], case["dim"]
    q = jnp.asarray(rng.standard_normal((b, t, case["hq"], d)), dtype)
    k = jnp.asarray(rng.standard_normal((b, t, case["hkv"], d)), dtype)
    rows = t if case["pos"] is None else t + 11  # with position_ids: a longer table, rows picked at random
    tb = max(case["table_batch"], 1)
    tdtype = jnp.float32 if case["fp32_tables"] else dtype
    if case["rotation"]:  # HF tables at positions shifted by a random offset per batch row (never 0..T-1 only)
        cos, sin = rope_tables(rng, tb, rows, d, tdtype)
    else:  # arbitrary tables (halves differ): the backward must be the exact transpose
        cos, sin = (jnp.asarray(rng.standard_normal((tb, rows, d)), tdtype) for _ in range(2))
    if case["table_batch"] == 0:
        cos, sin = cos[0], sin[0]
    position_ids = None
    if case["pos"] is not None:
        pshape = {"bt": (b, t), "1t": (1, t), "t": (t,)}[case["pos"]]
        position_ids = jnp.asarray(rng.integers(0, rows, pshape), jnp.int32)
    kw = dict(position_ids=position_ids, interleaved=case["interleaved"])
    out_dtype = jnp.promote_types(dtype, tdtype)
    gq, gk = cotangent(rng, q.shape, out_dtype), cotangent(rng, k.shape, out_dtype)

    (qo, ko), vjp = jax.vjp(lambda a, c: liger_jax.rope(a, c, cos, sin, **kw), q, k)
    dq, dk = vjp((gq, gk))
    qo_ref, ko_ref = rope_reference(q, k, cos, sin, **kw)
    with x64():
        _, vjp_ref = jax.vjp(lambda a, c: rope_reference(a, c, cos, sin, **kw), q.astype(jnp.float64),
                             k.astype(jnp.float64))
        dq_ref, dk_ref = vjp_ref((gq.astype(jnp.float64), gk.astype(jnp.float64)))

    assert qo.dtype == ko.dtype == out_dtype and qo.shape == q.shape and ko.shape == k.shape
    assert dq.dtype == dk.dtype == dtype
    sizes = rope_term_sizes(q, k, cos, sin, (gq, gk), **kw)
    for got, ref, size, rdtype, name in zip((qo, ko, dq, dk), (qo_ref, ko_ref, dq_ref, dk_ref), sizes,
                                            (out_dtype, out_dtype, dtype, dtype), ("q_embed", "k_embed", "dq", "dk")):
        assert_close(f32(got), np.asarray(ref), rdtype, name, magnitude=size)


# ----------------------------------------------------------------------------------------------------- kl_div
@FEW
@given(lead=JLEAD, v=st.sampled_from(HIDDEN), dtype=JDTYPES,
       reduction=st.sampled_from(["none", "sum", "mean", "batchmean"]), log_target=st.booleans(),
       zeros=st.integers(0, 3), seed=SEEDS)
def test_jax_kl_div(lead, v, dtype, reduction, log_target, zeros, seed):
    rng = np.random.default_rng(seed)
    x = jax.nn.log_softmax(jnp.asarray(rng.standard_normal(lead + (v,)) * 2, jnp.float32), -1).astype(dtype)
    logits = jnp.asarray(rng.standard_normal(lead + (v,)) * 2, jnp.float32)
    if log_target:
        t = jax.nn.log_softmax(logits, -1)
    else:
        t = jax.nn.softmax(logits, -1)
        t = t.at[(0,) * len(lead) + (slice(0, min(zeros, v)),)].set(0.0)  # zero probabilities: 0 * log 0 = 0
    t = t.astype(dtype)
    opts = dict(reduction=reduction, log_target=log_target)
    g = cotangent(rng, x.shape if reduction == "none" else (), dtype)

    # the targets stop_gradient'ed (differentiating them is an error, tests/test_errors.py): a zero gradient
    loss, vjp = jax.vjp(lambda a, b: liger_jax.kl_div(a, jax.lax.stop_gradient(b), **opts), x, t)
    dx, dt = vjp(g)
    loss_ref = kl_reference(x, t, **opts)
    with x64():
        _, vjp_ref = jax.vjp(lambda a: kl_reference(a, t, **opts), x.astype(jnp.float64))
        (dx_ref,) = vjp_ref(g.astype(jnp.float64))

    assert loss.dtype == dtype and loss.shape == loss_ref.shape and dx.dtype == dtype
    widen = 1.0 if reduction == "none" else x.size ** 0.5  # as test_kl_div_jax: a sum over the elements
    assert_close(f32(loss), np.asarray(loss_ref), dtype, "loss", scale=widen)
    count = {"mean": x.size, "batchmean": lead[0]}.get(reduction, 1)  # the means' gradients are ~1/count
    assert_close(f32(dx) * count, np.asarray(dx_ref) * count, dtype, "dlog_predictions")
    assert not np.any(f64(dt)), "targets must get a zero gradient"


# -------------------------------------------------------------------------------------------------------- jsd
@FEW
@given(lead=JLEAD, v=st.sampled_from(HIDDEN), dtype=JDTYPES,
       beta=st.one_of(st.sampled_from([0.0, 0.5, 1.0]), st.floats(0.05, 0.95)),
       labels=st.sampled_from([None, -100, 7, "all_ignored"]), seed=SEEDS)
def test_jax_jsd(lead, v, dtype, beta, labels, seed):
    rng = np.random.default_rng(seed)
    s = jax.nn.log_softmax(jnp.asarray(rng.standard_normal(lead + (v,)) * 2, jnp.float32), -1).astype(dtype)
    t = jax.nn.log_softmax(jnp.asarray(rng.standard_normal(lead + (v,)) * 2, jnp.float32), -1).astype(dtype)
    ignore_index = -100 if labels in (None, "all_ignored") else labels
    lab = None
    if labels is not None:
        n = int(np.prod(lead))
        ignored = [True] * n if labels == "all_ignored" else list(rng.random(n) < 0.3)
        lab = labels_with_ignored(rng, lead, v, ignore_index, ignored)
    g = cotangent(rng, (), dtype)

    # the teacher stop_gradient'ed (differentiating it is an error, tests/test_errors.py): a zero gradient
    loss, vjp = jax.vjp(lambda a, b: liger_jax.jsd(a, jax.lax.stop_gradient(b), lab, beta=beta,
                                                   ignore_index=ignore_index), s, t)
    ds, dt = vjp(g)
    loss_ref = jsd_reference(s, t, beta, lab, ignore_index)
    with x64():
        _, vjp_ref = jax.vjp(lambda a: jsd_reference(a, t, beta, lab, ignore_index), s.astype(jnp.float64))
        (ds_ref,) = vjp_ref(g.astype(jnp.float64))

    assert loss.dtype == dtype and loss.shape == () and ds.dtype == dtype
    assert_close(f32(loss), np.asarray(loss_ref), dtype, "loss", scale=4.0)  # as test_jsd_jax: a mean of row sums
    rows = s.size // v
    count = rows if lab is None else max(1, int((lab != ignore_index).sum()))  # the mean's gradient ~1/count
    assert_close(f32(ds) * count, np.asarray(ds_ref) * count, dtype, "dstudent")
    assert not np.any(f64(dt)), "the teacher must get a zero gradient"
    if lab is not None:
        dropped = np.asarray(lab) == ignore_index
        assert not np.any(f64(ds)[dropped]), "ignored rows must get zero gradient"


# ------------------------------------------------------------------------------------ fused_linear_cross_entropy
@st.composite
def jflce_case(draw):
    lead = draw(st.sampled_from([(1,), (2,), (5,), (9,), (2, 3), (1, 1)]))
    h, v = draw(st.sampled_from(FUSED_HIDDEN)), draw(st.sampled_from(FUSED_VOCAB))
    opts = ce_options(draw, v)
    extra = dict(with_bias=draw(st.booleans()), with_ce_weight=draw(st.booleans()), chunk_size=draw(CHUNKS),
                 transpose=draw(st.booleans()))
    n = int(np.prod(lead))
    ignored = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    return lead, h, v, opts, extra, ignored


@FEW
@given(case=jflce_case(), dtype=JDTYPES, seed=SEEDS)
def test_jax_fused_linear_cross_entropy(case, dtype, seed):
    lead, h, v, opts, extra, ignored = case
    rng = np.random.default_rng(seed)
    n, transpose = int(np.prod(lead)), extra["transpose"]
    x = jnp.asarray(rng.standard_normal(lead + (h,)), dtype)
    kernel = jnp.asarray(rng.standard_normal((v, h) if transpose else (h, v)) * 0.4, dtype)  # (V, H): tied
    bias = jnp.asarray(rng.standard_normal(v), dtype) if extra["with_bias"] else None
    cw = jnp.asarray(rng.random(v) + 0.5, jnp.float32) if extra["with_ce_weight"] else None
    ii = opts["ignore_index"]
    labels = labels_with_ignored(rng, lead, v, ii, ignored)
    reduction = opts["reduction"]
    # the loss (and z-loss) is fp32 whatever x's dtype (as test_fused_linear_cross_entropy_jax asserts)
    g = cotangent(rng, lead if reduction == "none" else (), jnp.float32)
    params = (x, kernel) + ((bias,) if bias is not None else ())

    def ours(a, k, *b):
        return liger_jax.fused_linear_cross_entropy(a, k, labels, b[0] if b else None, transpose=transpose,
                                                    ce_weight=cw, return_z_loss=True,
                                                    chunk_size=extra["chunk_size"], **opts)

    def ref(a, k, *b):
        return flce_reference(a, k, labels, b[0] if b else None, transpose=transpose, weight=cw, **opts)

    (loss, z) = ours(*params)
    _, vjp = jax.vjp(lambda *p: ours(*p)[0], *params)
    got = vjp(g)
    loss_ref, z_ref = ref(*params)
    with x64():
        # the inputs in their own dtype, as test_fused_linear_cross_entropy_jax: the reference rounds the logits
        # to x's dtype where the lm_head does
        _, vjp_ref = jax.vjp(lambda *p: ref(*p)[0], *params)
        want = vjp_ref(g.astype(jnp.float64))

    assert loss.dtype == z.dtype == jnp.float32, (loss.dtype, z.dtype)
    assert loss.shape == loss_ref.shape and z.shape == z_ref.shape
    assert_close(f32(loss), np.asarray(loss_ref), dtype, "loss")
    assert_close(f32(z), np.asarray(z_ref), dtype, "z_loss")
    scale = n if reduction == "mean" else 1.0  # the mean's gradients are ~1/N: compare them scaled up
    for name, gr, wa, p in zip(("dx", "dkernel", "dbias"), got, want, params):
        assert gr.dtype == dtype and gr.shape == p.shape, name
        # as test_fused_linear_cross_entropy_jax: kernel and bias gradients are sums of N rounded terms, and
        # twice that in half precision
        widen = 1.0 if name == "dx" else n ** 0.5
        assert_close(f32(gr) * scale, f64(wa) * scale, dtype, name,
                     scale=widen if dtype == jnp.float32 else 2 * widen)
    dropped = np.asarray(labels) == ii
    assert not np.any(f64(got[0])[dropped]), "ignored rows must get exactly zero dx"


# ----------------------------------------------------------------------------------------------- fused_linear_jsd
@st.composite
def jfljsd_case(draw):
    lead = draw(st.sampled_from([(1,), (2,), (5,), (9,), (2, 3), (1, 1)]))
    hs, ht = draw(st.sampled_from(FUSED_HIDDEN)), draw(st.sampled_from(FUSED_HIDDEN))
    v = draw(st.sampled_from(FUSED_VOCAB))
    beta = draw(st.one_of(st.sampled_from([0.0, 0.5, 1.0]), st.floats(0.05, 0.95)))
    temperature = draw(st.sampled_from([1.0, 1.0, 0.7, 2.0]))
    labels = draw(st.sampled_from([None, -100, "in_vocab", "all_ignored"]))
    ignore_index = draw(st.integers(0, v - 1)) if labels == "in_vocab" else -100
    n = int(np.prod(lead))
    ignored = [True] * n if labels == "all_ignored" else draw(st.lists(st.booleans(), min_size=n, max_size=n))
    return dict(lead=lead, hs=hs, ht=ht, v=v, beta=beta, temperature=temperature, with_labels=labels is not None,
                ignore_index=ignore_index, ignored=ignored, transpose=draw(st.booleans()), chunk_size=draw(CHUNKS))


@FEW
@given(case=jfljsd_case(), dtype=JDTYPES, seed=SEEDS)
def test_jax_fused_linear_jsd(case, dtype, seed):
    rng = np.random.default_rng(seed)
    lead, v, ii, transpose = case["lead"], case["v"], case["ignore_index"], case["transpose"]
    n = int(np.prod(lead))
    xs = jnp.asarray(rng.standard_normal(lead + (case["hs"],)), dtype)
    ks = jnp.asarray(rng.standard_normal((case["hs"], v)) * 0.4, dtype)
    xt = jnp.asarray(rng.standard_normal(lead + (case["ht"],)), dtype)
    kt = jnp.asarray(rng.standard_normal((case["ht"], v)) * 0.5, dtype)
    labels = labels_with_ignored(rng, lead, v, ii, case["ignored"]) if case["with_labels"] else None
    layout = (lambda k: k.T) if transpose else (lambda k: k)  # (V, H) matrices with transpose=True
    ks_in, kt_in = layout(ks), layout(kt)
    opts = dict(beta=case["beta"], temperature=case["temperature"], ignore_index=ii)
    g = cotangent(rng, (), dtype)

    def ours(a, k, b, c):  # the teacher stop_gradient'ed (differentiating it is an error): zero gradients
        b, c = jax.lax.stop_gradient(b), jax.lax.stop_gradient(c)
        return liger_jax.fused_linear_jsd(a, k, b, c, labels, transpose=transpose, chunk_size=case["chunk_size"],
                                          **opts)

    def ref(a, k):  # the reference takes (H, V) kernels and 2-d inputs; x's leading axes fold into the rows
        return fljsd_reference(a.reshape(n, -1), layout(k), xt.reshape(n, -1), kt,
                               None if labels is None else labels.reshape(n), **opts)

    loss, vjp = jax.vjp(ours, xs, ks_in, xt, kt_in)
    dx, dk, dxt, dkt = vjp(g)
    loss_ref = ref(xs, ks_in)
    with x64():
        # the inputs in their own dtype: the reference rounds the logits to the inputs' dtype where the lm_head does
        _, vjp_ref = jax.vjp(ref, xs, ks_in)
        dx_ref, dk_ref = vjp_ref(g.astype(jnp.float64))

    assert loss.dtype == dtype and loss.shape == ()
    assert_close(f32(loss), np.asarray(loss_ref), dtype, "loss", scale=4.0)  # as test_fused_linear_jsd_jax
    count = n if labels is None else max(1, int((np.asarray(labels) != ii).sum()))  # the mean's gradient ~1/count
    assert dx.dtype == dk.dtype == dtype and dx.shape == xs.shape and dk.shape == ks_in.shape
    widen = 1.0 if dtype == jnp.float32 else 2.0  # as test_fused_linear_jsd_jax (half precision: twice)
    assert_close(f32(dx) * count, f64(dx_ref) * count, dtype, "dstudent_input", scale=widen)
    # as test_fused_linear_jsd_jax: the kernel gradient is a sum of N rounded terms
    assert_close(f32(dk) * count, f64(dk_ref) * count, dtype, "dstudent_kernel", scale=widen * n ** 0.5)
    assert not np.any(f64(dxt)) and not np.any(f64(dkt)), "the teacher must get zero gradients"
    if labels is not None:
        dropped = np.asarray(labels) == ii
        assert not np.any(f64(dx)[dropped]), "ignored rows must get zero gradient"

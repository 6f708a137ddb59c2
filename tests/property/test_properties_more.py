"""Property-based sweeps (hypothesis) of the public functions test_properties_torch.py does not cover:
liger_torch's fused_add_rms_norm, rope, kl_div, jsd and fused_linear_cross_entropy (and the three norms'
chunked forwards, through their plans), and liger_jax's rms_norm,
layer_norm, swiglu/geglu (and swiglu_linear / geglu_linear) and cross_entropy.

As in test_properties_torch.py, each example draws shapes (1 row, odd and prime sizes), dtypes and options, the
tensors' values come from a generator seeded by a drawn integer (hypothesis' falsifying example reproduces the
whole input), and the forward and every gradient are compared against the float64 references of the
per-function test modules within helpers' dtype tolerance, widened only where those modules widen it. The jax
functions run their kernels through pure_callback (slow in the interpreter): their sweeps draw fewer examples.
"""

import jax
import jax.numpy as jnp
import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import liger_jax
import liger_torch
from helpers import assert_close, f32, x64
from test_properties_torch import (DEVICE, DTYPES, HIDDEN, SEEDS, ce_options, grads, leading_and_layout, leaf, make,
                                   ref_leaf)
from test_cross_entropy_jax import reference as jce_reference
from test_fused_add_rms_norm_torch import SLACK as FA_SLACK
from test_fused_add_rms_norm_torch import reference as fa_reference
from test_fused_linear_cross_entropy_torch import reference as flce_reference
from test_jsd_torch import reference as jsd_reference
from test_layer_norm_jax import reference as jln_reference
from test_layer_norm_torch import reference as ln_reference
from test_rms_norm_jax import reference as jrms_reference
from test_rms_norm_torch import reference as rms_reference
from test_rope_torch import check_against_references as check_rope, hf_tables, run as rope_run
from test_swiglu_jax import ACTS as JACTS, LINEAR_ACTS as JLINEAR_ACTS
from test_swiglu_jax import check_gated_linear as check_jax_gated_linear

import torch.nn.functional as F

FP32_BF16 = st.sampled_from([torch.float32, torch.bfloat16])
# jax sweeps: a third of the profile's examples (at least 3), each one a few pure_callback launches
FEW = settings(max_examples=max(3, settings.default.max_examples // 3))


def row_scaled_close(dx, dx_ref, dtype, rstd, wg, name, scale=1.0):
    """test_properties_torch.assert_dx_close (dx of a normalisation compared in units of its row scale
    rstd * max|w * dy| where that exceeds 1), with the per-function module's ``scale``."""
    def f64(a):
        return a.detach().double().cpu() if isinstance(a, torch.Tensor) else torch.as_tensor(np.asarray(a, np.float64))

    row = (rstd * wg.abs().amax(-1, keepdim=True)).clamp(min=1.0).cpu()
    assert_close(f64(dx) / row, f64(dx_ref) / row, dtype, name, scale=scale)


# ------------------------------------------------------------------------------------------ fused_add_rms_norm
@given(shape=leading_and_layout(), h=st.sampled_from(HIDDEN), dtype=DTYPES,
       mode_offset=st.sampled_from([("llama", 0.0), ("llama", 0.5), ("gemma", 1.0), ("none", 0.0)]),
       with_weight=st.booleans(), used=st.sampled_from(["both", "both", "y_only", "h_only"]),
       eps=st.sampled_from([1e-6, 1e-5]), seed=SEEDS)
def test_fused_add_rms_norm(shape, h, dtype, mode_offset, with_weight, used, eps, seed):
    (lead, layout, pad), (mode, offset) = shape, mode_offset
    gen = torch.Generator().manual_seed(seed)
    x = make(gen, lead, h, dtype, layout, pad, scale=2.0)
    r = make(gen, lead, h, dtype, "contiguous", pad, scale=2.0)
    w = (torch.randn(h, generator=gen) * 0.5 + 1).to(DEVICE, dtype) if with_weight else None
    gy = torch.randn(x.shape, generator=gen).to(DEVICE, dtype) if used != "h_only" else None
    gh = torch.randn(x.shape, generator=gen).to(DEVICE, dtype) if used != "y_only" else None

    def backward(outs, gs, leaves):
        live = [(o, g) for o, g in zip(outs, gs) if g is not None]
        want = [t for t in leaves if t is not None]
        got = iter(torch.autograd.grad([o for o, _ in live], want, [g for _, g in live], allow_unused=True))
        return [None if t is None else next(got) for t in leaves]

    xl, rl, wl = leaf(x), leaf(r), leaf(w)
    y, hh = liger_torch.fused_add_rms_norm(xl, rl, wl, eps, offset, mode)
    dx, dr, dw = backward((y, hh), (None if gy is None else gy.clone(), None if gh is None else gh.clone()),
                          [xl, rl, wl])
    # the reference rounds where HF does, by the inputs' dtypes: it takes leaves of those dtypes (as
    # test_fused_add_rms_norm_torch's run does) and computes in float64 inside
    xr, rr, wr = leaf(x), leaf(r), leaf(w)
    y_ref, h_ref = fa_reference(xr, rr, wr, eps, offset, mode)
    dx_ref, dr_ref, dw_ref = backward((y_ref, h_ref), (None if gy is None else gy.double(),
                                                       None if gh is None else gh.double()), [xr, rr, wr])

    assert y.shape == hh.shape == x.shape and y.dtype == hh.dtype == dtype
    slack = FA_SLACK.get(dtype, 1.0)
    assert_close(y, y_ref, dtype, "y", scale=slack)
    assert_close(hh, h_ref, dtype, "h", scale=slack)
    assert dx.dtype == dr.dtype == dtype
    h64 = h_ref.detach()
    rstd = torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + eps)
    wg = (torch.zeros_like(h64) if gy is None else gy.double()) * (1.0 if w is None else (offset + w.double()))
    # dx = dresidual = dy through the norm + dh: the row scale covers the norm's part (as for rms_norm)
    row_scaled_close(dx, dx_ref, dtype, rstd, wg, "dx", scale=slack)
    row_scaled_close(dr, dr_ref, dtype, rstd, wg, "dresidual", scale=slack)
    assert torch.equal(dx, dr)
    if with_weight:
        rows = x.numel() // h
        if gy is None:  # no gradient reaches the weight
            assert dw is None or torch.equal(dw, torch.zeros_like(dw))
        else:
            assert dw.dtype == dtype
            assert_close(dw, dw_ref, dtype, "dw", scale=slack * max(1.0, rows ** 0.5))


# -------------------------------------------------------------------------------------- chunked norm forwards
@given(shape=leading_and_layout(["contiguous", "offset", "row_slice", "strided_columns"]), h=st.integers(1, 600),
       chunk=st.sampled_from([16, 32, 64, 128]), prefetch=st.booleans(), dtype=DTYPES,
       family=st.sampled_from(["rms_norm", "layer_norm", "fused_add_rms_norm"]),
       mode_offset=st.sampled_from([("llama", 0.0), ("gemma", 1.0), ("none", 0.0)]), seed=SEEDS)
def test_chunked_norm_forwards(shape, h, chunk, prefetch, dtype, family, mode_offset, seed):
    """The forwards of rows over 16384 columns, forced on small rows (``chunk``): any width against any chunk
    (partial last chunks, a chunk wider than the row), every foldable layout, against the references."""
    from liger_core import fused_add_rms_norm, layer_norm, rms_norm
    from liger_torch._launch import info, run_plan

    (lead, layout, pad), (mode, offset) = shape, mode_offset
    gen = torch.Generator().manual_seed(seed)
    x = make(gen, lead, h, dtype, layout, pad, scale=3.0, shift=0.5)
    w = (torch.randn(h, generator=gen) * 0.5 + 1).to(DEVICE, dtype)
    b = torch.randn(h, generator=gen).to(DEVICE, dtype)
    kw = dict(chunk=chunk, prefetch=prefetch)
    if family == "rms_norm":
        y, rstd = run_plan(rms_norm.forward_plan(info(x), info(w), eps=1e-6, offset=offset, casting_mode=mode, **kw),
                           x=x, weight=w)
        assert_close(y, rms_reference(x, w, 1e-6, offset, mode), dtype, "y")
        assert_close(rstd, torch.rsqrt(x.double().pow(2).mean(-1) + 1e-6), torch.float32, "rstd")
    elif family == "layer_norm":
        y, mean, rstd = run_plan(layer_norm.forward_plan(info(x), info(w), info(b), eps=1e-5, **kw),
                                 x=x, weight=w, bias=b)
        assert_close(y, ln_reference(x, w, b, 1e-5), dtype, "y")
        assert_close(mean, x.double().mean(-1), torch.float32, "mean")
        assert_close(rstd, (x.double().var(-1, unbiased=False) + 1e-5).rsqrt(), torch.float32, "rstd")
    else:
        r = make(gen, lead, h, dtype, "contiguous", pad, scale=2.0)
        y, hh, rstd = run_plan(fused_add_rms_norm.forward_plan(info(x), info(r), info(w), eps=1e-6, offset=offset,
                                                               casting_mode=mode, **kw), x=x, residual=r, weight=w)
        y_ref, h_ref = fa_reference(x, r, w, 1e-6, offset, mode)
        slack = FA_SLACK.get(dtype, 1.0)
        assert_close(y, y_ref, dtype, "y", scale=slack)
        assert_close(hh, h_ref, dtype, "h", scale=slack)


# ------------------------------------------------------------------------------------------------------- rope
@st.composite
def rope_case(draw):
    batch, seq = draw(st.integers(1, 2)), draw(st.integers(1, 5))
    dim = draw(st.sampled_from([2, 6, 10, 22, 64]))  # even; half of it odd except 64
    hkv = draw(st.integers(1, 2))
    ratio = draw(st.sampled_from([1, 2, 3, 4]))
    pos = draw(st.sampled_from([None, None, "bt", "1t", "t"]))
    table_batch = draw(st.sampled_from([0, 1, batch]))  # 0: a (T, D) table
    return dict(batch=batch, seq=seq, dim=dim, hkv=hkv, hq=hkv * ratio, pos=pos, table_batch=table_batch,
                interleaved=draw(st.booleans()), unsqueeze_dim=draw(st.sampled_from([1, 1, 2])),
                rotation=draw(st.booleans()))


@given(case=rope_case(), dtype=DTYPES, seed=SEEDS)
def test_rope(case, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    b, t, d, ud = case["batch"], case["seq"], case["dim"], case["unsqueeze_dim"]
    q = torch.randn(b, case["hq"], t, d, generator=gen).to(DEVICE, dtype)
    k = torch.randn(b, case["hkv"], t, d, generator=gen).to(DEVICE, dtype)
    if ud == 2:  # (B, T, H, D)
        q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
    rows = t if case["pos"] is None else t + 11  # with position_ids: a longer table picked by row
    tb = max(case["table_batch"], 1)
    if case["rotation"]:
        cos, sin = hf_tables(tb, rows, d, dtype, gen)
    else:  # arbitrary tables (halves differ): the backward must be the exact transpose
        cos, sin = (torch.randn(tb, rows, d, generator=gen).to(dtype) for _ in range(2))
    if case["table_batch"] == 0:
        cos, sin = cos[0], sin[0]
    cos, sin = cos.to(DEVICE), sin.to(DEVICE)
    position_ids = None
    if case["pos"] is not None:
        pshape = {"bt": (b, t), "1t": (1, t), "t": (t,)}[case["pos"]]
        position_ids = torch.randint(0, rows, pshape, generator=gen).to(DEVICE)
    gq = torch.randn(q.shape, generator=gen).to(DEVICE, dtype)
    gk = torch.randn(k.shape, generator=gen).to(DEVICE, dtype)
    kw = dict(position_ids=position_ids, unsqueeze_dim=ud, interleaved=case["interleaved"])

    ours = rope_run(liger_torch.rope, q, k, gq.clone(), gk.clone(), cos, sin, **kw)
    assert all(t.dtype == dtype for t in ours)
    check_rope(ours, q, k, cos, sin, gq, gk, dtype, **kw)


# ----------------------------------------------------------------------------------------------------- kl_div
@given(n=st.integers(1, 9), v=st.sampled_from(HIDDEN), dtype=DTYPES,
       reduction=st.sampled_from(["none", "sum", "mean", "batchmean"]), log_target=st.booleans(),
       zeros=st.integers(0, 3), seed=SEEDS)
def test_kl_div(n, v, dtype, reduction, log_target, zeros, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.log_softmax(torch.randn(n, v, generator=gen) * 2, -1).to(DEVICE, dtype)
    if log_target:
        t = torch.log_softmax(torch.randn(n, v, generator=gen) * 2, -1)
    else:
        t = torch.softmax(torch.randn(n, v, generator=gen) * 2, -1)
        t[0, :min(zeros, v)] = 0.0  # zero probabilities: 0 * log 0 = 0
    t = t.to(DEVICE, dtype)
    g = (torch.randn(n, v, generator=gen) if reduction == "none" else torch.tensor(0.7)).to(DEVICE, dtype)

    xl = leaf(x)
    loss = liger_torch.kl_div(xl, t, reduction, log_target)
    (dx,) = grads(loss, g.clone(), [xl])
    xr = ref_leaf(x)
    loss_ref = F.kl_div(xr, t.double(), reduction=reduction, log_target=log_target)
    (dx_ref,) = grads(loss_ref, g.double(), [xr])

    assert loss.dtype == dtype and loss.shape == loss_ref.shape and dx.dtype == dtype
    widen = 1.0 if reduction == "none" else x.numel() ** 0.5  # as test_kl_div_torch: a sum over the elements
    assert_close(loss, loss_ref, dtype, "loss", scale=widen)
    count = {"mean": x.numel(), "batchmean": n}.get(reduction, 1)  # the means' gradients are ~1/count
    assert_close(dx * count, dx_ref * count, dtype, "dinput")


# -------------------------------------------------------------------------------------------------------- jsd
@given(lead=st.sampled_from([(1,), (2,), (5,), (9,), (2, 3), (1, 1)]), v=st.sampled_from(HIDDEN),
       dtype=FP32_BF16, beta=st.one_of(st.sampled_from([0.0, 0.5, 1.0]), st.floats(0.05, 0.95)),
       labels=st.sampled_from([None, -100, 7, "all_ignored"]), seed=SEEDS)
def test_jsd(lead, v, dtype, beta, labels, seed):
    gen = torch.Generator().manual_seed(seed)
    s = torch.log_softmax(torch.randn(*lead, v, generator=gen) * 2, -1).to(DEVICE, dtype)
    t = torch.log_softmax(torch.randn(*lead, v, generator=gen) * 2, -1).to(DEVICE, dtype)
    ignore_index = -100 if labels in (None, "all_ignored") else labels
    lab = None
    if labels is not None:
        lab = torch.randint(0, v, lead, generator=gen)
        lab[lab == ignore_index] = (ignore_index + 1) % v
        lab[torch.rand(lead, generator=gen) < 0.3] = ignore_index
        if labels == "all_ignored":
            lab[...] = ignore_index
        lab = lab.to(DEVICE)
    g = torch.tensor(0.7)

    sl = leaf(s)
    loss = liger_torch.jsd(sl, t, lab, beta=beta, ignore_index=ignore_index)
    (ds,) = grads(loss, g.to(DEVICE, loss.dtype), [sl])
    sr = ref_leaf(s)
    loss_ref = jsd_reference(sr, t, beta, lab, ignore_index)
    (ds_ref,) = grads(loss_ref, g.double(), [sr])

    assert loss.dtype == dtype and loss.shape == () and ds.dtype == dtype
    assert_close(loss, loss_ref, dtype, "loss", scale=4.0)  # as test_jsd_torch: a mean of row sums over V terms
    rows = s.numel() // v
    count = rows if lab is None else max(1, int((lab != ignore_index).sum()))  # the mean's gradient ~1/count
    assert_close(ds * count, ds_ref * count, dtype, "dstudent")
    if lab is not None:
        dropped = lab == ignore_index
        assert torch.equal(ds[dropped], torch.zeros_like(ds[dropped])), "ignored rows must get zero gradient"


# ------------------------------------------------------------------------------------ fused_linear_cross_entropy
@st.composite
def flce_case(draw):
    n, h, v = draw(st.integers(1, 9)), draw(st.sampled_from([1, 3, 8, 17])), draw(st.sampled_from([1, 2, 7, 31, 97]))
    opts = ce_options(draw, v)
    extra = dict(with_bias=draw(st.booleans()), with_ce_weight=draw(st.booleans()),
                 chunk_size=draw(st.integers(1, 5)), leading_3d=draw(st.booleans()))
    ignored = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    return n, h, v, opts, extra, ignored


@given(case=flce_case(), seed=SEEDS)
def test_fused_linear_cross_entropy(case, seed):
    n, h, v, opts, extra, ignored = case
    dtype = torch.float32
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(v, h, generator=gen) * 0.4).to(DEVICE, dtype)
    b = torch.randn(v, generator=gen).to(DEVICE, dtype) if extra["with_bias"] else None
    cw = (torch.rand(v, generator=gen) + 0.5).to(DEVICE) if extra["with_ce_weight"] else None
    t = torch.randint(0, v, (n,), generator=gen)
    ii = opts["ignore_index"]
    if ii >= 0:  # an in-vocab ignore_index: only the rows drawn as ignored carry it
        t[t == ii] = (ii + 1) % v if v > 1 else 0
        if v == 1:
            ignored = [True] * n
    t[torch.tensor(ignored)] = ii
    reduction = opts["reduction"]
    g = (torch.randn(n, generator=gen) if reduction == "none" else torch.tensor(0.7)).to(DEVICE, dtype)
    shape = (1, n) if extra["leading_3d"] else (n,)  # x as (1, N, H): the loss keeps the leading shape
    xs, ts, gs = x.reshape(*shape, h), t.reshape(shape).to(DEVICE), (g.reshape(shape) if reduction == "none" else g)

    xl, wl, bl = leaf(xs), leaf(w), leaf(b)
    loss, z = liger_torch.fused_linear_cross_entropy(xl, wl, ts, bl, cw, return_z_loss=True,
                                                     chunk_size=extra["chunk_size"], **opts)
    dx, dw, db = grads(loss, gs.clone(), [xl, wl, bl])
    xr, wr, br = leaf(xs), leaf(w), leaf(b)  # fp32 leaves: the reference rounds the logits to x's dtype
    loss_ref, z_ref = flce_reference(xr, wr, ts, br, cw, **opts)
    if reduction == "none":
        loss_ref, z_ref = loss_ref.reshape(shape), z_ref.reshape(shape)
    dx_ref, dw_ref, db_ref = grads(loss_ref, gs.double(), [xr, wr, br])

    assert loss.dtype == dtype and loss.shape == loss_ref.shape and dx.shape == xs.shape
    assert_close(loss, loss_ref, dtype, "loss")
    assert_close(z, z_ref, dtype, "z_loss")
    scale = n if reduction == "mean" else 1.0  # the mean's gradients are ~1/N: compare them scaled up
    for name, got, want in (("dx", dx, dx_ref), ("dweight", dw, dw_ref), ("dbias", db, db_ref)):
        if want is None:
            assert got is None
            continue
        assert got.dtype == dtype, name
        widen = 1.0 if name == "dx" else n ** 0.5  # as test_fused_linear_cross_entropy_torch: N terms per element
        assert_close(got * scale, want * scale, dtype, name, scale=widen)
    keep = (ts != ii)
    assert torch.equal(dx[~keep], torch.zeros_like(dx[~keep])), "ignored rows must get exactly zero dx"


# ------------------------------------------------------------------------------------------------------- jax
JDTYPES = st.sampled_from([jnp.float32, jnp.bfloat16])
JLEAD = st.sampled_from([(1,), (2,), (5,), (9,), (2, 3), (1, 1)])


def jdraw(seed, shape, dtype, scale=1.0, shift=0.0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal(shape) * scale + shift, dtype), rng


@FEW
@given(lead=JLEAD, h=st.sampled_from(HIDDEN), dtype=JDTYPES,
       mode_offset=st.sampled_from([("llama", 0.0), ("llama", 0.5), ("gemma", 1.0), ("none", 0.0)]),
       with_scale=st.booleans(), seed=SEEDS)
def test_jax_rms_norm(lead, h, dtype, mode_offset, with_scale, seed):
    mode, offset = mode_offset
    eps = 1e-6
    x, rng = jdraw(seed, lead + (h,), dtype, scale=3.0)
    s = jnp.asarray(rng.standard_normal(h) * 0.5 + 1, dtype) if with_scale else None
    probe = jnp.asarray(rng.standard_normal(lead + (h,)), jnp.float32)
    ours = lambda a, w: liger_jax.rms_norm(a, w, epsilon=eps, offset=offset, casting_mode=mode)
    argnums = (0, 1) if with_scale else (0,)

    y = ours(x, s)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(f32(y), np.asarray(jrms_reference(x, s, eps, offset, mode)), dtype, "y")
    got = jax.grad(lambda a, w: jnp.sum(ours(a, w).astype(jnp.float32) * probe), argnums=argnums)(x, s)
    with x64():
        want = jax.grad(lambda a, w: jnp.sum(jrms_reference(a, w, eps, offset, mode) * probe),
                        argnums=argnums)(x, s)
    assert all(gr.dtype == dtype for gr in got)
    x64_ = torch.as_tensor(f32(x), dtype=torch.float64)
    rstd = torch.rsqrt(x64_.pow(2).mean(-1, keepdim=True) + eps)
    wg = torch.as_tensor(np.asarray(probe), dtype=torch.float64) * (
        1.0 if s is None else offset + torch.as_tensor(f32(s), dtype=torch.float64))
    row_scaled_close(f32(got[0]), np.asarray(want[0]), dtype, rstd, wg, "dx")
    if with_scale:
        rows = x.size // h
        assert_close(f32(got[1]), np.asarray(want[1]), dtype, "dscale", scale=max(1.0, rows ** 0.5))


@FEW
@given(lead=JLEAD, h=st.sampled_from(HIDDEN), dtype=JDTYPES,
       params=st.sampled_from(["scale_bias", "scale", "bias", "none"]), seed=SEEDS)
def test_jax_layer_norm(lead, h, dtype, params, seed):
    eps = 1e-6
    x, rng = jdraw(seed, lead + (h,), dtype, scale=3.0, shift=0.5)
    s = jnp.asarray(rng.standard_normal(h) * 0.5 + 1, dtype) if "scale" in params else None
    b = jnp.asarray(rng.standard_normal(h), dtype) if "bias" in params else None
    probe = jnp.asarray(rng.standard_normal(lead + (h,)), jnp.float32)
    argnums = (0,) + ((1,) if s is not None else ()) + ((2,) if b is not None else ())
    ours = lambda a, w, c: liger_jax.layer_norm(a, w, c, epsilon=eps)

    y = ours(x, s, b)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(f32(y), np.asarray(jln_reference(x, s, b, eps)), dtype, "y")
    got = jax.grad(lambda a, w, c: jnp.sum(ours(a, w, c).astype(jnp.float32) * probe), argnums=argnums)(x, s, b)
    with x64():
        want = jax.grad(lambda a, w, c: jnp.sum(jln_reference(a, w, c, eps) * probe), argnums=argnums)(x, s, b)
    assert all(gr.dtype == dtype for gr in got)
    x64_ = torch.as_tensor(f32(x), dtype=torch.float64)
    rstd = torch.rsqrt(x64_.var(-1, unbiased=False, keepdim=True) + eps)
    wg = torch.as_tensor(np.asarray(probe), dtype=torch.float64) * (
        1.0 if s is None else torch.as_tensor(f32(s), dtype=torch.float64))
    row_scaled_close(f32(got[0]), np.asarray(want[0]), dtype, rstd, wg, "dx")
    rows = x.size // h
    for gr, wa, num in zip(got[1:], want[1:], argnums[1:]):
        assert_close(f32(gr), np.asarray(wa), dtype, "dscale" if num == 1 else "dbias", scale=max(1.0, rows ** 0.5))


@FEW
@given(lead=JLEAD, h=st.sampled_from(HIDDEN), dtype=JDTYPES, act=st.sampled_from(list(JACTS)), seed=SEEDS)
def test_jax_glu(lead, h, dtype, act, seed):
    a, rng = jdraw(seed, lead + (h,), dtype, scale=3.0)
    b = jnp.asarray(rng.standard_normal(lead + (h,)), dtype)
    probe = jnp.asarray(rng.standard_normal(lead + (h,)), jnp.float32)
    ours, ref = JACTS[act]
    c = ours(a, b)
    assert c.dtype == dtype and c.shape == a.shape
    da, db = jax.grad(lambda u, v: jnp.sum(ours(u, v).astype(jnp.float32) * probe), argnums=(0, 1))(a, b)
    assert da.dtype == db.dtype == dtype
    with x64():
        a64, b64 = a.astype(jnp.float64), b.astype(jnp.float64)
        c_ref = ref(a64, b64)
        da_ref, db_ref = jax.grad(lambda u, v: jnp.sum(ref(u, v) * probe), argnums=(0, 1))(a64, b64)
    for got, want, name in ((c, c_ref, "c"), (da, da_ref, "da"), (db, db_ref, "db")):
        assert_close(f32(got), np.asarray(want), dtype, f"{act} {name}")


@FEW
@given(lead=JLEAD, h=st.sampled_from(HIDDEN), out=st.sampled_from([1, 5, 16]), dtype=JDTYPES,
       act=st.sampled_from(list(JLINEAR_ACTS)), bias=st.booleans(), seed=SEEDS)
def test_jax_glu_linear(lead, h, out, dtype, act, bias, seed):
    """swiglu_linear / geglu_linear with the rematerialised product."""
    a, rng = jdraw(seed, lead + (h,), dtype, scale=3.0)
    b = jnp.asarray(rng.standard_normal(lead + (h,)), dtype)
    kernel = jnp.asarray(rng.standard_normal((h, out)) / np.sqrt(h), dtype)
    bb = jnp.asarray(rng.standard_normal(out), dtype) if bias else None
    probe = jnp.asarray(rng.standard_normal(lead + (out,)), jnp.float32)
    check_jax_gated_linear(act, a, b, kernel, bb, probe)


@st.composite
def jce_case(draw):
    lead = draw(st.sampled_from([(1,), (3,), (7,), (2, 3)]))
    v = draw(st.sampled_from(HIDDEN))
    opts = ce_options(draw, v)
    n = int(np.prod(lead))
    ignored = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    return lead, v, opts, draw(st.booleans()), ignored


@FEW
@given(case=jce_case(), dtype=JDTYPES, seed=SEEDS)
def test_jax_cross_entropy(case, dtype, seed):
    lead, v, opts, with_weight, ignored = case
    logits, rng = jdraw(seed, lead + (v,), dtype, scale=4.0)
    labels = rng.integers(0, v, lead)
    ii = opts["ignore_index"]
    if ii >= 0:
        labels[labels == ii] = (ii + 1) % v if v > 1 else 0
        if v == 1:
            ignored = [True] * len(ignored)
    labels[np.asarray(ignored).reshape(lead)] = ii
    labels = jnp.asarray(labels, jnp.int32)
    weight = jnp.asarray(rng.random(v) + 0.5, jnp.float32) if with_weight else None
    reduction = opts["reduction"]
    probe = jnp.asarray(rng.standard_normal(lead), jnp.float32) if reduction == "none" else jnp.float32(0.7)

    def ours(x):
        return liger_jax.cross_entropy(x, labels, weight=weight, return_z_loss=True, **opts)

    loss, z = ours(logits)
    loss_ref, z_ref = jce_reference(logits, labels, weight, **opts)
    assert loss.dtype == dtype and loss.shape == loss_ref.shape
    assert_close(f32(loss), np.asarray(loss_ref), dtype, "loss")
    assert_close(f32(z), np.asarray(z_ref), dtype, "z_loss")
    grad = jax.grad(lambda x: jnp.sum(ours(x)[0].astype(jnp.float32) * probe))(logits)
    with x64():
        grad_ref = jax.grad(lambda x: jnp.sum(jce_reference(x, labels, weight, **opts)[0] * probe))(
            logits.astype(jnp.float64))
    assert grad.dtype == dtype
    scale = float(np.prod(lead)) if reduction == "mean" else 1.0  # the mean's gradient is ~1/rows
    assert_close(f32(grad) * scale, np.asarray(grad_ref) * scale, dtype, "dlogits")
    dropped = np.asarray(labels) == ii
    assert np.array_equal(f32(grad)[dropped], np.zeros_like(f32(grad)[dropped])), "ignored rows: zero gradient"

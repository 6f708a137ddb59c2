"""Property-based sweeps (hypothesis) of liger_torch's rms_norm, layer_norm, swiglu/geglu (and their *_linear
forms) and cross_entropy.

Each example draws a shape (1 row, odd and prime sizes), a dtype, the function's options and a memory layout
(contiguous, offset into a bigger buffer, row slice of a wider buffer, strided columns, transposed leading
axes), then checks the forward and every gradient against the float64 references of the per-function test
modules, within helpers' dtype tolerance. The tensors' values come from a torch generator seeded by a drawn
integer, so hypothesis' falsifying example (printed on failure) reproduces the whole input.
"""

import torch
from hypothesis import given
from hypothesis import strategies as st

import liger_torch
from property_helpers import device
from helpers import assert_close
from test_cross_entropy_torch import reference as ce_reference
from test_layer_norm_torch import reference as ln_reference
from test_rms_norm_torch import reference as rms_reference
from test_swiglu_torch import ACTS, LINEAR_ACTS, check_gated_linear

DEVICE = device()

HIDDEN = [1, 2, 3, 7, 31, 64, 97, 123, 257]
DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])
SEEDS = st.integers(0, 2**31 - 1)
LAYOUTS = ["contiguous", "offset", "row_slice", "strided_columns", "transposed_leading"]


@st.composite
def leading_and_layout(draw, layouts=LAYOUTS):
    """(leading shape, layout): 1..9 rows as (r,) or (a, b); the transposed layout needs two leading axes."""
    layout = draw(st.sampled_from(layouts))
    if layout == "transposed_leading" or draw(st.booleans()):
        lead = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    else:
        lead = (draw(st.integers(1, 9)),)
    pad = draw(st.integers(1, 5))  # how far the view sits inside its buffer
    return lead, layout, pad


def make(gen, lead, h, dtype, layout, pad, scale=1.0, shift=0.0):
    """A (*lead, h) tensor of dtype on DEVICE in the given layout (a view of a bigger buffer where it says)."""
    def buf(*shape):
        return (torch.randn(shape, generator=gen) * scale + shift).to(DEVICE, dtype)

    n = 1
    for d in lead:
        n *= d
    if layout == "contiguous":
        x = buf(*lead, h)
    elif layout == "offset":  # storage offset: the data pointer is not aligned
        x = buf(n * h + 2 * pad)[pad:pad + n * h].view(*lead, h)
    elif layout == "row_slice":  # rows of a wider buffer
        x = buf(*lead, h + 2 * pad)[..., pad:pad + h]
    elif layout == "strided_columns":
        x = buf(*lead, h * (pad + 1))[..., ::pad + 1]
    else:
        assert layout == "transposed_leading" and len(lead) == 2
        x = buf(lead[1], lead[0], h).transpose(0, 1)
    assert x.shape == (*lead, h)
    return x.detach()  # detach keeps strides and storage offset: the kernel sees the view itself


def grads(y, g, leaves):
    """d(y . g) / d leaf for each leaf that is not None (None stays None)."""
    live = [t for t in leaves if t is not None]
    got = iter(torch.autograd.grad(y, live, g))
    return [None if t is None else next(got) for t in leaves]


def assert_dx_close(dx, dx_ref, dtype, rstd, wg, name="dx"):
    """dx of a normalisation is a difference of terms of size rstd * |w * dy| (row-wise): where a row's spread is
    tiny (rstd large: hidden 2 with two close values, hidden 1 near 0), fp32 rounding of those terms, not a bug,
    dominates the result, and torch's own fp32 kernels err as much. Compare in units of that row scale where it
    exceeds 1 (unchanged elsewhere)."""
    row = (rstd * wg.abs().amax(-1, keepdim=True)).clamp(min=1.0)
    assert_close(dx.double() / row, dx_ref / row, dtype, name)


def leaf(t):
    return None if t is None else t.detach().requires_grad_(True)


def ref_leaf(t):
    return None if t is None else t.detach().double().requires_grad_(True)


# ---------------------------------------------------------------------------------------------------- rms_norm
@given(shape=leading_and_layout(), h=st.sampled_from(HIDDEN), dtype=DTYPES,
       mode_offset=st.sampled_from([("llama", 0.0), ("llama", 0.5), ("gemma", 1.0), ("gemma", 0.0),
                                    ("none", 0.0), ("none", 1.0)]),
       with_weight=st.booleans(), eps=st.sampled_from([1e-6, 1e-5]), seed=SEEDS)
def test_rms_norm(shape, h, dtype, mode_offset, with_weight, eps, seed):
    (lead, layout, pad), (mode, offset) = shape, mode_offset
    gen = torch.Generator().manual_seed(seed)
    x = make(gen, lead, h, dtype, layout, pad, scale=3.0)
    w = (torch.randn(h, generator=gen) * 0.5 + 1).to(DEVICE, dtype) if with_weight else None
    g = torch.randn(x.shape, generator=gen).to(DEVICE, dtype)

    xl, wl = leaf(x), leaf(w)
    y = liger_torch.rms_norm(xl, wl, eps, offset, mode)
    dx, dw = grads(y, g.clone(), [xl, wl])  # clone: the backward may write dx over the incoming gradient
    xr, wr = ref_leaf(x), ref_leaf(w)
    y_ref = rms_reference(xr, wr, eps, offset, mode)
    dx_ref, dw_ref = grads(y_ref, g.double(), [xr, wr])

    assert y.shape == x.shape and y.dtype == dtype and dx.dtype == dtype
    assert_close(y, y_ref, dtype, "y")
    x64 = x.double()
    rstd = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    wg = g.double() * (1.0 if w is None else (offset + w.double()))
    assert_dx_close(dx, dx_ref, dtype, rstd, wg)
    if with_weight:
        rows = x.numel() // h  # dw sums one rounded term per row
        assert dw.dtype == dtype
        assert_close(dw, dw_ref, dtype, "dw", scale=max(1.0, rows ** 0.5))


# -------------------------------------------------------------------------------------------------- layer_norm
@given(shape=leading_and_layout(), h=st.sampled_from(HIDDEN), dtype=DTYPES,
       params=st.sampled_from(["weight_bias", "weight", "bias", "none"]), eps=st.sampled_from([1e-5, 1e-6]),
       seed=SEEDS)
def test_layer_norm(shape, h, dtype, params, eps, seed):
    lead, layout, pad = shape
    gen = torch.Generator().manual_seed(seed)
    x = make(gen, lead, h, dtype, layout, pad, scale=3.0, shift=0.5)
    w = (torch.randn(h, generator=gen) * 0.5 + 1).to(DEVICE, dtype) if "weight" in params else None
    b = torch.randn(h, generator=gen).to(DEVICE, dtype) if "bias" in params else None
    g = torch.randn(x.shape, generator=gen).to(DEVICE, dtype)

    xl, wl, bl = leaf(x), leaf(w), leaf(b)
    y = liger_torch.layer_norm(xl, wl, bl, eps)
    dx, dw, db = grads(y, g.clone(), [xl, wl, bl])
    xr, wr, br = ref_leaf(x), ref_leaf(w), ref_leaf(b)
    y_ref = ln_reference(xr, wr, br, eps)
    dx_ref, dw_ref, db_ref = grads(y_ref, g.double(), [xr, wr, br])

    assert y.shape == x.shape and y.dtype == dtype and dx.dtype == dtype
    assert_close(y, y_ref, dtype, "y")
    rstd = torch.rsqrt(x.double().var(-1, unbiased=False, keepdim=True) + eps)
    assert_dx_close(dx, dx_ref, dtype, rstd, g.double() * (1.0 if w is None else w.double()))
    rows = x.numel() // h
    for got, want, name in ((dw, dw_ref, "dw"), (db, db_ref, "db")):
        if got is not None:
            assert got.dtype == dtype
            assert_close(got, want, dtype, name, scale=max(1.0, rows ** 0.5))


# ------------------------------------------------------------------------------------------------ swiglu/geglu
@given(shape=leading_and_layout(LAYOUTS + ["chunked"]), h=st.sampled_from(HIDDEN), dtype=DTYPES,
       act=st.sampled_from(list(ACTS)), seed=SEEDS)
def test_glu(shape, h, dtype, act, seed):
    lead, layout, pad = shape
    gen = torch.Generator().manual_seed(seed)
    if layout == "chunked":  # gate and up halves of one fused projection
        fused = (torch.randn(*lead, 2 * h, generator=gen) * 3).to(DEVICE, dtype)
        a, b = (t.detach() for t in fused.chunk(2, dim=-1))
        b = b / 3
    else:
        a = make(gen, lead, h, dtype, layout, pad, scale=3.0)
        b = make(gen, lead, h, dtype, layout, pad)
    g = torch.randn(a.shape, generator=gen).to(DEVICE, dtype)
    ours, ref = ACTS[act]

    al, bl = leaf(a), leaf(b)
    c = ours(al, bl)
    da, db = grads(c, g.clone(), [al, bl])
    ar, br = ref_leaf(a), ref_leaf(b)
    c_ref = ref(ar, br)
    da_ref, db_ref = grads(c_ref, g.double(), [ar, br])

    assert c.shape == a.shape and c.dtype == dtype and da.dtype == db.dtype == dtype
    assert_close(c, c_ref, dtype, f"{act} c")
    assert_close(da, da_ref, dtype, f"{act} da")
    assert_close(db, db_ref, dtype, f"{act} db")


@given(shape=leading_and_layout(), h=st.sampled_from(HIDDEN), out=st.sampled_from([1, 5, 16, 37]), dtype=DTYPES,
       act=st.sampled_from(list(LINEAR_ACTS)), bias=st.booleans(), seed=SEEDS)
def test_glu_linear(shape, h, out, dtype, act, bias, seed):
    """swiglu_linear / geglu_linear: gate, down projection and the recomputing backward, any input layout."""
    lead, layout, pad = shape
    gen = torch.Generator().manual_seed(seed)
    a = make(gen, lead, h, dtype, layout, pad, scale=3.0)
    b = make(gen, lead, h, dtype, layout, pad)
    w = (torch.randn(out, h, generator=gen) * h ** -0.5).to(DEVICE, dtype)
    bb = torch.randn(out, generator=gen).to(DEVICE, dtype) if bias else None
    g = torch.randn(*lead, out, generator=gen).to(DEVICE, dtype)
    check_gated_linear(act, a, b, w, bb, g, dtype)


# ----------------------------------------------------------------------------------------------- cross_entropy
def ce_options(draw, v: int) -> dict:
    """The cross-entropy options (every kernel path, the plain one drawn more often) for a vocabulary of v."""
    ignore_index = draw(st.sampled_from([-100, "in_vocab"]))
    ignore_index = draw(st.integers(0, v - 1)) if ignore_index == "in_vocab" else ignore_index
    return {
        "reduction": draw(st.sampled_from(["mean", "sum", "none"])),
        "ignore_index": ignore_index,
        "label_smoothing": draw(st.sampled_from([0.0, 0.0, 0.1, 0.37])),
        "lse_square_scale": draw(st.sampled_from([0.0, 0.0, 1e-3, 1e-2])),
        "softcap": draw(st.sampled_from([None, None, 3.0, 30.0])),
    }


@st.composite
def ce_case(draw):
    n = draw(st.integers(1, 9))
    v = draw(st.sampled_from(HIDDEN))
    layout = draw(st.sampled_from(["contiguous", "offset", "row_slice", "strided_columns", "transposed"]))
    pad = draw(st.integers(1, 5))
    opts = ce_options(draw, v)
    ignored = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    return n, v, layout, pad, opts, draw(st.booleans()), ignored


def ce_logits(gen, n, v, dtype, layout, pad):
    def buf(*shape):
        return (torch.randn(shape, generator=gen) * 4).to(DEVICE, dtype)

    if layout == "contiguous":
        x = buf(n, v)
    elif layout == "offset":
        x = buf(n * v + 2 * pad)[pad:pad + n * v].view(n, v)
    elif layout == "row_slice":
        x = buf(n, v + 2 * pad)[:, pad:pad + v]
    elif layout == "strided_columns":
        x = buf(n, v * (pad + 1))[:, ::pad + 1]
    else:
        assert layout == "transposed"
        x = buf(v, n).t()
    return x.detach()


@given(case=ce_case(), dtype=DTYPES, seed=SEEDS)
def test_cross_entropy(case, dtype, seed):
    n, v, layout, pad, opts, with_weight, ignored = case
    gen = torch.Generator().manual_seed(seed)
    x = ce_logits(gen, n, v, dtype, layout, pad)
    t = torch.randint(0, v, (n,), generator=gen)
    if opts["ignore_index"] >= 0:  # an in-vocab ignore_index: only the rows drawn as ignored may carry it
        t[t == opts["ignore_index"]] = (opts["ignore_index"] + 1) % v if v > 1 else 0
        if v == 1:
            ignored = [True] * n  # the only class is the ignored one
    t[torch.tensor(ignored)] = opts["ignore_index"]
    t = t.to(DEVICE)
    weight = (torch.rand(v, generator=gen) + 0.5).to(DEVICE) if with_weight else None
    reduction = opts["reduction"]
    g = (torch.randn(n, generator=gen) if reduction == "none" else torch.tensor(0.7)).to(DEVICE, dtype)

    xl = leaf(x)
    loss, z = liger_torch.cross_entropy(xl, t, weight, return_z_loss=True, **opts)
    (dx,) = grads(loss, g.clone(), [xl])
    xr = ref_leaf(x)
    loss_ref, z_ref = ce_reference(xr, t, weight, **opts)
    (dx_ref,) = grads(loss_ref, g.double(), [xr])

    assert loss.dtype == dtype and loss.shape == loss_ref.shape and dx.dtype == dtype
    assert_close(loss, loss_ref, dtype, "loss")
    assert_close(z, z_ref, dtype, "z_loss")
    # the mean's gradient is ~1/n per element: compare it scaled back up so the tolerance means something
    scale = n if reduction == "mean" else 1.0
    assert_close(dx * scale, dx_ref * scale, dtype, "dlogits")
    keep = (t != opts["ignore_index"]).to(dx.device)
    assert torch.equal(dx[~keep], torch.zeros_like(dx[~keep])), "ignored rows must get exactly zero gradient"

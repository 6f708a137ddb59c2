"""liger_torch.layer_norm / LayerNorm against torch.nn.functional.layer_norm in float64, forward and backward."""

import pytest
import torch
import torch.nn.functional as F

import liger_torch
from helpers import assert_close, non_contiguous

SHAPES = [(1, 64), (7, 123), (3, 5, 96), (2, 1000)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def reference(x, w, b, eps):
    """F.layer_norm on the (already rounded) inputs, every step in float64."""
    return F.layer_norm(x.double(), (x.shape[-1],), None if w is None else w.double(),
                        None if b is None else b.double(), eps)


def grads_of(fn, g, *tensors):
    leaves = [None if t is None else t.detach().clone().requires_grad_(True) for t in tensors]
    y = fn(*leaves)
    y.backward(g)
    return (y,) + tuple(None if t is None else t.grad for t in leaves)


def draw(seed, shape, dtype, param_dtype=None, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    param_dtype = param_dtype or dtype
    x = (torch.randn(shape, generator=gen) * 3 + 0.5).to(device, dtype)
    w = (torch.randn(shape[-1], generator=gen) * 0.5 + 1).to(device, param_dtype)
    b = torch.randn(shape[-1], generator=gen).to(device, param_dtype)
    g = torch.randn(shape, generator=gen).to(device, dtype)
    return x, w, b, g


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("params", ["weight_bias", "weight", "none"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_backward(shape, params, dtype, device, seed):
    x, w, b, g = draw(seed, shape, dtype, device=device)
    w = None if params == "none" else w
    b = b if params == "weight_bias" else None
    eps = 1e-5
    y, dx, dw, db = grads_of(lambda a, c, d: liger_torch.layer_norm(a, c, d, eps), g.clone(), x, w, b)
    y_ref, dx_ref, dw_ref, db_ref = grads_of(lambda a, c, d: reference(a, c, d, eps), g.double(), x, w, b)
    assert y.dtype == dtype and dx.dtype == dtype
    assert_close(y, y_ref, dtype, "y")
    assert_close(dx, dx_ref, dtype, "dx")
    # dw / db sum one term per row: allow the bound to grow with sqrt(rows).
    rows = x.numel() // shape[-1]
    if w is not None:
        assert dw.dtype == dtype
        assert_close(dw, dw_ref, dtype, "dw", scale=max(1.0, rows ** 0.5))
    if b is not None:
        assert db.dtype == dtype
        assert_close(db, db_ref, dtype, "db", scale=max(1.0, rows ** 0.5))


@pytest.mark.parametrize("chunk", [0, 256])
@pytest.mark.parametrize("n_cols", [4096, 1000])
def test_rows_far_from_zero_keep_fp32_accuracy(n_cols, chunk, device, seed):
    """fp32 rows whose mean is 2000x their spread: an fp32 sum of the row misses the mean by ~1e-4 of the spread,
    which the held-row kernel's refinement step (the centred values' own sum) removes, and the chunked one's
    Welford sums never incur (``chunk`` 256; 0 holds the row). The forward and its statistics
    against float64; full rows (4096 columns: no masked column) and masked ones. The backward starts from the
    saved fp32 mean, whose own rounding (up to half an ulp of 2000, 6e-5 of the spread) moves every xhat and so
    dx by up to ~1e-5 of dx's scale (torch's LayerNorm saves the same): dx is checked against the float64
    backward of those saved statistics, which holds the backward's own arithmetic to fp32 accuracy."""
    from liger_core import layer_norm as core
    from liger_torch._launch import info, run_plan

    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(5, n_cols, generator=gen, dtype=torch.float64) + 2000.0).float().to(device)
    w = (torch.rand(n_cols, generator=gen) + 0.5).to(device)
    b = torch.randn(n_cols, generator=gen).to(device)
    g = torch.randn(5, n_cols, generator=gen).to(device)
    eps = 1e-5
    y, mean, rstd = run_plan(core.forward_plan(info(x), info(w), info(b), eps=eps, chunk=chunk), x=x, weight=w,
                             bias=b)
    xd = x.double()
    assert_close(y, reference(xd, w.double(), b.double(), eps), torch.float32, "y")
    assert_close(mean, xd.mean(-1), torch.float32, "mean")
    assert_close(rstd, (xd.var(-1, unbiased=False) + eps).rsqrt(), torch.float32, "rstd")
    (dx, _, _) = run_plan(core.backward_plan(info(g), info(x), info(w), info(b), num_sms=3, in_place=False),
                          dy=g, x=x, weight=w, mean=mean, rstd=rstd)
    xhat = (xd - mean.double()[:, None]) * rstd.double()[:, None]
    dxhat = g.double() * w.double()
    dx_ref = rstd.double()[:, None] * (dxhat - dxhat.mean(-1, keepdim=True)
                                       - xhat * (dxhat * xhat).mean(-1, keepdim=True))
    assert_close(dx, dx_ref, torch.float32, "dx")


def test_bias_without_weight(device, seed):
    x, _, b, g = draw(seed, (7, 123), torch.float32, device=device)
    y, dx, _, db = grads_of(lambda a, c, d: liger_torch.layer_norm(a, c, d), g.clone(), x, None, b)
    y_ref, dx_ref, _, db_ref = grads_of(lambda a, c, d: reference(a, c, d, 1e-5), g.double(), x, None, b)
    for got, want, name in ((y, y_ref, "y"), (dx, dx_ref, "dx"), (db, db_ref, "db")):
        assert_close(got, want, torch.float32, name, scale=3.0 if name == "db" else 1.0)


def test_mixed_dtypes_keep_x_dtype(device, seed):
    """bf16 activations with fp32 parameters (as under autocast): y and dx in bf16, dw and db in fp32."""
    x, w, b, g = draw(seed, (7, 123), torch.bfloat16, param_dtype=torch.float32, device=device)
    y, dx, dw, db = grads_of(lambda a, c, d: liger_torch.layer_norm(a, c, d), g.clone(), x, w, b)
    y_ref, dx_ref, dw_ref, db_ref = grads_of(lambda a, c, d: reference(a, c, d, 1e-5), g.double(), x, w, b)
    assert y.dtype == dx.dtype == torch.bfloat16 and dw.dtype == db.dtype == torch.float32
    assert_close(y, y_ref, torch.bfloat16, "y")
    assert_close(dx, dx_ref, torch.bfloat16, "dx")
    assert_close(dw, dw_ref, torch.float32, "dw", scale=3.0)
    assert_close(db, db_ref, torch.float32, "db", scale=3.0)


def test_large_mean_is_accurate(device, seed):
    """A row mean far above its spread: E[x^2] - E[x]^2 in fp32 would lose most digits of the variance."""
    x, w, b, g = draw(seed, (7, 123), torch.float32, device=device)
    x = x + 300.0
    y, dx, dw, db = grads_of(lambda a, c, d: liger_torch.layer_norm(a, c, d), g.clone(), x, w, b)
    y_ref, dx_ref, dw_ref, db_ref = grads_of(lambda a, c, d: reference(a, c, d, 1e-5), g.double(), x, w, b)
    # fp32 inputs near 300 carry ~2e-5 absolute rounding; the result is ~300x more sensitive than near 0.
    assert_close(y, y_ref, torch.float32, "y", scale=4.0)
    assert_close(dx, dx_ref, torch.float32, "dx", scale=4.0)
    assert_close(dw, dw_ref, torch.float32, "dw", scale=4.0)


@pytest.mark.parametrize("layout", ["row_slice", "transposed_leading", "strided_columns"])
def test_non_contiguous_input(layout, device, seed):
    gen = torch.Generator().manual_seed(seed)
    x = non_contiguous(layout, gen, device)
    w = torch.randn(123, generator=gen).to(device)
    b = torch.randn(123, generator=gen).to(device)
    g = torch.randn(x.shape, generator=gen).to(device).transpose(0, -1).contiguous().transpose(0, -1)
    y, dx, dw, db = grads_of(lambda a, c, d: liger_torch.layer_norm(a, c, d), g, x, w, b)
    y_ref, dx_ref, dw_ref, db_ref = grads_of(lambda a, c, d: reference(a, c, d, 1e-5), g.double(), x, w, b)
    assert_close(y, y_ref, torch.float32, "y")
    assert_close(dx, dx_ref, torch.float32, "dx")
    assert_close(dw, dw_ref, torch.float32, "dw", scale=3.0)
    assert_close(db, db_ref, torch.float32, "db", scale=3.0)


def test_backward_leaves_incoming_grad_alone(device, seed):
    """The gradient of y may be shared with another branch (a residual sum): it must not be overwritten."""
    x, w, b, g = draw(seed, (7, 123), torch.float32, device=device)
    x.requires_grad_(True)
    g_in = g.clone()
    liger_torch.layer_norm(x, w, b).backward(g_in)
    assert torch.equal(g_in, g)


def test_expanded_grad(device, seed):
    """y.sum().backward() hands in a stride-0 gradient."""
    x, w, b, _ = draw(seed, (7, 123), torch.float32, device=device)
    x.requires_grad_(True)
    liger_torch.layer_norm(x, w, b).sum().backward()
    ref = x.detach().double().requires_grad_(True)
    reference(ref, w, b, 1e-5).sum().backward()
    assert_close(x.grad, ref.grad, torch.float32, "dx")


def test_bitwise_deterministic(device, seed):
    x, w, b, g = draw(seed, (64, 257), torch.float32, device=device)
    runs = [grads_of(lambda a, c, d: liger_torch.layer_norm(a, c, d), g.clone(), x, w, b) for _ in range(2)]
    for first, second in zip(*runs):
        assert torch.equal(first, second)


@pytest.mark.parametrize("kwargs", [{}, {"bias": False}, {"elementwise_affine": False}])
def test_module_is_drop_in_for_nn_layer_norm(kwargs, device, seed):
    theirs = torch.nn.LayerNorm(96, eps=1e-6, **kwargs).to(device)
    ours = liger_torch.LayerNorm(96, eps=1e-6, **kwargs).to(device)
    assert set(ours.state_dict()) == set(theirs.state_dict())
    assert ours.normalized_shape == theirs.normalized_shape and ours.eps == theirs.eps
    assert (ours.weight is None) == (theirs.weight is None) and (ours.bias is None) == (theirs.bias is None)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(3, 5, 96, generator=torch.Generator().manual_seed(seed)).to(device).requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    y, y_ref = ours(x), theirs(x_ref)
    assert_close(y, y_ref, torch.float32, "y", scale=2.0)
    (y ** 2).sum().backward()
    (y_ref ** 2).sum().backward()
    assert_close(x.grad, x_ref.grad, torch.float32, "dx", scale=4.0)
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert_close(p.grad, q.grad, torch.float32, name, scale=10.0)


def test_module_defaults_and_shape_check(device):
    norm = liger_torch.LayerNorm(8)
    assert norm.eps == 1e-5 and norm.normalized_shape == (8,)
    assert torch.equal(norm.weight, torch.ones(8)) and torch.equal(norm.bias, torch.zeros(8))
    assert liger_torch.LayerNorm((8,)).normalized_shape == (8,)
    with pytest.raises(ValueError, match="hidden_size"):
        liger_torch.LayerNorm((4, 8))
    with pytest.raises(ValueError, match="last dimension must be 8"):
        norm.to(device)(torch.randn(2, 7, device=device))


@pytest.mark.parametrize("bad,error,match", [
    (lambda d: (torch.randn(4, 8, device=d), torch.randn(7, device=d), None), ValueError, "weight must have shape"),
    (lambda d: (torch.randn(4, 8, device=d), torch.randn(8, device=d), torch.randn(2, 8, device=d)),
     ValueError, "bias must have shape"),
    (lambda d: (torch.ones(4, 8, dtype=torch.int32, device=d), None, None), TypeError, "x must have a floating"),
    (lambda d: (torch.randn(4, 8, device=d), None, torch.ones(8, dtype=torch.int64, device=d)), TypeError, "bias"),
    (lambda d: (torch.randn(4, 8, device=d), torch.ones(8, dtype=torch.float64, device=d), None), TypeError,
     "weight"),
    (lambda d: (torch.randn(0, 8, device=d), None, None), ValueError, "x must not be empty"),
    (lambda d: (torch.tensor(3.0, device=d), None, None), ValueError, "x must have at least one dimension"),
    (lambda d: (torch.randn(4, 8, device=d), None, [0.0] * 8), TypeError, "bias must be a torch.Tensor"),
])
def test_bad_input_raises_before_launch(bad, error, match, device):
    x, w, b = bad(device)
    with pytest.raises(error, match=match):
        liger_torch.layer_norm(x, w, b)


def test_fp16_rounds_once_like_torch(device, seed):
    """fp16 (rounded to nearest in the interpreter too): y is torch's fp16 layer_norm bit for bit except where
    fp32 reduction order flips a rounding (< 1% of elements, by one ulp)."""
    x, w, b, _ = draw(seed, (64, 257), torch.float16, device=device)
    y, y_ref = liger_torch.layer_norm(x, w, b, 1e-5), F.layer_norm(x, (257,), w, b, 1e-5)
    exact = (y == y_ref).float().mean().item()
    assert exact >= 0.99, f"only {exact:.2%} of y is bitwise torch's"
    # one ulp, plus fp32 noise where the bias cancels the normalised term (y near 0)
    assert ((y.float() - y_ref.float()).abs() <= y_ref.float().abs() * 2 ** -10 + 1e-6).all()


@pytest.mark.parametrize("prefetch,block_m,reload", [(False, 1, False), (True, 1, False), (False, 4, False),
                                                   (True, 4, False), (False, 1, True), (False, 4, True),
                                                   (True, 2, True)])
def test_backward_launch_variants_agree(prefetch, block_m, reload, device, seed):
    """The backward's launch variants (prefetching the next tile or not, tile height; 3 programs over 37 rows,
    so tiles run past a program's last row) compute the same gradients."""
    from liger_core import layer_norm as core
    from liger_torch._launch import info, run_plan

    x, w, b, dy = draw(seed, (37, 123), torch.float32, device=device)
    _, mean, rstd = run_plan(core.forward_plan(info(x), info(w), info(b), eps=1e-5), x=x, weight=w, bias=b)
    plan = core.backward_plan(info(dy), info(x), info(w), info(b), num_sms=3, in_place=False, block_m=block_m,
                              prefetch=prefetch, reload=reload)
    dx, dw, db = run_plan(plan, dy=dy, x=x, weight=w, mean=mean, rstd=rstd)
    _, dx_ref, dw_ref, db_ref = grads_of(lambda a, c, d: reference(a, c, d, 1e-5), dy.double(), x, w, b)
    assert_close(dx, dx_ref, torch.float32, "dx")
    assert_close(dw, dw_ref, torch.float32, "dw", scale=3.0)
    assert_close(db, db_ref, torch.float32, "db", scale=3.0)


# The column-split backward of rows over rowwise.MAX_HELD_COLUMNS; ``column_block`` forces it on small rows (row
# sums swept in chunks of as many columns): several blocks with the last partial, one block a tile row, tiles of
# four rows, a folded leading axis, a single row, whole blocks only; and the default blocks just past the threshold.
SPLIT = [((37, 123), 32, None), ((5, 77), 16, 1), ((9, 300), 64, 4), ((2, 3, 40), 16, None), ((1, 17), 16, None),
         ((6, 64), 16, 2), ((2, 16400), None, None)]
PARAMS = {"weight_bias": (True, True), "weight": (True, False), "bias": (False, True), "none": (False, False)}


def column_split_grads(x, w, b, dy, column_block, block_m, in_place=False):
    from liger_core import layer_norm as core
    from liger_torch._launch import info, run_plan

    params = {k: v for k, v in (("weight", w), ("bias", b)) if v is not None}
    _, mean, rstd = run_plan(core.forward_plan(info(x), *(None if t is None else info(t) for t in (w, b)), eps=1e-5),
                             x=x, **params)
    plan = core.backward_plan(info(dy), info(x), *(None if t is None else info(t) for t in (w, b)), num_sms=3,
                              in_place=in_place, block_m=block_m, column_block=column_block)
    assert plan.launches[0].constexprs.get("CHUNK"), "the row sums come first"
    params.pop("bias", None)
    return run_plan(plan, dy=dy, x=x, mean=mean, rstd=rstd, **params)


@pytest.mark.parametrize("shape,column_block,block_m", SPLIT)
@pytest.mark.parametrize("params", list(PARAMS))
def test_column_split_backward_against_reference(shape, column_block, block_m, params, device, seed):
    """fp32 gradients of the column-split backward against the float64 reference; dx written over dy (the row
    sums read dy in a launch of their own, before any block writes over it)."""
    has_w, has_b = PARAMS[params]
    x, w, b, dy = draw(seed, shape, torch.float32, device=device)
    w, b = (w if has_w else None), (b if has_b else None)
    grads = column_split_grads(x, w, b, dy.clone(), column_block, block_m, in_place=True)
    _, dx_ref, dw_ref, db_ref = grads_of(lambda a, c, d: reference(a, c, d, 1e-5), dy.double(), x, w, b)
    want = [("dx", dx_ref, 1.0)] + [("dw", dw_ref, 3.0)] * has_w + [("db", db_ref, 3.0)] * has_b
    assert len(grads) == len(want)
    for got, (name, ref, scale) in zip(grads, want):
        assert_close(got, ref, torch.float32, name, scale=scale)


@pytest.mark.parametrize("shape,column_block,block_m", SPLIT[:3])
def test_column_split_backward_half_precision_matches_whole_rows(shape, column_block, block_m, device, seed):
    """bf16 gradients of the column-split backward within a rounding of the whole-row backward's (the same
    arithmetic but the row sums' order)."""
    from liger_core import layer_norm as core
    from liger_torch._launch import info, run_plan

    x, w, b, dy = draw(seed, shape, torch.bfloat16, device=device)
    split = column_split_grads(x, w, b, dy, column_block, block_m)
    _, mean, rstd = run_plan(core.forward_plan(info(x), info(w), info(b), eps=1e-5), x=x, weight=w, bias=b)
    whole = run_plan(core.backward_plan(info(dy), info(x), info(w), info(b), num_sms=3, in_place=False,
                                        column_block=0), dy=dy, x=x, weight=w, mean=mean, rstd=rstd)
    for got, want, name in zip(split, whole, ("dx", "dw", "db")):
        assert_close(got, want.double(), torch.bfloat16, name)


# Rows swept in chunks: the forward of rows over rowwise.MAX_HELD_COLUMNS; ``chunk`` forces it on small rows:
# several chunks with the last partial, whole chunks only, one column, one chunk wider than the row.
CHUNKED = [((7, 123), 16), ((3, 64), 16), ((2, 1), 16), ((5, 1000), 256), ((2, 3, 40), 64)]


@pytest.mark.parametrize("shape,chunk", CHUNKED)
@pytest.mark.parametrize("params", ["weight_bias", "weight", "bias", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_forward_against_reference(shape, chunk, params, dtype, device, seed):
    from liger_core import layer_norm as core
    from liger_torch._launch import info, run_plan

    x, w, b, _ = draw(seed, shape, dtype, device=device)
    w = w if "weight" in params else None
    b = b if "bias" in params else None
    params = {k: v for k, v in (("weight", w), ("bias", b)) if v is not None}
    outs = [run_plan(core.forward_plan(info(x), *(None if t is None else info(t) for t in (w, b)), eps=1e-5,
                                       chunk=chunk, prefetch=prefetch), x=x, **params) for prefetch in (False, True)]
    for a, c in zip(*outs):  # the prefetch changes when loads are issued, not what is computed
        assert torch.equal(a, c)
    y, mean, rstd = outs[0]
    xd = x.double()
    assert y.dtype == dtype
    assert_close(y, reference(x, w, b, 1e-5), dtype, "y")
    assert_close(mean, xd.mean(-1), torch.float32, "mean")
    assert_close(rstd, (xd.var(-1, unbiased=False) + 1e-5).rsqrt(), torch.float32, "rstd")


@pytest.mark.parametrize("n_cols,dtype,chunk,warps,prefetch", [
    (20496, torch.bfloat16, 4096, 16, False), (24576, torch.bfloat16, 8192, 16, False),
    (28672, torch.bfloat16, 0, 16, False), (32768, torch.float32, 8192, 16, False),
    (65541, torch.float32, 16384, 16, True)])
def test_default_launch_by_width(n_cols, dtype, chunk, warps, prefetch, device, seed):
    """Past 16384 columns the forward's launch follows the row's width (layer_norm._CHUNKED_BY_WIDTH): chunks that
    grow with the row, bf16 rows of 28672-32768 columns held (``chunk`` 0; an fp32 row of 32768 goes in chunks:
    rowwise.held_rows_for), the widest with a 5-column partial last chunk. Each default is right on its width."""
    from liger_core import layer_norm as core
    from liger_torch._launch import info, run_plan

    x, w, b, _ = draw(seed, (2, n_cols), dtype, device=device)
    plan = core.forward_plan(info(x), info(w), info(b), eps=1e-5)
    (launch,) = plan.launches
    assert (launch.constexprs.get("CHUNK", 0), launch.num_warps) == (chunk, warps)
    assert launch.constexprs.get("PREFETCH", False) == prefetch
    y, mean, rstd = run_plan(plan, x=x, weight=w, bias=b)
    assert_close(y, reference(x, w, b, 1e-5), dtype, "y")
    assert_close(rstd, (x.double().var(-1, unbiased=False) + 1e-5).rsqrt(), torch.float32, "rstd")


@pytest.mark.parametrize("outlier", [1e4, -3e3])
def test_chunked_forward_outliers(outlier, device, seed):
    """Outliers of 1e3-1e4 spreads (LLM activations have such channels) in a quarter of the chunked forward's
    lanes, at their first value (chunk 0, so also the row's shift), and in one lane's later values; fp32
    statistics and y against float64. The mean's error is measured against the row's spread: the sums run over
    values of the outliers' size, whose rounding (~1e-3 at 1e4) no fp32 mean of ~200 escapes, and y sees the
    mean only relative to the spread."""
    from liger_core import layer_norm as core
    from liger_torch._launch import info, run_plan

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 1000, generator=gen, dtype=torch.float64)
    x[:, 0:64:4] = outlier * (1 + torch.rand(3, 16, generator=gen, dtype=torch.float64))
    x[:, 1 + 256 * 2] = -outlier
    x = x.float().to(device)
    w, b = (torch.rand(1000, generator=gen) + 0.5).to(device), torch.randn(1000, generator=gen).to(device)
    y, mean, rstd = run_plan(core.forward_plan(info(x), info(w), info(b), eps=1e-5, chunk=256), x=x, weight=w,
                             bias=b)
    xd = x.double()
    assert_close(y, reference(xd, w.double(), b.double(), 1e-5), torch.float32, "y")
    assert_close(mean, xd.mean(-1), torch.float32, "mean", magnitude=xd.std(-1))
    assert_close(rstd, (xd.var(-1, unbiased=False) + 1e-5).rsqrt(), torch.float32, "rstd")

@pytest.mark.parametrize("shape,chunk", [((7, 123), 16), ((5, 1000), 256)])
@pytest.mark.parametrize("rows", [2, 4])
def test_chunked_forward_several_rows_a_program(shape, chunk, rows, device, seed):
    """``block_m`` rows a program (w and b loaded once for them): 7 and 5 rows leave the last program short, its
    extra rows the last one again; every row against the reference."""
    from liger_core import layer_norm as core
    from liger_torch._launch import info, run_plan

    x, w, b, _ = draw(seed, shape, torch.bfloat16, device=device)
    plan = core.forward_plan(info(x), info(w), info(b), eps=1e-5, chunk=chunk, block_m=rows)
    assert plan.launches[0].grid == (-(-shape[0] // rows),)
    y, mean, rstd = run_plan(plan, x=x, weight=w, bias=b)
    xd = x.double()
    assert_close(y, reference(x, w, b, 1e-5), torch.bfloat16, "y")
    assert_close(mean, xd.mean(-1), torch.float32, "mean")
    assert_close(rstd, (xd.var(-1, unbiased=False) + 1e-5).rsqrt(), torch.float32, "rstd")

@pytest.mark.parametrize("n_cols", [16400, 28680, 32800])
def test_rows_over_16384_columns_through_autograd(n_cols, device, seed):
    """16400 columns: the forward sweeps five 4096-column chunks, the last partial; 28680: it holds the row (a
    32768-wide block at 16 warps, w and b loaded after the reductions); 32800: five 8192-column chunks, the last
    partial (test_default_launch_by_width checks the launches). The op through autograd against the reference."""
    x, w, b, g = draw(seed, (2, n_cols), torch.bfloat16, device=device)
    y, dx, dw, db = grads_of(lambda a, c, d: liger_torch.layer_norm(a, c, d), g.clone(), x, w, b)
    y_ref, dx_ref, dw_ref, db_ref = grads_of(lambda a, c, d: reference(a, c, d, 1e-5), g.double(), x, w, b)
    for got, want, name in ((y, y_ref, "y"), (dx, dx_ref, "dx"), (dw, dw_ref, "dw"), (db, db_ref, "db")):
        assert_close(got, want, torch.bfloat16, name, scale=2 ** 0.5 if name in ("dw", "db") else 1.0)


@pytest.mark.parametrize("has_weight,has_bias", [(True, True), (True, False), (False, True)])
def test_a_row_held_past_16384_columns_loads_its_parameters_after_the_reductions(has_weight, has_bias, device,
                                                                                  seed):
    """``chunk=0`` holds a 16400-column row (a 32768-wide block at 16 warps); past 16384 columns the kernel loads w
    and b after the row's reductions (held across them they spilled): y, mean and rstd against the reference."""
    from liger_core import layer_norm as core
    from liger_torch._launch import info, run_plan

    x, w, b, _ = draw(seed, (3, 16400), torch.bfloat16, device=device)
    w, b = (w if has_weight else None), (b if has_bias else None)
    plan = core.forward_plan(info(x), info(w) if has_weight else None, info(b) if has_bias else None, eps=1e-5,
                             chunk=0)
    launch = plan.launches[0]
    assert launch.kernel.fn.__name__ == "_layer_norm_forward_kernel" and launch.constexprs["BLOCK_N"] == 32768
    assert launch.num_warps == 16
    y, mean, rstd = run_plan(plan, x=x, **({"weight": w} if has_weight else {}), **({"bias": b} if has_bias else {}))
    xd = x.double()
    assert_close(y, reference(x, w, b, 1e-5), torch.bfloat16, "y")
    assert_close(mean, xd.mean(-1), torch.float32, "mean")
    assert_close(rstd, (xd.var(-1, unbiased=False) + 1e-5).rsqrt(), torch.float32, "rstd")


@pytest.mark.parametrize("layout", ["row_slice", "strided_columns"])
def test_chunked_forward_reads_rows_by_strides(layout, device, seed):
    from liger_core import layer_norm as core
    from liger_torch._launch import info, run_plan

    gen = torch.Generator().manual_seed(seed)
    x = non_contiguous(layout, gen, device)
    w = (torch.rand(123, generator=gen) + 0.5).to(device)
    b = torch.randn(123, generator=gen).to(device)
    y, _, _ = run_plan(core.forward_plan(info(x), info(w), info(b), eps=1e-5, chunk=32), x=x, weight=w, bias=b)
    assert_close(y, reference(x, w, b, 1e-5), torch.float32, "y")

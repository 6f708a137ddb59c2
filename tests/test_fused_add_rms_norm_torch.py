"""liger_torch.fused_add_rms_norm / FusedAddRMSNorm against a float64 reference of the HF formulas
(``residual = x + residual; y = LlamaRMSNorm(residual)``), forward and backward through both outputs."""

import pytest
import torch

import liger_torch
from helpers import HandOverGradient, assert_close, non_contiguous
from test_rms_norm_torch import reference as rms_reference

# Triton's interpreter converts fp32 to bf16 by truncation (round toward zero; compiled kernels round to
# nearest even), so each bf16 rounding point may be one ulp off the reference's instead of half an ulp.
SLACK = {torch.bfloat16: 2.0} if liger_torch.INTERPRET else {}

SHAPES = [(1, 64), (7, 123), (3, 5, 96)]
MODES = [("llama", 0.0), ("gemma", 1.0), ("none", 0.0), ("llama", 0.5)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def rounded(v, dtype):
    """v rounded to dtype in the forward; the identity in the backward (the kernels' gradient)."""
    return v + (v.to(dtype).double() - v).detach()


def reference(x, r, w, eps, offset, mode):
    """HF's formulas in float64, rounded where HF rounds; returns (y, h)."""
    h_dtype = torch.promote_types(x.dtype, r.dtype)
    h = rounded(x.double() + r.double(), h_dtype)
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if w is None:
        return (normed if mode == "gemma" else rounded(normed, h_dtype)), h
    scale = offset + w.double()
    if mode == "llama":
        out_dtype = torch.promote_types(h_dtype, w.dtype)
        return rounded(normed, h_dtype) * rounded(scale, out_dtype), h
    return normed * scale, h


def run(fn, x, r, w, gy, gh):
    """Forward, then backward through y (gradient gy) and h (gradient gh; None: h unused)."""
    x, r = (t.detach().clone().requires_grad_(True) for t in (x, r))
    w = None if w is None else w.detach().clone().requires_grad_(True)
    y, h = fn(x, r, w)
    outs, grads = zip(*[(o, g) for o, g in ((y, gy), (h, gh)) if g is not None])
    torch.autograd.backward(outs, grads)
    return y, h, x.grad, r.grad, (None if w is None else w.grad)


def draw(seed, shape, dtype, r_dtype=None, w_dtype=None, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 2).to(device, dtype)
    r = (torch.randn(shape, generator=gen) * 2).to(device, r_dtype or dtype)
    w = (torch.randn(shape[-1], generator=gen) * 0.5 + 1).to(device, w_dtype or dtype)
    gy = torch.randn(shape, generator=gen).to(device, dtype)
    gh = torch.randn(shape, generator=gen).to(device, dtype)
    return x, r, w, gy, gh


def check(got, want, dtype, rows, dw_scale=None):
    y, h, dx, dr, dw = got
    y_ref, h_ref, dx_ref, dr_ref, dw_ref = want
    slack = SLACK.get(dtype, 1.0)
    assert_close(y, y_ref, dtype, "y", scale=slack)
    assert_close(h, h_ref, dtype, "h", scale=slack)
    assert_close(dx, dx_ref, dtype, "dx", scale=slack)
    assert_close(dr, dr_ref, dtype, "dresidual", scale=slack)
    if dw is not None:
        # dw sums one rounded term per row: allow the bound to grow with sqrt(rows).
        assert_close(dw, dw_ref, dtype, "dw", scale=slack * (dw_scale or max(1.0, rows ** 0.5)))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mode,offset", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_backward(shape, mode, offset, dtype, device, seed):
    x, r, w, gy, gh = draw(seed, shape, dtype, device=device)
    eps = 1e-6
    got = run(lambda a, b, c: liger_torch.fused_add_rms_norm(a, b, c, eps, offset, mode), x, r, w, gy, gh)
    want = run(lambda a, b, c: reference(a, b, c, eps, offset, mode), x, r, w, gy.double(), gh.double())
    y, h, dx, dr, dw = got
    assert y.dtype == dtype and h.dtype == dtype and dx.dtype == dr.dtype == dw.dtype == dtype
    check(got, want, dtype, x.numel() // shape[-1])


@pytest.mark.parametrize("used", ["y_only", "h_only"])
def test_one_output_unused(used, device, seed):
    x, r, w, gy, gh = draw(seed, (7, 123), torch.float32, device=device)
    gy, gh = (gy, None) if used == "y_only" else (None, gh)
    got = run(lambda a, b, c: liger_torch.fused_add_rms_norm(a, b, c), x, r, w, gy, gh)
    want = run(lambda a, b, c: reference(a, b, c, 1e-6, 0.0, "llama"), x, r, w,
               None if gy is None else gy.double(), None if gh is None else gh.double())
    if used == "h_only":  # no gradient reaches the weight
        assert got[4] is None or torch.equal(got[4], torch.zeros_like(got[4]))
        got, want = got[:4] + (None,), want[:4] + (None,)
    check(got, want, torch.float32, 7, dw_scale=3.0)


def test_without_weight(device, seed):
    x, r, _, gy, gh = draw(seed, (7, 123), torch.float32, device=device)
    got = run(lambda a, b, c: liger_torch.fused_add_rms_norm(a, b, None), x, r, None, gy, gh)
    want = run(lambda a, b, c: reference(a, b, None, 1e-6, 0.0, "llama"), x, r, None, gy.double(), gh.double())
    check(got, want, torch.float32, 7)


def test_mixed_dtypes(device, seed):
    """bf16 x onto an fp32 residual stream with an fp32 weight: h and y in fp32, dx in bf16, dresidual fp32."""
    x, r, w, gy, gh = draw(seed, (7, 123), torch.bfloat16, r_dtype=torch.float32, w_dtype=torch.float32,
                           device=device)
    gy, gh = gy.float(), gh.float()
    got = run(lambda a, b, c: liger_torch.fused_add_rms_norm(a, b, c), x, r, w, gy, gh)
    want = run(lambda a, b, c: reference(a, b, c, 1e-6, 0.0, "llama"), x, r, w, gy.double(), gh.double())
    y, h, dx, dr, dw = got
    assert y.dtype == h.dtype == dr.dtype == dw.dtype == torch.float32 and dx.dtype == torch.bfloat16
    assert_close(dx, want[2], torch.bfloat16, "dx", scale=SLACK.get(torch.bfloat16, 1.0))
    check((y, h, dr, dr, dw), (want[0], want[1], want[3], want[3], want[4]), torch.float32, 7, dw_scale=3.0)


@pytest.mark.parametrize("layout", ["row_slice", "strided_columns", "transposed_leading"])
def test_non_contiguous_inputs(layout, device, seed):
    gen = torch.Generator().manual_seed(seed)
    x = non_contiguous(layout, gen, device)
    r = torch.randn(123, x.numel() // 123, generator=gen).to(device).t().reshape(x.shape)  # column-major rows
    assert not r.is_contiguous()
    w = torch.randn(123, generator=gen).to(device)
    gy, gh = (torch.randn(x.shape, generator=gen).to(device) for _ in range(2))
    got = run(lambda a, b, c: liger_torch.fused_add_rms_norm(a, b, c), x, r, w, gy, gh)
    want = run(lambda a, b, c: reference(a, b, c, 1e-6, 0.0, "llama"), x, r, w, gy.double(), gh.double())
    check(got, want, torch.float32, x.numel() // 123, dw_scale=4.0)


def test_one_gradient_tensor_for_x_and_residual(device, seed):
    """As autograd's add: dx and dresidual are one tensor when their dtypes agree (one write fewer), two when
    they differ."""
    x, r, w, gy, gh = draw(seed, (7, 123), torch.float32, device=device)
    want = run(lambda a, b, c: reference(a, b, c, 1e-6, 0.0, "llama"), x, r, w, gy.double(), gh.double())
    x, r = x.requires_grad_(True), r.requires_grad_(True)
    dx, dr = torch.autograd.grad(liger_torch.fused_add_rms_norm(x, r, w), (x, r), (gy, gh))
    assert dx.data_ptr() == dr.data_ptr()
    assert_close(dx, want[2], torch.float32, "dx")
    xb, rf, wb, gyb, ghf = draw(seed, (7, 123), torch.bfloat16, r_dtype=torch.float32, device=device)
    got = run(lambda a, b, c: liger_torch.fused_add_rms_norm(a, b, c), xb, rf, wb, gyb, ghf.float())
    assert got[2].dtype == torch.bfloat16 and got[3].dtype == torch.float32
    want = run(lambda a, b, c: reference(a, b, c, 1e-6, 0.0, "llama"), xb, rf, wb, gyb.double(), ghf.double())
    assert_close(got[3], want[3], torch.float32, "dresidual (fp32)", scale=SLACK.get(torch.bfloat16, 1.0))


@pytest.mark.parametrize("norm_first", [False, True])
def test_shared_gradient_survives_an_in_place_backward_on_either_branch(norm_first, device, seed):
    """x comes from an in-place RMSNorm (a post-norm) and the residual from another op: the one gradient
    tensor reaches both; whichever backward runs first must not write over it. The order of the two branches
    (autograd runs the later-created first) is swept."""
    gen = torch.Generator().manual_seed(seed)
    a, b, w1, w2, gy, gh = (torch.randn(s, generator=gen).to(device) for s in
                            ((7, 123), (7, 123), (123,), (123,), (7, 123), (7, 123)))

    def layer(a, b, w1, w2, fused):
        if norm_first:
            x, r = norm(a, w1, fused), torch.sin(b)
        else:
            r = torch.sin(b)
            x = norm(a, w1, fused)
        return liger_torch.fused_add_rms_norm(x, r, w2) if fused else reference(x, r, w2, 1e-6, 0.0, "llama")

    def norm(t, w, fused):
        return liger_torch.rms_norm(t, w, in_place=True) if fused else rms_reference(t, w, 1e-6, 0.0, "llama")

    grads = []
    for fused in (True, False):
        args = [(t.double() if not fused else t).detach().requires_grad_(True) for t in (a, b, w1, w2)]
        y, h = layer(*args, fused)
        torch.autograd.backward((y, h), (gy.to(y.dtype), gh.to(h.dtype)))
        grads.append([t.grad for t in args])
    for name, got, want in zip(("da", "db", "dw1", "dw2"), *grads):
        assert_close(got, want, torch.float32, name, scale=3.0)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_in_place_backward_is_optional(x_dtype, device, seed):
    """fp32 x and residual: dx (also dresidual) over the gradient of y when this backward holds it alone. bf16
    x, fp32 residual: a separate fp32 dresidual over the fp32 gradient of h likewise (dx is bf16, dy fp32)."""
    x, r, w, gy, gh = draw(seed, (7, 123), x_dtype, r_dtype=torch.float32, w_dtype=torch.float32, device=device)
    for in_place in (False, True):
        x_, r_ = x.clone().requires_grad_(True), r.clone().requires_grad_(True)
        y_addresses, h_addresses = [], []
        y, h = liger_torch.fused_add_rms_norm(x_, r_, w, in_place=in_place)
        dx, dr = torch.autograd.grad((HandOverGradient.apply(y, y_addresses), HandOverGradient.apply(h, h_addresses)),
                                     (x_, r_), (gy.to(y.dtype), gh.to(h.dtype)))
        if x_dtype == torch.float32:
            assert (dx.data_ptr() == y_addresses[0]) == in_place and dr.data_ptr() == dx.data_ptr()
        else:
            assert (dr.data_ptr() == h_addresses[0]) == in_place and dx.data_ptr() != y_addresses[0]


def test_in_place_with_one_gradient_for_both_outputs(device, seed):
    """The same tensor as the gradient of y and of h: nothing may be written over it twice."""
    x, r, w, g, _ = draw(seed, (7, 123), torch.float32, device=device)
    got = run(lambda a, b, c: liger_torch.fused_add_rms_norm(a, b, c, in_place=True), x, r, w, g, g)
    want = run(lambda a, b, c: reference(a, b, c, 1e-6, 0.0, "llama"), x, r, w, g.double(), g.double())
    check(got, want, torch.float32, 7, dw_scale=3.0)


def test_expanded_grads(device, seed):
    """(y.sum() + h.sum()).backward() hands in stride-0 gradients, which must not be written over."""
    x, r, w, _, _ = draw(seed, (7, 123), torch.float32, device=device)
    grads = []
    for fn in (lambda a, b: liger_torch.fused_add_rms_norm(a, b, w, in_place=True),
               lambda a, b: reference(a, b, w, 1e-6, 0.0, "llama")):
        a, b = x.double() if len(grads) else x, r.double() if len(grads) else r
        a, b = a.detach().requires_grad_(True), b.detach().requires_grad_(True)
        y, h = fn(a, b)
        (y.sum() + h.sum()).backward()
        grads.append((a.grad, b.grad))
    assert_close(grads[0][0], grads[1][0], torch.float32, "dx")
    assert_close(grads[0][1], grads[1][1], torch.float32, "dresidual")


def test_bitwise_deterministic(device, seed):
    x, r, w, gy, gh = draw(seed, (64, 257), torch.float32, device=device)
    runs = [run(lambda a, b, c: liger_torch.fused_add_rms_norm(a, b, c), x, r, w, gy.clone(), gh.clone())
            for _ in range(2)]
    for first, second in zip(*runs):
        assert torch.equal(first, second)


def test_module_matches_transformers_residual_and_llama_rms_norm(device, seed):
    modeling = pytest.importorskip("transformers.models.llama.modeling_llama")
    hf = modeling.LlamaRMSNorm(96, eps=1e-6).to(device, torch.bfloat16)
    ours = liger_torch.FusedAddRMSNorm(96, eps=1e-6).to(device, torch.bfloat16)
    assert set(ours.state_dict()) == set(hf.state_dict()) == {"weight"} and ours.variance_epsilon == 1e-6
    with torch.no_grad():
        hf.weight.normal_()
    ours.load_state_dict(hf.state_dict())
    gen = torch.Generator().manual_seed(seed)
    x, r = (torch.randn(3, 5, 96, generator=gen).to(device, torch.bfloat16) for _ in range(2))
    y, h = ours(x, r)
    h_ref = x + r
    if liger_torch.INTERPRET:  # the interpreter truncates to bf16: at most one ulp below torch's add
        assert_close(h, h_ref, torch.bfloat16, "h", scale=SLACK[torch.bfloat16])
    else:
        assert torch.equal(h, h_ref)  # the bf16 add, bit for bit
    assert_close(y, hf(h_ref), torch.bfloat16, "y", scale=SLACK.get(torch.bfloat16, 1.0))
    gemma = liger_torch.FusedAddRMSNorm(96, offset=1.0, casting_mode="gemma", init_fn="zeros")
    assert torch.equal(gemma.weight, torch.zeros(96))
    with pytest.raises(ValueError, match="casting_mode"):
        liger_torch.FusedAddRMSNorm(96, casting_mode="fp8")


@pytest.mark.parametrize("bad,error,match", [
    (lambda d: (torch.randn(4, 8, device=d), torch.randn(4, 7, device=d), None), ValueError,
     "residual must have the shape of x"),
    (lambda d: (torch.randn(4, 8, device=d), torch.randn(4, 8, device=d), torch.randn(7, device=d)), ValueError,
     "weight must have shape"),
    (lambda d: (torch.randn(4, 8, device=d), torch.ones(4, 8, dtype=torch.int32, device=d), None), TypeError,
     "residual must have a floating"),
    (lambda d: (torch.ones(4, 8, dtype=torch.int32, device=d), torch.randn(4, 8, device=d), None), TypeError,
     "x must have a floating"),
    (lambda d: (torch.randn(0, 8, device=d), torch.randn(0, 8, device=d), None), ValueError, "x must not be empty"),
    (lambda d: (torch.randn(4, 8, device=d), [[0.0] * 8] * 4, None), TypeError, "residual must be a torch.Tensor"),
])
def test_bad_input_raises_before_launch(bad, error, match, device):
    x, r, w = bad(device)
    with pytest.raises(error, match=match):
        liger_torch.fused_add_rms_norm(x, r, w)


def test_bad_casting_mode(device):
    with pytest.raises(ValueError, match="casting_mode"):
        liger_torch.fused_add_rms_norm(torch.randn(2, 8, device=device), torch.randn(2, 8, device=device), None,
                                       casting_mode="fp8")


@pytest.mark.parametrize("mode", ["llama", "gemma"])
def test_fp16_rounding_points_match_hf(mode, device, seed):
    """fp16 (rounded to nearest in the interpreter too) pins the rounding points: h is torch's fp16 add bit for
    bit, and y is HF's result bit for bit except where fp32 reduction order flips a rounding (< 1%, one ulp).
    Without llama's rounding of the normalised h to fp16 about a quarter of the elements would differ."""
    x, r, w, _, _ = draw(seed, (64, 257), torch.float16, device=device)
    y, h = liger_torch.fused_add_rms_norm(x, r, w, 1e-6, 0.0, mode)
    h_ref = x + r
    assert torch.equal(h, h_ref)
    normed = h_ref.float() * torch.rsqrt(h_ref.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    y_ref = w * normed.to(torch.float16) if mode == "llama" else (normed * w.float()).to(torch.float16)
    exact = (y == y_ref).float().mean().item()
    assert exact >= 0.99, f"only {exact:.2%} of y is bitwise HF's"
    # llama rounds twice (normed to fp16, then w * normed): a flipped rounding of normed moves y by up to
    # |w| ulp(normed) plus y's own half ulp, i.e. up to 2 ulp of y; gemma rounds once (1 ulp).
    ulps = 2 if mode == "llama" else 1
    assert ((y.float() - y_ref.float()).abs() <= ulps * (y_ref.float().abs() * 2 ** -10 + 2 ** -24)).all()


@pytest.mark.parametrize("prefetch,block_m,reload", [(False, 1, False), (True, 1, False), (False, 4, False),
                                                   (True, 4, False), (False, 1, True), (False, 4, True),
                                                   (True, 2, True)])
@pytest.mark.parametrize("with_dh", [True, False])
def test_backward_launch_variants_agree(prefetch, block_m, reload, with_dh, device, seed):
    """The backward's launch variants (prefetching the next tile or not, tile height; 3 programs over 37 rows,
    so tiles run past a program's last row), with and without an incoming gradient for h."""
    from liger_core import fused_add_rms_norm as core
    from liger_torch._launch import info, run_plan

    x, r, w, gy, gh = draw(seed, (37, 123), torch.float32, device=device)
    _, h, rstd = run_plan(core.forward_plan(info(x), info(r), info(w), eps=1e-6), x=x, residual=r, weight=w)
    dh = gh if with_dh else None
    plan = core.backward_plan(info(gy), None if dh is None else info(dh), info(h), info(w), x_dtype="float32",
                              residual_dtype="float32", num_sms=3, in_place=False, block_m=block_m,
                              prefetch=prefetch, reload=reload)
    inputs = dict(dy=gy, h=h, weight=w, rstd=rstd, **({"dh": dh} if with_dh else {}))
    dx, dr, dw = run_plan(plan, **inputs)
    want = run(lambda a, b, c: reference(a, b, c, 1e-6, 0.0, "llama"), x.double(), r.double(), w.double(),
               gy.double(), dh.double() if with_dh else None)
    assert_close(dx, want[2], torch.float32, "dx")
    assert_close(dr, want[3], torch.float32, "dresidual")
    assert_close(dw, want[4], torch.float32, "dw", scale=3.0)


# The column-split backward of rows over rowwise.MAX_HELD_COLUMNS; ``column_block`` forces it on small rows (row
# sums swept in chunks of as many columns): several blocks with the last partial, one block a tile row, tiles of
# four rows, a folded leading axis, a single row, whole blocks only; and the default blocks just past the threshold.
SPLIT = [((37, 123), 32, None), ((5, 77), 16, 1), ((9, 300), 64, 4), ((2, 3, 40), 16, None), ((1, 17), 16, None),
         ((6, 64), 16, 2), ((2, 16400), None, None)]


def column_split_grads(x, r, w, gy, dh, mode, offset, column_block, block_m, dtype, in_place=False):
    from liger_core import fused_add_rms_norm as core
    from liger_torch._launch import info, run_plan

    params = {} if w is None else {"weight": w}
    _, h, rstd = run_plan(core.forward_plan(info(x), info(r), None if w is None else info(w), eps=1e-6,
                                            offset=offset, casting_mode=mode), x=x, residual=r, **params)
    plan = core.backward_plan(info(gy), None if dh is None else info(dh), info(h), None if w is None else info(w),
                              x_dtype=dtype, residual_dtype=dtype, offset=offset, casting_mode=mode, num_sms=3,
                              in_place=in_place, block_m=block_m, column_block=column_block)
    assert plan.launches[0].constexprs.get("CHUNK"), "the row sums come first"
    return run_plan(plan, dy=gy, h=h, rstd=rstd, **params, **({} if dh is None else {"dh": dh}))


@pytest.mark.parametrize("shape,column_block,block_m", SPLIT)
@pytest.mark.parametrize("mode,offset", MODES[:2])
@pytest.mark.parametrize("with_dh,has_weight", [(True, True), (False, True), (True, False)])
def test_column_split_backward_against_reference(shape, column_block, block_m, mode, offset, with_dh, has_weight,
                                                 device, seed):
    """fp32 gradients of the column-split backward against the float64 reference, with and without an incoming
    gradient of h; dx and dresidual written over dy and dh (the row sums read dy in a launch of their own)."""
    x, r, w, gy, gh = draw(seed, shape, torch.float32, device=device)
    w = w if has_weight else None
    dh = gh.clone() if with_dh else None
    grads = column_split_grads(x, r, w, gy.clone(), dh, mode, offset, column_block, block_m, "float32",
                               in_place=True)
    want = run(lambda a, b, c: reference(a, b, c, 1e-6, offset, mode), x.double(), r.double(),
               None if w is None else w.double(), gy.double(), gh.double() if with_dh else None)
    assert_close(grads[0], want[2], torch.float32, "dx")
    assert_close(grads[1], want[3], torch.float32, "dresidual")
    if has_weight:
        assert_close(grads[2], want[4], torch.float32, "dw", scale=3.0)
    else:
        assert len(grads) == 2


@pytest.mark.parametrize("shape,column_block,block_m", SPLIT[:3])
def test_column_split_backward_half_precision_matches_whole_rows(shape, column_block, block_m, device, seed):
    """bf16 gradients of the column-split backward within a rounding of the whole-row backward's (the same
    arithmetic but the row sums' order)."""
    from liger_core import fused_add_rms_norm as core
    from liger_torch._launch import info, run_plan

    x, r, w, gy, gh = draw(seed, shape, torch.bfloat16, device=device)
    split = column_split_grads(x, r, w, gy, gh, "llama", 0.0, column_block, block_m, "bfloat16")
    _, h, rstd = run_plan(core.forward_plan(info(x), info(r), info(w), eps=1e-6), x=x, residual=r, weight=w)
    whole = run_plan(core.backward_plan(info(gy), info(gh), info(h), info(w), x_dtype="bfloat16",
                                        residual_dtype="bfloat16", num_sms=3, in_place=False, column_block=0),
                     dy=gy, dh=gh, h=h, weight=w, rstd=rstd)
    for got, want, name in zip(split, whole, ("dx", "dresidual", "dw")):
        assert_close(got, want.double(), torch.bfloat16, name)



# The lagged backward (rows from rms_norm.LAGGED_BACKWARD["from_cols"] columns; RMSNorm's kernel with the incoming
# gradient of h and the residual's gradient): (shape, segment width, rows a block, lag bytes).
LAGGED = [((37, 123), 32, 4, 1), ((5, 77), 16, 2, 10**9), ((2, 3, 40), 16, 4, 1)]


@pytest.mark.parametrize("shape,segment,rows,lag_bytes", LAGGED)
@pytest.mark.parametrize("with_dh,has_weight,separate,chain_dw", [(True, True, True, False),
                                                                   (False, True, True, True),
                                                                   (True, False, True, False),
                                                                   (True, True, False, True)])
def test_lagged_backward_against_reference(shape, segment, rows, lag_bytes, with_dh, has_weight, separate, chain_dw,
                                           norm_lagged, device, seed):
    """fp32 gradients of the lagged backward against the float64 reference, dx and dresidual written over dy and
    dh, or one gradient for both (``separate_residual_grad=False``); the weight gradient summed from partial rows
    or chained through the blocks (``chain_dw``)."""
    from liger_core import fused_add_rms_norm as core
    from liger_torch._launch import info, run_plan

    norm_lagged(rows=rows, lag_bytes=lag_bytes, block=16, chain_dw=chain_dw)
    x, r, w, gy, gh = draw(seed, shape, torch.float32, device=device)
    w = w if has_weight else None
    dh = gh.clone() if with_dh else None
    params = {} if w is None else {"weight": w}
    _, h, rstd = run_plan(core.forward_plan(info(x), info(r), None if w is None else info(w), eps=1e-6,
                                            offset=0.5, casting_mode="llama"), x=x, residual=r, **params)
    plan = core.backward_plan(info(gy), None if dh is None else info(dh), info(h), None if w is None else info(w),
                              x_dtype="float32", residual_dtype="float32", offset=0.5, num_sms=3, in_place=True,
                              separate_residual_grad=separate, lagged=segment)
    assert plan.launches[0].kernel.fn.__name__ == "_rms_norm_lagged_backward_kernel"
    grads = run_plan(plan, dy=gy.clone(), h=h, rstd=rstd, **params, **({} if dh is None else {"dh": dh}))
    want = run(lambda a, b, c: reference(a, b, c, 1e-6, 0.5, "llama"), x.double(), r.double(),
               None if w is None else w.double(), gy.double(), gh.double() if with_dh else None)
    assert_close(grads[0], want[2], torch.float32, "dx")
    if separate:
        assert_close(grads[1], want[3], torch.float32, "dresidual")
    if has_weight:
        assert_close(grads[-1], want[4], torch.float32, "dw", scale=3.0)
    assert len(grads) == 1 + separate + has_weight


# Rows swept in chunks: the forward of rows over rowwise.MAX_HELD_COLUMNS; ``chunk`` forces it on small rows:
# several chunks with the last partial, whole chunks only, one column, one chunk wider than the row.
CHUNKED = [((7, 123), 16), ((3, 64), 16), ((2, 1), 16), ((5, 1000), 256), ((2, 3, 40), 64)]


@pytest.mark.parametrize("shape,chunk", CHUNKED)
@pytest.mark.parametrize("mode,offset", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_forward_against_reference(shape, chunk, mode, offset, dtype, device, seed):
    """The chunked forward writes h in its first sweep and reads it back in the second: y, h and rstd against
    the reference, with and without a weight; h bitwise the held-row kernel's (the same rounded sum); the same
    bits with and without the first sweep's prefetch."""
    from liger_core import fused_add_rms_norm as core
    from liger_torch._launch import info, run_plan

    x, r, w, _, _ = draw(seed, shape, dtype, device=device)
    slack = SLACK.get(dtype, 1.0)
    for weight in (w, None):
        given = {} if weight is None else {"weight": weight}

        def forward(chunk, prefetch=None):
            plan = core.forward_plan(info(x), info(r), None if weight is None else info(weight), eps=1e-6,
                                     offset=offset, casting_mode=mode, chunk=chunk, prefetch=prefetch)
            return run_plan(plan, x=x, residual=r, **given)

        y, h, rstd = forward(chunk, prefetch=False)
        y_ref, h_ref = reference(x, r, weight, 1e-6, offset, mode)
        assert_close(y, y_ref, dtype, "y", scale=slack)
        assert_close(h, h_ref, dtype, "h", scale=slack)
        assert_close(rstd, torch.rsqrt(h_ref.pow(2).mean(-1) + 1e-6), torch.float32, "rstd")
        assert torch.equal(h, forward(0)[1])
        for a, b in zip((y, h, rstd), forward(chunk, prefetch=True)):  # when loads are issued, not what is computed
            assert torch.equal(a, b)



@pytest.mark.parametrize("shape,chunk", [((7, 123), 16), ((5, 1000), 256)])
@pytest.mark.parametrize("rows", [2, 4])
def test_chunked_forward_several_rows_a_program(shape, chunk, rows, device, seed):
    """``block_m`` rows a program (w loaded once for them): 7 and 5 rows leave the last program short, its extra
    rows the last one again (h stored twice with the same bits); every row against the reference."""
    from liger_core import fused_add_rms_norm as core
    from liger_torch._launch import info, run_plan

    x, r, w, _, _ = draw(seed, shape, torch.bfloat16, device=device)
    plan = core.forward_plan(info(x), info(r), info(w), eps=1e-6, chunk=chunk, block_m=rows)
    assert plan.launches[0].grid == (-(-shape[0] // rows),)
    y, h, rstd = run_plan(plan, x=x, residual=r, weight=w)
    y_ref, h_ref = reference(x, r, w, 1e-6, 0.0, "llama")
    slack = SLACK.get(torch.bfloat16, 1.0)
    assert_close(y, y_ref, torch.bfloat16, "y", scale=slack)
    assert_close(h, h_ref, torch.bfloat16, "h", scale=slack)
    assert_close(rstd, torch.rsqrt(h_ref.pow(2).mean(-1) + 1e-6), torch.float32, "rstd")

@pytest.mark.parametrize("n_cols", [16400, 32800])
def test_rows_over_16384_columns_through_autograd(n_cols, device, seed):
    """16400 columns: the forward holds the row (a 32768-wide block at 16 warps); 32800: it sweeps three
    16384-column chunks, the last partial (tests/core/test_launch.py checks the kernel choice); the backward
    splits both into column blocks. The op through autograd against the reference."""
    x, r, w, gy, gh = draw(seed, (2, n_cols), torch.bfloat16, device=device)
    got = run(lambda a, b, c: liger_torch.fused_add_rms_norm(a, b, c), x, r, w, gy, gh)
    want = run(lambda a, b, c: reference(a, b, c, 1e-6, 0.0, "llama"), x, r, w, gy.double(), gh.double())
    check(got, want, torch.bfloat16, rows=2)


@pytest.mark.parametrize("layout", ["row_slice", "strided_columns"])
def test_chunked_forward_reads_rows_by_strides(layout, device, seed):
    """x by strides, the residual contiguous (each has its own strides in the kernel)."""
    from liger_core import fused_add_rms_norm as core
    from liger_torch._launch import info, run_plan

    gen = torch.Generator().manual_seed(seed)
    x = non_contiguous(layout, gen, device)
    r = torch.randn(x.shape, generator=gen).to(device)
    w = (torch.rand(123, generator=gen) + 0.5).to(device)
    y, h, _ = run_plan(core.forward_plan(info(x), info(r), info(w), eps=1e-6, chunk=32), x=x, residual=r, weight=w)
    y_ref, h_ref = reference(x, r, w, 1e-6, 0.0, "llama")
    assert_close(y, y_ref, torch.float32, "y")
    assert_close(h, h_ref, torch.float32, "h")

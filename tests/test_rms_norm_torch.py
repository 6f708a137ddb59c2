"""liger_torch.rms_norm / RMSNorm against a float64 reference of the HF formulas, forward and backward."""

import pytest
import torch

import liger_torch
from helpers import HandOverGradient, assert_close, non_contiguous

SHAPES = [(1, 64), (7, 123), (3, 5, 96), (2, 1000)]
MODES = [("llama", 0.0), ("gemma", 1.0), ("none", 0.0), ("llama", 0.5)]


def reference(x, w, eps, offset, mode):
    """HF's formulas, every step in float64 but rounded to the dtypes HF rounds to."""
    x64 = x.double()
    normed = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    if w is None:
        return normed.to(x.dtype).double() if mode != "gemma" else normed
    scale = offset + w.double()
    if mode == "llama":
        out_dtype = torch.promote_types(x.dtype, w.dtype)
        return normed.to(x.dtype).to(out_dtype).double() * scale.to(out_dtype).double()
    if mode == "gemma":
        return normed * scale
    return normed * scale


def grads_of(fn, x, w, g):
    x = x.detach().clone().requires_grad_(True)
    w = None if w is None else w.detach().clone().requires_grad_(True)
    y = fn(x, w)
    y.backward(g)
    return y, x.grad, (None if w is None else w.grad)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mode,offset", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_forward_backward(shape, mode, offset, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).to(device, dtype) * 3
    w = (torch.randn(shape[-1], generator=gen) * 0.5 + 1).to(device, dtype)
    g = torch.randn(shape, generator=gen).to(device, dtype)
    eps = 1e-6
    y, dx, dw = grads_of(lambda a, b: liger_torch.rms_norm(a, b, eps, offset, mode), x, w, g.clone())
    y_ref, dx_ref, dw_ref = grads_of(lambda a, b: reference(a, b, eps, offset, mode), x, w, g.double())
    assert y.dtype == (torch.promote_types(dtype, w.dtype) if mode == "llama" else dtype)
    assert_close(y, y_ref, dtype, "y")
    assert_close(dx, dx_ref, dtype, "dx")
    # dw sums one rounded term per row: allow the bound to grow with sqrt(rows).
    rows = x.numel() // shape[-1]
    assert_close(dw, dw_ref, dtype, "dw", scale=max(1.0, rows ** 0.5))


@pytest.mark.parametrize("mode", ["llama", "gemma"])
def test_without_weight(mode, device, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(7, 123, generator=gen).to(device)
    g = torch.randn(7, 123, generator=gen).to(device)
    y, dx, _ = grads_of(lambda a, b: liger_torch.rms_norm(a, None, 1e-5, 0.0, mode), x, None, g.clone())
    y_ref, dx_ref, _ = grads_of(lambda a, b: reference(a, None, 1e-5, 0.0, mode), x, None, g.double())
    assert_close(y, y_ref, torch.float32, "y")
    assert_close(dx, dx_ref, torch.float32, "dx")


def test_mixed_dtypes_follow_hf_promotion(device, seed):
    """bf16 activations with an fp32 weight: HF LlamaRMSNorm returns fp32 (weight * hidden.to(bf16))."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(7, 123, generator=gen).to(device, torch.bfloat16)
    w = torch.randn(123, generator=gen).to(device)
    g = torch.randn(7, 123, generator=gen).to(device)
    y, dx, dw = grads_of(lambda a, b: liger_torch.rms_norm(a, b), x, w, g.clone())
    y_ref, dx_ref, dw_ref = grads_of(lambda a, b: reference(a, b, 1e-6, 0.0, "llama"), x, w, g.double())
    assert y.dtype == torch.float32 and dx.dtype == torch.bfloat16 and dw.dtype == torch.float32
    assert_close(y, y_ref, torch.bfloat16, "y")
    assert_close(dx, dx_ref, torch.bfloat16, "dx")
    assert_close(dw, dw_ref, torch.bfloat16, "dw", scale=3.0)


@pytest.mark.parametrize("layout", ["row_slice", "transposed_leading", "strided_columns"])
def test_non_contiguous_input(layout, device, seed):
    gen = torch.Generator().manual_seed(seed)
    x = non_contiguous(layout, gen, device)
    w = torch.randn(123, generator=gen).to(device)
    g = torch.randn(x.shape, generator=gen).to(device)
    y, dx, dw = grads_of(lambda a, b: liger_torch.rms_norm(a, b), x, w, g.clone())
    y_ref, dx_ref, dw_ref = grads_of(lambda a, b: reference(a, b, 1e-6, 0.0, "llama"), x, w, g.double())
    assert_close(y, y_ref, torch.float32, "y")
    assert_close(dx, dx_ref, torch.float32, "dx")
    assert_close(dw, dw_ref, torch.float32, "dw", scale=3.0)


def test_in_place_backward_writes_over_grad_and_is_optional(device, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(7, 123, generator=gen).to(device).requires_grad_(True)
    w = torch.randn(123, generator=gen).to(device).requires_grad_(True)
    g = torch.randn(7, 123, generator=gen).to(device)
    for in_place in (True, False):
        x.grad, addresses = None, []
        HandOverGradient.apply(liger_torch.rms_norm(x, w, in_place=in_place), addresses).backward(g)
        assert (x.grad.data_ptr() == addresses[0]) == in_place  # in place: dx lives in dy's buffer


def test_a_gradient_held_elsewhere_is_never_written_over(device, seed):
    """The caller's backward(gradient) keeps its tensor, and an add hands one tensor to both its inputs: the
    backward that sees another holder writes a fresh dx even with in_place."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(7, 123, generator=gen).to(device).requires_grad_(True)
    w = torch.randn(123, generator=gen).to(device)
    g = torch.randn(7, 123, generator=gen).to(device)
    g_in = g.clone()
    liger_torch.rms_norm(x, w, in_place=True).backward(g_in)
    assert torch.equal(g_in, g)
    ref = x.detach().double().requires_grad_(True)
    reference(ref, w.double(), 1e-6, 0.0, "llama").backward(g.double())
    assert_close(x.grad, ref.grad, torch.float32, "dx")


def test_expanded_grad_is_not_written_in_place(device, seed):
    """y.sum().backward() hands in a stride-0 gradient; writing dx over it would race."""
    x = torch.randn(7, 123, generator=torch.Generator().manual_seed(seed)).to(device).requires_grad_(True)
    liger_torch.rms_norm(x, None).sum().backward()
    ref = x.detach().double().requires_grad_(True)
    reference(ref, None, 1e-6, 0.0, "llama").sum().backward()
    assert_close(x.grad, ref.grad, torch.float32, "dx")


def test_bitwise_deterministic(device, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 257, generator=gen).to(device)
    w = torch.randn(257, generator=gen).to(device)
    g = torch.randn(64, 257, generator=gen).to(device)
    runs = [grads_of(lambda a, b: liger_torch.rms_norm(a, b), x, w, g.clone()) for _ in range(2)]
    for first, second in zip(*runs):
        assert torch.equal(first, second)


def test_module_is_drop_in_for_llama_rms_norm(device, seed):
    norm = liger_torch.RMSNorm(123, eps=1e-5).to(device)
    assert set(norm.state_dict()) == {"weight"} and norm.variance_epsilon == 1e-5
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(2, 7, 123, generator=torch.Generator().manual_seed(seed)).to(device)
    assert_close(norm(x), reference(x, norm.weight, 1e-5, 0.0, "llama"), torch.float32, "y")
    gemma = liger_torch.RMSNorm(123, offset=1.0, casting_mode="gemma", init_fn="zeros")
    assert torch.equal(gemma.weight, torch.zeros(123))


def test_module_matches_transformers_llama_rms_norm(device, seed):
    modeling = pytest.importorskip("transformers.models.llama.modeling_llama")
    hf = modeling.LlamaRMSNorm(96, eps=1e-6).to(device, torch.bfloat16)
    ours = liger_torch.RMSNorm(96, eps=1e-6).to(device, torch.bfloat16)
    with torch.no_grad():
        hf.weight.normal_()
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(3, 5, 96, generator=torch.Generator().manual_seed(seed)).to(device, torch.bfloat16)
    assert_close(ours(x), hf(x), torch.bfloat16, "y")


@pytest.mark.parametrize("bad,error,match", [
    (lambda d: (torch.randn(4, 8, device=d), torch.randn(7, device=d)), ValueError, "weight must have shape"),
    (lambda d: (torch.ones(4, 8, dtype=torch.int32, device=d), None), TypeError, "x must have a floating"),
    (lambda d: (torch.randn(4, 8, device=d), torch.ones(8, dtype=torch.int64, device=d)), TypeError, "weight"),
    (lambda d: (torch.randn(0, 8, device=d), None), ValueError, "x must not be empty"),
    (lambda d: (torch.tensor(3.0, device=d), None), ValueError, "x must have at least one dimension"),
    (lambda d: ([1.0, 2.0], None), TypeError, "x must be a torch.Tensor"),
])
def test_bad_input_raises_before_launch(bad, error, match, device):
    x, w = bad(device)
    with pytest.raises(error, match=match):
        liger_torch.rms_norm(x, w)


def test_bad_casting_mode(device):
    with pytest.raises(ValueError, match="casting_mode"):
        liger_torch.rms_norm(torch.randn(2, 8, device=device), None, casting_mode="fp8")


@pytest.mark.gpu
def test_wrong_device_names_argument():
    with pytest.raises(ValueError, match="weight must be on a CUDA device, got cpu"):
        liger_torch.rms_norm(torch.randn(4, 8, device="cuda"), torch.randn(8))
    with pytest.raises(ValueError, match="x must be on a CUDA device"):
        liger_torch.rms_norm(torch.randn(4, 8), None)


def test_cuda_tensor_in_interpreter_mode_is_refused():
    if liger_torch.INTERPRET is False or not torch.cuda.is_available():
        pytest.skip("needs interpreter mode with a visible CUDA device")
    with pytest.raises(ValueError, match="interpreter"):
        liger_torch.rms_norm(torch.randn(4, 8, device="cuda"), None)


def test_repeated_calls_and_unaligned_views(device, seed):
    """The torch executor caches compiled kernels per plan and pointer alignment (GPU): fresh data through a
    cached launch, and a view whose data pointer is not 16-byte aligned, must both be right."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(96, generator=gen).to(device, torch.bfloat16)
    for offset in (0, 0, 1, 0, 1):  # 1: the rows start 2 bytes into the buffer
        buf = torch.randn(5 * 96 + 1, generator=gen).to(device, torch.bfloat16).requires_grad_(True)
        g = torch.randn(5, 96, generator=gen).to(device, torch.bfloat16)
        x = buf[offset:offset + 5 * 96].view(5, 96)
        assert (x.data_ptr() % 16 == 0) == (offset == 0)
        y = liger_torch.rms_norm(x, w)
        y.backward(g.clone())
        x_ref = x.detach().double().requires_grad_(True)
        y_ref = reference(x_ref, w, 1e-6, 0.0, "llama")
        y_ref.backward(g.double())
        assert_close(y, y_ref, torch.bfloat16, "y")
        assert_close(buf.grad[offset:offset + 5 * 96].view(5, 96), x_ref.grad, torch.bfloat16, "dx")


@pytest.mark.parametrize("prefetch,block_m,reload", [(False, 1, False), (True, 1, False), (False, 4, False),
                                                   (True, 4, False), (False, 1, True), (False, 4, True),
                                                   (True, 2, True)])
def test_backward_launch_variants_agree(prefetch, block_m, reload, device, seed):
    """The backward's tuned variants (prefetching the next tile or not, tile height) compute the same thing."""
    from liger_core import rms_norm as core
    from liger_torch._launch import info, run_plan

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(37, 123, generator=gen).to(device)
    w = torch.randn(123, generator=gen).to(device)
    dy = torch.randn(37, 123, generator=gen).to(device)
    _, rstd = run_plan(core.forward_plan(info(x), info(w), eps=1e-6), x=x, weight=w)
    plan = core.backward_plan(info(dy), info(x), info(w), num_sms=3, in_place=False, block_m=block_m,
                              prefetch=prefetch, reload=reload)
    dx, dw = run_plan(plan, dy=dy, x=x, weight=w, rstd=rstd)
    _, dx_ref, dw_ref = grads_of(lambda a, b: reference(a, b, 1e-6, 0.0, "llama"), x, w, dy.double())
    assert_close(dx, dx_ref, torch.float32, "dx")
    assert_close(dw, dw_ref, torch.float32, "dw", scale=3.0)


# The column-split backward of rows over rowwise.MAX_HELD_COLUMNS; ``column_block`` forces it on small rows (row
# sums swept in chunks of as many columns): several blocks with the last partial, one block a tile row, tiles of
# four rows, a folded leading axis, a single row, whole blocks only; and the default blocks just past the threshold.
SPLIT = [((37, 123), 32, None), ((5, 77), 16, 1), ((9, 300), 64, 4), ((2, 3, 40), 16, None), ((1, 17), 16, None),
         ((6, 64), 16, 2), ((2, 16400), None, None)]


def column_split_grads(core, x, w, dy, mode, offset, column_block, block_m, in_place=False):
    from liger_torch._launch import info, run_plan

    _, rstd = run_plan(core.forward_plan(info(x), None if w is None else info(w), eps=1e-6, offset=offset,
                                         casting_mode=mode), x=x, **({} if w is None else {"weight": w}))
    plan = core.backward_plan(info(dy), info(x), None if w is None else info(w), offset=offset, casting_mode=mode,
                              num_sms=3, in_place=in_place, block_m=block_m, column_block=column_block)
    assert plan.launches[0].constexprs.get("CHUNK"), "the row sums come first"
    return run_plan(plan, dy=dy, x=x, rstd=rstd, **({} if w is None else {"weight": w}))


@pytest.mark.parametrize("shape,column_block,block_m", SPLIT)
@pytest.mark.parametrize("mode,offset", MODES)
@pytest.mark.parametrize("has_weight", [True, False])
def test_column_split_backward_against_reference(shape, column_block, block_m, mode, offset, has_weight, device,
                                                 seed):
    """fp32 gradients of the column-split backward against the float64 reference; dx written over dy (the row
    sums read dy in a launch of their own, before any block writes over it)."""
    from liger_core import rms_norm as core

    gen = torch.Generator().manual_seed(seed)
    x, dy = (torch.randn(shape, generator=gen).to(device) for _ in range(2))
    w = (torch.randn(shape[-1], generator=gen) + 1).to(device) if has_weight else None
    grads = column_split_grads(core, x, w, dy.clone(), mode, offset, column_block, block_m, in_place=True)
    _, dx_ref, dw_ref = grads_of(lambda a, b: reference(a, b, 1e-6, offset, mode), x, w, dy.double())
    assert_close(grads[0], dx_ref, torch.float32, "dx")
    if has_weight:
        assert_close(grads[1], dw_ref, torch.float32, "dw", scale=3.0)


def test_column_split_backward_keeps_one_weight_gradient_per_group(device, seed):
    """With ``groups`` (a folded vmap batch) each group's rows give their own weight gradient, split or not."""
    from liger_core import rms_norm as core
    from liger_torch._launch import info, run_plan

    gen = torch.Generator().manual_seed(seed)
    x, dy = (torch.randn(2, 9, 100, generator=gen).to(device) for _ in range(2))
    w = (torch.rand(100, generator=gen) + 0.5).to(device)
    _, rstd = run_plan(core.forward_plan(info(x), info(w), eps=1e-6), x=x, weight=w)
    dx, dw = run_plan(core.backward_plan(info(dy), info(x), info(w), num_sms=3, in_place=False, groups=2,
                                         column_block=32), dy=dy, x=x, weight=w, rstd=rstd)
    for g in range(2):
        _, dx_ref, dw_ref = grads_of(lambda a, b: reference(a, b, 1e-6, 0.0, "llama"), x[g], w, dy[g].double())
        assert_close(dx[g], dx_ref, torch.float32, "dx")
        assert_close(dw[g], dw_ref, torch.float32, "dw", scale=3.0)


@pytest.mark.parametrize("shape,column_block,block_m", SPLIT[:3])
@pytest.mark.parametrize("mode,offset", MODES[:2])
def test_column_split_backward_half_precision_matches_whole_rows(shape, column_block, block_m, mode, offset, device,
                                                                 seed):
    """bf16 gradients of the column-split backward within a rounding of the whole-row backward's (the same
    arithmetic but the row sums' order)."""
    from liger_core import rms_norm as core
    from liger_torch._launch import info, run_plan

    gen = torch.Generator().manual_seed(seed)
    x, dy = (torch.randn(shape, generator=gen).to(device, torch.bfloat16) for _ in range(2))
    w = (torch.rand(shape[-1], generator=gen) + 0.5).to(device, torch.bfloat16)
    split = column_split_grads(core, x, w, dy, mode, offset, column_block, block_m)
    _, rstd = run_plan(core.forward_plan(info(x), info(w), eps=1e-6, offset=offset, casting_mode=mode), x=x, weight=w)
    whole = run_plan(core.backward_plan(info(dy), info(x), info(w), offset=offset, casting_mode=mode, num_sms=3,
                                        in_place=False, column_block=0), dy=dy, x=x, weight=w, rstd=rstd)
    for got, want, name in zip(split, whole, ("dx", "dw")):
        assert_close(got, want.double(), torch.bfloat16, name)



# The lagged backward (rows from rms_norm.LAGGED_BACKWARD["from_cols"] columns): (shape, segment width, rows a
# block, lag bytes): several segments with the last partial and lag 1 (a block's gradient jobs between later
# blocks' dot jobs), a lag past the last block, one segment wider than the row, a single row, a last block of
# fewer rows, a folded leading axis.
LAGGED = [((37, 123), 32, 4, 1), ((5, 77), 16, 2, 10**9), ((9, 300), 512, 8, 1), ((1, 17), 16, 16, 1),
          ((40, 96), 32, 16, 3000), ((2, 3, 40), 16, 4, 1)]


def lagged_grads(core, x, w, dy, mode, offset, segment, in_place=False, launches=None):
    from liger_torch._launch import info, run_plan

    params = {} if w is None else {"weight": w}
    _, rstd = run_plan(core.forward_plan(info(x), None if w is None else info(w), eps=1e-6, offset=offset,
                                         casting_mode=mode), x=x, **params)
    plan = core.backward_plan(info(dy), info(x), None if w is None else info(w), offset=offset, casting_mode=mode,
                              num_sms=3, in_place=in_place, lagged=segment)
    assert plan.launches[0].kernel.fn.__name__ == "_rms_norm_lagged_backward_kernel"
    assert launches is None or len(plan.launches) == launches
    return run_plan(plan, dy=dy, x=x, rstd=rstd, **params)


@pytest.mark.parametrize("shape,segment,rows,lag_bytes", LAGGED)
@pytest.mark.parametrize("mode,offset,has_weight,chain_dw", [("llama", 0.0, True, False), ("gemma", 1.0, True, True),
                                                              ("none", 0.0, True, False), ("llama", 0.5, False, False),
                                                              ("llama", 0.0, True, True)])
def test_lagged_backward_against_reference(shape, segment, rows, lag_bytes, mode, offset, has_weight, chain_dw,
                                           norm_lagged, device, seed):
    """fp32 gradients of the lagged backward against the float64 reference, dx written over dy (a block's
    gradient jobs write only after all its dot jobs have read); the weight gradient as partial rows summed
    afterwards or chained through the blocks in order (``chain_dw``: one launch)."""
    from liger_core import rms_norm as core

    norm_lagged(rows=rows, lag_bytes=lag_bytes, block=16, chain_dw=chain_dw)
    gen = torch.Generator().manual_seed(seed)
    x, dy = (torch.randn(shape, generator=gen).to(device) for _ in range(2))
    w = (torch.randn(shape[-1], generator=gen) + 1).to(device) if has_weight else None
    grads = lagged_grads(core, x, w, dy.clone(), mode, offset, segment, in_place=True, launches=1 + (
        has_weight and not chain_dw))
    _, dx_ref, dw_ref = grads_of(lambda a, b: reference(a, b, 1e-6, offset, mode), x, w, dy.double())
    assert_close(grads[0], dx_ref, torch.float32, "dx")
    if has_weight:
        assert_close(grads[1], dw_ref, torch.float32, "dw", scale=3.0)
    else:
        assert len(grads) == 1


@pytest.mark.parametrize("shape,segment,rows,lag_bytes", LAGGED[:2])
@pytest.mark.parametrize("chain_dw", [False, True])
def test_lagged_backward_half_precision_matches_column_split(shape, segment, rows, lag_bytes, chain_dw, norm_lagged,
                                                             device, seed):
    """bf16 gradients of the lagged backward within a rounding of the column split's (the same arithmetic but
    the row sums' order)."""
    from liger_core import rms_norm as core
    from liger_torch._launch import info, run_plan

    norm_lagged(rows=rows, lag_bytes=lag_bytes, block=16, chain_dw=chain_dw)
    gen = torch.Generator().manual_seed(seed)
    x, dy = (torch.randn(shape, generator=gen).to(device, torch.bfloat16) for _ in range(2))
    w = (torch.rand(shape[-1], generator=gen) + 0.5).to(device, torch.bfloat16)
    lagged = lagged_grads(core, x, w, dy, "llama", 0.0, segment)
    split = column_split_grads(core, x, w, dy, "llama", 0.0, 16, None)
    for got, want, name in zip(lagged, split, ("dx", "dw")):
        assert_close(got, want.double(), torch.bfloat16, name)


def test_lagged_backward_is_chosen_by_width_for_one_group(norm_lagged):
    """From LAGGED_BACKWARD["from_cols"] columns (None by default: never) in one group of rows the plan takes the
    lagged kernel; a folded vmap batch (groups), a forced column block or ``lagged=False`` keep the column split;
    ``lagged=True`` with groups and a segment that is no power of two are refused."""
    from liger_core import rms_norm as core
    from liger_core.launch import ArrayInfo

    def kernels(n_cols, **kw):
        x, w = ArrayInfo.contiguous((8, n_cols), "bfloat16"), ArrayInfo.contiguous((n_cols,), "bfloat16")
        return [launch.kernel.fn.__name__ for launch in core.backward_plan(x, x, w, num_sms=132, **kw).launches]

    assert core.LAGGED_BACKWARD["from_cols"] is None and kernels(65536)[0] == "_rms_norm_row_dots_kernel", (
        "off by default: it has not beaten the column split on a GPU")
    from_cols = 32768
    norm_lagged(from_cols=from_cols)
    assert kernels(from_cols)[0] == "_rms_norm_lagged_backward_kernel"
    assert kernels(from_cols - 16)[0] == "_rms_norm_row_dots_kernel"
    assert kernels(from_cols, groups=2)[0] == "_rms_norm_row_dots_kernel"
    assert kernels(from_cols, column_block=4096)[0] == "_rms_norm_row_dots_kernel"
    assert kernels(from_cols, lagged=False)[0] == "_rms_norm_row_dots_kernel"
    assert kernels(64, lagged=32)[0] == "_rms_norm_lagged_backward_kernel"
    with pytest.raises(ValueError, match="one group"):
        kernels(from_cols, groups=2, lagged=True)
    with pytest.raises(ValueError, match="power of two"):
        kernels(from_cols, lagged=48)
    norm_lagged(from_cols=None)
    assert kernels(from_cols)[0] == "_rms_norm_row_dots_kernel"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frontend_takes_the_lagged_backward_by_width(dtype, norm_lagged, device, seed):
    """liger_torch.rms_norm's backward through the lagged kernel (its threshold lowered to the test's width),
    against the float64 reference."""
    norm_lagged(from_cols=96, segment=32, rows=4, lag_bytes=1, block=16)
    gen = torch.Generator().manual_seed(seed)
    x, g = (torch.randn(7, 123, generator=gen).to(device, dtype) for _ in range(2))
    w = (torch.rand(123, generator=gen) + 0.5).to(device, dtype)
    _, dx, dw = grads_of(lambda a, b: liger_torch.rms_norm(a, b, eps=1e-6), x, w, g)
    _, dx_ref, dw_ref = grads_of(lambda a, b: reference(a, b, 1e-6, 0.0, "llama"), x, w, g.double())
    assert_close(dx, dx_ref, dtype, "dx")
    assert_close(dw, dw_ref, dtype, "dw", scale=3.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recompute_norm_outputs_frees_the_output_and_gives_the_same_grads(dtype, device, seed):
    """Inside recompute_norm_outputs(), the linear layers after a norm save a recipe instead of the norm's output
    (they save a 2-d view of it: the view is rebuilt), so the output is freed after the forward; the backward
    recomputes it, and every gradient is bitwise the one of keeping it."""
    import gc
    import weakref

    gen = torch.Generator().manual_seed(seed)
    x0 = torch.randn(2, 7, 123, generator=gen).to(device, dtype)
    w0 = (torch.rand(123, generator=gen) + 0.5).to(device, dtype)
    lins = [torch.nn.Linear(123, 9, dtype=dtype).to(device) for _ in range(2)]
    g = torch.randn(2, 7, 9, generator=gen).to(device, dtype)

    def run(recompute):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        for lin in lins:
            lin.zero_grad(set_to_none=True)
        with liger_torch.recompute_norm_outputs(recompute):
            y = liger_torch.rms_norm(x, w)
            out = sum(lin(y) for lin in lins)  # two readers of one output
        ref = weakref.ref(y)
        del y
        gc.collect()
        freed = ref() is None
        out.backward(g)
        return freed, [x.grad, w.grad] + [p.grad for lin in lins for p in lin.parameters()]

    freed_kept, grads_kept = run(False)
    freed, grads = run(True)
    assert not freed_kept and freed
    for a, b in zip(grads, grads_kept):
        assert torch.equal(a, b)


def test_recompute_norm_outputs_refuses_an_input_modified_in_place(device, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 16, generator=gen).to(device)
    w = torch.ones(16, device=device, requires_grad=True)
    lin = torch.nn.Linear(16, 3).to(device)
    with liger_torch.recompute_norm_outputs():
        out = lin(liger_torch.rms_norm(x, w)).sum()
    x.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified in place"):
        out.backward()


@pytest.mark.parametrize("casting_mode", ["llama", "gemma"])
def test_wide_row_reload_is_bitwise_the_held_tile(casting_mode, device, seed):
    """A wide row may reload its tile after the row's reduction instead of holding it (``reload``; LayerNorm's
    default above 8192 columns, an option here): the same arithmetic in the same order, so bf16 gradients are
    bitwise those of the held tile, llama's rounding of the normalised x included."""
    from liger_core import rms_norm as core
    from liger_torch._launch import info, run_plan

    gen = torch.Generator().manual_seed(seed)
    x, dy = (torch.randn(37, 123, generator=gen).to(device, torch.bfloat16) for _ in range(2))
    w = (torch.rand(123, generator=gen) + 0.5).to(device, torch.bfloat16)
    _, rstd = run_plan(core.forward_plan(info(x), info(w), eps=1e-6, casting_mode=casting_mode), x=x, weight=w)
    grads = [run_plan(core.backward_plan(info(dy), info(x), info(w), casting_mode=casting_mode, num_sms=3,
                                         in_place=False, block_m=2, prefetch=False, reload=reload),
                      dy=dy, x=x, weight=w, rstd=rstd) for reload in (False, True)]
    for held, reloaded, name in zip(*grads, ("dx", "dw")):
        assert torch.equal(held, reloaded), name


# Rows swept in chunks: the forward of rows over rowwise.MAX_HELD_COLUMNS; ``chunk`` forces it on small rows:
# several chunks with the last partial, whole chunks only, one column, one chunk wider than the row.
CHUNKED = [((7, 123), 16), ((3, 64), 16), ((2, 1), 16), ((5, 1000), 256), ((2, 3, 40), 64)]


@pytest.mark.parametrize("shape,chunk", CHUNKED)
@pytest.mark.parametrize("mode,offset", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_forward_against_reference(shape, chunk, mode, offset, dtype, device, seed):
    from liger_core import rms_norm as core
    from liger_torch._launch import info, run_plan

    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 3).to(device, dtype)
    w = (torch.randn(shape[-1], generator=gen) * 0.5 + 1).to(device, dtype)
    for weight in (w, None):
        outs = [run_plan(core.forward_plan(info(x), None if weight is None else info(weight), eps=1e-6,
                                           offset=offset, casting_mode=mode, chunk=chunk, prefetch=prefetch),
                         x=x, **({} if weight is None else {"weight": weight})) for prefetch in (False, True)]
        y, rstd = outs[0]
        assert_close(y, reference(x, weight, 1e-6, offset, mode), dtype, "y")
        x64 = x.double()
        assert_close(rstd, torch.rsqrt(x64.pow(2).mean(-1) + 1e-6), torch.float32, "rstd")
        for a, b in zip(*outs):  # the prefetch changes when loads are issued, not what is computed
            assert torch.equal(a, b)



@pytest.mark.parametrize("shape,chunk", [((7, 123), 16), ((5, 1000), 256)])
@pytest.mark.parametrize("rows", [2, 4])
def test_chunked_forward_several_rows_a_program(shape, chunk, rows, device, seed):
    """``block_m`` rows a program (w loaded once for them): 7 and 5 rows leave the last program short, its extra
    rows the last one again; every row against the reference."""
    from liger_core import rms_norm as core
    from liger_torch._launch import info, run_plan

    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 3).to(device, torch.bfloat16)
    w = (torch.randn(shape[-1], generator=gen) * 0.5 + 1).to(device, torch.bfloat16)
    plan = core.forward_plan(info(x), info(w), eps=1e-6, chunk=chunk, block_m=rows)
    assert plan.launches[0].grid == (-(-shape[0] // rows),)
    y, rstd = run_plan(plan, x=x, weight=w)
    assert_close(y, reference(x, w, 1e-6, 0.0, "llama"), torch.bfloat16, "y")
    assert_close(rstd, torch.rsqrt(x.double().pow(2).mean(-1) + 1e-6), torch.float32, "rstd")

@pytest.mark.parametrize("n_cols", [16400, 32800])
def test_rows_over_16384_columns_through_autograd(n_cols, device, seed):
    """16400 columns: the forward holds the row (a 32768-wide block at 16 warps); 32800: it sweeps three
    16384-column chunks, the last partial (tests/core/test_launch.py checks the kernel choice); the backward
    splits both into column blocks. The op through autograd against the reference."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, n_cols, generator=gen).to(device, torch.bfloat16)
    w = (torch.rand(n_cols, generator=gen) + 0.5).to(device, torch.bfloat16)
    g = torch.randn(2, n_cols, generator=gen).to(device, torch.bfloat16)
    y, dx, dw = grads_of(lambda a, b: liger_torch.rms_norm(a, b), x, w, g.clone())
    y_ref, dx_ref, dw_ref = grads_of(lambda a, b: reference(a, b, 1e-6, 0.0, "llama"), x, w, g.double())
    assert_close(y, y_ref, torch.bfloat16, "y")
    assert_close(dx, dx_ref, torch.bfloat16, "dx")
    assert_close(dw, dw_ref, torch.bfloat16, "dw", scale=2 ** 0.5)


@pytest.mark.parametrize("layout", ["row_slice", "strided_columns"])
def test_chunked_forward_reads_rows_by_strides(layout, device, seed):
    from liger_core import rms_norm as core
    from liger_torch._launch import info, run_plan

    gen = torch.Generator().manual_seed(seed)
    x = non_contiguous(layout, gen, device)
    w = (torch.rand(123, generator=gen) + 0.5).to(device)
    y, _ = run_plan(core.forward_plan(info(x), info(w), eps=1e-6, chunk=32), x=x, weight=w)
    assert_close(y, reference(x, w, 1e-6, 0.0, "llama"), torch.float32, "y")

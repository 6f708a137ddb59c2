"""liger_torch.cross_entropy / CrossEntropyLoss against F.cross_entropy in float64, forward and backward."""

import pytest
import torch
import torch.nn.functional as F

import liger_core
import liger_torch
from helpers import assert_close

OPTIONS = {
    "plain": {},
    "smoothing": {"label_smoothing": 0.1},
    "weight": {"weight": True},
    "weight_smoothing": {"weight": True, "label_smoothing": 0.2},
    "z_loss": {"lse_square_scale": 1e-2},
    "softcap": {"softcap": 4.0},
    "everything": {"weight": True, "label_smoothing": 0.1, "lse_square_scale": 1e-3, "softcap": 6.0},
}


def reference(x, t, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0, lse_square_scale=0.0,
              softcap=None):
    """torch's own cross_entropy in float64, plus z-loss and softcap written out; (loss, z_loss)."""
    z = x.double()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    w = None if weight is None else weight.double()
    keep = t != ignore_index
    if reduction == "mean" and not keep.any():
        zero = (z * 0).sum()
        return zero, zero
    ce = F.cross_entropy(z, t, weight=w, ignore_index=ignore_index, reduction=reduction,
                         label_smoothing=label_smoothing)
    zl = lse_square_scale * torch.logsumexp(z, -1) ** 2 * keep
    if reduction == "mean":
        zl = zl.sum() / keep.sum()
    elif reduction == "sum":
        zl = zl.sum()
    return ce + zl, zl


def draw(seed, n, v, dtype, ignore_fraction=0.25, ignore_index=-100, device="cpu"):
    """Drawn on the CPU from a seeded generator (the same numbers on every device), then moved to ``device``."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, v, generator=gen) * 4).to(device, dtype)
    t = torch.randint(0, v, (n,), generator=gen)
    t[torch.rand(n, generator=gen) < ignore_fraction] = ignore_index
    w = torch.rand(v, generator=gen) + 0.5
    return x, t.to(device), w.to(device), gen


def run(fn, x, t, g):
    x = x.detach().clone().requires_grad_(True)
    out = fn(x, t)
    loss = out[0] if isinstance(out, tuple) else out
    loss.backward(g)
    return out, x.grad


def incoming(loss_shape, reduction, gen, n, device="cpu"):
    if reduction == "none":
        return torch.randn(n, generator=gen).to(device)  # non-uniform per-row gradient
    return torch.tensor(0.7, device=device)


@pytest.mark.parametrize("n,v", [(9, 1000), (6, 259)])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_forward_backward(n, v, reduction, option, dtype, device, seed):
    x, t, w, gen = draw(seed, n, v, dtype, device=device)
    opts = dict(OPTIONS[option])
    if opts.pop("weight", False):
        opts["weight"] = w
    g = incoming(None, reduction, gen, n, device).to(dtype)
    (loss, z), dx = run(lambda a, b: liger_torch.cross_entropy(a, b, reduction=reduction, return_z_loss=True,
                                                               **opts), x, t, g)
    (loss_ref, z_ref), dx_ref = run(lambda a, b: reference(a, b, reduction=reduction, **opts), x, t, g.double())
    assert loss.dtype == dtype and loss.shape == loss_ref.shape and dx.dtype == dtype
    assert_close(loss, loss_ref, dtype, "loss")
    assert_close(z, z_ref, dtype, "z_loss")
    # The mean's gradient is ~1/n per element: compare it scaled back up so the tolerance means something.
    scale = n if reduction == "mean" else 1.0
    assert_close(dx * scale, dx_ref * scale, dtype, "dlogits")


@pytest.mark.parametrize("option", ["plain", "everything"])
def test_vocab_over_several_blocks(option, device, seed):
    """V larger than one block (32003, not a power of two): the online softmax rescales across blocks."""
    assert liger_core.cross_entropy.ce_block_and_warps(32003)[0] < 32003
    x, t, w, gen = draw(seed, 4, 32003, torch.float32, ignore_fraction=0.0, device=device)
    opts = dict(OPTIONS[option])
    if opts.pop("weight", False):
        opts["weight"] = w
    x = x * 3
    x[0, 9000] = 80.0  # the row max lands in the second block
    (loss,), dx = run(lambda a, b: (liger_torch.cross_entropy(a, b, **opts),), x, t, torch.tensor(1.0, device=device))
    (loss_ref, _), dx_ref = run(lambda a, b: reference(a, b, **opts), x, t,
                                torch.tensor(1.0, dtype=torch.float64, device=device))
    assert_close(loss, loss_ref, torch.float32, "loss")
    assert_close(dx * 4, dx_ref * 4, torch.float32, "dlogits")


def test_row_sweep_launch_by_width():
    """Longer steps from 32000 columns (cross_entropy._CE_SWEEPS); the library's row sweep below."""
    from liger_core.cross_entropy import ce_block_and_warps

    assert ce_block_and_warps(65541) == ce_block_and_warps(32000) == (8192, 16)
    assert ce_block_and_warps(31999) == liger_core.launch.sweep_block_and_warps(31999)


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("option", ["plain", "everything"])
@pytest.mark.parametrize("v", [65533, 65541])
def test_wide_vocab_steps(v, option, in_place, device, seed, lagged_from_65536):
    """65533 columns (the widest rows the two-pass kernel takes with a gradient): 8192-column steps at 16 warps,
    seven whole and an eighth 3 columns short; 65541, the lagged kernel by default: 9 segments of 8192, the last 5
    columns wide. The row max and a target in the partial step or segment, the gradient in place or in its own
    buffer; the plan's launch is checked, so the test runs the path it names."""
    from liger_torch._launch import info

    x, t, w, gen = draw(seed, 3, v, torch.float32, ignore_fraction=0.0, device=device)
    core = liger_core.cross_entropy
    plan = core.forward_plan(info(x), info(t), reduction="none", in_place=in_place)
    (row_launch,) = [launch for launch in plan.launches
                     if launch.kernel in (core._cross_entropy_kernel, core._cross_entropy_lagged_kernel)]
    if v == 65533:
        assert (row_launch.constexprs["BLOCK_V"], row_launch.num_warps) == (8192, 16)
    else:
        assert row_launch.kernel is core._cross_entropy_lagged_kernel and row_launch.constexprs["N_SEG"] == 9
    opts = dict(OPTIONS[option])
    if opts.pop("weight", False):
        opts["weight"] = w
    x = x * 3
    x[1, v - 2] = 60.0
    t[2] = v - 1
    g = incoming(None, "none", gen, 3, device)
    (loss,), dx = run(lambda a, b: (liger_torch.cross_entropy(a, b, reduction="none", in_place=in_place, **opts),),
                      x, t, g)
    (loss_ref, _), dx_ref = run(lambda a, b: reference(a, b, reduction="none", **opts), x, t, g.double())
    assert_close(loss, loss_ref, torch.float32, "loss")
    assert_close(dx, dx_ref, torch.float32, "dlogits")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("option", ["plain", "weight_smoothing", "everything"])
def test_all_rows_ignored_gives_zero_loss_and_gradient(reduction, option, device, seed):
    x, t, w, _ = draw(seed, 5, 259, torch.float32, ignore_fraction=1.0, device=device)
    opts = dict(OPTIONS[option])
    if opts.pop("weight", False):
        opts["weight"] = w
    x = x.requires_grad_(True)
    loss = liger_torch.cross_entropy(x, t, reduction=reduction, **opts)
    assert torch.equal(loss, torch.zeros_like(loss))
    loss.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))


def test_negative_class_weights_divide_the_mean_as_torch(device, seed):
    """Class weights may be negative: the mean divides by their (here negative) total over the kept targets, as
    torch's; only a total of exactly 0 gives the all-ignored 0."""
    x, t, w, gen = draw(seed, 9, 123, torch.float32, device=device)
    w = (w - 1.3).to(device)  # weights in [-0.8, 0.2): the targets' total is negative
    kept = t[t != -100]
    assert float(w[kept].sum()) < 0
    opts = dict(weight=w, label_smoothing=0.1)
    (loss, _), dx = run(lambda a, b: (liger_torch.cross_entropy(a, b, **opts), None), x, t, torch.tensor(0.7))
    xr = x.double().requires_grad_(True)
    ref = reference(xr, t, **opts)[0]
    ref.backward(torch.tensor(0.7, dtype=torch.float64))
    assert_close(loss, ref, torch.float32, "loss", scale=9 ** 0.5)
    assert_close(dx, xr.grad, torch.float32, "dlogits")
    flce = liger_torch.fused_linear_cross_entropy(x, torch.eye(123, device=device), t, ce_weight=w,
                                                  label_smoothing=0.1)
    assert_close(flce, ref, torch.float32, "fused linear loss", scale=9 ** 0.5)


def test_custom_ignore_index_inside_the_vocab(device, seed):
    x, t, w, gen = draw(seed, 12, 100, torch.float32, ignore_fraction=0.0, device=device)
    t[::3] = 7
    for reduction in ("mean", "sum", "none"):
        g = incoming(None, reduction, gen, 12, device)
        opts = dict(weight=w, ignore_index=7, label_smoothing=0.1, reduction=reduction)
        loss, dx = run(lambda a, b: liger_torch.cross_entropy(a, b, **opts), x, t, g)
        (loss_ref, _), dx_ref = run(lambda a, b: reference(a, b, **opts), x, t, g.double())
        assert_close(loss, loss_ref, torch.float32, "loss")
        assert_close(dx * 12, dx_ref * 12, torch.float32, "dlogits")
        assert torch.equal(dx[::3], torch.zeros_like(dx[::3]))


def test_in_place_writes_the_gradient_over_the_logits(device, seed):
    x, t, _, _ = draw(seed, 7, 300, torch.bfloat16, device=device)
    x = x.requires_grad_(True)
    kept = x.detach().clone()
    liger_torch.cross_entropy(x, t).backward()
    assert torch.equal(x.detach(), kept)  # default: logits untouched
    grad = x.grad.clone()
    x.grad = None
    loss = liger_torch.cross_entropy(x, t, in_place=True)
    assert torch.equal(x.detach(), grad)  # the forward wrote d loss / d logits into the logits' buffer
    loss.backward()
    assert torch.equal(x.grad, grad)


def test_in_place_over_logits_saved_by_autograd_is_detected(device, seed):
    """Overwriting logits that another op saved for its backward must fail loudly, not corrupt gradients."""
    x, t, _, _ = draw(seed, 4, 50, torch.float32, device=device)
    h = x.requires_grad_(True)
    logits = torch.exp(h)  # exp saves its output
    loss = liger_torch.cross_entropy(logits, t, in_place=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_no_grad_computes_no_gradient(device, seed):
    x, t, _, _ = draw(seed, 7, 300, torch.float32, device=device)
    kept = x.clone()
    with torch.no_grad():
        loss = liger_torch.cross_entropy(x.requires_grad_(True), t, in_place=True)
    assert torch.equal(x.detach(), kept)
    assert_close(loss, reference(kept, t)[0], torch.float32, "loss")


def test_second_backward_is_refused(device, seed):
    x, t, _, _ = draw(seed, 4, 50, torch.float32, device=device)
    loss = liger_torch.cross_entropy(x.requires_grad_(True), t)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        loss.backward()


def test_expanded_incoming_gradient_for_none(device, seed):
    """loss.sum().backward() hands reduction='none' a stride-0 gradient."""
    x, t, _, _ = draw(seed, 6, 259, torch.float32, device=device)
    x = x.requires_grad_(True)
    liger_torch.cross_entropy(x, t, reduction="none", lse_square_scale=1e-2).sum().backward()
    ref = x.detach().double().requires_grad_(True)
    reference(ref, t, reduction="none", lse_square_scale=1e-2)[0].sum().backward()
    assert_close(x.grad, ref.grad, torch.float32, "dlogits")


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_incoming_gradient_of_exactly_one(reduction, in_place, device, seed):
    """Rows whose incoming gradient is exactly 1 skip the backward's scaling pass (their gradient is already
    right): a mean's plain backward(), and a per-row gradient mixing ones with other values."""
    x, t, _, gen = draw(seed, 7, 259, torch.bfloat16, device=device)
    if reduction == "none":
        g = torch.randn(7, generator=gen)
        g[[0, 3, 4]] = 1.0
    else:
        g = torch.tensor(1.0)
    g = g.to(device, torch.bfloat16)
    fn = lambda a, b: liger_torch.cross_entropy(a, b, reduction=reduction, label_smoothing=0.1, in_place=in_place)
    loss, dx = run(fn, x, t, g)
    loss_ref, dx_ref = run(lambda a, b: reference(a, b, reduction=reduction, label_smoothing=0.1)[0], x, t,
                           g.double())
    assert_close(loss, loss_ref, torch.bfloat16, "loss")
    scale = 7 if reduction == "mean" else 1.0
    assert_close(dx * scale, dx_ref * scale, torch.bfloat16, "dlogits")


@pytest.mark.parametrize("layout", ["row_slice", "transposed"])
def test_non_contiguous_logits(layout, device, seed):
    gen = torch.Generator().manual_seed(seed)
    if layout == "row_slice":
        base = torch.randn(6, 400, generator=gen).to(device)
        x = base[:, 50:309]
    else:
        x = torch.randn(259, 6, generator=gen).to(device).t()
    assert not x.is_contiguous()
    t = torch.randint(0, 259, (6,), generator=gen).to(device)
    loss, dx = run(lambda a, b: liger_torch.cross_entropy(a, b, label_smoothing=0.1, in_place=True), x, t,
                   torch.tensor(1.0, device=device))
    (loss_ref, _), dx_ref = run(lambda a, b: reference(a, b, label_smoothing=0.1), x, t,
                                torch.tensor(1.0, dtype=torch.float64, device=device))
    assert_close(loss, loss_ref, torch.float32, "loss")
    assert_close(dx * 6, dx_ref * 6, torch.float32, "dlogits")


def test_int32_targets(device, seed):
    x, t, _, _ = draw(seed, 8, 100, torch.float32, device=device)
    loss, dx = run(lambda a, b: liger_torch.cross_entropy(a, b), x, t.int(), torch.tensor(1.0, device=device))
    (loss_ref, _), dx_ref = run(lambda a, b: reference(a, b), x, t,
                                torch.tensor(1.0, dtype=torch.float64, device=device))
    assert_close(loss, loss_ref, torch.float32, "loss")
    assert_close(dx * 8, dx_ref * 8, torch.float32, "dlogits")


def test_bitwise_deterministic(device, seed):
    x, t, w, _ = draw(seed, 33, 1000, torch.float32, device=device)
    runs = [run(lambda a, b: liger_torch.cross_entropy(a, b, w, label_smoothing=0.1), x, t,
                torch.tensor(1.0, device=device)) for _ in range(2)]
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


def test_module_is_drop_in_for_cross_entropy_loss(device, seed):
    x, t, w, _ = draw(seed, 9, 259, torch.float32, device=device)
    ours = liger_torch.CrossEntropyLoss(weight=w, label_smoothing=0.05)
    theirs = torch.nn.CrossEntropyLoss(weight=w, label_smoothing=0.05)
    assert set(ours.state_dict()) == set(theirs.state_dict()) == {"weight"}
    loss, dx = run(ours, x, t, torch.tensor(1.0, device=device))
    loss_ref, dx_ref = run(theirs, x, t, torch.tensor(1.0, device=device))
    assert_close(loss, loss_ref, torch.float32, "loss")
    assert_close(dx * 9, dx_ref * 9, torch.float32, "dlogits")
    z_module = liger_torch.CrossEntropyLoss(lse_square_scale=1e-3, return_z_loss=True)
    loss, z = z_module(x, t)
    assert_close(z, reference(x, t, lse_square_scale=1e-3)[1], torch.float32, "z_loss")


@pytest.mark.parametrize("target_value", [259, -1, 10**6])
def test_out_of_range_target_raises(target_value, device, seed):
    x, t, _, _ = draw(seed, 4, 259, torch.float32, device=device)
    t[2] = target_value
    with pytest.raises(ValueError, match=r"outside \[0, 259\)"):
        liger_torch.cross_entropy(x, t)


# make(device) -> (logits, target); kwargs(device) -> keyword arguments. Everything is built on the test's device,
# so the device check (which runs first) passes and the check under test is the one that fires.
@pytest.mark.parametrize("make,kwargs,error,match", [
    (lambda d: (torch.randn(4, 10, device=d), torch.zeros(5, dtype=torch.long, device=d)), lambda d: {}, ValueError,
     "target must have shape"),
    (lambda d: (torch.randn(4, 10, device=d), torch.zeros(4, device=d)), lambda d: {}, TypeError,
     "target must have an integer dtype"),
    (lambda d: (torch.ones(4, 10, dtype=torch.int32, device=d), torch.zeros(4, dtype=torch.long, device=d)),
     lambda d: {}, TypeError, "logits"),
    (lambda d: (torch.randn(2, 4, 10, device=d), torch.zeros(2, 4, dtype=torch.long, device=d)), lambda d: {},
     ValueError, r"\(N, V\)"),
    (lambda d: (torch.randn(0, 10, device=d), torch.zeros(0, dtype=torch.long, device=d)), lambda d: {}, ValueError,
     "logits must not be empty"),
    (lambda d: (torch.randn(4, 10, device=d), torch.zeros(4, dtype=torch.long, device=d)),
     lambda d: {"weight": torch.ones(9, device=d)}, ValueError, r"weight must have shape \(10,\)"),
    (lambda d: (torch.randn(4, 10, device=d), torch.zeros(4, dtype=torch.long, device=d)),
     lambda d: {"weight": torch.ones(10, dtype=torch.long, device=d)}, TypeError, "weight"),
    (lambda d: (torch.randn(4, 10, device=d), torch.zeros(4, dtype=torch.long, device=d)),
     lambda d: {"reduction": "avg"}, ValueError, "reduction"),
    (lambda d: (torch.randn(4, 10, device=d), torch.zeros(4, dtype=torch.long, device=d)),
     lambda d: {"label_smoothing": 1.5}, ValueError, "label_smoothing"),
    (lambda d: (torch.randn(4, 10, device=d), torch.zeros(4, dtype=torch.long, device=d)),
     lambda d: {"lse_square_scale": -1.0}, ValueError, "lse_square_scale"),
    (lambda d: (torch.randn(4, 10, device=d), torch.zeros(4, dtype=torch.long, device=d)),
     lambda d: {"softcap": 0.0}, ValueError, "softcap"),
    (lambda d: ([[1.0]], torch.zeros(1, dtype=torch.long, device=d)), lambda d: {}, TypeError,
     "logits must be a torch.Tensor"),
])
def test_bad_input_raises_before_launch(make, kwargs, error, match, device):
    x, t = make(device)
    with pytest.raises(error, match=match):
        liger_torch.cross_entropy(x, t, **kwargs(device))


def test_target_check_steps_aside_while_a_cuda_graph_is_captured(monkeypatch, device):
    """No host sync is allowed during CUDA-graph capture, so the eager target check is skipped then (the GPU
    test tests/gpu/test_cuda_graphs.py captures for real); an invalid target's row is then NaN, as the kernel
    marks it, rather than garbage."""
    import sys

    module = sys.modules["liger_torch.cross_entropy"]
    x = torch.randn(4, 10, device=device)
    t = torch.tensor([1, 10, 2, -100], device=device)  # 10 is outside [0, 10)
    with pytest.raises(ValueError, match="outside"):
        liger_torch.cross_entropy(x, t)
    monkeypatch.setattr(module, "capturing_cuda_graph", lambda tensor: True)
    rows = liger_torch.cross_entropy(x, t, reduction="none")
    assert torch.isnan(rows[1]) and torch.isfinite(rows[[0, 2, 3]]).all()
    assert torch.isnan(liger_torch.cross_entropy(x, t))


@pytest.mark.parametrize("fn", ["cross_entropy", "fused_linear_cross_entropy"])
def test_target_check_reads_its_count_after_the_loss_kernels_are_queued(fn, monkeypatch, device):
    """The check's host read of the invalid-target count comes after the loss's kernels are launched (reading it
    first left the GPU idle through the host's launch path), and a bad target still raises."""
    import liger_core.cross_entropy
    import liger_torch._launch

    events = []
    launch_for_real = liger_torch._launch._launch
    item_for_real = torch.Tensor.item

    def recording_launch(launch, *args, **kwargs):
        events.append(launch.kernel.__name__ if hasattr(launch.kernel, "__name__") else launch.kernel.fn.__name__)
        return launch_for_real(launch, *args, **kwargs)

    def recording_item(self):
        events.append("item")
        return item_for_real(self)

    monkeypatch.setattr(liger_torch._launch, "_launch", recording_launch)
    monkeypatch.setattr(torch.Tensor, "item", recording_item)
    gen = torch.Generator().manual_seed(3)
    t = torch.tensor([1, 4, -100, 9], device=device)
    if fn == "cross_entropy":
        call = lambda target: liger_torch.cross_entropy(  # noqa: E731
            torch.randn(4, 10, generator=gen).to(device), target)
    else:
        call = lambda target: liger_torch.fused_linear_cross_entropy(  # noqa: E731
            torch.randn(4, 8, generator=gen).to(device), torch.randn(10, 8, generator=gen).to(device), target)
    call(t)
    kernel = liger_core.cross_entropy._cross_entropy_kernel.fn.__name__
    assert kernel in events and "item" in events and events.index(kernel) < events.index("item"), events
    events.clear()
    with pytest.raises(ValueError, match="outside"):
        call(torch.tensor([1, 10, -100, 9], device=device))
    assert events.index(kernel) < events.index("item"), events


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("g", [0.7, 1.0, "per_row"])
def test_scale_strides_over_more_tiles_than_programs(in_place, g, device, seed):
    """The backward's scale: a fixed number of programs, each over several (row, block) tiles; exact in fp32 (one
    multiplication), every element written (out of place into a fresh buffer); in place, a scalar of 1 returns
    at once and rows whose own value is 1 are skipped."""
    from liger_core import cross_entropy as core
    from liger_torch._launch import info, run_plan

    gen = torch.Generator().manual_seed(seed)
    rows = core._SCALE_PROGRAMS + 77
    grad = torch.randn(rows, 20, generator=gen).to(device)
    if g == "per_row":
        g_t = torch.randn(rows, generator=gen).to(device)
        g_t[::3] = 1.0
        reduction, expected = "none", grad * g_t[:, None]
    else:
        g_t = torch.tensor(g, device=device)
        reduction, expected = "mean", grad * g
    plan = core.backward_plan(info(grad), info(g_t), reduction=reduction, in_place=in_place)
    assert plan.launches[0].grid == (core._SCALE_PROGRAMS,)
    work = grad.clone()
    (out,) = run_plan(plan, grad=work, grad_output=g_t)
    assert (out.data_ptr() == work.data_ptr()) == in_place
    assert torch.equal(out, expected)


# (rows, vocab, segment, lag rows: gradient jobs interleaved with later rows' statistics jobs, or after them all)
LAGGED_CASES = [(7, 1000, 64, 2), (5, 259, 16, 1), (1, 77, 32, None), (9, 300, 128, 3)]


def run_lagged(x, t, lagged, reduction, opts, in_place=False):
    """(loss, dlogits for an incoming gradient of 1) from the plan with the given kernel choice."""
    from liger_torch._launch import info, run_plan

    core = liger_core.cross_entropy
    weight = opts.get("weight")
    kwargs = {k: v for k, v in opts.items() if k != "weight"}
    plan = core.forward_plan(info(x), info(t), info(weight) if weight is not None else None, reduction=reduction,
                             in_place=in_place, lagged=lagged, **kwargs)
    kernels = {launch.kernel for launch in plan.launches}
    assert (core._cross_entropy_lagged_kernel in kernels) == (lagged is not False), kernels
    inputs = {"logits": x.clone(), "target": t}
    if weight is not None:
        inputs["weight"] = weight
    return run_plan(plan, **inputs)


@pytest.mark.parametrize("n,v,segment,lag", LAGGED_CASES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_lagged_kernel_matches_the_reference(n, v, segment, lag, reduction, option, device, seed, monkeypatch):
    """The lagged kernel (rows cut into segments, statistics and gradient jobs in one grid) against float64
    torch, segments forced narrow so the small rows have several (and a partial last one), a row ignored, the
    lag short enough for gradient jobs to run between later rows' statistics jobs."""
    if lag is not None:
        monkeypatch.setitem(liger_core.cross_entropy.LAGGED, "lag_bytes", lag * v * 4)
        assert liger_core.cross_entropy.lag_rows(v, "float32") == lag
    x, t, w, gen = draw(seed, n, v, torch.float32, device=device)
    t[n // 2] = -100
    t[0] = v - 1  # a target in the partial last segment
    x[-1, v // 2] = 70.0  # a row max in a middle segment
    opts = dict(OPTIONS[option])
    if opts.pop("weight", False):
        opts["weight"] = w
    loss, dx = run_lagged(x, t, segment, reduction, opts)
    (loss_ref, _), dx_ref = run(lambda a, b: reference(a, b, reduction=reduction, **opts), x, t,
                                torch.ones_like(loss, dtype=torch.float64))
    assert_close(loss, loss_ref, torch.float32, "loss")
    scale = n if reduction == "mean" else 1.0
    assert_close(dx * scale, dx_ref * scale, torch.float32, "dlogits")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("in_place", [False, True])
def test_lagged_kernel_half_precision_agrees_with_the_two_pass_kernel(dtype, in_place, device, seed):
    """In half precision, in place or not, with every option: the lagged kernel's loss and gradient within a
    rounding of the two-pass kernel's (their logsumexps are summed in different orders), z-loss returned."""
    x, t, w, _ = draw(seed, 6, 1000, dtype, device=device)
    opts = dict(OPTIONS["everything"], weight=w, return_z_loss=True)
    two_pass = run_lagged(x, t, False, "none", opts, in_place=in_place)
    lagged = run_lagged(x, t, 64, "none", opts, in_place=in_place)
    for name, a, b in zip(("loss", "z_loss", "dlogits"), two_pass, lagged):
        assert_close(b, a.double(), dtype, name)


def test_lagged_kernel_by_width():
    """By default rows of 98304 columns up take the lagged kernel for the loss with its gradient (in place it
    lost at 65536 on an H100); the loss alone, and narrower rows, the two-pass one. Its lag is 12 MiB of rows."""
    from liger_core.launch import ArrayInfo

    core = liger_core.cross_entropy
    target = ArrayInfo.contiguous((8,), "int64")

    def kernel(v, **kwargs):
        plan = core.forward_plan(ArrayInfo.contiguous((8, v), "bfloat16"), target, **kwargs)
        return {launch.kernel for launch in plan.launches} & {core._cross_entropy_kernel,
                                                              core._cross_entropy_lagged_kernel}

    assert core.uses_lagged(98304) and core.uses_lagged(10**6) and not core.uses_lagged(98303)
    assert kernel(128256) == kernel(98304) == kernel(256000) == {core._cross_entropy_lagged_kernel}
    assert kernel(65536) == kernel(128256, compute_grad=False) == kernel(128256, lagged=False) == {
        core._cross_entropy_kernel}
    assert kernel(1000, lagged=True) == {core._cross_entropy_lagged_kernel}
    with pytest.raises(ValueError, match="lagged"):
        kernel(1000, lagged=48)
    assert core.lag_rows(128256, "bfloat16") == 49 and core.lag_rows(128256, "float32") == 24
    assert core.lag_rows(1000, "bfloat16") == 256 and core.lag_rows(10**8, "float32") == 1


def test_lagged_from_65536_fixture(lagged_from_65536):
    """The fixture the frontends' wide-row tests take: the lagged kernel from 65536 columns, at any width."""
    core = liger_core.cross_entropy
    assert core.uses_lagged(65536) and core.uses_lagged(10**6) and not core.uses_lagged(65535)


def test_lagged_kernel_is_bitwise_deterministic(device, seed):
    """The segments' statistics are combined in segment order, whichever job finishes last."""
    x, t, w, _ = draw(seed, 9, 1000, torch.bfloat16, device=device)
    first = run_lagged(x, t, 64, "mean", {"label_smoothing": 0.1})
    second = run_lagged(x, t, 64, "mean", {"label_smoothing": 0.1})
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_lagged_chunk_with_per_row_gradient_scale(device, seed):
    """Fused linear cross-entropy's chunk plan (gradient written over the chunk's logits, scaled per row for
    reduction='none') through the lagged kernel, against the two-pass kernel."""
    from liger_torch._launch import info, run_plan

    core = liger_core.cross_entropy
    x, t, w, gen = draw(seed, 7, 1000, torch.float32, device=device)
    g = torch.randn(7, generator=gen).to(device)
    denominators = run_plan(core.denominators_plan(info(t), None, 1000, -100), target=t)[0]
    results = []
    for lagged in (False, 64):
        plan = core.chunk_plan(info(x), info(t), None, ignore_index=-100, reduction="mean", label_smoothing=0.1,
                               lse_square_scale=1e-3, softcap=None, return_z_loss=True, compute_grad=True,
                               grad_scale=info(g), lagged=lagged)
        results.append(run_plan(plan, logits=x.clone(), target=t, denom=denominators, grad_scale=g))
    for name, a, b in zip(("loss_rows", "z_rows", "grad"), *results):
        assert_close(b, a.double(), torch.float32, name)

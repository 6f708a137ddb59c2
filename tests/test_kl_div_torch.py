"""liger_torch.kl_div / KLDivLoss against F.kl_div in float64, forward and backward."""

import pytest
import torch
import torch.nn.functional as F

import liger_torch
from helpers import assert_close
from liger_core import kl_div
from liger_torch._launch import info, run_plan

REDUCTIONS = ["none", "sum", "mean", "batchmean"]


def draw(seed, shape, dtype, log_target, device="cpu"):
    """Drawn on the CPU from a seeded generator (the same numbers on every device), then moved to ``device``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.log_softmax(torch.randn(shape, generator=gen) * 2, -1).to(dtype)
    if log_target:
        t = torch.log_softmax(torch.randn(shape, generator=gen) * 2, -1).to(dtype)
    else:
        t = torch.softmax(torch.randn(shape, generator=gen) * 2, -1)
        t.view(-1, shape[-1])[0, :7] = 0.0  # zero probabilities: 0 * log 0 = 0
        t = t.to(dtype)
    return x.to(device), t.to(device), gen


@pytest.mark.parametrize("shape", [(7, 1000), (2, 3, 259)])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("log_target", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grad_in_forward", [True, False])
def test_forward_backward(shape, reduction, log_target, dtype, grad_in_forward, device, seed):
    x, t, gen = draw(seed, shape, dtype, log_target, device=device)
    g_shape = shape if reduction == "none" else ()
    g = (torch.randn(g_shape, generator=gen) if reduction == "none" else torch.tensor(0.7)).to(device, dtype)
    xa = x.clone().requires_grad_(True)
    loss = liger_torch.kl_div(xa, t, reduction, log_target, grad_in_forward=grad_in_forward)
    loss.backward(g)
    xr = x.double().requires_grad_(True)
    ref = F.kl_div(xr, t.double(), reduction=reduction, log_target=log_target)
    ref.backward(g.double())
    assert loss.dtype == dtype and loss.shape == ref.shape and xa.grad.dtype == dtype
    # sums over many elements: widen the bound with sqrt(elements)
    widen = 1.0 if reduction == "none" else x.numel() ** 0.5
    assert_close(loss, ref, dtype, "loss", scale=widen)
    # the means' gradients are ~1/count: compare them scaled up
    count = {"mean": x.numel(), "batchmean": shape[0]}.get(reduction, 1)
    assert_close(xa.grad * count, xr.grad * count, dtype, "dinput")


def test_vocab_over_several_blocks_and_module(device, seed):
    x, t, _ = draw(seed, (3, 32003), torch.float32, False, device=device)  # several blocks, not a power of two
    xa = x.clone().requires_grad_(True)
    loss = liger_torch.KLDivLoss(reduction="batchmean")(xa, t)
    loss.backward()
    xr = x.double().requires_grad_(True)
    ref = torch.nn.KLDivLoss(reduction="batchmean")(xr, t.double())
    ref.backward()
    assert_close(loss, ref, torch.float32, "loss")
    assert_close(xa.grad * 3, xr.grad * 3, torch.float32, "dinput")


@pytest.mark.parametrize("plan_kind", ["none", "batchmean with grad", "row sums with grad"])
def test_forward_over_several_column_chunks(plan_kind, device, seed):
    """The forward's grid is rows x column chunks: with chunks of 4096 columns (two steps of 2048) a row of 5000
    spans 2 programs, the second one partial (its second step all masked). Outputs start as NaN (poisoned), so a
    chunk or step left unwritten or unsummed shows up as NaN."""
    x, t, _ = draw(seed, (2, 3, 5000), torch.float32, False, device=device)
    x_info, t_info = info(x), info(t)
    if plan_kind == "row sums with grad":
        plan = kl_div.row_sums_plan(x_info, t_info, grad_scale=0.25, chunk=4096)
    else:
        reduction = plan_kind.split()[0]
        plan = kl_div.forward_plan(x_info, t_info, reduction=reduction, compute_grad=reduction != "none",
                                   chunk=4096)
    assert plan.launches[0].grid == (6, 2) and plan.launches[0].constexprs["BLOCK"] == 2048
    loss, *grad = run_plan(plan, input=x, target=t)
    pointwise = F.kl_div(x.double(), t.double(), reduction="none")
    if plan_kind == "none":
        assert_close(loss, pointwise, torch.float32, "loss")
        return
    # sums over many elements: widen the bound with sqrt(elements summed)
    if plan_kind == "row sums with grad":  # a shard's per-row sums; the gradient scaled by the global divisor
        ref, grad_scale, widen = pointwise.sum(-1).flatten(), 0.25, 5000 ** 0.5
    else:
        ref, grad_scale, widen = pointwise.sum() / 2, 0.5, x.numel() ** 0.5  # batchmean: x.shape[0] == 2
    assert_close(loss, ref, torch.float32, "loss", scale=widen)
    assert_close(grad[0], -t.double() * grad_scale, torch.float32, "grad")


def test_non_contiguous_and_expanded_grad(device, seed):
    x, t, _ = draw(seed, (259, 6), torch.float32, False, device=device)
    x, t = x.t(), t.t()  # rows along a strided axis
    xa = x.clone().t().t().requires_grad_(True)
    assert not xa.is_contiguous()
    liger_torch.kl_div(xa, t, "none").sum().backward()  # stride-0 incoming gradient
    xr = x.double().requires_grad_(True)
    F.kl_div(xr, t.double(), reduction="none").sum().backward()
    assert_close(xa.grad, xr.grad, torch.float32, "dinput")


@pytest.mark.parametrize("reduction", ["sum", "batchmean"])
def test_gradient_from_the_forward_is_scaled_once(reduction, device, seed):
    """A loss reduced to a scalar gets its gradient in the forward and the backward scales it in place: a second
    backward through the same graph is refused instead of scaling it twice. Without grad, none is computed."""
    x, t, _ = draw(seed, (3, 259), torch.float32, False, device=device)
    loss = liger_torch.kl_div(x.clone().requires_grad_(True), t, reduction)
    loss.backward(torch.tensor(0.5, device=device), retain_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        loss.backward()
    xa = x.clone().requires_grad_(True)
    separate = liger_torch.KLDivLoss(reduction, grad_in_forward=False)(xa, t)  # the gradient from the target
    separate.backward(retain_graph=True)
    separate.backward()
    assert_close(xa.grad, -2 * t / (3 if reduction == "batchmean" else 1), torch.float32, "dinput")
    with torch.no_grad():
        plain = liger_torch.kl_div(x.clone().requires_grad_(True), t, reduction)
    assert not plain.requires_grad
    assert_close(plain, F.kl_div(x.double(), t.double(), reduction=reduction), torch.float32, "no-grad loss",
                 scale=x.numel() ** 0.5)


def test_elementwise_loss_backward_twice(device, seed):
    """``none`` computes its gradient in the backward, from the target: a retained graph runs it again."""
    x, t, gen = draw(seed, (3, 259), torch.float32, False, device=device)
    xa = x.clone().requires_grad_(True)
    loss = liger_torch.kl_div(xa, t, "none")
    g = torch.randn(x.shape, generator=gen).to(device)
    loss.backward(g, retain_graph=True)
    loss.backward(g)
    assert_close(xa.grad, -2 * t * g, torch.float32, "dinput")


def test_bad_input(device):
    x = torch.zeros(2, 3, device=device)
    with pytest.raises(ValueError, match="reduction"):
        liger_torch.kl_div(x, torch.zeros(2, 3, device=device), "avg")
    with pytest.raises(ValueError, match="target must have the shape of input"):
        liger_torch.kl_div(x, torch.zeros(2, 4, device=device))
    with pytest.raises(TypeError, match="target must have a floating"):
        liger_torch.kl_div(x, torch.zeros(2, 3, dtype=torch.long, device=device))
    with pytest.raises(ValueError, match="target requires grad"):
        liger_torch.kl_div(x, torch.zeros(2, 3, requires_grad=True, device=device))


def _clear_plan_caches():
    for plan in (kl_div.forward_plan, kl_div.row_sums_plan, kl_div.backward_plan):
        plan.cache_clear()


@pytest.mark.parametrize("reduction", ["none", "batchmean"])
def test_column_blocks_past_grid_axis_1_run_on_one_axis(reduction, device, seed, monkeypatch):
    """A flattened array of 268M+ elements has more column blocks than CUDA's grid axis 1 takes (65535): the
    programs then run on one axis of rows x blocks, decoded in the kernel. The limit lowered to 1 here puts
    every multi-block launch on that path: the same bits as the 2-d grid, a reference's numbers."""
    x, t, gen = draw(seed, (5, 9001), torch.float32, True, device=device)
    g = torch.randn(x.shape if reduction == "none" else (), generator=gen).to(device)
    monkeypatch.setattr(kl_div, "FORWARD_CHUNK", 4096)  # 3 chunks a row in the forward, 3 blocks in the backward

    def run():
        _clear_plan_caches()
        xa = x.clone().requires_grad_(True)
        loss = liger_torch.kl_div(xa, t, reduction, True, grad_in_forward=False)
        loss.backward(g)
        return loss.detach(), xa.grad

    expected = run()
    from liger_core import launch
    monkeypatch.setattr(launch, "MAX_GRID_YZ", 1)
    _clear_plan_caches()
    launches = kl_div.forward_plan(info(x), info(t), reduction=reduction, log_target=True,
                                   compute_grad=False).launches
    assert launches[0].grid == (15,) and launches[0].constexprs["FLAT_GRID"]
    flat = run()
    monkeypatch.undo()
    _clear_plan_caches()
    assert torch.equal(flat[0], expected[0]) and torch.equal(flat[1], expected[1])
    ref_x = x.double().requires_grad_(True)
    ref = F.kl_div(ref_x, t.double(), reduction=reduction, log_target=True)
    ref.backward(g.double())
    assert_close(flat[0], ref, torch.float32, "loss", scale=1.0 if reduction == "none" else x.numel() ** 0.5)
    assert_close(flat[1] * 5, ref_x.grad * 5, torch.float32, "dinput")

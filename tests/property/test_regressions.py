"""Regression tests for failure classes of kernel libraries seen in the field that can be checked on CPU:
all-ignored batches, NaN/inf propagation, and the loss scale under gradient accumulation (num_items_in_batch).
"""

import pytest
import torch

import liger_torch
from helpers import assert_close
from property_helpers import device
from test_cross_entropy_torch import reference as ce_reference
from test_rms_norm_torch import reference as rms_reference

DEVICE = device()
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NAN, INF = float("nan"), float("inf")
# The interpreter runs the kernels in numpy, which warns on inf - inf and 0 * inf: expected here.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:overflow encountered:RuntimeWarning")


def assert_same_nonfinite(actual, expected, dtype, name):
    """NaN exactly where the reference has NaN, +-inf exactly where it has +-inf, the rest within tolerance."""
    actual = actual.detach().to("cpu", torch.float64)
    expected = expected.detach().to("cpu", torch.float64)
    assert actual.shape == expected.shape, name
    assert torch.equal(torch.isnan(actual), torch.isnan(expected)), (
        f"{name}: NaN at {torch.isnan(actual).nonzero().tolist()}, reference at "
        f"{torch.isnan(expected).nonzero().tolist()}")
    for sign in (INF, -INF):
        assert torch.equal(actual == sign, expected == sign), f"{name}: {sign} positions differ"
    finite = torch.isfinite(expected)
    if finite.any():
        assert_close(actual[finite], expected[finite], dtype, name)


def grad_pair(fn, ref_fn, x, g, *extra):
    """(y, dx, *d extra) from ours and from the float64 reference, for incoming gradient g."""
    out = []
    for f, cast in ((fn, lambda t: t), (ref_fn, lambda t: t.double())):
        leaves = [cast(t.detach()).requires_grad_(True) for t in (x,) + extra]
        y = f(*leaves)
        y.backward(cast(g.clone()))
        out.append((y,) + tuple(t.grad for t in leaves))
    return out


# ------------------------------------------------------------------------------------- all-ignored batches
@pytest.mark.parametrize("n", [1, 5])
@pytest.mark.parametrize("ignore_index", [-100, 3])
@pytest.mark.parametrize("option", [{}, {"label_smoothing": 0.1, "lse_square_scale": 1e-2, "softcap": 5.0},
                                    {"weight": True, "label_smoothing": 0.2}])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_ce_all_ignored_batch_gives_zero_loss_and_zero_grad(n, ignore_index, option, reduction, dtype):
    """mean over zero kept rows must be 0 (not 0/0 = NaN) and every logit must get exactly zero gradient."""
    gen = torch.Generator().manual_seed(n * 1000 + ignore_index)
    x = (torch.randn(n, 97, generator=gen) * 4).to(DEVICE, dtype).requires_grad_(True)
    t = torch.full((n,), ignore_index, dtype=torch.long, device=DEVICE)
    opts = dict(option)
    if opts.pop("weight", False):
        opts["weight"] = (torch.rand(97, generator=gen) + 0.5).to(DEVICE)
    loss, z = liger_torch.cross_entropy(x, t, ignore_index=ignore_index, reduction=reduction, return_z_loss=True,
                                        **opts)
    assert loss.shape == (() if reduction != "none" else (n,)) and loss.dtype == dtype
    assert torch.equal(loss, torch.zeros_like(loss)) and torch.equal(z, torch.zeros_like(z))
    loss.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))


# --------------------------------------------------------------------------------------- NaN / inf inputs
@pytest.mark.parametrize("mode,offset,with_weight", [("llama", 0.0, True), ("gemma", 1.0, True),
                                                     ("none", 0.0, True), ("llama", 0.0, False)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_nan_and_inf_propagate_like_the_reference(mode, offset, with_weight, dtype):
    """A NaN makes its row NaN (forward and dx) and dw NaN; +-inf gives NaN at that element and 0 elsewhere in
    its row (rstd = 0); other rows stay exact. Neither masked nor crashing."""
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(5, 31, generator=gen) * 3)
    x[1, 4], x[2, 0], x[3, 30] = NAN, INF, -INF
    x = x.to(DEVICE, dtype)
    w = (torch.randn(31, generator=gen) * 0.5 + 1).to(DEVICE, dtype)
    g = torch.randn(5, 31, generator=gen).to(DEVICE, dtype)
    if with_weight:
        ours, ref = grad_pair(lambda a, b: liger_torch.rms_norm(a, b, 1e-6, offset, mode),
                              lambda a, b: rms_reference(a, b, 1e-6, offset, mode), x, g, w)
    else:
        ours, ref = grad_pair(lambda a: liger_torch.rms_norm(a, None, 1e-6, offset, mode),
                              lambda a: rms_reference(a, None, 1e-6, offset, mode), x, g)
    for got, want, name in zip(ours, ref, ("y", "dx", "dw")):
        assert_same_nonfinite(got, want, dtype, name)
    assert torch.isfinite(ours[0][[0, 4]]).all() and torch.isfinite(ours[1][[0, 4]]).all()


@pytest.mark.parametrize("option", [{}, {"label_smoothing": 0.1}, {"softcap": 5.0, "lse_square_scale": 1e-2},
                                    {"weight": True}])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_ce_nan_or_inf_logit_row_gives_nan_loss_for_that_row(option, reduction, dtype):
    """A NaN logit, or a +inf one without softcap (inf - inf in the softmax), makes that row's loss and gradient NaN (and so a
    reduced loss NaN), exactly as torch's cross_entropy: not a crash, not a silently finite value. Other rows'
    per-row losses and gradients are unaffected."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(6, 97, generator=gen) * 4
    x[1, 5] = NAN
    x[3, 40] = INF
    x = x.to(DEVICE, dtype)
    t = torch.randint(0, 97, (6,), generator=gen)
    t[4] = -100
    t = t.to(DEVICE)
    opts = dict(option, reduction=reduction)
    if opts.pop("weight", False):
        opts["weight"] = (torch.rand(97, generator=gen) + 0.5).to(DEVICE)
    g = (torch.randn(6, generator=gen) if reduction == "none" else torch.tensor(1.0)).to(DEVICE, dtype)
    ours, ref = grad_pair(lambda a: liger_torch.cross_entropy(a, t, **opts),
                          lambda a: ce_reference(a, t, **opts)[0], x, g)
    loss, dx = ours
    nan_rows = [1] if "softcap" in opts else [1, 3]  # a softcap maps +inf to the finite cap
    if reduction == "none":
        assert torch.isnan(loss[nan_rows]).all()
        assert torch.isfinite(loss[[r for r in range(6) if r not in nan_rows]]).all()
    else:
        assert torch.isnan(loss)
    assert torch.isnan(dx[nan_rows]).all()
    assert torch.equal(dx[4], torch.zeros_like(dx[4]))  # an ignored row stays exactly zero
    assert_same_nonfinite(loss, ref[0], dtype, "loss")
    scale = 6.0 if reduction == "mean" else 1.0
    assert_same_nonfinite(dx * scale, ref[1] * scale, dtype, "dlogits")


@pytest.mark.parametrize("option", [{}, {"label_smoothing": 0.1}, {"softcap": 5.0}])
@pytest.mark.parametrize("dtype", DTYPES)
def test_ce_minus_inf_masked_vocab_matches_reference(option, dtype):
    """-inf logits at non-target classes (a masked vocabulary) give a finite loss and zero gradient there without
    smoothing; with label smoothing the smoothing term is inf, as in torch; with a softcap they are finite."""
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(4, 64, generator=gen) * 4
    t = torch.tensor([0, 1, 2, 3])
    x[:, 32:] = -INF
    x = x.to(DEVICE, dtype)
    t = t.to(DEVICE)
    g = torch.randn(4, generator=gen).to(DEVICE, dtype)
    ours, ref = grad_pair(lambda a: liger_torch.cross_entropy(a, t, reduction="none", **option),
                          lambda a: ce_reference(a, t, reduction="none", **option)[0], x, g)
    assert_same_nonfinite(ours[0], ref[0], dtype, "loss")
    assert_same_nonfinite(ours[1], ref[1], dtype, "dlogits")
    if not option:
        assert torch.isfinite(ours[0]).all() and torch.equal(ours[1][:, 32:], torch.zeros_like(ours[1][:, 32:]))


# ------------------------------------------------------------------------------ gradient-accumulation scale
@pytest.mark.parametrize("option", [{}, {"label_smoothing": 0.1, "softcap": 6.0, "lse_square_scale": 1e-3}])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ce_sum_over_num_items_in_batch_matches_full_batch_mean(option, dtype):
    """Gradient accumulation as transformers does it with num_items_in_batch: each micro-batch's
    reduction='sum' loss divided by the number of non-ignored targets in the whole batch. The summed losses and
    accumulated gradients must equal the mean loss of the whole batch (float64 reference and our own mean),
    not the mean of the micro-batch means."""
    gen = torch.Generator().manual_seed(17)
    sizes = [3, 7, 1]
    x = (torch.randn(sum(sizes), 123, generator=gen) * 4).to(DEVICE, dtype)
    t = torch.randint(0, 123, (sum(sizes),), generator=gen)
    t[[0, 1, 5, 6, 7]] = -100  # uneven ignoring across micro-batches: per-micro-batch means would be wrong
    t = t.to(DEVICE)
    num_items = int((t != -100).sum())

    leaf = x.detach().clone().requires_grad_(True)
    total = 0.0
    for chunk_x, chunk_t in zip(leaf.split(sizes), t.split(sizes)):
        loss = liger_torch.cross_entropy(chunk_x, chunk_t, reduction="sum", **option) / num_items
        loss.backward()
        total = total + loss.detach().double()

    full = x.detach().clone().requires_grad_(True)
    liger_torch.cross_entropy(full, t, reduction="mean", **option).backward()
    ref = x.detach().double().requires_grad_(True)
    loss_ref = ce_reference(ref, t, reduction="mean", **option)[0]
    loss_ref.backward()

    n = sum(sizes)
    assert_close(total, loss_ref, dtype, "accumulated loss", scale=len(sizes))
    assert_close(leaf.grad * n, ref.grad * n, dtype, "accumulated dlogits", scale=2.0)
    assert_close(leaf.grad * n, full.grad * n, dtype, "accumulated vs full-batch dlogits", scale=2.0)
    mean_of_means = sum(float(ce_reference(cx, ct, reduction="mean", **option)[0])
                        for cx, ct in zip(x.double().split(sizes), t.split(sizes))) / len(sizes)
    assert abs(mean_of_means - float(loss_ref.detach())) > 0.05  # the setup does distinguish the two scales

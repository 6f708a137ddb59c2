"""liger_torch.jsd / JSD against float64 references (explicit formulas and F.kl_div), forward and backward."""

import pytest
import torch
import torch.nn.functional as F

import liger_torch
from helpers import assert_close


def reference_rows(s, t, beta):
    """float64 per-row generalized JSD of student / teacher log-probs (0 * log 0 = 0)."""
    s, t = s.double(), t.double()
    p, q = t.exp(), s.exp()
    if beta == 0.0:
        pointwise = torch.where(p == 0, 0.0, p * (t - s))
    elif beta == 1.0:
        pointwise = torch.where(q == 0, 0.0, q * (s - t))
    else:
        log_m = torch.log(beta * p + (1 - beta) * q)
        pointwise = (beta * torch.where(p == 0, 0.0, p * (t - log_m))
                     + (1 - beta) * torch.where(q == 0, 0.0, q * (s - log_m)))
    return pointwise.sum(-1)


def reference(s, t, beta, labels=None, ignore_index=-100):
    rows = reference_rows(s, t, beta)
    if labels is None:
        return rows.mean()
    keep = labels != ignore_index
    return (rows * keep).sum() / keep.sum() if keep.any() else (rows * 0).sum()


def draw(seed, shape, dtype, device="cpu", ignore_fraction=0.3):
    """Drawn on the CPU from a seeded generator (the same numbers on every device), then moved to ``device``."""
    gen = torch.Generator().manual_seed(seed)
    s = torch.log_softmax(torch.randn(shape, generator=gen) * 2, -1).to(dtype)
    t = torch.log_softmax(torch.randn(shape, generator=gen) * 2, -1).to(dtype)
    labels = torch.randint(0, shape[-1], shape[:-1], generator=gen)
    labels[torch.rand(shape[:-1], generator=gen) < ignore_fraction] = -100
    labels.view(-1)[0] = 3  # at least one kept row
    return s.to(device), t.to(device), labels.to(device)


def run(s, t, labels, beta, g=0.7, **kwargs):
    leaf = s.clone().requires_grad_(True)
    loss = liger_torch.jsd(leaf, t, labels, beta=beta, **kwargs)
    loss.backward(torch.tensor(g, device=s.device, dtype=loss.dtype))
    return loss, leaf.grad


def run_reference(s, t, labels, beta, g=0.7, **kwargs):
    leaf = s.detach().double().requires_grad_(True)
    loss = reference(leaf, t, beta, labels, **kwargs)
    loss.backward(torch.tensor(g, dtype=torch.float64, device=s.device))
    return loss, leaf.grad


@pytest.mark.parametrize("shape", [(7, 1000), (2, 3, 259), (2, 32003)])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("with_labels", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_backward(shape, beta, with_labels, dtype, device, seed):
    s, t, labels = draw(seed, shape, dtype, device)
    labels = labels if with_labels else None
    loss, grad = run(s, t, labels, beta)
    loss_ref, grad_ref = run_reference(s, t, labels, beta)
    assert loss.dtype == dtype and loss.shape == () and grad.dtype == dtype
    assert_close(loss, loss_ref, dtype, "loss", scale=4.0)  # a mean of row sums over V terms
    rows = shape[0] * (shape[1] if len(shape) == 3 else 1)
    count = rows if labels is None else int((labels != -100).sum())  # the mean's gradient is ~1/count
    assert_close(grad * count, grad_ref * count, dtype, "dstudent")
    if labels is not None:
        assert torch.equal(grad[labels == -100], torch.zeros_like(grad[labels == -100]))


def test_limits_are_forward_and_reverse_kl(device, seed):
    """beta=0 is F.kl_div(student, teacher) = KL(P||Q), beta=1 is F.kl_div(teacher, student) = KL(Q||P), beta=0.5
    the symmetric JSD; and the endpoints are the limits of JSD_beta / beta and JSD_beta / (1 - beta)."""
    s, t, _ = draw(seed, (6, 1000), torch.float32, device)
    n = s.shape[0]
    sd = s.double().requires_grad_(True)
    forward_kl = F.kl_div(sd, t.double(), reduction="sum", log_target=True) / n
    loss, grad = run(s, t, None, 0.0, g=1.0)
    forward_kl.backward()
    assert_close(loss, forward_kl, torch.float32, "beta=0 loss", scale=4.0)
    assert_close(grad * n, sd.grad * n, torch.float32, "beta=0 grad")

    sd = s.double().requires_grad_(True)
    reverse_kl = F.kl_div(t.double(), sd, reduction="sum", log_target=True) / n
    loss, grad = run(s, t, None, 1.0, g=1.0)
    reverse_kl.backward()
    assert_close(loss, reverse_kl, torch.float32, "beta=1 loss", scale=4.0)
    assert_close(grad * n, sd.grad * n, torch.float32, "beta=1 grad")

    sd = s.double().requires_grad_(True)
    log_m = torch.logsumexp(torch.stack([sd, t.double()]), 0) - torch.log(torch.tensor(2.0, dtype=torch.float64))
    symmetric = (0.5 * F.kl_div(log_m, t.double(), reduction="sum", log_target=True)
                 + 0.5 * F.kl_div(log_m, sd, reduction="sum", log_target=True)) / n
    loss, grad = run(s, t, None, 0.5, g=1.0)
    symmetric.backward()
    assert_close(loss, symmetric, torch.float32, "beta=0.5 loss", scale=4.0)
    assert_close(grad * n, sd.grad * n, torch.float32, "beta=0.5 grad")

    # JSD_beta itself tends to 0 at both ends; the endpoints are the limits of JSD_beta / beta (beta -> 0) and of
    # JSD_beta / (1 - beta) (beta -> 1), checked on the float64 formula, the kernel following it near the ends.
    eps = 1e-7
    assert abs(float(reference(s, t, eps)) / eps / float(forward_kl) - 1) < 1e-3
    assert abs(float(reference(s, t, 1 - eps)) / eps / float(reverse_kl) - 1) < 1e-3
    with torch.no_grad():
        for beta in (1e-3, 1 - 1e-3):
            assert_close(liger_torch.jsd(s, t, beta=beta) * 1e3, reference(s, t, beta) * 1e3, torch.float32,
                         f"beta={beta}", scale=4.0)


def test_all_ignored_rows(device, seed):
    s, t, labels = draw(seed, (5, 259), torch.float32, device)
    labels = torch.full_like(labels, -1)
    for beta in (0.0, 0.5, 1.0):
        loss, grad = run(s, t, labels, beta, ignore_index=-1)
        assert float(loss) == 0.0
        assert torch.equal(grad, torch.zeros_like(grad))


def test_zero_probabilities(device, seed):
    """log-probability -inf (a masked token) contributes 0 to loss and gradient (0 * log 0 = 0), no NaN; where
    the divergence is infinite (P > 0 = Q for beta 0) the loss is +inf."""
    s, t, _ = draw(seed, (4, 259), torch.float32, device)
    s, t = s.clone(), t.clone()
    s[2, :10] = t[2, :10] = float("-inf")  # both zero: finite for every beta
    s[3, 100:110] = t[3, 100:110] = float("-inf")
    both = torch.log_softmax(s, -1), torch.log_softmax(t, -1)
    t[0, :20] = float("-inf")  # only one of them zero: finite for 0 < beta < 1
    s[1, 5:30] = float("-inf")
    one = torch.log_softmax(s, -1), torch.log_softmax(t, -1)
    for (s, t), betas in ((both, (0.0, 0.5, 1.0)), (one, (0.3,))):
        for beta in betas:
            loss, grad = run(s, t, None, beta, g=1.0)
            sd, td = s.double(), t.double()
            p, q = td.exp(), sd.exp()
            if beta == 0.0:
                grad_ref = -p
            elif beta == 1.0:
                grad_ref = torch.where(q == 0, 0.0, q * (sd - td + 1))
            else:
                log_m = torch.log(beta * p + (1 - beta) * q)
                grad_ref = torch.where(q == 0, 0.0, (1 - beta) * q * (sd - log_m))
            assert_close(loss, reference(s, t, beta), torch.float32, f"loss beta={beta}", scale=4.0)
            assert_close(grad * 4, grad_ref, torch.float32, f"grad beta={beta}")
    s, t = one
    with torch.no_grad():
        assert liger_torch.jsd(s, t, beta=0.0).item() == float("inf")
        assert liger_torch.jsd(s, t, beta=1.0).item() == float("inf")


@pytest.mark.parametrize("beta", [0.0, 0.4, 1.0])
def test_probabilities_that_underflow(beta, device, seed):
    """Log-probabilities far below fp32's exp range (-90 to -300, as a sharp teacher or student gives the tail
    of a large vocabulary): their probabilities underflow to 0, and the loss and gradient still match the fp64
    reference (those elements contribute below 1e-36), finite, no NaN."""
    gen = torch.Generator().manual_seed(seed)
    s, t, _ = draw(seed, (5, 300), torch.float32, device)
    tail_s = -90.0 - 210.0 * torch.rand(5, 120, generator=gen)
    tail_t = -90.0 - 210.0 * torch.rand(5, 120, generator=gen)
    s, t = s.clone(), t.clone()
    s[:, 30:150], t[:, 60:180] = tail_s.to(device), tail_t.to(device)  # overlapping and one-sided tails
    s, t = torch.log_softmax(s, -1), torch.log_softmax(t, -1)
    loss, grad = run(s, t, None, beta, g=1.0)
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
    # the loss: a mean of 5 rows, each a sum of 300 terms (scale as in test_zero_probabilities)
    assert_close(loss, reference(s, t, beta), torch.float32, f"loss beta={beta}", scale=5.0)
    s64 = s.double().requires_grad_(True)
    reference(s64, t.double(), beta).backward()
    assert_close(grad * 5, s64.grad * 5, torch.float32, f"grad beta={beta}")  # per element: times the 5 rows


def test_non_contiguous_module_and_no_grad(device, seed):
    s, t, labels = draw(seed, (259, 6), torch.float32, device)
    s, t = torch.log_softmax(s.t(), -1), torch.log_softmax(t.t(), -1)
    s_strided = s.t().contiguous().t()  # rows along a strided axis
    assert not s_strided.is_contiguous()
    module = liger_torch.JSD(beta=0.3)
    leaf = s_strided.clone().requires_grad_(True)
    loss = module(leaf, t)
    loss.backward()
    loss_ref, grad_ref = run_reference(s, t, None, 0.3, g=1.0)
    assert_close(loss, loss_ref, torch.float32, "loss", scale=4.0)
    assert_close(leaf.grad * 6, grad_ref * 6, torch.float32, "dstudent")
    with torch.no_grad():
        assert_close(liger_torch.jsd(s, t, beta=0.3), loss_ref, torch.float32, "no-grad loss", scale=4.0)
    loss = module(s, t)  # student does not require grad: no gradient computed
    assert not loss.requires_grad


def test_second_backward_is_refused(device, seed):
    s, t, _ = draw(seed, (3, 259), torch.float32, device)
    loss = liger_torch.jsd(s.requires_grad_(True), t)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        loss.backward()


@pytest.mark.parametrize("make,kwargs,error,match", [
    (lambda d: (torch.zeros(2, 3, device=d), torch.zeros(2, 4, device=d)), {}, ValueError,
     "teacher_logprobs must have the shape of student_logprobs"),
    (lambda d: (torch.zeros(2, 3, dtype=torch.long, device=d), torch.zeros(2, 3, device=d)), {}, TypeError,
     "student_logprobs must have a floating"),
    (lambda d: (torch.zeros(2, 3, device=d), torch.zeros(2, 3, dtype=torch.float64, device=d)), {}, TypeError,
     "teacher_logprobs must have a floating"),
    (lambda d: (torch.zeros(2, 3, device=d), torch.zeros(2, 3, device=d), torch.zeros(3, dtype=torch.long, device=d)),
     {}, ValueError, "labels must have shape"),
    (lambda d: (torch.zeros(2, 3, device=d), torch.zeros(2, 3, device=d), torch.zeros(2, device=d)), {}, TypeError,
     "labels must have an integer"),
    (lambda d: (torch.zeros(2, 3, device=d), torch.zeros(2, 3, device=d)), {"beta": 1.5}, ValueError, "beta"),
    (lambda d: (torch.zeros(2, 3, device=d), torch.zeros(2, 3, device=d)), {"beta": "half"}, TypeError, "beta"),
    (lambda d: (torch.zeros(2, 3, device=d), torch.zeros(2, 3, device=d)), {"ignore_index": 1.0}, TypeError,
     "ignore_index"),
    (lambda d: (torch.zeros(2, 3, device=d), torch.zeros(2, 3, requires_grad=True, device=d)), {}, ValueError,
     "teacher_logprobs requires grad"),
    (lambda d: (torch.zeros(2, 3, device=d), [[0.0] * 3] * 2), {}, TypeError, "teacher_logprobs must be a torch"),
])
def test_bad_input(make, kwargs, error, match, device):
    with pytest.raises(error, match=match):
        liger_torch.jsd(*make(device), **kwargs)
    if "beta" in kwargs:
        with pytest.raises(error, match="beta"):
            liger_torch.JSD(beta=kwargs["beta"])

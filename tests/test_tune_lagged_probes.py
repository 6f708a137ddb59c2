"""scripts/tune_ce_lagged.py and scripts/tune_norm_lagged.py, the GPU probes of the lagged job order (a row's
second read from L2): their stripped kernels must give the reference's loss and gradients, or their timings
compare different work. Here they run in the interpreter on odd shapes (the order needs no concurrency: a job
waits only on jobs with lower tickets), and each check is shown to catch a wrong kernel."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import tune_ce_lagged  # noqa: E402
import tune_norm_lagged  # noqa: E402


@pytest.mark.parametrize("case", tune_ce_lagged.CHECK_CASES)
def test_ce_probe_matches_torch(device, seed, case):
    import torch

    torch.manual_seed(seed)
    tune_ce_lagged.check_case(*case, device=device)


@pytest.mark.parametrize("case", tune_norm_lagged.CHECK_CASES)
def test_norm_probe_matches_the_formula(device, seed, case):
    import torch

    torch.manual_seed(seed)
    tune_norm_lagged.check_case(*case, device=device)


def test_ce_probe_check_catches_a_wrong_kernel(device, seed, monkeypatch):
    import torch

    torch.manual_seed(seed)
    right = tune_ce_lagged.lagged_ce

    def halved_gradient(x, target, **kwargs):  # the loss right, the gradient off by a factor
        loss, grad = right(x, target, **kwargs)
        return loss, grad * 0.5

    monkeypatch.setattr(tune_ce_lagged, "lagged_ce", halved_gradient)
    with pytest.raises(AssertionError):
        tune_ce_lagged.check_case(*tune_ce_lagged.CHECK_CASES[0], device=device)


def test_norm_probe_check_catches_a_wrong_kernel(device, seed, monkeypatch):
    import torch

    torch.manual_seed(seed)
    right = tune_norm_lagged.lagged_rms_backward

    def one_block_short(dy, x, weight, rstd, **kwargs):  # dw without the last row block's partial
        dx, _ = right(dy, x, weight, rstd, **kwargs)
        return dx, right(dy[:-1].clone(), x[:-1], weight, rstd[:-1], **kwargs)[1]

    monkeypatch.setattr(tune_norm_lagged, "lagged_rms_backward", one_block_short)
    with pytest.raises(AssertionError):
        tune_norm_lagged.check_case(*tune_norm_lagged.CHECK_CASES[0], device=device)

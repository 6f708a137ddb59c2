"""scripts/tune_ce_l2.py, the GPU probe of cross-entropy's second read from L2: its stripped kernel (persistent
grid, cache hints, the row's head held in registers) must give the library's loss and gradient, or its timings
compare different work. Each launch is checked this way on the GPU before it is timed; here the check itself
runs (in the interpreter on CPU), on odd shapes, and is shown to catch a wrong kernel."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import tune_ce_l2  # noqa: E402


@pytest.mark.parametrize("programs, block, hints, hold", [
    (0, 128, "none", 0),  # one program a row
    (3, 128, "last/first/cs", 256),  # 3 programs looping over 7 rows, the first 256 columns held
    (2, 256, "cs", 1024),  # the held head longer than the row
])
def test_probe_matches_the_library(device, seed, programs, block, hints, hold):
    import torch

    torch.manual_seed(seed)
    tune_ce_l2._check(7, 1000, block, 4, programs, hints, hold, device=device)


def test_probe_check_catches_a_wrong_kernel(device, seed, monkeypatch):
    import torch

    torch.manual_seed(seed)
    right = tune_ce_l2._probe

    # a kernel that reads the wrong target column: only the loss's x_t and two gradient entries a row differ
    def wrong(x, target, loss, *args, **kwargs):
        right(x, torch.remainder(target + 1, x.shape[1]), loss, *args, **kwargs)

    monkeypatch.setattr(tune_ce_l2, "_probe", wrong)
    with pytest.raises(AssertionError):
        tune_ce_l2._check(7, 1000, 128, 4, 0, "none", 0, device=device)

"""The split-row cross-entropy kernel at training sizes on the GPU: thousands of rows in flight, each split over
up to 32 programs that wait for each other inside the kernel (tickets, arrival counts), against fp32 torch; and a
vocabulary of 256k (32 programs a row)."""

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close
from liger_core import cross_entropy as core
from liger_torch._launch import info, run_plan

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("reload", [False, True])
@pytest.mark.parametrize("n,v", [(4096, 128256), (1, 128256), (333, 256000), (2048, 32003)])
def test_split_rows_against_fp32(n, v, reload, seed, monkeypatch):
    monkeypatch.setattr(core, "SPLIT_RELOAD", reload)
    core.forward_plan.cache_clear()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(n, v, generator=gen, device="cuda") * 4).to(torch.bfloat16)
    t = torch.randint(0, v, (n,), generator=gen, device="cuda")
    t[torch.rand(n, generator=gen, device="cuda") < 0.1] = -100
    plan = core.forward_plan(info(x), info(t), reduction="mean", in_place=True, label_smoothing=0.1,
                             row_split=core.SPLIT_SEGMENT if v <= 32 * core.SPLIT_SEGMENT else 16384)
    assert any("split" in launch.kernel.fn.__name__ for launch in plan.launches)
    ref_x = x.float().requires_grad_(True)
    ref = F.cross_entropy(ref_x, t, label_smoothing=0.1)
    ref.backward()
    logits = x.clone()
    loss, grad = run_plan(plan, logits=logits, target=t)
    assert grad.data_ptr() == logits.data_ptr()
    assert_close(loss, ref, torch.bfloat16, "loss")
    assert_close(grad.float() * n, ref_x.grad * n, torch.bfloat16, "dlogits")
    # the same bits again
    loss2, grad2 = run_plan(plan, logits=x.clone(), target=t)
    assert torch.equal(loss, loss2) and torch.equal(grad, grad2)

"""scripts/tune_ce_lagged.py builds each swept plan with the lagged kernel's launch settings it names, and leaves
the library's defaults (and its plan cache) as they were."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))


def test_plans_take_the_swept_settings_and_restore_the_defaults():
    import torch

    import tune_ce_lagged
    from liger_core import cross_entropy

    x = torch.randn(5, 1000).to(torch.bfloat16)
    target = torch.randint(0, 1000, (5,))
    defaults = dict(cross_entropy.LAGGED)
    settings = {"segment": 256, "lag_bytes": 3 * 1000 * 2, "block": 64, "num_warps": 2}  # a lag of 3 rows
    plan = tune_ce_lagged.plan_with(settings, x, target, True)
    (launch,) = [launch for launch in plan.launches if launch.kernel is cross_entropy._cross_entropy_lagged_kernel]
    assert (launch.constexprs["SEG"], launch.constexprs["LAG"], launch.constexprs["BLOCK_V"], launch.num_warps) == (
        256, 3, 64, 2)
    assert launch.grid == ((5 + 3) * 2 * 4,)
    assert cross_entropy.LAGGED == defaults
    default_plan = cross_entropy.forward_plan(tune_ce_lagged.info(x), tune_ce_lagged.info(target), reduction="sum",
                                              in_place=True, lagged=True)
    (launch,) = [launch for launch in default_plan.launches
                 if launch.kernel is cross_entropy._cross_entropy_lagged_kernel]
    assert launch.constexprs["LAG"] == cross_entropy.lag_rows(1000, "bfloat16") == 256

"""KL divergence against a target given as probabilities (``log_target=False``, the default of ``F.kl_div`` and
of Liger-Kernel's ``LigerKLDIVLoss``), ``batchmean``, bf16 (tokens, vocab): the same providers and shapes as
``bench_kl_div``. Its kernel takes a log of the target per element, which the log-target case does not."""

from __future__ import annotations

from . import bench_kl_div
from .harness import Case


def cases(quick: bool = False, smoke: bool = False) -> list[Case]:
    return bench_kl_div.cases(quick=quick, smoke=smoke, log_target=False)

"""Parity tests: on CPU, liger_jax runs the kernels inside a host callback on an XLA thread, whose CPU flushes
fp32 denormals to zero (FTZ/DAZ). The torch side runs here with the same flags, so that in the interpreter both
frontends do the same arithmetic and can be compared bit for bit (tests/helpers.py, assert_parity)."""

import pytest


@pytest.fixture(autouse=True)
def flush_denormals_like_xla():
    import torch

    flushes = torch.set_flush_denormal(True)  # False where the CPU cannot (then nothing changes)
    yield
    if flushes:
        torch.set_flush_denormal(False)

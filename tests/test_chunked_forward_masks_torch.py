"""FULL_CHUNKS: when every chunk of a chunked norm forward is whole (n_cols a multiple of the chunk) the kernels
drop their column masks (liger_core.rowwise.full_chunks: no compares, zero fills or selects in the loops). The
same bits as the masked kernel, with and without the first sweep's prefetch and with several rows a program; the
plan takes it only where the chunks are whole. Each family's own tests check the whole-chunk case against its
reference (their CHUNKED shapes (3, 64) with 16-column chunks)."""

import pytest
import torch

from norm_plans import NORM_FAMILIES, norm_forward_plan


def forward(family, x, r, w, b, **overrides):
    """(plan, outputs) of ``family``'s forward on bf16 ``x`` (``r`` the residual, ``b`` the bias where used)."""
    from liger_torch._launch import info, run_plan

    plan = norm_forward_plan(family, info(x), info(w), **overrides)
    arrays = dict(x=x, residual=r, weight=w, bias=b)
    return plan, run_plan(plan, **{name: arrays[name] for name in plan.inputs})


def draw(seed, shape, device):
    gen = torch.Generator().manual_seed(seed)
    # rows far from zero: LayerNorm's sweeps work on x less the row's first value
    x, r = ((torch.randn(shape, generator=gen) * 2 + 5).to(device, torch.bfloat16) for _ in range(2))
    w, b = ((torch.randn(shape[-1], generator=gen) * 0.5 + 1).to(device, torch.bfloat16) for _ in range(2))
    return x, r, w, b


@pytest.mark.parametrize("family", NORM_FAMILIES)
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("rows", [1, 2])
def test_whole_chunks_without_masks_same_bits(family, prefetch, rows, device, seed):
    """5 rows of three 32-column chunks (2 rows a program leave the last program short)."""
    tensors = draw(seed, (5, 96), device)
    common = dict(chunk=32, prefetch=prefetch, block_m=rows)
    plan, unmasked = forward(family, *tensors, **common)
    masked_plan, masked = forward(family, *tensors, full_chunks=False, **common)
    assert plan.launches[0].constexprs["FULL_CHUNKS"] is True
    assert masked_plan.launches[0].constexprs["FULL_CHUNKS"] is False
    for name, a, c in zip(plan.outputs, unmasked, masked):
        assert torch.equal(a, c), name


@pytest.mark.parametrize("family", NORM_FAMILIES)
def test_partial_last_chunk_keeps_masks(family, device, seed):
    tensors = draw(seed, (3, 100), device)
    plan, _ = forward(family, *tensors, chunk=32)
    assert plan.launches[0].constexprs["FULL_CHUNKS"] is False
    with pytest.raises(ValueError, match=r"full_chunks=True needs n_cols \(100\) to be a multiple of the chunk"):
        forward(family, *tensors, chunk=32, full_chunks=True)

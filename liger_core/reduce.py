"""Deterministic reduction of per-program fp32 partial sums (used for weight gradients).

Row-wise backward kernels accumulate a parameter gradient per program into ``partials[group, program, col]``;
this kernel sums over ``program`` in a fixed order, so the result is bitwise identical run to run (no atomics).
``group`` lets one launch produce per-example gradients when a frontend folds a vmapped batch into rows.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tl_math import cast
from .launch import Buf, Launch, NewBuffer, cdiv, next_power_of_2


@triton.jit
def _sum_partials_kernel(
    PARTIALS,
    n_partials,
    n_cols,
    OUT,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    col_block = tl.program_id(0)
    group = tl.program_id(1).to(tl.int64)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    base = PARTIALS + group * n_partials * n_cols
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for start in range(0, n_partials, BLOCK_P):
        p = start + tl.arange(0, BLOCK_P)
        mask = (p < n_partials)[:, None] & col_mask[None, :]
        acc += tl.load(base + p[:, None].to(tl.int64) * n_cols + cols[None, :], mask=mask, other=0.0)
    total = tl.sum(acc, axis=0)
    tl.store(OUT + group * n_cols + cols, cast(total, OUT.dtype.element_ty), mask=col_mask)


def sum_partials_launch(partials: str, out: str, groups: int, n_partials: int, n_cols: int, dtype: str,
                        out_shape=None) -> Launch:
    """Launch summing ``partials`` (groups, n_partials, n_cols) fp32 over axis 1 into a new buffer ``out``."""
    block_n = min(256, next_power_of_2(n_cols))
    block_p = min(32, next_power_of_2(n_partials))
    shape = tuple(out_shape) if out_shape is not None else ((n_cols,) if groups == 1 else (groups, n_cols))
    return Launch(
        kernel=_sum_partials_kernel,
        grid=(cdiv(n_cols, block_n), groups),
        args=(Buf(partials), n_partials, n_cols),
        outputs=(NewBuffer(out, shape, dtype),),
        constexprs={"BLOCK_P": block_p, "BLOCK_N": block_n},
        num_warps=4,
    )

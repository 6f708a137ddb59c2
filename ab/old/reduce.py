"""Deterministic reduction of per-program fp32 partial sums (used for weight gradients).

Row-wise backward kernels accumulate a parameter gradient per program into ``partials[group, program, col]``;
this kernel sums over ``program`` in a fixed order, so the result is bitwise identical run to run (no atomics).
``group`` lets one launch produce per-example gradients when a frontend folds a vmapped batch into rows.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tl_math import aligned, cast
from .launch import Buf, Launch, NewBuffer, cdiv, next_power_of_2, warps_for


@triton.jit
def _sum_partials_kernel(
    PARTIALS,
    n_partials,
    n_cols,
    OUT,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ALIGN: tl.constexpr,
):
    n_cols = aligned(n_cols, ALIGN)
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


# A program sums a (BLOCK_P, BLOCK_N) tile per step: ~_TILE values (16 per thread at 8 warps), its columns
# narrowed until the grid has ~_PROGRAMS programs (a weight gradient's 4096 columns: 128 programs of 32 columns,
# not 16 of 256), its partials widened to fill the tile (a loss's one column: 4096 rows a step, not 32). On an
# H100 the old 32 x 256 tiles took 6-8 us for 132 x 4096 partials and 27 us for a loss over 8192 rows, ~20x the
# bytes' time: too few programs, and under jax_triton (no ALIGN hint) 4-byte loads: 29 us.
_TILE = 4096
_PROGRAMS = 128


def sum_partials_tile(n_partials: int, n_cols: int) -> tuple[int, int]:
    """(BLOCK_P, BLOCK_N) of :func:`sum_partials_launch`."""
    block_n = min(next_power_of_2(n_cols), 256, max(32, next_power_of_2(cdiv(n_cols, _PROGRAMS))))
    block_p = min(next_power_of_2(n_partials), max(1, _TILE // block_n))
    return block_p, block_n


def sum_partials_launch(partials: str, out: str, groups: int, n_partials: int, n_cols: int, dtype: str,
                        out_shape=None) -> Launch:
    """Launch summing ``partials`` (groups, n_partials, n_cols) fp32 over axis 1 into a new buffer ``out``."""
    block_p, block_n = sum_partials_tile(n_partials, n_cols)
    shape = tuple(out_shape) if out_shape is not None else ((n_cols,) if groups == 1 else (groups, n_cols))
    return Launch(
        kernel=_sum_partials_kernel,
        grid=(cdiv(n_cols, block_n), groups),
        args=(Buf(partials), n_partials, n_cols),
        outputs=(NewBuffer(out, shape, dtype),),
        constexprs={"BLOCK_P": block_p, "BLOCK_N": block_n},
        num_warps=warps_for(block_p * block_n, max_warps=8),
    )

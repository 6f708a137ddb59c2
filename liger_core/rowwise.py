"""Launch planning shared by the row-wise families (RMSNorm, LayerNorm, fused add + RMSNorm; ``row_view`` also
by the losses).

A row-wise kernel sees its input as (rows, last axis) by strides; the forward gives each program a tile of
``block_m`` rows (one row swept in chunks, past MAX_HELD_COLUMNS); the backward is persistent: ``n_programs``
per group walk ``rows_per_program`` rows each and leave one fp32 partial of each parameter gradient, reduced
by :mod:`liger_core.reduce`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .launch import ArrayInfo, Launch, NewBuffer, cdiv, collapse_rows, next_power_of_2, warps_for


def row_view(info: ArrayInfo, name: str) -> tuple[int, int, int, int]:
    """``(n_rows, n_cols, row_stride, col_stride)`` of an array folded into rows, or a ValueError naming it."""
    view = collapse_rows(info)
    if view is None:
        raise ValueError(f"{name}'s leading dimensions cannot be folded into rows by strides, or its rows span "
                         f"2**31 elements or more (shape {info.shape}, strides {info.strides}); make it contiguous "
                         "first")
    return view


def tile(n_cols: int, n_rows: int, elements: int) -> tuple[int, int]:
    """(block_m, block_n): whole rows (padded to a power of two), as many as fit ``elements`` (at most 16)."""
    block_n = next_power_of_2(n_cols)
    return max(1, min(16, elements // block_n, next_power_of_2(n_rows))), block_n


# Rows wider than MAX_HELD_COLUMNS are swept by the forwards in WIDE_CHUNK-column chunks instead of held in
# registers: a held row spilled from 32768 columns (LayerNorm's forward at 8 warps, 148 bytes a thread) and by
# kilobytes at 65536 in all three (a 65536-column fp32 row is a whole SM's register file; sm_90 ptxas). No LLM is
# wider than 16384 (Llama-3-405B), so the held-row kernels serve every model's hidden size.
MAX_HELD_COLUMNS = 16384
WIDE_CHUNK = 8192


def forward_chunk(n_cols: int, chunk: int | None) -> int:
    """Columns a norm forward sweeps at a time: 0 to hold whole rows (the default up to MAX_HELD_COLUMNS),
    else a power of two. ``chunk`` overrides (0 forces held rows; for tuning and tests)."""
    if chunk is None:
        return WIDE_CHUNK if n_cols > MAX_HELD_COLUMNS else 0
    if chunk != 0 and (chunk < 16 or chunk & (chunk - 1)):
        raise ValueError(f"chunk must be 0 (whole rows) or a power of two of at least 16, got {chunk}")
    return chunk


def norm_forward_launch(held_kernel, chunked_kernel, lead_args: tuple, scalars: tuple, outputs: tuple,
                        constexprs: dict, n_rows: int, n_cols: int, *, tile_elements: int, chunked_prefetch: bool,
                        block_m: int | None = None, num_warps: int | None = None, chunk: int | None = None,
                        prefetch: bool | None = None, full_row_flag: bool = False) -> Launch:
    """The launch of a norm forward: ``held_kernel`` on ``block_m`` whole rows a program (about
    ``tile_elements`` values, 4-8 warps), or past MAX_HELD_COLUMNS ``chunked_kernel`` on one row a program,
    swept in chunks (:func:`forward_chunk`; with the family's ``chunked_prefetch``). Both kernels take
    ``lead_args`` (buffers and strides), the held one then ``n_rows``, both ``n_cols`` and ``scalars``;
    ``constexprs`` are common to both; ``full_row_flag`` adds the held kernel's FULL_ROW. ``block_m``,
    ``num_warps``, ``chunk`` and ``prefetch`` override (for tuning and tests)."""
    chunk = forward_chunk(n_cols, chunk)
    if chunk:
        return Launch(
            kernel=chunked_kernel, grid=(n_rows,), args=(*lead_args, n_cols, *scalars), outputs=outputs,
            constexprs={**constexprs, "CHUNK": chunk, "PREFETCH": chunked_prefetch if prefetch is None else prefetch},
            num_warps=num_warps or warps_for(chunk))
    default_m, block_n = tile(n_cols, n_rows, tile_elements)
    block_m = block_m or default_m
    held = {**constexprs, "BLOCK_M": block_m, "BLOCK_N": block_n}
    if full_row_flag:
        held["FULL_ROW"] = n_cols == block_n
    return Launch(
        kernel=held_kernel, grid=(cdiv(n_rows, block_m),), args=(*lead_args, n_rows, n_cols, *scalars),
        outputs=outputs, constexprs=held,
        num_warps=num_warps or min(8, max(4, next_power_of_2(block_m * block_n // 1024))))


def rows_in_group(n_rows: int, groups: int) -> int:
    """Rows in each of ``groups`` equal blocks (a vmapped batch folded into rows)."""
    if groups < 1 or n_rows % groups:
        raise ValueError(f"groups={groups} does not divide the {n_rows} rows")
    return n_rows // groups


@dataclass(frozen=True)
class PersistentGrid:
    n_programs: int
    rows_per_program: int


def persistent_grid(group_rows: int, block_m: int, num_sms: int, programs_per_sm: int) -> PersistentGrid:
    """Split a group of rows over at most ``num_sms * programs_per_sm`` programs, whole tiles each."""
    n_programs = max(1, min(num_sms * programs_per_sm, cdiv(group_rows, block_m)))
    rows_per_program = cdiv(cdiv(group_rows, n_programs), block_m) * block_m
    return PersistentGrid(cdiv(group_rows, rows_per_program), rows_per_program)


def dense_rows(n_rows: int, n_cols: int, row_stride: int, col_stride: int) -> bool:
    """True when no two elements of the rows view share memory (an expanded, stride-0 gradient does)."""
    return col_stride == 1 and (n_rows == 1 or row_stride >= n_cols)


def gradient_output(name: str, shape, dtype: str, over: str | None, over_info: ArrayInfo | None,
                    n_rows: int, n_cols: int) -> tuple[NewBuffer, int, int]:
    """The buffer a backward writes a gradient into, with its row and column strides: written over input
    ``over`` (an incoming gradient) when that is safe — same dtype, rows that do not overlap — else fresh."""
    if over is not None and over_info is not None and over_info.dtype == dtype:
        _, _, row_stride, col_stride = row_view(over_info, over)
        if dense_rows(n_rows, n_cols, row_stride, col_stride):
            return NewBuffer(name, over_info.shape, dtype, alias=over), row_stride, col_stride
    return NewBuffer(name, tuple(shape), dtype), n_cols, 1

"""Launch planning shared by the row-wise families (RMSNorm, LayerNorm, fused add + RMSNorm; ``row_view`` also
by the losses).

A row-wise kernel sees its input as (rows, last axis) by strides; the forward gives each program a tile of
``block_m`` rows (one row swept in chunks, past MAX_HELD_COLUMNS); the backward is persistent: ``n_programs``
per group walk ``rows_per_program`` rows each and leave one fp32 partial of each parameter gradient, reduced
by :mod:`liger_core.reduce`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .launch import (
    ITEMSIZE, MAX_GRID_YZ, ArrayInfo, Launch, NewBuffer, cdiv, collapse_rows, next_power_of_2, warps_for,
)


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


# Rows wider than MAX_HELD_COLUMNS are swept by the backwards, and by the forwards past their held_up_to, in
# column chunks instead of held in registers: a held row spilled from 32768 columns (LayerNorm's forward at 8
# warps, 148 bytes a thread; 92 at 16 warps) and by kilobytes at 65536 in all three (a 65536-column fp32 row is a
# whole SM's register file; sm_90 ptxas). No LLM is wider than 16384 (Llama-3-405B), so the held-row kernels serve
# every model's hidden size. With 2-byte operands the RMSNorm forwards hold rows up to 32768 columns, LayerNorm's
# from 28672 to 32768 (ChunkedSweep.held_up_to, held_rows_for; 16 warps there).
MAX_HELD_COLUMNS = 16384


@dataclass(frozen=True)
class ChunkedSweep:
    """A family's default launch of its chunked forward: ``chunk`` columns a step at ``num_warps``, with or
    without the next chunk's load issued first (``prefetch``), on ``rows`` rows a program (the parameters read once
    for all of them), for rows wider than ``held_up_to`` columns (narrower ones are held in registers)."""
    chunk: int
    num_warps: int
    prefetch: bool
    rows: int = 1
    held_up_to: int = MAX_HELD_COLUMNS


def held_rows_for(sweep: ChunkedSweep, *arrays: ArrayInfo | None) -> ChunkedSweep:
    """``sweep``, holding rows past MAX_HELD_COLUMNS only where every one of ``arrays`` (None: absent) has 2-byte
    elements: with an fp32 weight or residual a held 32768-column row spilled (ptxas, 16 warps: 28-144 bytes a
    thread), and an fp32 x left no register spare."""
    if sweep.held_up_to <= MAX_HELD_COLUMNS or all(a is None or ITEMSIZE[a.dtype] == 2 for a in arrays):
        return sweep
    return replace(sweep, held_up_to=MAX_HELD_COLUMNS)


def forward_chunk(n_cols: int, chunk: int | None, sweep: ChunkedSweep) -> int:
    """Columns a norm forward sweeps at a time: 0 to hold whole rows (the default up to ``sweep.held_up_to``),
    else a power of two (``sweep.chunk`` past it). ``chunk`` overrides (0 forces held rows; for tuning and
    tests)."""
    if chunk is None:
        return sweep.chunk if n_cols > sweep.held_up_to else 0
    return _columns_override(chunk, "chunk")


def full_chunks(n_cols: int, chunk: int, override: bool | None = None) -> bool:
    """A chunked sweep's FULL_CHUNKS constexpr: whether every chunk is whole (``n_cols`` a multiple of ``chunk``),
    so the kernel drops its column masks. ``override=False`` keeps them anyway (for tuning and tests)."""
    whole = n_cols % chunk == 0
    if override and not whole:
        raise ValueError(f"full_chunks=True needs n_cols ({n_cols}) to be a multiple of the chunk ({chunk})")
    return whole if override is None else bool(override)


def _columns_override(value: int, name: str) -> int:
    """A column-count override: 0 (whole rows) or a power of two of at least 16, or a ValueError naming it."""
    if value != 0 and (value < 16 or value & (value - 1)):
        raise ValueError(f"{name} must be 0 (whole rows) or a power of two of at least 16, got {value}")
    return value


def norm_forward_launch(held_kernel, chunked_kernel, lead_args: tuple, scalars: tuple, outputs: tuple,
                        constexprs: dict, n_rows: int, n_cols: int, *, tile_elements: int, chunked: ChunkedSweep,
                        block_m: int | None = None, num_warps: int | None = None, chunk: int | None = None,
                        prefetch: bool | None = None, full_chunks_override: bool | None = None,
                        full_row_flag: bool = False) -> Launch:
    """The launch of a norm forward: ``held_kernel`` on ``block_m`` whole rows a program (about
    ``tile_elements`` values, 4-8 warps), or past MAX_HELD_COLUMNS ``chunked_kernel`` on ``block_m`` rows a
    program (ROWS), swept in chunks (the family's ``chunked`` defaults). Both kernels take ``lead_args`` (buffers
    and strides), then ``n_rows``, ``n_cols`` and ``scalars``; ``constexprs`` are common to both;
    ``full_row_flag`` adds the held kernel's FULL_ROW. ``block_m``, ``num_warps``, ``chunk``, ``prefetch`` and
    ``full_chunks_override`` (:func:`full_chunks`) override (for tuning and tests; a chunk other than the default
    gets warps_for(chunk)). A held row past MAX_HELD_COLUMNS gets 16 warps (64 fp32 values a thread at 32768)."""
    if block_m is not None and (block_m < 1 or block_m & (block_m - 1)):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    default_chunk = chunk is None
    chunk = forward_chunk(n_cols, chunk, chunked)
    if chunk:
        warps = chunked.num_warps if default_chunk else warps_for(chunk)
        rows = block_m or chunked.rows
        return Launch(
            kernel=chunked_kernel, grid=(cdiv(n_rows, rows),), args=(*lead_args, n_rows, n_cols, *scalars),
            outputs=outputs, num_warps=num_warps or warps,
            constexprs={**constexprs, "CHUNK": chunk, "ROWS": rows,
                        "PREFETCH": chunked.prefetch if prefetch is None else prefetch,
                        "FULL_CHUNKS": full_chunks(n_cols, chunk, full_chunks_override)})
    default_m, block_n = tile(n_cols, n_rows, tile_elements)
    block_m = block_m or default_m
    held = {**constexprs, "BLOCK_M": block_m, "BLOCK_N": block_n}
    if full_row_flag:
        held["FULL_ROW"] = n_cols == block_n
    return Launch(
        kernel=held_kernel, grid=(cdiv(n_rows, block_m),), args=(*lead_args, n_rows, n_cols, *scalars),
        outputs=outputs, constexprs=held,
        num_warps=num_warps or min(8 if block_n <= MAX_HELD_COLUMNS else 16,
                                   max(4, next_power_of_2(block_m * block_n // 1024))))


def rows_in_group(n_rows: int, groups: int) -> int:
    """Rows in each of ``groups`` equal blocks (a vmapped batch folded into rows)."""
    if groups < 1 or n_rows % groups:
        raise ValueError(f"groups={groups} does not divide the {n_rows} rows")
    if groups > MAX_GRID_YZ:  # the groups are a grid axis of the backward and of the partials' sum
        raise ValueError(f"a vmapped batch of {groups} blocks is more than the {MAX_GRID_YZ} the weight-gradient "
                         "launches take; vmap over fewer, or fold the batch into the rows (reshape) instead")
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


# Rows over MAX_HELD_COLUMNS: the backward splits them into SPLIT_BLOCK_N-column blocks. Its dW accumulator, one
# fp32 value a column for the rows a program walks, cannot stay in registers for a whole wide row (ptxas at 65536
# columns: 1.1-1.4 KB of spills a thread in the three backwards). So a first launch sweeps each row once for the
# row sums dx needs (two tensor reads), and the second, on (row programs, groups, column blocks), is the row-tile
# backward on BLOCK_M x SPLIT_BLOCK_N tiles: the tile shape of the tuned 4096-column backward.
SPLIT_BLOCK_N = 4096


@dataclass(frozen=True)
class BackwardTiles:
    """How a norm backward covers a group of rows: ``block_m`` x ``block_n`` tiles walked by ``grid``'s
    persistent programs, in each of ``column_blocks`` column blocks (more than one only when ``split``: the
    row sums then come from a first launch, swept as ``row_sums`` says)."""
    block_m: int
    block_n: int
    column_blocks: int
    grid: PersistentGrid
    row_sums: ChunkedSweep | None

    @property
    def split(self) -> bool:
        return self.row_sums is not None


def backward_tiles(group_rows: int, n_cols: int, tile_elements: int, num_sms: int, programs_per_sm: int,
                   row_sums: ChunkedSweep, *, block_m: int | None = None,
                   column_block: int | None = None) -> BackwardTiles:
    """Whole-row tiles of about ``tile_elements`` values up to MAX_HELD_COLUMNS, column blocks of
    SPLIT_BLOCK_N past it (the row sums swept as the family's ``row_sums``), one persistent program an SM in
    all. ``column_block`` overrides (0: whole rows always; a power of two: split rows into blocks of that many
    columns, and sweep them in chunks of as many for the row sums; for tuning and tests), as does
    ``block_m``."""
    if column_block is None:
        column_block = SPLIT_BLOCK_N if n_cols > MAX_HELD_COLUMNS else 0
    _columns_override(column_block, "column_block")
    if not column_block:
        default_m, block_n = tile(n_cols, group_rows, tile_elements)
        block_m = block_m or default_m
        return BackwardTiles(block_m, block_n, 1, persistent_grid(group_rows, block_m, num_sms, programs_per_sm),
                             None)
    block_m = block_m or max(1, min(16, tile_elements // column_block, next_power_of_2(group_rows)))
    column_blocks = cdiv(n_cols, column_block)
    programs_per_block = max(1, num_sms * programs_per_sm // column_blocks)
    if column_block != SPLIT_BLOCK_N:
        row_sums = ChunkedSweep(column_block, warps_for(column_block), row_sums.prefetch)
    return BackwardTiles(block_m, column_block, column_blocks,
                         persistent_grid(group_rows, block_m, programs_per_block, 1), row_sums)


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

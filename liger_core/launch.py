"""Framework-free descriptions of kernel launches.

A kernel family builds a :class:`Plan` from :class:`ArrayInfo` descriptions of its inputs (shape, strides in
elements, dtype name). A plan is an ordered list of :class:`Launch` es over named buffers: the plan's inputs, and
the buffers each launch creates (:class:`NewBuffer`, fresh or written in place into an input). Each frontend has
one generic executor for plans (``liger_torch._launch``, ``liger_jax._launch``); the kernel calling convention it
follows, and that ``jax_triton.triton_call`` imposes, is::

    kernel[grid](*launch.args, *launch.outputs, **launch.constexprs, num_warps=..., num_stages=...)

where each arg is a buffer (:class:`Buf`) or a Python int/float scalar. Fresh outputs are always contiguous
(row-major); an output that aliases an input keeps that input's strides, and the plan passes those strides.
"""

from __future__ import annotations

import inspect
import math
import numbers
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

FLOAT_DTYPES = ("float32", "bfloat16", "float16")
ALL_FLOAT_DTYPES = FLOAT_DTYPES + ("float64",)
ITEMSIZE = {
    "float64": 8, "float32": 4, "bfloat16": 2, "float16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}
# Rank of each float dtype for type promotion (bf16 + fp16 promote to fp32, as in torch and jax).
_FLOAT_RANK = {"float16": 1, "bfloat16": 1, "float32": 2, "float64": 3}


@dataclass(frozen=True)
class ArrayInfo:
    """What a plan needs to know about an array: shape, strides (in elements) and dtype name."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str

    @classmethod
    def contiguous(cls, shape, dtype: str) -> "ArrayInfo":
        return cls(tuple(shape), contiguous_strides(shape), dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass(frozen=True)
class Buf:
    """A reference, in a launch's argument list, to a named buffer of the plan."""

    name: str


@dataclass(frozen=True)
class NewBuffer:
    """A buffer a launch writes: fresh (contiguous, or laid out by ``strides``; optionally zero-filled) or the
    memory of input ``alias``."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    alias: str | None = None
    zeroed: bool = False
    strides: tuple[int, ...] | None = None  # element strides of a fresh buffer (a dense layout); None: contiguous


@dataclass(frozen=True)
class Launch:
    kernel: Any
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    outputs: tuple[NewBuffer, ...]
    constexprs: Mapping[str, Any] = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        if any(g > MAX_GRID_YZ for g in self.grid[1:]) or self.grid[0] >= 2**31:
            # a plan's own checks should have refused this with the argument's name; never a failed CUDA launch
            raise ValueError(f"{getattr(self.kernel, '__name__', self.kernel)}: grid {self.grid} exceeds CUDA's "
                             f"limits (2**31 - 1 programs on axis 0, {MAX_GRID_YZ} on axes 1 and 2)")
        # A kernel with an ALIGN constexpr passes some int arguments through tl_math.aligned: ALIGN says whether
        # all of them are multiples of 16 (computed here from the values, so no plan can get it wrong).
        names = list(getattr(self.kernel, "arg_names", ()))
        if "ALIGN" in names and "ALIGN" not in self.constexprs:
            if not aligned_args(self.kernel):  # alignment() of nothing would say 16 for any stride
                raise AssertionError(f"{self.kernel} takes ALIGN but has no `name = aligned(name, ALIGN)` line")
            values = []
            for name in aligned_args(self.kernel):
                index = names.index(name)
                if index >= len(self.args) or not isinstance(self.args[index], int):
                    raise AssertionError(f"{name} of {self.kernel} is not an int argument of this launch")
                values.append(self.args[index])
            object.__setattr__(self, "constexprs", {**self.constexprs, "ALIGN": alignment(*values)})

    def array_args(self) -> list[str]:
        return [a.name for a in self.args if isinstance(a, Buf)]


@dataclass(frozen=True)
class Plan:
    """Launches over named buffers. ``inputs`` are supplied by the caller, ``outputs`` are returned in order."""

    inputs: tuple[str, ...]
    launches: tuple[Launch, ...]
    outputs: tuple[str, ...]

    def __post_init__(self):
        known = set(self.inputs)
        for launch in self.launches:
            for arg in launch.args:
                if isinstance(arg, Buf) and arg.name not in known:
                    raise AssertionError(f"{launch.kernel}: reads buffer {arg.name!r} before it exists")
                if not isinstance(arg, (Buf, int, float)):
                    raise AssertionError(f"{launch.kernel}: argument {arg!r} is neither a buffer nor a scalar")
            for out in launch.outputs:
                if out.alias is not None and out.alias not in launch.array_args():
                    # jax_triton aliases an output onto one of the same launch's array arguments.
                    raise AssertionError(f"output {out.name!r} aliases {out.alias!r}, which the launch does not take")
                known.add(out.name)
        missing = [name for name in self.outputs if name not in known]
        if missing:
            raise AssertionError(f"plan outputs {missing} are never written")

    def new_buffer(self, name: str) -> NewBuffer:
        for launch in self.launches:
            for out in launch.outputs:
                if out.name == name:
                    return out
        raise KeyError(name)


# ---------------------------------------------------------------------------------------------------------
# Shapes, strides and dtypes


def contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for dim in reversed(tuple(shape)):
        strides.append(step)
        step *= max(int(dim), 1)
    return tuple(reversed(strides))


# CUDA launches at most 65535 programs along grid axes 1 and 2 (axis 0: 2**31 - 1).
MAX_GRID_YZ = 65535


def rows_by_blocks_grid(n_rows: int, n_blocks: int) -> tuple[tuple[int, ...], bool]:
    """``(grid, flat)`` for a kernel with one program per (row, column block) that decodes its program with
    ``tl_math.row_and_block``: the 2-d grid (rows, blocks), or where the blocks exceed grid axis 1's limit
    (a flattened array of 268M+ elements) one axis of rows x blocks, ``flat``."""
    if n_blocks <= MAX_GRID_YZ:
        return (n_rows, n_blocks), False
    return (n_rows * n_blocks,), True  # Launch refuses 2**31 programs or more


def spans_int32(n: int, stride: int) -> bool:
    """Whether ``n`` elements ``stride`` apart span 2**31 elements of memory or more: the kernels index along a
    row, a parameter vector or a head in int32 (``col * stride``), which only a view strided by a huge other
    dimension overflows."""
    return (n - 1) * abs(stride) >= 2**31


def check_last_axis_span(info: ArrayInfo, name: str) -> None:
    """ValueError naming ``name`` when its last axis spans 2**31 elements of memory or more (``spans_int32``)."""
    if info.ndim and spans_int32(info.shape[-1], info.strides[-1]):
        raise ValueError(f"{name}'s last dimension ({info.shape[-1]} elements strided by {info.strides[-1]}) spans "
                         "2**31 elements of memory or more, which the kernels index in int32; make it contiguous "
                         "first")


def collapse_rows(info: ArrayInfo) -> tuple[int, int, int, int] | None:
    """View an array as (rows, last-axis) by strides: ``(n_rows, n_cols, row_stride, col_stride)``.

    Returns None when the leading axes cannot be folded into one strided axis without a copy, and when a row's
    columns span 2**31 elements or more: the kernels index a row's columns in int32 (``col * col_stride``), which
    only a transposed view of a huge array (columns strided by its row count) would overflow.
    """
    if info.ndim == 0:
        return None
    n_cols, col_stride = info.shape[-1], info.strides[-1]
    if spans_int32(n_cols, col_stride):
        return None
    lead = [(d, s) for d, s in zip(info.shape[:-1], info.strides[:-1]) if d != 1]
    n_rows = math.prod(d for d, _ in lead)
    if not lead:
        return n_rows, n_cols, n_cols * max(col_stride, 1), col_stride
    for (d_outer, s_outer), (d_inner, s_inner) in zip(lead, lead[1:]):
        if s_outer != s_inner * d_inner:
            return None
    return n_rows, n_cols, lead[-1][1], col_stride


def dense_strides(info: ArrayInfo) -> tuple[int, ...] | None:
    """``info``'s strides when its elements fill a block of exactly ``size`` elements without overlap (a
    permutation of a contiguous layout, such as a transposed view), else None: the layout a fresh output can
    copy, as torch's elementwise ops keep their input's memory format."""
    size = 1
    for d in info.shape:
        size *= d
    if size == 0 or not non_overlapping(info):
        return None
    extent = 1 + sum((d - 1) * s for d, s in zip(info.shape, info.strides))
    return tuple(info.strides) if extent == size else None


def non_overlapping(info: ArrayInfo) -> bool:
    """True when no two elements of the array share memory (so it can be written in place)."""
    dims = sorted((s, d) for d, s in zip(info.shape, info.strides) if d != 1)
    extent = 1
    for stride, dim in dims:
        if stride < extent:
            return False
        extent = stride * dim
    return True


def promote(*dtypes: str) -> str:
    """Float type promotion, as torch and jax do it."""
    best = max(dtypes, key=lambda d: _FLOAT_RANK[d])
    if len(set(dtypes)) > 1 and _FLOAT_RANK[best] == 1:
        return "float32"  # bf16 with fp16
    return best


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


_ALIGNED_ARGS: dict = {}


def aligned_args(kernel) -> tuple[str, ...]:
    """The int arguments ``kernel`` passes through :func:`liger_core.tl_math.aligned` (lines
    ``name = aligned(name, ALIGN)`` of its source: the one place they are listed)."""
    key = id(kernel.fn)
    if key not in _ALIGNED_ARGS:
        source = inspect.getsource(kernel.fn)
        _ALIGNED_ARGS[key] = tuple(re.findall(r"^\s+(\w+) = aligned\(\1, ALIGN\)$", source, re.M))
    return _ALIGNED_ARGS[key]


def alignment(*values: int) -> int:
    """A kernel's ``ALIGN`` constexpr: 16 when every one of ``values`` (row strides and row lengths, in
    elements) is a multiple of 16, else 1. Kernels pass those values through :func:`liger_core.tl_math.aligned`
    so that rows are loaded with 16-byte accesses whichever launcher compiled them."""
    return 16 if all(int(v) % 16 == 0 for v in values) else 1


def warps_for(elements: int, max_warps: int = 16) -> int:
    """num_warps for a row-wise kernel holding ``elements`` values per program (about 8-16 per thread)."""
    warps = next_power_of_2(cdiv(elements, 32 * 16))
    return max(1, min(max_warps, warps))


# A row sweep (a program walking a row, or the KL forward's 16384-column chunk of one, block by block: the CE, JSD
# and KL losses) holds 2048 elements per step at 8 warps, 8 per thread. GPU sweep on the H200 (bf16, 8192x128256,
# scripts/tune_row_kernels.py, benchmarks/results/h200-2026-12-03-tune_row_kernels.txt): CE loss+grad 1.615 ms
# against 1.709 at 4096/8 and 1.698 at 8192/16; JSD loss+grad 1.864 against 1.964 at 4096/8; the KL forward's
# chunks: h200-2026-12-04-tune_kl_div_chunks.txt. Small blocks with many warps keep more loads in flight per SM
# than a few large blocks. (CE has since taken longer steps on wide rows, with streamed gradient stores:
# cross_entropy._CE_SWEEPS.)
_SWEEP_BLOCK = 2048


def by_width(table, n_cols: int, default=None):
    """The launch of the first ``(from_columns, launch)`` entry of ``table`` (widest first) that ``n_cols``
    reaches, else ``default``: a tuned launch that changes with the row's width."""
    return next((launch for from_columns, launch in table if n_cols >= from_columns), default)


def sweep_block_and_warps(n_cols: int) -> tuple[int, int]:
    """(elements per step, num_warps) of a row sweep over ``n_cols`` columns."""
    block = min(_SWEEP_BLOCK, next_power_of_2(n_cols))
    return block, max(1, min(8, block // 256))


# ---------------------------------------------------------------------------------------------------------
# Validation shared by every kernel family: errors name the argument and come before any launch.


def check_float(info: ArrayInfo, name: str, allowed=FLOAT_DTYPES) -> None:
    if info.dtype not in allowed:
        raise TypeError(f"{name} must have a floating dtype in {allowed}, got {info.dtype}")


def check_nonempty(info: ArrayInfo, name: str) -> None:
    if info.ndim == 0:
        raise ValueError(f"{name} must have at least one dimension, got a scalar")
    if info.numel == 0:
        raise ValueError(f"{name} must not be empty, got shape {info.shape}")


def check_same_shape(a: ArrayInfo, a_name: str, b: ArrayInfo, b_name: str) -> None:
    if tuple(a.shape) != tuple(b.shape):
        raise ValueError(f"{b_name} must have the shape of {a_name} {a.shape}, got {b.shape}")


# Scalar options. Errors name the option; a value that cannot become a Python float / int is a TypeError, one out
# of range (NaN and inf included) a ValueError. Bools and strings are refused although float() would take them.


def as_real(value, name: str) -> float:
    """``float(value)`` for a real number (Python, numpy, or a concrete 0-d array); TypeError naming it else."""
    if value is None or isinstance(value, (bool, str, bytes)):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):  # a jax tracer's ConcretizationTypeError is a TypeError too
        raise TypeError(f"{name} must be a real number, got {value!r}{_traced_hint(value)}") from None


def _traced_hint(value) -> str:
    """The remedy for an option traced under jax.jit (a tracer is neither a float nor an int to the plans)."""
    if "Tracer" in type(value).__name__:
        return "; options are compile-time constants: pass a Python number (static under jax.jit)"
    return ""


def check_finite(value, name: str) -> float:
    result = as_real(value, name)
    if not math.isfinite(result):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return result


def check_eps(value, name: str = "eps") -> float:
    """A normalisation epsilon: finite and >= 0 (a NaN or negative one turns rows NaN without any error)."""
    result = as_real(value, name)
    if not (math.isfinite(result) and result >= 0.0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return result


def check_bool(value, name: str) -> bool:
    """``value``, a bool (numpy's too); a TypeError naming ``name`` for anything else: ``bool("False")`` is True,
    so a string (or a number) passed for an on/off option would silently select the wrong computation."""
    if isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")):
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {value!r}")


INT64_RANGE = (-(2**63), 2**63 - 1)


def check_int(value, name: str) -> int:
    """An integer scalar option (Python or numpy int, not a bool) that fits a kernel's int64 argument."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r}{_traced_hint(value)}")
    result = int(value)
    if not INT64_RANGE[0] <= result <= INT64_RANGE[1]:
        raise ValueError(f"{name} must fit in int64, got {result}")
    return result


def check_positive_int(value, name: str) -> int:
    """A size option (a hidden size, a chunk's rows): an int (Python or numpy, not a bool) >= 1."""
    result = check_int(value, name)
    if result < 1:
        raise ValueError(f"{name} must be a positive int, got {result}")
    return result

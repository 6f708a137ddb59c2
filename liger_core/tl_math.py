"""Small ``@triton.jit`` helpers every kernel family shares: rounding to half precision, tanh without libdevice.

Kernels load half-precision values, compute in fp32 and round where the reference rounds. The rounding is done
on the fp32 bit pattern (round to nearest, ties to even), because Triton's interpreter converts fp32 to bf16 by
truncation; a value rounded here is exactly representable in bf16, so the truncating store is then exact and
the interpreter gives the GPU's results.
"""

import triton
import triton.language as tl

from . import runtime

# Compiled kernels convert fp32 to bf16 with the hardware's round-to-nearest-even (cvt.rn, NaN stays NaN); only
# the interpreter needs the bit-pattern rounding below.
_INTERPRETED = tl.constexpr(runtime.interpreting())


@triton.jit
def round_to(value, dtype: tl.constexpr):
    """Round fp32 ``value`` to ``dtype`` (round to nearest even) and return it as fp32."""
    if dtype == tl.bfloat16:
        if _INTERPRETED:
            bits = value.to(tl.uint32, bitcast=True)
            bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
            # A NaN's payload can carry into the exponent or the sign bit (0x7FFFFFFF, the GPU's NaN, would
            # become -0.0): keep NaN as NaN.
            return tl.where(value != value, value, bits.to(tl.float32, bitcast=True))
        else:
            return value.to(tl.bfloat16).to(tl.float32)
    elif dtype == tl.float32:
        return value
    else:
        return value.to(dtype).to(tl.float32)


@triton.jit
def cast(value, dtype: tl.constexpr):
    """fp32 ``value`` as ``dtype`` for a store, rounded to nearest even also in the interpreter."""
    return round_to(value, dtype).to(dtype)


@triton.jit
def chunk_columns(i, n_chunks, CHUNK: tl.constexpr, SECOND_SWEEP: tl.constexpr):
    """Columns of step ``i`` of a sweep over a row in CHUNK-column steps. A second sweep over the same row goes
    last chunk first: the chunks the first sweep read last are the likeliest to be still in L2."""
    index = n_chunks - 1 - i if SECOND_SWEEP else i
    return index * CHUNK + tl.arange(0, CHUNK)


@triton.jit
def tanh(z):
    """tanh through exp (no libdevice): odd, with exp(-2|z|) <= 1 so nothing overflows."""
    e = tl.exp(-2.0 * tl.abs(z))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(z < 0, -t, t)


@triton.jit
def aligned(value, ALIGN: tl.constexpr):
    """``value``, a multiple of ALIGN (the launch plan checked it: :func:`liger_core.launch.alignment`), in a form
    the compiler can see is one. Triton's own launcher marks integer arguments divisible by 16; jax_triton does
    not, and without it row strides and lengths are of unknown alignment, so row loads and stores compile to
    2-byte accesses instead of 16-byte ones (seen in the PTX for sm_90; tests/core/test_vectorized_ptx.py)."""
    return value // ALIGN * ALIGN


@triton.jit
def row_and_block(n_blocks, FLAT: tl.constexpr):
    """(row, column block) of this program: program_id (0, 1) of a (rows, blocks) grid, or with ``FLAT`` the
    decoded id of a one-axis grid of rows x blocks (:func:`liger_core.launch.rows_by_blocks_grid`). The row is
    int64 either way."""
    if FLAT:
        program = tl.program_id(0).to(tl.int64)
        row, block = program // n_blocks, program % n_blocks
    else:
        row, block = tl.program_id(0).to(tl.int64), tl.program_id(1)
    return row, block


# Base-2 transcendentals. tl.exp(x) compiles to an FMUL by log2(e), the hardware's ex2 and three instructions that
# keep denormal results (FSETP and two predicated FMULs); tl.exp2 compiles to the ex2 alone (flushing denormals
# to 0). tl.log and tl.log2 compile to a ~25-instruction software routine, not to the hardware's lg2. In a loop
# that does little else per element these counts decide the time (the JSD loop issued ~52 instructions per
# element: perf-log, thirteenth session), so hot loops take exp_ftz and log_approx.
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def exp_ftz(x):
    """exp of fp32 ``x`` as tl.exp computes it (the hardware ex2 of x * log2(e)) but with results below fp32's
    smallest normal flushed to 0: two instructions instead of five."""
    return tl.exp2(x * LOG2E)


@triton.jit
def exp_minus_abs_ftz(x):
    """exp(-|x|) as :func:`exp_ftz` (written out: the compiler does not fold the negation into the multiply)."""
    return tl.exp2(tl.abs(x) * -LOG2E)


@triton.jit
def log2_approx(x):
    """log2 of fp32 ``x`` in one hardware instruction (``lg2.approx.ftz``). Its error is 2^-22 absolute for ``x``
    in [0.5, 2] and ~2 ulps of the result elsewhere (~4e-6 at log2 x = -17, where tl.log2 is good to half an ulp):
    where a sum of such logs must cancel, take the log of a ratio near 1 instead (liger_core.jsd). A denormal ``x``
    counts as 0 and gives -inf, so callers floor ``x`` at fp32's smallest normal. The interpreter, which runs no
    PTX, takes numpy's log2."""
    if _INTERPRETED:
        return tl.log2(x)
    else:
        return tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def log_approx(x):
    """Natural log by :func:`log2_approx` (same error, in nats; same caveats)."""
    return log2_approx(x) * LN2

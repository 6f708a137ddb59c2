"""Gated activations: SwiGLU ``silu(a) * b`` and GeGLU ``gelu(a) * b`` (tanh approximation or exact erf).

Forward: one pass reading a and b, writing c. Backward: one pass reading dc, a and b that recomputes the
activation instead of saving it, and writes ``da = dc * b * act'(a)`` and ``db = dc * act(a)``, optionally over
a's and b's own memory (the frontend decides when that is allowed).

Precision follows HF's eager ``act_fn(gate) * up`` in half precision: the activation is computed in fp32 and
rounded to the input dtype, then multiplied (rounded again); the backward rounds ``dc * b`` before applying
act' in fp32, as torch's autograd does. Everything is fp32 in registers (the interpreter cannot do bf16
arithmetic); gelu's tanh is written as a sigmoid of ``exp`` (no libdevice), erf is ``tl.erf`` (``math.erf``
in the interpreter, libdevice's erff on the GPU).
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from .launch import (
    ArrayInfo, Buf, Launch, NewBuffer, Plan, cdiv, check_float, check_nonempty, check_same_shape,
    next_power_of_2, non_overlapping, warps_for,
)
from .rowwise import row_view
from .tl_math import aligned, cast, round_to

ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "gelu": 2}
GELU_APPROXIMATIONS = {"tanh": "gelu_tanh", "none": "gelu"}
# Elements per program: 16-byte vectors for every thread, several in flight.
_TILE_ELEMENTS = 4096
_MAX_BLOCK_N = 1024
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_SQRT_1_2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
_KAPPA = tl.constexpr(0.044715)


@triton.jit
def _gelu_tanh_gate(a):
    """sigmoid(2u) = (1 + tanh(u)) / 2 with u = sqrt(2/pi) (a + 0.044715 a^3): gelu_tanh(a) = a * gate."""
    return 1.0 / (1.0 + tl.exp(-2.0 * _SQRT_2_OVER_PI * (a + _KAPPA * a * a * a)))


@triton.jit
def _activation(a, ACT: tl.constexpr):
    """act(a) in fp32."""
    if ACT == 0:
        return a / (1.0 + tl.exp(-a))
    elif ACT == 1:
        return a * _gelu_tanh_gate(a)
    else:
        return 0.5 * a * (1.0 + tl.erf(a * _SQRT_1_2))


@triton.jit
def _activation_and_derivative(a, ACT: tl.constexpr):
    """(act(a), act'(a)) in fp32, with torch's formulas for the derivative."""
    if ACT == 0:
        sig = 1.0 / (1.0 + tl.exp(-a))
        return a * sig, sig * (1.0 + a * (1.0 - sig))
    elif ACT == 1:
        # (1 + tanh(u)) / 2 = sigmoid(2u) and (1 - tanh(u)^2) / 2 = 2 s (1 - s): no 1 + tanh(u) cancellation,
        # which for a < -4 left act'(a) (~1e-5 there) as 0 or with no correct digit.
        s = _gelu_tanh_gate(a)
        d_inner = _SQRT_2_OVER_PI * (1.0 + 3.0 * _KAPPA * a * a)
        return a * s, s + 2.0 * a * s * (1.0 - s) * d_inner
    else:
        cdf = 0.5 * (1.0 + tl.erf(a * _SQRT_1_2))
        pdf = tl.exp(-0.5 * a * a) * _INV_SQRT_2PI
        return a * cdf, cdf + a * pdf


@triton.jit
def _tile_indices(n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Row and column indices of this program's tile. Programs are numbered column block first, so
    neighbouring programs read neighbouring bytes of the same rows (the grid is 1-d: no 65535 limit)."""
    program = tl.program_id(0)
    col_blocks = tl.cdiv(n_cols, BLOCK_N)
    rows = (program // col_blocks).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (program % col_blocks).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, cols


@triton.jit
def _gated_forward_kernel(
    A, a_row_stride, a_col_stride,
    B, b_row_stride, b_col_stride,
    n_rows, n_cols,
    C,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ACT: tl.constexpr, ALIGN: tl.constexpr,
):
    a_row_stride = aligned(a_row_stride, ALIGN)
    b_row_stride = aligned(b_row_stride, ALIGN)
    n_cols = aligned(n_cols, ALIGN)
    rows, cols = _tile_indices(n_cols, BLOCK_M, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    a = tl.load(A + rows[:, None] * a_row_stride + cols[None, :] * a_col_stride, mask=mask, other=0.0)
    b = tl.load(B + rows[:, None] * b_row_stride + cols[None, :] * b_col_stride, mask=mask, other=0.0)
    c_dtype = C.dtype.element_ty
    act = round_to(_activation(a.to(tl.float32), ACT), c_dtype)  # act_fn(gate) in the input dtype
    c = act * b.to(tl.float32)
    tl.store(C + rows[:, None] * n_cols + cols[None, :], cast(c, c_dtype), mask=mask)


@triton.jit
def _gated_backward_kernel(
    DC, dc_row_stride, dc_col_stride,
    A, a_row_stride, a_col_stride,
    B, b_row_stride, b_col_stride,
    da_row_stride, da_col_stride,
    db_row_stride, db_col_stride,
    n_rows, n_cols,
    DA, DB,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ACT: tl.constexpr, ALIGN: tl.constexpr,
):
    dc_row_stride = aligned(dc_row_stride, ALIGN)
    a_row_stride = aligned(a_row_stride, ALIGN)
    b_row_stride = aligned(b_row_stride, ALIGN)
    da_row_stride = aligned(da_row_stride, ALIGN)
    db_row_stride = aligned(db_row_stride, ALIGN)
    n_cols = aligned(n_cols, ALIGN)
    rows, cols = _tile_indices(n_cols, BLOCK_M, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    dc = tl.load(DC + rows[:, None] * dc_row_stride + cols[None, :] * dc_col_stride, mask=mask, other=0.0)
    a = tl.load(A + rows[:, None] * a_row_stride + cols[None, :] * a_col_stride, mask=mask, other=0.0)
    b = tl.load(B + rows[:, None] * b_row_stride + cols[None, :] * b_col_stride, mask=mask, other=0.0)
    dc = dc.to(tl.float32)
    act, d_act = _activation_and_derivative(a.to(tl.float32), ACT)
    da_dtype = DA.dtype.element_ty
    db_dtype = DB.dtype.element_ty
    db = dc * round_to(act, db_dtype)  # grad of act(a) * b w.r.t. b, act(a) in the input dtype
    da = round_to(dc * b.to(tl.float32), da_dtype) * d_act  # grad w.r.t. act(a), then act's backward in fp32
    tl.store(DA + rows[:, None] * da_row_stride + cols[None, :] * da_col_stride, cast(da, da_dtype), mask=mask)
    tl.store(DB + rows[:, None] * db_row_stride + cols[None, :] * db_col_stride, cast(db, db_dtype), mask=mask)


# ---------------------------------------------------------------------------------------------------------
# Launch logic


def activation_name(activation: str) -> str:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")
    return activation


def gelu_activation(approximate: str) -> str:
    """The activation of ``geglu(a, b, approximate=...)`` (torch's ``F.gelu`` naming: 'tanh' or 'none')."""
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
    return GELU_APPROXIMATIONS[approximate]


def check_inputs(a: ArrayInfo, b: ArrayInfo, activation: str) -> None:
    activation_name(activation)
    check_nonempty(a, "a")
    check_float(a, "a")
    check_float(b, "b")
    check_same_shape(a, "a", b, "b")
    if b.dtype != a.dtype:
        raise TypeError(f"b must have a's dtype {a.dtype}, got {b.dtype}")


def check_linear(a: ArrayInfo, weight: ArrayInfo, bias: ArrayInfo | None, *, layout: str = "oi",
                 weight_name: str = "weight", bias_name: str = "bias") -> int:
    """The down projection of ``swiglu_linear`` / ``geglu_linear``: ``weight`` (O, I) (``layout="oi"``, torch's
    ``nn.Linear``) or (I, O) (``"io"``, a Flax kernel) with I = a's last dimension, ``bias`` (O,). Returns O."""
    check_float(weight, weight_name)
    n_in = a.shape[-1] if a.ndim else None
    expect = "(O, I)" if layout == "oi" else "(I, O)"
    if weight.ndim != 2 or weight.shape[1 if layout == "oi" else 0] != n_in:
        raise ValueError(f"{weight_name} must have shape {expect} with I={n_in} (a's last dimension), "
                         f"got {weight.shape}")
    n_out = weight.shape[0 if layout == "oi" else 1]
    if bias is not None:
        check_float(bias, bias_name)
        if tuple(bias.shape) != (n_out,):
            raise ValueError(f"{bias_name} must have shape ({n_out},), got {bias.shape}")
    return n_out


def _tile(n_rows: int, n_cols: int) -> tuple[int, int]:
    block_n = min(_MAX_BLOCK_N, next_power_of_2(n_cols))
    block_m = max(1, min(_TILE_ELEMENTS // block_n, next_power_of_2(n_rows)))
    return block_m, block_n


@functools.lru_cache(maxsize=1024)  # plans are pure functions of hashable arguments
def forward_plan(a: ArrayInfo, b: ArrayInfo, *, activation: str) -> Plan:
    """Plan for ``c = act(a) * b``: inputs ``a``, ``b``; output ``c`` (a's shape and dtype, contiguous)."""
    check_inputs(a, b, activation)
    n_rows, n_cols, a_rs, a_cs = row_view(a, "a")
    _, _, b_rs, b_cs = row_view(b, "b")
    block_m, block_n = _tile(n_rows, n_cols)
    launch = Launch(
        kernel=_gated_forward_kernel,
        grid=(cdiv(n_rows, block_m) * cdiv(n_cols, block_n),),
        args=(Buf("a"), a_rs, a_cs, Buf("b"), b_rs, b_cs, n_rows, n_cols),
        outputs=(NewBuffer("c", a.shape, a.dtype),),
        constexprs={"BLOCK_M": block_m, "BLOCK_N": block_n, "ACT": ACTIVATIONS[activation]},
        num_warps=warps_for(block_m * block_n, max_warps=8),
    )
    return Plan(inputs=("a", "b"), launches=(launch,), outputs=("c",))


@functools.lru_cache(maxsize=1024)  # plans are pure functions of hashable arguments
def backward_plan(dc: ArrayInfo, a: ArrayInfo, b: ArrayInfo, *, activation: str, in_place: bool) -> Plan:
    """Plan for ``da, db`` from ``dc``: inputs ``dc``, ``a``, ``b``; outputs ``da``, ``db``.

    With ``in_place`` da is written over a and db over b (each when its memory has no overlapping elements);
    only the caller knows whether a and b may be destroyed."""
    check_inputs(a, b, activation)
    check_float(dc, "grad_output")
    if tuple(dc.shape) != tuple(a.shape):
        raise ValueError(f"grad_output must have the shape of a {a.shape}, got {dc.shape}")
    n_rows, n_cols, a_rs, a_cs = row_view(a, "a")
    _, _, b_rs, b_cs = row_view(b, "b")
    _, _, dc_rs, dc_cs = row_view(dc, "grad_output")
    outputs, strides = [], []
    for src, (rs, cs), name in ((a, (a_rs, a_cs), "a"), (b, (b_rs, b_cs), "b")):
        if in_place and non_overlapping(src):
            outputs.append(NewBuffer(f"d{name}", src.shape, src.dtype, alias=name))
            strides += [rs, cs]
        else:
            outputs.append(NewBuffer(f"d{name}", src.shape, src.dtype))
            strides += [n_cols, 1]
    block_m, block_n = _tile(n_rows, n_cols)
    launch = Launch(
        kernel=_gated_backward_kernel,
        grid=(cdiv(n_rows, block_m) * cdiv(n_cols, block_n),),
        args=(Buf("dc"), dc_rs, dc_cs, Buf("a"), a_rs, a_cs, Buf("b"), b_rs, b_cs, *strides, n_rows, n_cols),
        outputs=tuple(outputs),
        constexprs={"BLOCK_M": block_m, "BLOCK_N": block_n, "ACT": ACTIVATIONS[activation]},
        num_warps=warps_for(block_m * block_n, max_warps=8),
    )
    return Plan(inputs=("dc", "a", "b"), launches=(launch,), outputs=("da", "db"))

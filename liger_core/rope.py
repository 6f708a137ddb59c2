"""Rotary position embedding (RoPE) of q and k in one launch.

``out = x * cos + rot(x) * sin`` per head, with cos/sin rows shared by all heads of a token:

- Hugging Face ("rotate_half") convention: ``rot(x) = cat(-x[D/2:], x[:D/2])``, pairs (j, j + D/2);
- interleaved (GPT-J, "rotate_every_two"): ``rot(x)[2j] = -x[2j+1]``, ``rot(x)[2j+1] = x[2j]``, pairs (2j, 2j+1).

cos and sin have shape (T, D) or (1 or B, T, D); with ``position_ids`` ((T,) or (1 or B, T), integer) token
(b, t) uses row ``position_ids[b, t]`` of cos/sin, whose length is then the table size. q and k are 4-d with any
head counts (GQA/MQA: H_q and H_kv are independent), in the layout (B, H, T, D) (``head_axis=1``, HF) or
(B, T, H, D) (``head_axis=2``, Flax); the kernel takes every axis stride, so no layout is copied.

The backward is the transpose of the same map (the inverse rotation, sin -> -sin, for HF's cos/sin whose two
halves are equal): ``dx1 = c1 dy1 + s2 dy2``, ``dx2 = c2 dy2 - s1 dy1``, run by the same kernel. No gradient is
produced for cos/sin. Products and sums are rounded where HF's eager formula (and its autograd) rounds, so the
results match HF bitwise in every dtype.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from .launch import (
    ArrayInfo, Buf, Launch, NewBuffer, Plan, cdiv, check_float, check_last_axis_span, check_nonempty,
    contiguous_strides, dense_strides, next_power_of_2, non_overlapping, promote, warps_for,
)
from .tl_math import aligned, cast, round_to

INT_DTYPES = ("int64", "int32", "int16", "int8", "uint8")
# q/k elements one program rotates (a block of heads x a block of tokens x head_dim): enough bytes in flight per
# program to keep the copy bandwidth, few enough that many programs fit on an SM.
_TILE_ELEMENTS = 2048
# Most heads in one program's block: the cos/sin tile is read once per block, so more heads read it less
# often, but fewer heads give more programs (a small T needs them).
_MAX_BLOCK_H = 2
# Head blocks one program rotates in turn with the token block's cos/sin tile, read once (1: one head block per
# program, the neighbouring programs of a token block reading the tile again from L2). scripts/tune_rope.py
# on the H200 (B1, 32/8 heads, D128, bf16): all 20 head blocks per program 0.349 ms at T=65536 against 0.411
# with one; at T=16384 4 per program 0.096-0.099, all 20 0.100-0.101, one 0.104-0.108. So a program takes
# every head block of its tokens...
_GROUPS_PER_PROGRAM = 64
# ...as long as the grid keeps this many programs (8192 token blocks at T=65536; a shorter sequence splits its
# heads again: 5 head blocks per program at T=16384).
_MIN_PROGRAMS = 8192


@triton.jit
def _as_fp32(tile, poison, ADD_POISON: tl.constexpr):
    tile = tile.to(tl.float32)
    if ADD_POISON:
        tile = tile + poison[:, None]
    return tile


@triton.jit
def _rotate_tile(X, x_sh, x_st, x_sd, O, o_sh, o_st, o_sd, h0, n_heads, t, t_mask, half, c1, c2, s1, s2, poison,
                 BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, INTERLEAVED: tl.constexpr,
                 BACKWARD: tl.constexpr, ADD_POISON: tl.constexpr):
    """Rotate heads [h0, h0 + BLOCK_H) of the tokens ``t`` (a (BLOCK_T,) vector): X and O point at the sequence's
    first element; c1..s2 are (BLOCK_T, BLOCK_HALF) tiles of the tokens' cos/sin halves, as loaded or already
    fp32; ``poison`` (BLOCK_T,) is added to them with ADD_POISON."""
    o_dtype = O.dtype.element_ty
    heads = h0 + tl.arange(0, BLOCK_H).to(tl.int64)
    row_mask = (heads < n_heads)[:, None, None] & t_mask[None, :, None]
    x_rows = X + heads[:, None, None] * x_sh + t[None, :, None] * x_st
    o_rows = O + heads[:, None, None] * o_sh + t[None, :, None] * o_st
    if INTERLEAVED:
        d = tl.arange(0, 2 * BLOCK_HALF)
        mask = row_mask & (d < 2 * half)[None, None, :]
        x = tl.load(x_rows + d[None, None, :] * x_sd, mask=mask, other=0.0).to(tl.float32)
        x1, x2 = tl.split(tl.reshape(x, (BLOCK_H, x.shape[1], BLOCK_HALF, 2)))
    else:
        j = tl.arange(0, BLOCK_HALF)
        mask = row_mask & (j < half)[None, None, :]
        x1 = tl.load(x_rows + j[None, None, :] * x_sd, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_rows + (j + half)[None, None, :] * x_sd, mask=mask, other=0.0).to(tl.float32)
    # A tile still in its dtype is converted here, after the x loads are issued: converted before them (in the
    # kernel), a one-group program waited for cos/sin before it even asked for x, two memory round trips in a
    # row (seen in the sm_90 SASS: every cos/sin conversion before the first x load).
    c1 = _as_fp32(c1, poison, ADD_POISON)[None, :, :]
    c2 = _as_fp32(c2, poison, ADD_POISON)[None, :, :]
    s1 = _as_fp32(s1, poison, ADD_POISON)[None, :, :]
    s2 = _as_fp32(s2, poison, ADD_POISON)[None, :, :]
    # Each product is rounded to the output dtype, then the sum: what HF's eager formula (forward) and its
    # autograd (backward: grad * cos and the rotated grad * sin, accumulated) compute in half precision.
    if BACKWARD:
        o1 = round_to(x1 * c1, o_dtype) + round_to(x2 * s2, o_dtype)
        o2 = round_to(x2 * c2, o_dtype) - round_to(x1 * s1, o_dtype)
    else:
        o1 = round_to(x1 * c1, o_dtype) - round_to(x2 * s1, o_dtype)
        o2 = round_to(x2 * c2, o_dtype) + round_to(x1 * s2, o_dtype)
    if INTERLEAVED:
        o = tl.reshape(tl.join(o1, o2), (BLOCK_H, o1.shape[1], 2 * BLOCK_HALF))
        tl.store(o_rows + d[None, None, :] * o_sd, cast(o, o_dtype), mask=mask)
    else:
        tl.store(o_rows + j[None, None, :] * o_sd, cast(o1, o_dtype), mask=mask)
        tl.store(o_rows + (j + half)[None, None, :] * o_sd, cast(o2, o_dtype), mask=mask)


@triton.jit
def _rope_kernel(
    Q, q_sb, q_st, q_sh, q_sd,
    K, k_sb, k_st, k_sh, k_sd,
    COS, cos_sb, cos_st, cos_sd,
    SIN, sin_sb, sin_st, sin_sd,
    POS, pos_sb, pos_st,
    qo_sb, qo_st, qo_sh, qo_sd,
    ko_sb, ko_st, ko_sh, ko_sd,
    n_tokens, n_heads_q, n_heads_k, half, n_positions, n_groups_q, n_groups,
    QO, KO,
    BLOCK_T: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
    INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr, HAS_POS: tl.constexpr, GROUPS_PER_PROGRAM: tl.constexpr,
    ALIGN: tl.constexpr,
):
    """One program: a block of BLOCK_T tokens of one sequence and GROUPS_PER_PROGRAM consecutive groups of heads
    (a group: a block of heads of q, the first ``n_groups_q`` groups, or of k), rotated in turn with the token
    block's cos/sin tile, loaded once. The group blocks of a token block are neighbouring programs, so the tile
    each of them reads is mostly an L2 hit."""
    q_sb = aligned(q_sb, ALIGN)
    q_st = aligned(q_st, ALIGN)
    q_sh = aligned(q_sh, ALIGN)
    k_sb = aligned(k_sb, ALIGN)
    k_st = aligned(k_st, ALIGN)
    k_sh = aligned(k_sh, ALIGN)
    qo_sb = aligned(qo_sb, ALIGN)
    qo_st = aligned(qo_st, ALIGN)
    qo_sh = aligned(qo_sh, ALIGN)
    ko_sb = aligned(ko_sb, ALIGN)
    ko_st = aligned(ko_st, ALIGN)
    ko_sh = aligned(ko_sh, ALIGN)
    half = aligned(half, ALIGN)
    cos_sb = aligned(cos_sb, ALIGN)
    cos_st = aligned(cos_st, ALIGN)
    sin_sb = aligned(sin_sb, ALIGN)
    sin_st = aligned(sin_st, ALIGN)
    pid = tl.program_id(0).to(tl.int64)
    n_group_blocks = tl.cdiv(n_groups, GROUPS_PER_PROGRAM)
    t_blocks = tl.cdiv(n_tokens, BLOCK_T)
    b = pid // n_group_blocks // t_blocks
    t = (pid // n_group_blocks % t_blocks) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    t_mask = t < n_tokens
    rows = t
    poison = tl.zeros((BLOCK_T,), dtype=tl.float32)
    if HAS_POS:
        rows = tl.load(POS + b * pos_sb + t * pos_st, mask=t_mask, other=0).to(tl.int64)
        # The frontends reject out-of-range positions they can see; a traced one (jax.jit) must still not read
        # outside the tables: read row 0 instead and make the token's outputs NaN, so the error shows.
        inside = (rows >= 0) & (rows < n_positions)
        rows = tl.where(inside, rows, 0)
        poison = tl.where(inside, 0.0, float("nan"))
    cos_rows = COS + b * cos_sb + rows[:, None] * cos_st
    sin_rows = SIN + b * sin_sb + rows[:, None] * sin_st
    if INTERLEAVED:
        d = tl.arange(0, 2 * BLOCK_HALF)
        d_mask = t_mask[:, None] & (d < 2 * half)[None, :]
        c = tl.load(cos_rows + d[None, :] * cos_sd, mask=d_mask, other=0.0)
        s = tl.load(sin_rows + d[None, :] * sin_sd, mask=d_mask, other=0.0)
        c1, c2 = tl.split(tl.reshape(c, (BLOCK_T, BLOCK_HALF, 2)))
        s1, s2 = tl.split(tl.reshape(s, (BLOCK_T, BLOCK_HALF, 2)))
    else:
        j = tl.arange(0, BLOCK_HALF)
        j_mask = t_mask[:, None] & (j < half)[None, :]
        c1 = tl.load(cos_rows + j[None, :] * cos_sd, mask=j_mask, other=0.0)
        c2 = tl.load(cos_rows + (j + half)[None, :] * cos_sd, mask=j_mask, other=0.0)
        s1 = tl.load(sin_rows + j[None, :] * sin_sd, mask=j_mask, other=0.0)
        s2 = tl.load(sin_rows + (j + half)[None, :] * sin_sd, mask=j_mask, other=0.0)
    # One head group: _rotate_tile converts the tile (and adds the poison) after its q/k loads are issued.
    POISON_IN_TILE: tl.constexpr = HAS_POS and GROUPS_PER_PROGRAM == 1
    if GROUPS_PER_PROGRAM > 1:
        # Several head groups: convert the tile once for all of them (converted per group, as one group's
        # program does after its q/k loads, the 65536-token forward measured 1.5% slower on an H100).
        c1 = _as_fp32(c1, poison, HAS_POS)
        c2 = _as_fp32(c2, poison, HAS_POS)
        s1 = _as_fp32(s1, poison, HAS_POS)
        s2 = _as_fp32(s2, poison, HAS_POS)
    for i in range(GROUPS_PER_PROGRAM):
        group = pid % n_group_blocks * GROUPS_PER_PROGRAM + i
        if group < n_groups_q:
            _rotate_tile(Q + b * q_sb, q_sh, q_st, q_sd, QO + b * qo_sb, qo_sh, qo_st, qo_sd, group * BLOCK_HQ,
                         n_heads_q, t, t_mask, half, c1, c2, s1, s2, poison, BLOCK_HQ, BLOCK_HALF, INTERLEAVED,
                         BACKWARD, POISON_IN_TILE)
        elif group < n_groups:
            _rotate_tile(K + b * k_sb, k_sh, k_st, k_sd, KO + b * ko_sb, ko_sh, ko_st, ko_sd,
                         (group - n_groups_q) * BLOCK_HK, n_heads_k, t, t_mask, half, c1, c2, s1, s2, poison, BLOCK_HK,
                         BLOCK_HALF, INTERLEAVED, BACKWARD, POISON_IN_TILE)


# ---------------------------------------------------------------------------------------------------------
# Launch logic


def _axes(head_axis: int) -> tuple[int, int, int, int]:
    """Positions of the (batch, seq, head, dim) axes in a q/k of the given layout."""
    return (0, 3 - head_axis, head_axis, 3)


def _bthd(values, head_axis: int) -> tuple[int, int, int, int]:
    return tuple(values[a] for a in _axes(head_axis))


def _check(q: ArrayInfo, k: ArrayInfo, cos: ArrayInfo, sin: ArrayInfo, position_ids: ArrayInfo | None,
           head_axis: int, q_name: str, k_name: str) -> tuple[int, int, int, int, int]:
    """Validate the arguments; returns (B, T, H_q, H_k, D)."""
    if head_axis not in (1, 2):
        raise ValueError(f"head_axis must be 1 ((B, H, T, D)) or 2 ((B, T, H, D)), got {head_axis!r}")
    layout = "(batch, heads, seq, head_dim)" if head_axis == 1 else "(batch, seq, heads, head_dim)"
    for info, name in ((q, q_name), (k, k_name)):
        if info.ndim != 4:
            raise ValueError(f"{name} must be 4-d {layout}, got shape {info.shape}")
        check_nonempty(info, name)
        check_float(info, name)
    B, T, Hq, D = _bthd(q.shape, head_axis)
    kB, kT, Hk, kD = _bthd(k.shape, head_axis)
    for what, a, b in (("batch size", B, kB), ("sequence length", T, kT), ("head_dim", D, kD)):
        if a != b:
            raise ValueError(f"{k_name} must have {q_name}'s {what} {a}, got {b} ({k_name} shape {k.shape}, "
                             f"{q_name} shape {q.shape}, layout {layout})")
    if D % 2:
        raise ValueError(f"{q_name}'s head_dim (last dimension) must be even for RoPE, got {D}")
    check_last_axis_span(q, q_name)
    check_last_axis_span(k, k_name)
    for info, name in ((cos, "cos"), (sin, "sin")):
        if info.ndim not in (2, 3):
            raise ValueError(f"{name} must have shape (seq, head_dim) or (batch or 1, seq, head_dim), "
                             f"got {info.shape}")
        check_nonempty(info, name)
        check_float(info, name)
    if sin.shape != cos.shape:
        raise ValueError(f"sin must have the shape of cos {cos.shape}, got {sin.shape}")
    if sin.dtype != cos.dtype:
        raise TypeError(f"sin must have cos's dtype {cos.dtype}, got {sin.dtype}")
    check_last_axis_span(cos, "cos")
    check_last_axis_span(sin, "sin")
    if cos.shape[-1] != D:
        raise ValueError(f"cos must have {q_name}'s head_dim {D} as its last dimension, got shape {cos.shape}")
    if cos.ndim == 3 and cos.shape[0] not in (1, B):
        raise ValueError(f"cos's batch dimension must be 1 or {q_name}'s batch size {B}, got shape {cos.shape}")
    if position_ids is None:
        if cos.shape[-2] != T:
            raise ValueError(f"cos has {cos.shape[-2]} positions but {q_name} has {T} tokens (sequence length); "
                             "slice cos/sin to the sequence or pass position_ids")
    else:
        if position_ids.dtype not in INT_DTYPES:
            raise TypeError(f"position_ids must have an integer dtype, got {position_ids.dtype}")
        if position_ids.ndim not in (1, 2) or position_ids.shape[-1] != T or (
                position_ids.ndim == 2 and position_ids.shape[0] not in (1, B)):
            raise ValueError(f"position_ids must have shape ({T},) or (1 or {B}, {T}) to match {q_name}, "
                             f"got {position_ids.shape}")
    return B, T, Hq, Hk, D


def n_positions(cos: ArrayInfo) -> int:
    """The number of rows of the cos/sin tables: ``position_ids`` values must lie in ``[0, n_positions)``."""
    return cos.shape[-2]


def invalid_positions_message(n_rows: int, name: str = "position_ids") -> str:
    """The frontends' error for a position outside the tables. The kernel reads row ``position_ids[b, t]`` of
    cos/sin without a bounds check (an out-of-range one reads outside the tables: a crash or garbage), so each
    frontend checks concrete values eagerly, as the cross-entropy does its targets."""
    return (f"{name} has values outside [0, {n_rows}) (the rows of cos/sin); every position must index a row "
            "of the tables")


def _table_strides(info: ArrayInfo) -> tuple[int, int, int]:
    """(batch, seq, dim) strides of cos/sin; batch stride 0 when shared by the whole batch."""
    if info.ndim == 2:
        return 0, info.strides[0], info.strides[1]
    return (info.strides[0] if info.shape[0] != 1 else 0), info.strides[1], info.strides[2]


def _tile(n_heads_q: int, n_heads_k: int, n_tokens: int, half: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_HQ, BLOCK_HK): head blocks of up to _MAX_BLOCK_H heads, the token block filling the rest
    of _TILE_ELEMENTS."""
    block_hq = min(next_power_of_2(n_heads_q), _MAX_BLOCK_H)
    block_hk = min(next_power_of_2(n_heads_k), _MAX_BLOCK_H)
    per_token = 2 * next_power_of_2(half) * max(block_hq, block_hk)
    block_t = max(1, min(next_power_of_2(n_tokens), _TILE_ELEMENTS // per_token))
    return block_t, block_hq, block_hk


@functools.lru_cache(maxsize=1024)  # plans are pure functions of hashable arguments
def _plan(q: ArrayInfo, k: ArrayInfo, cos: ArrayInfo, sin: ArrayInfo, position_ids: ArrayInfo | None, *,
          head_axis: int, interleaved: bool, backward: bool, q_out_dtype: str, k_out_dtype: str,
          in_place: bool, q_name: str, k_name: str) -> Plan:
    B, T, Hq, Hk, D = _check(q, k, cos, sin, position_ids, head_axis, q_name, k_name)
    half = D // 2
    outputs, out_strides = [], []
    for src, name, dtype in ((q, "q", q_out_dtype), (k, "k", k_out_dtype)):
        if in_place and src.dtype == dtype and non_overlapping(src):
            outputs.append(NewBuffer(f"{name}_out", src.shape, dtype, alias=name))
            out_strides.append(src.strides)
        else:
            strides = fresh_output_strides(src)
            outputs.append(NewBuffer(f"{name}_out", src.shape, dtype, strides=strides))
            out_strides.append(strides or contiguous_strides(src.shape))
    has_pos = position_ids is not None
    if has_pos:
        pos_sb = position_ids.strides[0] if position_ids.ndim == 2 and position_ids.shape[0] != 1 else 0
        pos_args = (Buf("position_ids"), pos_sb, position_ids.strides[-1])
    else:
        pos_args = (Buf("cos"), 0, 0)
    block_t, block_hq, block_hk = _tile(Hq, Hk, T, half)
    block_half = next_power_of_2(half)
    n_groups_q = cdiv(Hq, block_hq)
    n_groups = n_groups_q + cdiv(Hk, block_hk)
    token_programs = B * cdiv(T, block_t)
    groups_per_program = max(1, min(_GROUPS_PER_PROGRAM, n_groups, n_groups * token_programs // _MIN_PROGRAMS))
    launch = Launch(
        kernel=_rope_kernel,
        grid=(token_programs * cdiv(n_groups, groups_per_program),),
        args=(Buf("q"), *_bthd(q.strides, head_axis), Buf("k"), *_bthd(k.strides, head_axis),
              Buf("cos"), *_table_strides(cos), Buf("sin"), *_table_strides(sin), *pos_args,
              *_bthd(out_strides[0], head_axis), *_bthd(out_strides[1], head_axis),
              T, Hq, Hk, half, cos.shape[-2], n_groups_q, n_groups),
        outputs=tuple(outputs),
        constexprs={"BLOCK_T": block_t, "BLOCK_HQ": block_hq, "BLOCK_HK": block_hk, "BLOCK_HALF": block_half,
                    "INTERLEAVED": bool(interleaved), "BACKWARD": bool(backward), "HAS_POS": has_pos,
                    "GROUPS_PER_PROGRAM": groups_per_program},
        num_warps=warps_for(2 * block_half * block_t * max(block_hq, block_hk), max_warps=8),
    )
    inputs = ("q", "k", "cos", "sin") + (("position_ids",) if has_pos else ())
    return Plan(inputs=inputs, launches=(launch,), outputs=("q_out", "k_out"))


def fresh_output_strides(x: ArrayInfo) -> tuple[int, ...] | None:
    """The layout of a fresh output for input ``x``: x's own where it is dense (HF's q is a (B, T, H, D) buffer
    seen as (B, H, T, D), and attention reads HF's embeddings in that layout without a copy), else contiguous
    (None)."""
    strides = dense_strides(x)
    return None if strides is None or strides == contiguous_strides(x.shape) else strides


def output_dtype(x_dtype: str, cos_dtype: str) -> str:
    """HF's ``q * cos + rotate_half(q) * sin`` promotes q's dtype with cos's."""
    return promote(x_dtype, cos_dtype)


def forward_plan(q: ArrayInfo, k: ArrayInfo, cos: ArrayInfo, sin: ArrayInfo, position_ids: ArrayInfo | None = None,
                 *, head_axis: int, interleaved: bool = False, in_place: bool = False) -> Plan:
    """Plan for ``q_out, k_out = rope(q, k, cos, sin, position_ids)``.

    Inputs ``q``, ``k``, ``cos``, ``sin`` (and ``position_ids``); outputs ``q_out``, ``k_out`` of dtype
    promote(q/k, cos). With ``in_place`` an output of its input's dtype is written over that input."""
    _check(q, k, cos, sin, position_ids, head_axis, "q", "k")
    return _plan(q, k, cos, sin, position_ids, head_axis=head_axis, interleaved=interleaved, backward=False,
                 q_out_dtype=output_dtype(q.dtype, cos.dtype), k_out_dtype=output_dtype(k.dtype, cos.dtype),
                 in_place=in_place, q_name="q", k_name="k")


def backward_plan(dq: ArrayInfo, dk: ArrayInfo, cos: ArrayInfo, sin: ArrayInfo,
                  position_ids: ArrayInfo | None = None, *, head_axis: int, q_dtype: str, k_dtype: str,
                  interleaved: bool = False, in_place: bool = True) -> Plan:
    """Plan for the input gradients from the output gradients: inputs ``q`` (= dq_embed), ``k`` (= dk_embed),
    ``cos``, ``sin`` (and ``position_ids``); outputs ``q_out`` (dq, of ``q_dtype``) and ``k_out`` (dk).

    With ``in_place`` a gradient is written over the incoming one when that has the gradient's dtype and no
    overlapping elements (an expanded, stride-0 gradient has)."""
    return _plan(dq, dk, cos, sin, position_ids, head_axis=head_axis, interleaved=interleaved, backward=True,
                 q_out_dtype=q_dtype, k_out_dtype=k_dtype, in_place=in_place, q_name="grad_q", k_name="grad_k")

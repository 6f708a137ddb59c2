"""RoPE for torch: autograd wiring around :mod:`liger_core.rope` (q and k in one launch)."""

from __future__ import annotations

import torch

from liger_core import rope as core
from liger_core.launch import check_bool

from ._custom_ops import compiling, define, empty_like
from ._launch import (
    capturing_cuda_graph, check_tensors, dtype_name, info, once_differentiable, optional_info, refuse_grad, run_plan,
)

_HEAD_AXES = {1: 1, -3: 1, 2: 2, -2: 2}


def check_positions(position_ids, cos) -> None:
    """ValueError for a position outside cos/sin's rows, which the kernel would read out of bounds. A host sync
    (as the cross-entropy's target check), paid only when position ids are given."""
    if position_ids is None or capturing_cuda_graph(position_ids):  # captured: the kernel's NaN marks a bad one
        return
    n_rows = cos.shape[-2]
    if not bool(((position_ids >= 0) & (position_ids < n_rows)).all()):
        raise ValueError(core.invalid_positions_message(n_rows))


def _forward(q, k, cos, sin, position_ids, head_axis, interleaved):
    plan = core.forward_plan(info(q), info(k), info(cos), info(sin), optional_info(position_ids),
                             head_axis=head_axis, interleaved=interleaved)
    check_positions(position_ids, cos)  # after the plan's dtype and shape checks
    return run_plan(plan, q=q, k=k, cos=cos, sin=sin, position_ids=position_ids)


def _backward(dq, dk, cos, sin, position_ids, head_axis, interleaved, q_dtype, k_dtype, in_place):
    plan = core.backward_plan(info(dq), info(dk), info(cos), info(sin), optional_info(position_ids),
                              head_axis=head_axis, q_dtype=q_dtype, k_dtype=k_dtype, interleaved=interleaved,
                              in_place=in_place)
    return run_plan(plan, q=dq, k=dk, cos=cos, sin=sin, position_ids=position_ids)


class LigerRopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, position_ids, head_axis, interleaved, in_place):
        q_out, k_out = _forward(q, k, cos, sin, position_ids, head_axis, interleaved)
        ctx.save_for_backward(cos, sin, position_ids)
        ctx.head_axis, ctx.interleaved, ctx.in_place = head_axis, interleaved, in_place
        ctx.q_dtype, ctx.k_dtype = dtype_name(q.dtype), dtype_name(k.dtype)
        return q_out, k_out

    @staticmethod
    @once_differentiable
    def backward(ctx, dq, dk):
        cos, sin, position_ids = ctx.saved_tensors
        # (autograd materialises the gradient of an unused output as zeros, so neither is None)
        dq, dk = _backward(dq, dk, cos, sin, position_ids, ctx.head_axis, ctx.interleaved, ctx.q_dtype, ctx.k_dtype,
                           ctx.in_place)
        return dq, dk, None, None, None, None, None, None


# torch.compile path (see _custom_ops): the same helpers as custom ops, never in place.


def _fresh_like(x, dtype):
    """The real op's fresh output for input ``x`` (its layout where dense: core.fresh_output_strides)."""
    return empty_like(x, dtype, strides=core.fresh_output_strides(info(x)))


def _forward_fake(q, k, cos, sin, position_ids, head_axis, interleaved):
    cos_dtype = dtype_name(cos.dtype)
    return (_fresh_like(q, core.output_dtype(dtype_name(q.dtype), cos_dtype)),
            _fresh_like(k, core.output_dtype(dtype_name(k.dtype), cos_dtype)))


def _setup_context(ctx, inputs, output):
    q, k, cos, sin, position_ids, ctx.head_axis, ctx.interleaved = inputs
    ctx.save_for_backward(cos, sin, position_ids)
    ctx.q_dtype, ctx.k_dtype = q.dtype, k.dtype


def _backward_fn(ctx, dq, dk):
    cos, sin, position_ids = ctx.saved_tensors
    dq, dk = backward_op(dq, dk, cos, sin, position_ids, ctx.head_axis, ctx.interleaved, ctx.q_dtype, ctx.k_dtype)
    return dq, dk, None, None, None, None, None


forward_op = define("rope_forward",
                    "(Tensor q, Tensor k, Tensor cos, Tensor sin, Tensor? position_ids, int head_axis, "
                    "bool interleaved) -> (Tensor, Tensor)", _forward, _forward_fake, setup_context=_setup_context,
                    backward=_backward_fn)


def _backward_op(dq, dk, cos, sin, position_ids, head_axis, interleaved, q_dtype, k_dtype):
    return _backward(dq, dk, cos, sin, position_ids, head_axis, interleaved, dtype_name(q_dtype),
                     dtype_name(k_dtype), in_place=False)


def _backward_fake(dq, dk, cos, sin, position_ids, head_axis, interleaved, q_dtype, k_dtype):
    return _fresh_like(dq, q_dtype), _fresh_like(dk, k_dtype)


backward_op = define("rope_backward",
                     "(Tensor dq, Tensor dk, Tensor cos, Tensor sin, Tensor? position_ids, int head_axis, "
                     "bool interleaved, ScalarType q_dtype, ScalarType k_dtype) -> (Tensor, Tensor)",
                     _backward_op, _backward_fake)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         position_ids: torch.Tensor | None = None, unsqueeze_dim: int = 1, interleaved: bool = False,
         in_place: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding of q and k, drop-in for HF's ``apply_rotary_pos_emb``.

    q (B, H_q, T, D) and k (B, H_kv, T, D) (``unsqueeze_dim=1``, HF's layout; ``unsqueeze_dim=2`` for
    (B, T, H, D)), any head counts; cos/sin (T, D) or (1 or B, T, D), or with ``position_ids`` ((T,) or
    (1 or B, T)) tables whose rows ``position_ids`` selects. Returns ``(q_embed, k_embed)``
    (``q * cos + rotate_half(q) * sin``; ``interleaved=True`` pairs (2j, 2j+1) instead, GPT-J style).
    No gradient flows to cos/sin (HF computes them without one). With ``in_place`` the backward writes the
    q/k gradients over the incoming ones when those are dense and of q's/k's dtype (not under ``torch.compile``,
    where nothing is written in place).
    """
    check_tensors(q=q, k=k, cos=cos, sin=sin, position_ids=position_ids)
    if unsqueeze_dim not in _HEAD_AXES:
        raise ValueError(f"unsqueeze_dim must be 1 (q/k as (B, H, T, D)) or 2 ((B, T, H, D)), got {unsqueeze_dim!r}")
    interleaved = check_bool(interleaved, "interleaved")
    refuse_grad("rope", "q and k", cos=cos, sin=sin)  # HF's rotary embedding computes cos/sin without gradient
    if compiling():
        return forward_op(q, k, cos, sin, position_ids, _HEAD_AXES[unsqueeze_dim], interleaved)
    return LigerRopeFunction.apply(q, k, cos, sin, position_ids, _HEAD_AXES[unsqueeze_dim], interleaved,
                                   check_bool(in_place, "in_place"))

"""RoPE for torch: autograd wiring around :mod:`liger_core.rope` (q and k in one launch)."""

from __future__ import annotations

import torch

from liger_core import rope as core

from ._launch import check_tensors, dtype_name, info, optional_info, run_plan

_HEAD_AXES = {1: 1, -3: 1, 2: 2, -2: 2}


class LigerRopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, position_ids, head_axis, interleaved, in_place):
        plan = core.forward_plan(info(q), info(k), info(cos), info(sin), optional_info(position_ids),
                                 head_axis=head_axis, interleaved=interleaved)
        q_out, k_out = run_plan(plan, q=q, k=k, cos=cos, sin=sin, position_ids=position_ids)
        ctx.save_for_backward(cos, sin, position_ids)
        ctx.head_axis, ctx.interleaved, ctx.in_place = head_axis, interleaved, in_place
        ctx.q_dtype, ctx.k_dtype = dtype_name(q.dtype), dtype_name(k.dtype)
        return q_out, k_out

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin, position_ids = ctx.saved_tensors
        # (autograd materialises the gradient of an unused output as zeros, so neither is None)
        plan = core.backward_plan(info(dq), info(dk), info(cos), info(sin), optional_info(position_ids),
                                  head_axis=ctx.head_axis, q_dtype=ctx.q_dtype, k_dtype=ctx.k_dtype,
                                  interleaved=ctx.interleaved, in_place=ctx.in_place)
        dq, dk = run_plan(plan, q=dq, k=dk, cos=cos, sin=sin, position_ids=position_ids)
        return dq, dk, None, None, None, None, None, None


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         position_ids: torch.Tensor | None = None, unsqueeze_dim: int = 1, interleaved: bool = False,
         in_place: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding of q and k, drop-in for HF's ``apply_rotary_pos_emb``.

    q (B, H_q, T, D) and k (B, H_kv, T, D) (``unsqueeze_dim=1``, HF's layout; ``unsqueeze_dim=2`` for
    (B, T, H, D)), any head counts; cos/sin (T, D) or (1 or B, T, D), or with ``position_ids`` ((T,) or
    (1 or B, T)) tables whose rows ``position_ids`` selects. Returns ``(q_embed, k_embed)``
    (``q * cos + rotate_half(q) * sin``; ``interleaved=True`` pairs (2j, 2j+1) instead, GPT-J style).
    No gradient flows to cos/sin (HF computes them without one). With ``in_place`` the backward writes the
    q/k gradients over the incoming ones when those are dense and of q's/k's dtype.
    """
    check_tensors(q=q, k=k, cos=cos, sin=sin, position_ids=position_ids)
    if unsqueeze_dim not in _HEAD_AXES:
        raise ValueError(f"unsqueeze_dim must be 1 (q/k as (B, H, T, D)) or 2 ((B, T, H, D)), got {unsqueeze_dim!r}")
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise ValueError("rope does not differentiate with respect to cos/sin; pass cos.detach() / sin.detach() "
                         "(HF's rotary embedding computes them without gradient)")
    return LigerRopeFunction.apply(q, k, cos, sin, position_ids, _HEAD_AXES[unsqueeze_dim], bool(interleaved),
                                   bool(in_place))

"""Fused linear cross-entropy for torch: a chunk loop of torch matmuls around :mod:`liger_core.cross_entropy`.

For ``mean``/``sum`` the gradients (of x, weight, bias) are computed during the forward, chunk by chunk, and
the backward scales them by the incoming scalar (once: a second backward is refused). For ``none`` the
forward only computes the losses and the backward runs the chunk loop again with the per-row incoming
gradient folded into the kernel.
"""

from __future__ import annotations

import torch
from torch import nn

from liger_core import cross_entropy as ce_core
from liger_core import fused_linear_cross_entropy as core

from ._launch import check_tensors, dtype_name, info, optional_info, run_plan
from .cross_entropy import check_targets



def accumulate_linear_grads(dlogits, x_chunk, weight, grad_x_chunk, grad_w, grad_w_tmp, need) -> None:
    """One chunk's share of the input and weight gradients of ``logits = x @ weight.T``: grad_x rows written,
    grad_w accumulated (through the fp32 scratch ``grad_w_tmp`` when it accumulates in fp32)."""
    if need[0]:
        torch.mm(dlogits, weight, out=grad_x_chunk)
    if need[1]:
        if grad_w_tmp is not None:
            torch.mm(dlogits.t(), x_chunk, out=grad_w_tmp)
            grad_w.add_(grad_w_tmp)
        else:
            grad_w.addmm_(dlogits.t(), x_chunk)

def _chunk_loop(x, weight, target, bias, ce_weight, opts, chunk_size, accum_fp32, need, grad_scale=None):
    """Losses (fp32 per row, and z parts) and, when ``need`` asks, gradients for an incoming gradient of 1
    (or ``grad_scale`` per row). ``need`` = (x, weight, bias) flags; all False: forward only."""
    n, hidden = x.shape
    vocab = weight.shape[0]
    dtype = dtype_name(x.dtype)
    compute_grad = any(need)
    rows = core.chunk_rows(n, vocab, dtype, chunk_size)
    denom = None
    if opts["reduction"] == "mean":
        plan = core.denominators_plan(n, dtype_name(target.dtype), optional_info(ce_weight), vocab,
                                      opts["ignore_index"])
        (denom,) = run_plan(plan, target=target, weight=ce_weight)
    grad_x = torch.empty_like(x) if need[0] else None
    grad_w = grad_w_tmp = grad_b = None
    if need[1]:
        grad_w = torch.zeros(weight.shape, dtype=torch.float32 if accum_fp32 else weight.dtype, device=x.device)
        if accum_fp32 and weight.dtype != torch.float32:
            grad_w_tmp = torch.empty_like(weight)  # one chunk's dW in the weight's dtype, added in fp32
    if need[2]:
        grad_b = torch.zeros(vocab, dtype=torch.float32, device=x.device)
    losses, z_losses = [], []
    plans = {}
    for start in range(0, n, rows):
        stop = min(start + rows, n)
        xc = x[start:stop]
        logits = torch.addmm(bias, xc, weight.t()) if bias is not None else torch.mm(xc, weight.t())
        if stop - start not in plans:
            plans[stop - start] = core.chunk_plan(
                stop - start, vocab, dtype, dtype_name(target.dtype), optional_info(ce_weight),
                compute_grad=compute_grad, grad_scale_dtype=None if grad_scale is None else dtype_name(
                    grad_scale.dtype), **opts)
        outs = run_plan(plans[stop - start], logits=logits, target=target[start:stop], weight=ce_weight,
                        denom=denom, grad_scale=None if grad_scale is None else grad_scale[start:stop])
        losses.append(outs[0])
        if opts["return_z_loss"]:
            z_losses.append(outs[1])
        if not compute_grad:
            continue
        dlogits = outs[-1]
        accumulate_linear_grads(dlogits, xc, weight, grad_x[start:stop], grad_w, grad_w_tmp, need)
        if need[2]:
            grad_b.add_(dlogits.sum(0, dtype=torch.float32))
    z = torch.cat(z_losses) if z_losses else None
    return torch.cat(losses), z, grad_x, grad_w, grad_b


def _reduce(rows, reduction, dtype, shape):
    if reduction == "none":
        return rows.to(dtype).reshape(shape)
    (total,) = run_plan(core.loss_plan(rows.numel(), dtype_name(dtype)), rows=rows)
    return total


class LigerFusedLinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, target, bias, ce_weight, opts, chunk_size, accum_fp32, need):
        shape = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        t = target.reshape(-1).contiguous()
        precompute = opts["reduction"] != "none"
        rows, z, grad_x, grad_w, grad_b = _chunk_loop(x2, weight, t, bias, ce_weight, opts, chunk_size,
                                                      accum_fp32, need if precompute else (False,) * 3)
        loss = _reduce(rows, opts["reduction"], x.dtype, shape)
        ctx.opts, ctx.chunk_size, ctx.accum_fp32, ctx.need = opts, chunk_size, accum_fp32, need
        ctx.x_shape = x.shape
        ctx.backward_done = False
        if precompute:
            ctx.grads = (grad_x, grad_w, grad_b)
        elif any(need):
            ctx.save_for_backward(x2, weight, t, bias, ce_weight)
        if opts["return_z_loss"]:
            z_loss = _reduce(z, opts["reduction"], x.dtype, shape)
            ctx.mark_non_differentiable(z_loss)
            return loss, z_loss
        return loss

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        if ctx.backward_done:
            raise RuntimeError("liger_torch.fused_linear_cross_entropy: backward through the same loss twice is "
                               "not supported (the gradients computed in the forward are released)")
        ctx.backward_done = True
        need = ctx.need
        if ctx.opts["reduction"] != "none":
            grad_x, grad_w, grad_b = ctx.grads
            del ctx.grads
            g = grad_loss.to(torch.float32)
        else:
            x2, weight, t, bias, ce_weight = ctx.saved_tensors
            g_rows = grad_loss.reshape(-1)
            _, _, grad_x, grad_w, grad_b = _chunk_loop(x2, weight, t, bias, ce_weight, ctx.opts, ctx.chunk_size,
                                                       ctx.accum_fp32, need, grad_scale=g_rows)
            g = None
        out = []  # fp32 accumulators are cast to the parameters' dtypes by autograd
        for flag, grad in zip(need, (grad_x, grad_w, grad_b)):
            if not flag:
                out.append(None)
                continue
            out.append(grad if g is None else grad.mul_(g.to(grad.dtype)))
        dx, dw, db = out
        if dx is not None:
            dx = dx.reshape(ctx.x_shape)
        return dx, dw, None, db, None, None, None, None, None


def fused_linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                               bias: torch.Tensor | None = None, ce_weight: torch.Tensor | None = None,
                               ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                               lse_square_scale: float = 0.0, softcap: float | None = None,
                               return_z_loss: bool = False, chunk_size: int | None = None,
                               accum_dtype_fp32: bool | None = None):
    """``cross_entropy(x @ weight.T + bias, target)`` for x (..., H), weight (V, H) (an ``nn.Linear`` lm_head or
    a tied ``nn.Embedding``), without materialising the (N, V) logits.

    Tokens go through in chunks of ``chunk_size`` rows (default: a fixed logits workspace of
    ``liger_core.fused_linear_cross_entropy.DEFAULT_WORKSPACE_BYTES``, whatever N). ``ce_weight`` is the class
    weight; the other options are :func:`liger_torch.cross_entropy`'s (same semantics and the same eager,
    host-syncing target check). ``accum_dtype_fp32``: accumulate the weight gradient over chunks in fp32
    (default: on for bf16/fp16 weights). Loss in x's dtype; the logits chunks are in x's dtype (like an lm_head
    output) and upcast to fp32 inside the kernel.
    """
    check_tensors(x=x, weight=weight, target=target, bias=bias, ce_weight=ce_weight)
    ce_core.check_options(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
                          lse_square_scale=lse_square_scale, softcap=softcap)
    vocab = core.check_inputs(info(x), info(weight), info(target), optional_info(bias), optional_info(ce_weight))
    core.chunk_rows(1, vocab, dtype_name(x.dtype), chunk_size)  # validates chunk_size
    check_targets(target, vocab, ignore_index)
    grad_on = torch.is_grad_enabled()
    need = tuple(bool(grad_on and t is not None and t.requires_grad) for t in (x, weight, bias))
    accum_fp32 = core.accumulate_in_fp32(dtype_name(weight.dtype), accum_dtype_fp32)
    opts = dict(ignore_index=int(ignore_index), reduction=reduction, label_smoothing=float(label_smoothing),
                lse_square_scale=float(lse_square_scale), softcap=None if softcap is None else float(softcap),
                return_z_loss=bool(return_z_loss))
    return LigerFusedLinearCrossEntropyFunction.apply(x, weight, target, bias, ce_weight, opts, chunk_size,
                                                      accum_fp32, need)


class FusedLinearCrossEntropyLoss(nn.Module):
    """``loss_fn(lm_head.weight, hidden_states, target, bias)`` with the options of
    :func:`fused_linear_cross_entropy` (argument order as in Liger-Kernel's module)."""

    def __init__(self, ce_weight: torch.Tensor | None = None, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0, lse_square_scale: float = 0.0, softcap: float | None = None,
                 return_z_loss: bool = False, chunk_size: int | None = None, accum_dtype_fp32: bool | None = None):
        super().__init__()
        ce_core.check_options(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
                              lse_square_scale=lse_square_scale, softcap=softcap)
        self.register_buffer("ce_weight", ce_weight)
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.lse_square_scale, self.softcap, self.return_z_loss = lse_square_scale, softcap, return_z_loss
        self.chunk_size, self.accum_dtype_fp32 = chunk_size, accum_dtype_fp32

    def forward(self, lin_weight: torch.Tensor, x: torch.Tensor, target: torch.Tensor,
                bias: torch.Tensor | None = None):
        return fused_linear_cross_entropy(x, lin_weight, target, bias, self.ce_weight, self.ignore_index,
                                          self.reduction, self.label_smoothing, self.lse_square_scale,
                                          self.softcap, self.return_z_loss, self.chunk_size, self.accum_dtype_fp32)

"""Fused linear cross-entropy for torch: a chunk loop of torch matmuls around :mod:`liger_core.cross_entropy`.

For ``mean``/``sum`` the gradients (of x, weight, bias) are computed during the forward, chunk by chunk, and
the backward scales them by the incoming scalar (once: a second backward is refused). For ``none`` the
forward only computes the losses and the backward runs the chunk loop again with the per-row incoming
gradient folded into the kernel.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from liger_core import cross_entropy as ce_core
from liger_core import fused_linear_cross_entropy as core
from liger_core.launch import check_bool

from ._custom_ops import absent, compiling, define, empty_like
from ._launch import (
    autocast_dtype, check_tensors, dtype_name, info, once_differentiable, optional_info, refuse_grad, run_plan,
)
from .cross_entropy import scale_grad, start_target_check

# x is typically a model's last hidden states and weight its lm_head's: a model cast in part (or on one rank
# only) is the usual cause
DTYPE_REMEDY = ("cast them to one dtype (model.to(dtype), lm_head included) or run under torch.autocast, which "
                "casts both")


@functools.lru_cache(maxsize=None)
def _addmm_accumulates_in_fp32(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)`` adds low-precision products into an
    fp32 accumulator in place on this device (CUDA builds with the ``addmm.dtype_out`` kernel). Probed once
    on a small case against the two-step path, so a build without it (or the CPU) falls back silently."""
    if device.type != "cuda":
        return False
    try:
        a, b, acc = _probe_operands(device, dtype)
        want = acc + torch.mm(a.float(), b.float())
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        return bool(torch.allclose(acc, want, rtol=1e-4, atol=1e-4))
    except (RuntimeError, TypeError, NotImplementedError):
        return False


@functools.lru_cache(maxsize=None)
def _addmm_overwrites_in_fp32(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the same call with ``beta=0`` overwrites the accumulator without reading it (NaN in it must not
    leak through), so the first chunk needs no zero-filled accumulator. Probed once, as above."""
    if not _addmm_accumulates_in_fp32(device, dtype):
        return False
    try:
        a, b, acc = _probe_operands(device, dtype)
        acc.fill_(float("nan"))
        torch.addmm(acc, a, b, beta=0, out_dtype=torch.float32, out=acc)
        return bool(torch.allclose(acc, torch.mm(a.float(), b.float()), rtol=1e-4, atol=1e-4))
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _probe_operands(device, dtype):
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(64, 32, device=device, generator=gen).to(dtype)
    b = torch.randn(32, 48, device=device, generator=gen).to(dtype)
    return a, b, torch.randn(64, 48, device=device, generator=gen)


def weight_grad_buffers(weight: torch.Tensor, dtype: torch.dtype, fp32_acc: bool):
    """``(grad_w, grad_w_tmp)``: the dW accumulator (fp32 with ``fp32_acc``, see
    :func:`liger_core.fused_linear_cross_entropy.chunking`, else the weight's dtype, fp32 for a master weight;
    left unset: the first chunk overwrites it, see :func:`accumulate_linear_grads`) and, only where the device
    cannot add a matmul of ``dtype`` operands into fp32 in place, a scratch of W's size for one chunk's dW."""
    grad_w = torch.empty(weight.shape, dtype=torch.float32 if fp32_acc else weight.dtype, device=weight.device)
    if grad_w.dtype != dtype and not _addmm_accumulates_in_fp32(weight.device, dtype):
        return grad_w, torch.empty(weight.shape, dtype=dtype, device=weight.device)
    return grad_w, None


def matmul_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight in the activations' ``dtype`` for the loop's matmuls: itself, or an fp32 master weight's
    copy (made once per loop, as autocast's ``F.linear`` makes one)."""
    return weight if weight.dtype == dtype else weight.to(dtype)


def accumulate_linear_grads(dlogits, x_chunk, weight, grad_x_chunk, grad_w, grad_w_tmp, need,
                            first: bool) -> None:
    """One chunk's share of the input and weight gradients of ``logits = x @ weight.T``: grad_x rows written,
    grad_w accumulated (in fp32 inside the matmul where the device can, else through the scratch
    ``grad_w_tmp``: a W-sized write, read and fp32 read-modify-write more per chunk). The ``first`` chunk
    overwrites grad_w (unset until then): no zero fill, and no read of a W-sized accumulator of zeros (except
    where the device's fp32-output matmul cannot overwrite: it zero-fills first)."""
    if need[0]:
        torch.mm(dlogits, weight, out=grad_x_chunk)
    if need[1]:
        if grad_w_tmp is not None:
            torch.mm(dlogits.t(), x_chunk, out=grad_w_tmp)
            if first:
                grad_w.copy_(grad_w_tmp)
            else:
                grad_w.add_(grad_w_tmp)
        elif grad_w.dtype != dlogits.dtype:
            overwrite = first and _addmm_overwrites_in_fp32(grad_w.device, dlogits.dtype)
            if first and not overwrite:
                grad_w.zero_()
            torch.addmm(grad_w, dlogits.t(), x_chunk, beta=0 if overwrite else 1, out_dtype=grad_w.dtype, out=grad_w)
        elif first:
            torch.mm(dlogits.t(), x_chunk, out=grad_w)
        else:
            grad_w.addmm_(dlogits.t(), x_chunk)


def _denominators(target, ce_weight, vocab, opts):
    """The mean's divisors over all (flattened) targets, and the count of invalid ones, for the check."""
    plan = core.denominators_plan(target.numel(), dtype_name(target.dtype), optional_info(ce_weight), vocab,
                                  opts["ignore_index"])
    return run_plan(plan, target=target, weight=ce_weight)[0]


def _chunk_loop(x, weight, target, bias, ce_weight, opts, chunk_size, accum_fp32, need, grad_scale=None,
                denom=None):
    """Losses (fp32 per row, and z parts) and, when ``need`` asks, gradients for an incoming gradient of 1
    (or ``grad_scale`` per row). ``need`` = (x, weight, bias) flags; all False: forward only. ``denom``: the
    targets' denominators, if already counted (the mean needs them)."""
    n, hidden = x.shape
    vocab = weight.shape[0]
    dtype = dtype_name(x.dtype)
    compute_grad = any(need)
    # accumulation only matters when grad_W is computed (else one chunk saves no accumulator)
    rows, fp32_acc = core.chunking(n, vocab, hidden, dtype, dtype_name(weight.dtype), chunk_size,
                                   accum_fp32 and need[1])
    if opts["reduction"] == "mean" and denom is None:
        denom = _denominators(target, ce_weight, vocab, opts)
    grad_x = torch.empty_like(x) if need[0] else None
    grad_w = grad_w_tmp = grad_b = None
    if need[1]:
        grad_w, grad_w_tmp = weight_grad_buffers(weight, x.dtype, fp32_acc)
    weight = matmul_weight(weight, x.dtype)
    if need[2]:
        grad_b = torch.zeros(vocab, dtype=torch.float32, device=x.device)
    losses, z_losses = [], []
    for start in range(0, n, rows):
        stop = min(start + rows, n)
        xc = x[start:stop]
        logits = torch.addmm(bias, xc, weight.t()) if bias is not None else torch.mm(xc, weight.t())
        plan = core.chunk_plan(  # cached: built once per chunk length
            stop - start, vocab, dtype, dtype_name(target.dtype), optional_info(ce_weight),
            compute_grad=compute_grad, grad_scale_dtype=None if grad_scale is None else dtype_name(grad_scale.dtype),
            **opts)
        outs = run_plan(plan, logits=logits, target=target[start:stop], weight=ce_weight,
                        denom=denom, grad_scale=None if grad_scale is None else grad_scale[start:stop])
        losses.append(outs[0])
        if opts["return_z_loss"]:
            z_losses.append(outs[1])
        if compute_grad:  # outs[-1]: d loss / d logits, over the logits
            grad_x_chunk = grad_x[start:stop] if grad_x is not None else None
            accumulate_linear_grads(outs[-1], xc, weight, grad_x_chunk, grad_w, grad_w_tmp, need, first=start == 0)
            if need[2]:
                grad_b.add_(outs[-1].sum(0, dtype=torch.float32))
        del logits, outs  # before the next chunk's matmul allocates: one chunk of logits alive, not two
    z = torch.cat(z_losses) if z_losses else None
    return torch.cat(losses), z, grad_x, grad_w, grad_b


def _reduce(rows, reduction, dtype, shape):
    if reduction == "none":
        return rows.to(dtype).reshape(shape)
    (total,) = run_plan(core.loss_plan(rows.numel(), dtype_name(dtype)), rows=rows)
    return total


def _forward(x, weight, target, bias, ce_weight, opts, chunk_size, accum_fp32, need):
    """``(loss, z_loss, grads, x2, t)``: z_loss None without ``return_z_loss``; for mean/sum, grads = (grad_x
    (x's shape), grad_w, grad_b) for an incoming gradient of 1, None where ``need`` says no (all None for none,
    whose backward runs the loop again); x2 (N, H) and t (N,) are the flattened inputs."""
    shape = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    t = target.reshape(-1).contiguous()
    # one count of the targets: the check's, and the mean's divisors
    denom = _denominators(t, ce_weight, weight.shape[0], opts)
    # finished after the chunk loop: the GPU runs the loop while the host waits for the count
    finish_check = start_target_check(t, weight.shape[0], opts["ignore_index"], denom)
    precompute = opts["reduction"] != "none"
    rows, z, grad_x, grad_w, grad_b = _chunk_loop(x2, weight, t, bias, ce_weight, opts, chunk_size, accum_fp32,
                                                  need if precompute else (False,) * 3, denom=denom)
    finish_check()
    loss = _reduce(rows, opts["reduction"], torch.float32, shape)
    z_loss = _reduce(z, opts["reduction"], torch.float32, shape) if opts["return_z_loss"] else None
    grad_x = grad_x.view(x.shape) if grad_x is not None else None
    return loss, z_loss, (grad_x, grad_w, grad_b), x2, t


def scaled_grads(grads, need, grad_loss, dtypes, in_place):
    """mean/sum backward: the forward's gradients times the incoming scalar, in the inputs' ``dtypes`` (None
    where ``need`` says no). An fp32 accumulator (grad_W, grad_b) is scaled and rounded to its parameter's
    dtype in one pass (one read of it, one write of the result) instead of a scale and then a cast. A gradient
    already in its dtype is scaled in fp32 and rounded once: in place by the cross-entropy's scale kernel (where
    ``loss.backward()``'s gradient of 1 moves nothing), else (the torch.compile path, traced) by torch ops."""
    g = grad_loss.to(torch.float32)
    out = []
    for flag, grad, dtype in zip(need, grads, dtypes):
        if not flag:
            out.append(None)
        elif grad.dtype != dtype:
            out.append(torch.mul(grad, g, out=torch.empty(grad.shape, dtype=dtype, device=grad.device)))
        elif in_place:
            out.append(scale_grad(grad, g, "sum", in_place=True))
        else:
            out.append((grad.to(torch.float32) * g).to(dtype))
    return tuple(out)


def _backward_none(x2, weight, t, bias, ce_weight, opts, chunk_size, accum_fp32, need, grad_loss, x_shape):
    """reduction='none' backward: the chunk loop again, with the per-row incoming gradient in the kernel."""
    # contiguous: the chunk plan reads one value per row at stride 1, and the gradient of ``loss.sum()`` is an
    # expanded scalar (stride 0)
    g_rows = grad_loss.reshape(-1).contiguous()
    _, _, grad_x, grad_w, grad_b = _chunk_loop(x2, weight, t, bias, ce_weight, opts, chunk_size, accum_fp32, need,
                                               grad_scale=g_rows)
    return (grad_x.view(x_shape) if grad_x is not None else None), grad_w, grad_b


class LigerFusedLinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, target, bias, ce_weight, opts, chunk_size, accum_fp32, need):
        loss, z_loss, grads, x2, t = _forward(x, weight, target, bias, ce_weight, opts, chunk_size, accum_fp32, need)
        ctx.opts, ctx.chunk_size, ctx.accum_fp32, ctx.need = opts, chunk_size, accum_fp32, need
        ctx.x_shape = x.shape
        ctx.dtypes = tuple(None if t is None else t.dtype for t in (x, weight, bias))
        ctx.backward_done = False
        if opts["reduction"] != "none":
            ctx.grads = grads
        elif any(need):
            ctx.save_for_backward(x2, weight, t, bias, ce_weight)
        if opts["return_z_loss"]:
            ctx.mark_non_differentiable(z_loss)
            return loss, z_loss
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, *unused):
        if ctx.backward_done:
            raise RuntimeError("liger_torch.fused_linear_cross_entropy: backward through the same loss twice is "
                               "not supported (the gradients computed in the forward are released)")
        ctx.backward_done = True
        if ctx.opts["reduction"] != "none":
            grads = scaled_grads(ctx.grads, ctx.need, grad_loss, ctx.dtypes, in_place=True)
            del ctx.grads
        else:
            grads = _backward_none(*ctx.saved_tensors, ctx.opts, ctx.chunk_size, ctx.accum_fp32, ctx.need, grad_loss,
                                   ctx.x_shape)
        dx, dw, db = grads  # fp32 accumulators are cast to the parameters' dtypes by autograd
        return dx, dw, None, db, None, None, None, None, None


# torch.compile path (see _custom_ops): the same helpers as custom ops. The options travel as the op's scalar
# arguments (schema below); absent outputs (z-loss, gradients not needed) are empty tensors.

_OPTION_NAMES = ("ignore_index", "reduction", "label_smoothing", "lse_square_scale", "softcap", "return_z_loss")
_OPTIONS_SCHEMA = ("int ignore_index, str reduction, float label_smoothing, float lse_square_scale, float? softcap, "
                   "bool return_z_loss, int? chunk_size, bool accum_fp32, bool need_x, bool need_weight, "
                   "bool need_bias")


def _pack(opts, chunk_size, accum_fp32, need):
    return (*(opts[name] for name in _OPTION_NAMES), chunk_size, accum_fp32, *need)


def _unpack(options):
    """``(opts, chunk_size, accum_fp32, need)`` from the op's scalar arguments."""
    n = len(_OPTION_NAMES)
    return dict(zip(_OPTION_NAMES, options[:n])), options[n], options[n + 1], tuple(options[n + 2:])


def _forward_op(x, weight, target, bias, ce_weight, *options):
    loss, z_loss, grads, _, _ = _forward(x, weight, target, bias, ce_weight, *_unpack(options))
    return (loss, z_loss if z_loss is not None else absent(loss),
            *(grad if grad is not None else absent(loss) for grad in grads))


def _grad_weight_dtype(x, weight, chunk_size, accum_fp32):
    """The dtype the chunk loop returns grad_W in (an fp32 accumulator, or the weight's own)."""
    _, fp32_acc = core.chunking(math.prod(x.shape[:-1]), weight.shape[0], x.shape[-1], dtype_name(x.dtype),
                                dtype_name(weight.dtype), chunk_size, accum_fp32)
    return torch.float32 if fp32_acc else None


def _forward_fake(x, weight, target, bias, ce_weight, *options):
    opts, chunk_size, accum_fp32, need = _unpack(options)
    loss = empty_like(x, torch.float32, x.shape[:-1] if opts["reduction"] == "none" else ())
    z_loss = empty_like(loss) if opts["return_z_loss"] else absent(loss)
    if opts["reduction"] == "none":  # gradients come from the backward
        need = (False,) * 3
    grad_x = empty_like(x) if need[0] else absent(loss)
    grad_w = empty_like(weight, _grad_weight_dtype(x, weight, chunk_size, accum_fp32)) if need[1] else absent(loss)
    grad_b = empty_like(weight, torch.float32, weight.shape[:1]) if need[2] else absent(loss)
    return loss, z_loss, grad_x, grad_w, grad_b


def _setup_context(ctx, inputs, output):
    x, weight, target, bias, ce_weight, *options = inputs
    ctx.options = options
    ctx.opts, _, _, ctx.need = _unpack(options)
    ctx.dtypes = tuple(None if t is None else t.dtype for t in (x, weight, bias))
    if ctx.opts["reduction"] != "none":
        ctx.save_for_backward(*output[2:])
    else:
        ctx.save_for_backward(x, weight, target, bias, ce_weight)
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)  # no zero-filled gradients for them


def _backward_fn(ctx, grad_loss, *_):
    if ctx.opts["reduction"] != "none":
        grads = scaled_grads(ctx.saved_tensors, ctx.need, grad_loss, ctx.dtypes, in_place=False)
    else:
        grads = backward_op(*ctx.saved_tensors, grad_loss, *ctx.options)
    # the op's fp32 accumulators, cast to the parameters' dtypes (as autograd does for the eager Function)
    dx, dw, db = (grad.to(dtype) if flag else None for flag, grad, dtype in zip(ctx.need, grads, ctx.dtypes))
    return (dx, dw, None, db) + (None,) * (1 + len(ctx.options))


forward_op = define("fused_linear_cross_entropy_forward",
                    "(Tensor x, Tensor weight, Tensor target, Tensor? bias, Tensor? ce_weight, "
                    f"{_OPTIONS_SCHEMA}) -> (Tensor, Tensor, Tensor, Tensor, Tensor)", _forward_op, _forward_fake,
                    setup_context=_setup_context, backward=_backward_fn)


def _backward_op(x, weight, target, bias, ce_weight, grad_loss, *options):
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    grads = _backward_none(x2, weight, target.reshape(-1).contiguous(), bias, ce_weight, *_unpack(options),
                           grad_loss, x.shape)
    return tuple(grad if grad is not None else absent(x) for grad in grads)


def _backward_fake(x, weight, target, bias, ce_weight, grad_loss, *options):
    _, chunk_size, accum_fp32, need = _unpack(options)
    return (empty_like(x) if need[0] else absent(x),
            empty_like(weight, _grad_weight_dtype(x, weight, chunk_size, accum_fp32)) if need[1] else absent(x),
            empty_like(weight, torch.float32, weight.shape[:1]) if need[2] else absent(x))


backward_op = define("fused_linear_cross_entropy_backward",
                     "(Tensor x, Tensor weight, Tensor target, Tensor? bias, Tensor? ce_weight, Tensor grad_loss, "
                     f"{_OPTIONS_SCHEMA}) -> (Tensor, Tensor, Tensor)", _backward_op, _backward_fake)


def fused_linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                               bias: torch.Tensor | None = None, ce_weight: torch.Tensor | None = None,
                               ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                               lse_square_scale: float = 0.0, softcap: float | None = None,
                               return_z_loss: bool = False, chunk_size: int | None = None,
                               accum_dtype_fp32: bool | None = None):
    """``cross_entropy(x @ weight.T + bias, target)`` for x (..., H), weight (V, H) (an ``nn.Linear`` lm_head or
    a tied ``nn.Embedding``), without materialising the (N, V) logits.

    Tokens go through in chunks of ``chunk_size`` rows (default: a fixed logits workspace of
    ``liger_core.fused_linear_cross_entropy.DEFAULT_WORKSPACE_BYTES``, whatever N; or one chunk when all the
    logits take no more than the fp32 weight-gradient accumulator that chunks need, N <= 2H in bf16: no
    accumulator then, the weight gradient is one matmul summed in fp32 and rounded once). ``ce_weight`` is the class
    weight; the other options are :func:`liger_torch.cross_entropy`'s (same semantics and the same eager,
    host-syncing target check). ``accum_dtype_fp32``: accumulate the weight gradient over chunks in fp32
    (default: on for bf16/fp16 weights). Under ``torch.autocast`` x, weight and bias are cast to the autocast
    dtype first, as ``F.linear`` would, except an fp32 weight (mixed precision's master weight): the loop casts
    it once and accumulates its gradient in fp32 straight into the fp32 gradient (no accumulator beside it, no
    bf16 gradient cast back; the chunks then hold the default workspace whatever N). The loss (and z-loss) is
    fp32 whatever x's dtype, as HF's loss functions and Liger-Kernel return it (a bf16 loss near 12 would be
    rounded to multiples of 1/16); the logits chunks are in x's dtype (like an lm_head output) and upcast to fp32
    inside the kernel.
    """
    check_tensors(x=x, weight=weight, target=target, bias=bias, ce_weight=ce_weight)
    refuse_grad("fused_linear_cross_entropy", "x, weight and bias", ce_weight=ce_weight)
    args = (ce_weight, ignore_index, reduction, label_smoothing, lse_square_scale, softcap, return_z_loss,
            chunk_size, accum_dtype_fp32)
    dtype = autocast_dtype(x)
    if dtype is None:
        return _fused_linear_cross_entropy(x, weight, target, bias, *args)
    # logits in the autocast dtype, as F.linear's; gradients arrive in each input's dtype
    with torch.autocast(x.device.type, enabled=False):
        master = core.is_master_weight(dtype_name(weight.dtype), dtype_name(dtype))
        return _fused_linear_cross_entropy(x.to(dtype), weight if master else weight.to(dtype), target,
                                           None if bias is None else bias.to(dtype), *args, master_weight_ok=True)


def _fused_linear_cross_entropy(x, weight, target, bias, ce_weight, ignore_index, reduction, label_smoothing,
                                lse_square_scale, softcap, return_z_loss, chunk_size, accum_dtype_fp32,
                                master_weight_ok=False):
    ce_core.check_options(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
                          lse_square_scale=lse_square_scale, softcap=softcap)
    vocab = core.check_inputs(info(x), info(weight), info(target), optional_info(bias), optional_info(ce_weight),
                              dtype_remedy=DTYPE_REMEDY, master_weight_ok=master_weight_ok)
    core.chunk_rows(1, vocab, dtype_name(x.dtype), chunk_size)  # validates chunk_size
    grad_on = torch.is_grad_enabled()
    need = tuple(bool(grad_on and t is not None and t.requires_grad) for t in (x, weight, bias))
    accum_fp32 = core.accumulate_in_fp32(dtype_name(weight.dtype), accum_dtype_fp32)
    opts = dict(ignore_index=int(ignore_index), reduction=reduction, label_smoothing=float(label_smoothing),
                lse_square_scale=float(lse_square_scale), softcap=None if softcap is None else float(softcap),
                return_z_loss=check_bool(return_z_loss, "return_z_loss"))
    if compiling():
        loss, z_loss, *_ = forward_op(x, weight, target, bias, ce_weight, *_pack(opts, chunk_size, accum_fp32, need))
        return (loss, z_loss) if return_z_loss else loss
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
        core.check_loop_options(return_z_loss=return_z_loss, chunk_size=chunk_size,
                                accum_dtype_fp32=accum_dtype_fp32)
        self.register_buffer("ce_weight", ce_weight)
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.lse_square_scale, self.softcap, self.return_z_loss = lse_square_scale, softcap, return_z_loss
        self.chunk_size, self.accum_dtype_fp32 = chunk_size, accum_dtype_fp32

    def forward(self, lin_weight: torch.Tensor, x: torch.Tensor, target: torch.Tensor,
                bias: torch.Tensor | None = None):
        return fused_linear_cross_entropy(x, lin_weight, target, bias, self.ce_weight, self.ignore_index,
                                          self.reduction, self.label_smoothing, self.lse_square_scale,
                                          self.softcap, self.return_z_loss, self.chunk_size, self.accum_dtype_fp32)

"""Fused linear JSD for jax: a ``lax.scan`` over token chunks of XLA matmuls around the JSD kernel of
:mod:`liger_core.jsd` on logits (``custom_vjp``).

The forward rule computes the gradients of the student's hidden states and kernel chunk by chunk (the kernel
gradient accumulated in the scan carry, fp32 by default for half-precision kernels); the backward scales them
by the cotangent. The token axis is padded to a whole number of chunks with zero rows (ignored rows when there
are labels); their losses and hidden-state gradients are dropped, and their kernel-gradient terms are
``dz^T @ 0 = 0``.

Under ``jit`` with sharded inputs the loop runs shard by shard on the local tokens: the kernels are whole (an
FSDP-sharded kernel is gathered), the student kernel's gradient is summed over the shards, and the mean divides
by the rows (or non-ignored labels) of all shards (:mod:`liger_jax._sharding`). Under ``jax.vmap`` each example
is one loop (``lax.map``): means per example.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from liger_core import fused_linear_jsd as core

from ._launch import as_array, dtype_name, info, optional_info, run_plan, undifferentiated
from ._sharding import ROWS, WHOLE, like, partitioned, rows_rule
from .cross_entropy import _mapped_over_batch
from .fused_linear_cross_entropy import in_matmul_dtype, scaled, scan_from_first_chunk, sum_rows


def _logits(xc, kernel, layout):
    # (C, H) x kernel -> (C, V) in the activations' dtype (an lm_head's output); the kernel takes the log-softmax
    dims = (((1,), (0 if layout == "hv" else 1,)), ((), ()))
    return jax.lax.dot_general(xc, kernel, dims).astype(xc.dtype)


def _chunk_loop(xs, ws, xt, wt, labels, static, compute_grad, shards=None):
    """Per-row fp32 losses and, with ``compute_grad``, the gradients of xs and ws (an fp32 accumulator for ws
    by default) for an incoming gradient of 1. In one shard of the rows (``shards``) the mean divides by the
    rows or kept labels of all shards."""
    opts, layout, chunk_size, accum_fp32 = static[:4]
    n = xs.shape[0]
    n_total = n if shards is None else math.prod(shards.global_shapes[0][:-1])
    vocab = ws.shape[1 if layout == "hv" else 0]
    # the student head's gradient is computed with the losses' (else one chunk saves no accumulator)
    rows, fp32_acc = core.chunking(n, vocab, xs.shape[1], dtype_name(xs.dtype), dtype_name(xt.dtype),
                                   dtype_name(ws.dtype), chunk_size, accum_fp32 and compute_grad)
    n_chunks = -(-n // rows)
    pad = n_chunks * rows - n
    denom = None
    if labels is not None:
        (denom,) = run_plan(core.count_plan(n, dtype_name(labels.dtype), opts["ignore_index"]), labels=labels)
        if shards is not None:
            denom = shards.sum(denom)
    xss = jnp.pad(xs, ((0, pad), (0, 0))).reshape(n_chunks, rows, xs.shape[1])
    xts = jnp.pad(xt, ((0, pad), (0, 0))).reshape(n_chunks, rows, xt.shape[1])
    ls = None if labels is None else jnp.pad(labels, (0, pad), constant_values=opts["ignore_index"]).reshape(
        n_chunks, rows)
    plan = core.chunk_plan(rows, vocab, dtype_name(xs.dtype), dtype_name(xt.dtype),
                           None if labels is None else dtype_name(labels.dtype), beta=opts["beta"],
                           ignore_index=opts["ignore_index"], n_total_rows=n_total, temperature=opts["temperature"],
                           compute_grad=compute_grad)
    acc_dtype = jnp.float32 if fp32_acc else ws.dtype  # an fp32 master kernel's: its gradient accumulates
    ws = ws.astype(xs.dtype)  # the matmuls' copy of a master kernel (else itself)

    def body(gw, chunk):
        xsc, xtc, lc = chunk
        student = _logits(xsc, ws, layout)
        teacher = jax.lax.stop_gradient(_logits(xtc, wt, layout))
        outs = run_plan(plan, student=student, teacher=teacher, labels=lc, denom=denom)
        if not compute_grad:
            return gw, (outs[0],)
        dlogits = outs[1]  # over the student's logits, in their dtype
        # dx = dlogits @ W (contract V); dW += x^T dlogits (hv) or dlogits^T x (vh), accumulated in acc_dtype.
        dx = jax.lax.dot_general(dlogits, ws, (((1,), (1 if layout == "hv" else 0,)), ((), ())))
        if layout == "hv":
            dw = jax.lax.dot_general(xsc, dlogits, (((0,), (0,)), ((), ())), preferred_element_type=acc_dtype)
        else:
            dw = jax.lax.dot_general(dlogits, xsc, (((0,), (0,)), ((), ())), preferred_element_type=acc_dtype)
        gw = dw.astype(acc_dtype) if gw is None else gw + dw.astype(acc_dtype)  # None: the first chunk
        return gw, (outs[0], dx.astype(xs.dtype))

    if compute_grad:
        carry, ys = scan_from_first_chunk(body, (xss, xts, ls))
    else:
        carry, ys = jax.lax.scan(body, None, (xss, xts, ls))
    losses = ys[0].reshape(-1)[:n]
    if not compute_grad:
        return losses, None
    return losses, (ys[1].reshape(-1, xs.shape[1])[:n], carry)


@functools.lru_cache(maxsize=None)
def _loop_op(static, compute_grad: bool, has_labels: bool):
    """``(xs (..., Hs), ws, xt (..., Ht), wt[, labels (...)]) -> (losses (...)[, grad_xs, grad_ws])``: the
    chunk loop over one shard's tokens (or all of them)."""

    def loop(xs, ws, xt, wt, *labels, shards=None):
        lead = xs.shape[:-1]
        flat_labels = labels[0].reshape(-1) if has_labels else None
        rows, grads = _chunk_loop(xs.reshape(-1, xs.shape[-1]), ws, xt.reshape(-1, xt.shape[-1]), wt, flat_labels,
                                  static, compute_grad, shards=shards)
        outs = (rows.reshape(lead),)
        if compute_grad:
            outs += (grads[0].reshape(xs.shape), grads[1])
        return outs

    operands = (ROWS, WHOLE, ROWS, WHOLE) + (ROWS,) * has_labels
    results = (ROWS,) + ((ROWS, WHOLE) if compute_grad else ())
    rule = rows_rule(operands, results, sums=(2,) if compute_grad else ())
    return _mapped_over_batch(partitioned(loop, rule), len(results))


def _loop(xs, ws, xt, wt, labels, static, compute_grad):
    op = _loop_op(static, compute_grad, labels is not None)
    outs = op(xs, ws, xt, wt, *(() if labels is None else (labels,)))
    return outs[0], (tuple(outs[1:]) if compute_grad else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _fljsd(xs, ws, xt, wt, labels, static):
    rows, _ = _loop(xs, ws, xt, wt, labels, static, False)
    return sum_rows(rows, xs.dtype)


def _fljsd_fwd(xs, ws, xt, wt, labels, static):
    rows, grads = _loop(xs, ws, xt, wt, labels, static, True)
    return sum_rows(rows, xs.dtype), (grads, ws)  # ws (a parameter) only for its sharding


def _fljsd_bwd(static, residuals, g):
    (grad_x, grad_w), ws = residuals
    scale = g.astype(jnp.float32)
    dtypes = static[5]
    grad_x = scaled(grad_x, scale, dtypes[0])
    grad_w = scaled(grad_w, scale, dtypes[1])
    return like((grad_x, grad_w), (None, ws)) + (None, None, None)  # the teacher is a constant: zero cotangents


_fljsd.defvjp(_fljsd_fwd, _fljsd_bwd)


def fused_linear_jsd(student_input, student_kernel, teacher_input, teacher_kernel, labels=None, *,
                     transpose: bool = False, beta: float = 0.5, ignore_index: int = -100, temperature: float = 1.0,
                     chunk_size: int | None = None, accum_dtype_fp32: bool | None = None, dtype=None):
    """:func:`liger_jax.jsd` of ``log_softmax(student_input @ student_kernel / temperature)`` (student) and
    ``log_softmax(teacher_input @ teacher_kernel / temperature)`` (teacher), without materialising either
    (N, V) logits tensor.

    ``student_input`` (..., Hs) with a Flax ``nnx.Linear`` kernel (Hs, V); ``teacher_input`` (..., Ht) with the
    same leading shape and kernel (Ht, V); ``transpose=True`` takes (V, H) matrices for both instead (tied
    ``nnx.Embed.embedding``), used as ``x @ kernel.T``. Each kernel has its input's dtype. ``labels``, ``beta``
    and ``ignore_index`` as in :func:`liger_jax.jsd` (mean over non-ignored rows); not multiplied by
    ``temperature**2``. Tokens go through a ``lax.scan`` in chunks of ``chunk_size`` rows (default: as many as
    fit the student's (rows, V) logits in ``liger_core.fused_linear_jsd.WORKSPACE_BYTES``, the teacher's as many
    again); the logits are in the inputs' dtypes and their log-softmax is taken in fp32 inside the kernel.
    ``accum_dtype_fp32``: accumulate the student kernel's gradient in fp32 (default: on for bf16/fp16
    kernels). ``dtype``: the matmuls' dtype, as Flax's ``dtype`` (default: the inputs' own): both inputs and
    kernels are cast to it, except an fp32 student kernel of a bf16/fp16 ``dtype``, a master kernel (see
    :func:`liger_jax.fused_linear_cross_entropy`). Loss in the student's dtype. Differentiable in
    ``student_input`` and ``student_kernel``; the teacher is a constant (differentiating it is a ValueError:
    wrap it in ``jax.lax.stop_gradient``).
    """
    xs = as_array("student_input", student_input)
    ws = as_array("student_kernel", student_kernel)
    xt = undifferentiated("fused_linear_jsd", "the student", "teacher_input", as_array("teacher_input", teacher_input))
    wt = undifferentiated("fused_linear_jsd", "the student", "teacher_kernel",
                          as_array("teacher_kernel", teacher_kernel))
    labels = None if labels is None else as_array("labels", labels)
    layout = "vh" if transpose else "hv"
    if dtype is not None:
        xs, ws, _ = in_matmul_dtype(dtype, xs, ws)
        xt, wt = xt.astype(dtype), wt.astype(dtype)
    core.check_options(beta=beta, ignore_index=ignore_index, temperature=temperature)
    vocab = core.check_inputs(info(xs), info(ws), info(xt), info(wt), optional_info(labels), layout=layout,
                              student_w_name="student_kernel", teacher_w_name="teacher_kernel",
                              master_weight_ok=dtype is not None)
    core.chunk_rows(1, vocab, dtype_name(xs.dtype), chunk_size)  # validates chunk_size
    opts = _FrozenDict(beta=float(beta), ignore_index=int(ignore_index), temperature=float(temperature))
    accum_fp32 = core.accumulate_in_fp32(dtype_name(ws.dtype), accum_dtype_fp32)
    static = (opts, layout, chunk_size, accum_fp32, tuple(xs.shape), (xs.dtype, ws.dtype))
    return _fljsd(xs, ws, xt, wt, labels, static)


class _FrozenDict(dict):
    def __hash__(self):
        return hash(tuple(sorted(self.items())))

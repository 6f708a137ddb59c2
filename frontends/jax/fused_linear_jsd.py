"""Fused linear JSD for jax: a ``lax.scan`` over token chunks of XLA matmuls and log-softmaxes around the JSD
kernel of :mod:`liger_core.jsd` (``custom_vjp``).

The forward rule computes the gradients of the student's hidden states and kernel chunk by chunk (the kernel
gradient accumulated in the scan carry, fp32 by default for half-precision kernels); the backward scales them
by the cotangent. The token axis is padded to a whole number of chunks with zero rows (ignored rows when there
are labels); their losses and hidden-state gradients are dropped, and their kernel-gradient terms are
``dz^T @ 0 = 0``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from liger_core import fused_linear_jsd as core

from ._launch import as_array, dtype_name, info, optional_info, run_plan


def _log_probs(xc, kernel, layout, temperature):
    # (C, H) x kernel -> (C, V) in the activations' dtype (an lm_head's output), then log-softmax in fp32
    dims = (((1,), (0 if layout == "hv" else 1,)), ((), ()))
    logits = jax.lax.dot_general(xc, kernel, dims).astype(xc.dtype)
    return jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)


def _chunk_loop(xs, ws, xt, wt, labels, static, compute_grad):
    """Per-row fp32 losses and, with ``compute_grad``, the gradients of xs and ws (an fp32 accumulator for ws
    by default) for an incoming gradient of 1."""
    opts, layout, chunk_size, accum_fp32 = static[:4]
    n = xs.shape[0]
    vocab = ws.shape[1 if layout == "hv" else 0]
    rows = core.chunk_rows(n, vocab, chunk_size)
    n_chunks = -(-n // rows)
    pad = n_chunks * rows - n
    denom = None
    if labels is not None:
        (denom,) = run_plan(core.count_plan(n, dtype_name(labels.dtype), opts["ignore_index"]), labels=labels)
    xss = jnp.pad(xs, ((0, pad), (0, 0))).reshape(n_chunks, rows, xs.shape[1])
    xts = jnp.pad(xt, ((0, pad), (0, 0))).reshape(n_chunks, rows, xt.shape[1])
    ls = None if labels is None else jnp.pad(labels, (0, pad), constant_values=opts["ignore_index"]).reshape(
        n_chunks, rows)
    plan = core.chunk_plan(rows, vocab, None if labels is None else dtype_name(labels.dtype), beta=opts["beta"],
                           ignore_index=opts["ignore_index"], n_total_rows=n, temperature=opts["temperature"],
                           compute_grad=compute_grad)
    acc_dtype = jnp.float32 if accum_fp32 else ws.dtype
    temperature = opts["temperature"]

    def body(gw, chunk):
        xsc, xtc, lc = chunk
        student = _log_probs(xsc, ws, layout, temperature)
        teacher = jax.lax.stop_gradient(_log_probs(xtc, wt, layout, temperature))
        outs = run_plan(plan, student=student, teacher=teacher, labels=lc, denom=denom)
        if not compute_grad:
            return gw, (outs[0],)
        dlogits = outs[1].astype(xs.dtype)
        # dx = dlogits @ W (contract V); dW += x^T dlogits (hv) or dlogits^T x (vh), accumulated in acc_dtype.
        dx = jax.lax.dot_general(dlogits, ws, (((1,), (1 if layout == "hv" else 0,)), ((), ())))
        if layout == "hv":
            dw = jax.lax.dot_general(xsc, dlogits, (((0,), (0,)), ((), ())), preferred_element_type=acc_dtype)
        else:
            dw = jax.lax.dot_general(dlogits, xsc, (((0,), (0,)), ((), ())), preferred_element_type=acc_dtype)
        return gw + dw.astype(acc_dtype), (outs[0], dx.astype(xs.dtype))

    init = jnp.zeros(ws.shape, acc_dtype) if compute_grad else None
    carry, ys = jax.lax.scan(body, init, (xss, xts, ls))
    losses = ys[0].reshape(-1)[:n]
    if not compute_grad:
        return losses, None
    return losses, (ys[1].reshape(-1, xs.shape[1])[:n], carry)


def _flat(xs, xt, labels):
    return (xs.reshape(-1, xs.shape[-1]), xt.reshape(-1, xt.shape[-1]),
            None if labels is None else labels.reshape(-1))


def _total(rows, dtype):
    (total,) = run_plan(core.loss_plan(rows.shape[0], dtype_name(dtype)), rows=rows)
    return total


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _fljsd(xs, ws, xt, wt, labels, static):
    rows, _ = _chunk_loop(*_args(xs, ws, xt, wt, labels), static, False)
    return _total(rows, xs.dtype)


def _args(xs, ws, xt, wt, labels):
    xs2, xt2, l2 = _flat(xs, xt, labels)
    return xs2, ws, xt2, wt, l2


def _fljsd_fwd(xs, ws, xt, wt, labels, static):
    rows, grads = _chunk_loop(*_args(xs, ws, xt, wt, labels), static, True)
    return _total(rows, xs.dtype), grads


def _fljsd_bwd(static, grads, g):
    grad_x, grad_w = grads
    scale = g.astype(jnp.float32)
    x_shape, dtypes = static[4], static[5]
    grad_x = (grad_x * scale.astype(grad_x.dtype)).reshape(x_shape).astype(dtypes[0])
    grad_w = (grad_w * scale.astype(grad_w.dtype)).astype(dtypes[1])
    return grad_x, grad_w, None, None, None  # the teacher is a constant: zero cotangents


_fljsd.defvjp(_fljsd_fwd, _fljsd_bwd)


def fused_linear_jsd(student_input, student_kernel, teacher_input, teacher_kernel, labels=None, *,
                     transpose: bool = False, beta: float = 0.5, ignore_index: int = -100, temperature: float = 1.0,
                     chunk_size: int | None = None, accum_dtype_fp32: bool | None = None):
    """:func:`liger_jax.jsd` of ``log_softmax(student_input @ student_kernel / temperature)`` (student) and
    ``log_softmax(teacher_input @ teacher_kernel / temperature)`` (teacher), without materialising either
    (N, V) logits tensor.

    ``student_input`` (..., Hs) with a Flax ``nnx.Linear`` kernel (Hs, V); ``teacher_input`` (..., Ht) with the
    same leading shape and kernel (Ht, V); ``transpose=True`` takes (V, H) matrices for both instead (tied
    ``nnx.Embed.embedding``), used as ``x @ kernel.T``. Each kernel has its input's dtype. ``labels``, ``beta``
    and ``ignore_index`` as in :func:`liger_jax.jsd` (mean over non-ignored rows); not multiplied by
    ``temperature**2``. Tokens go through a ``lax.scan`` in chunks of ``chunk_size`` rows (default: two fp32
    (rows, V) buffers within ``liger_core.fused_linear_cross_entropy.DEFAULT_WORKSPACE_BYTES``).
    ``accum_dtype_fp32``: accumulate the student kernel's gradient in fp32 (default: on for bf16/fp16
    kernels). Loss in the student's dtype. Differentiable in ``student_input`` and ``student_kernel``; the
    teacher is a constant (zero cotangents).
    """
    xs = as_array("student_input", student_input)
    ws = as_array("student_kernel", student_kernel)
    xt = as_array("teacher_input", teacher_input)
    wt = as_array("teacher_kernel", teacher_kernel)
    labels = None if labels is None else as_array("labels", labels)
    layout = "vh" if transpose else "hv"
    core.check_options(beta=beta, ignore_index=ignore_index, temperature=temperature)
    vocab = core.check_inputs(info(xs), info(ws), info(xt), info(wt), optional_info(labels), layout=layout,
                              student_w_name="student_kernel", teacher_w_name="teacher_kernel")
    core.chunk_rows(1, vocab, chunk_size)  # validates chunk_size
    opts = _FrozenDict(beta=float(beta), ignore_index=int(ignore_index), temperature=float(temperature))
    accum_fp32 = core.accumulate_in_fp32(dtype_name(ws.dtype), accum_dtype_fp32)
    static = (opts, layout, chunk_size, accum_fp32, tuple(xs.shape), (xs.dtype, ws.dtype))
    return _fljsd(xs, ws, xt, wt, labels, static)


class _FrozenDict(dict):
    def __hash__(self):
        return hash(tuple(sorted(self.items())))

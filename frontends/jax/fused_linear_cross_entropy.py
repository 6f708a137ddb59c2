"""Fused linear cross-entropy for jax: a ``lax.scan`` over token chunks of XLA matmuls around the
cross-entropy kernel of :mod:`liger_core.cross_entropy` (``custom_vjp``).

For ``mean``/``sum`` the forward rule computes the gradients chunk by chunk (the weight gradient accumulated
in the scan carry, fp32 by default for half-precision kernels) and the backward scales them; for ``none`` the
backward runs the scan again with the per-row cotangent folded into the kernel. The token axis is padded to
a whole number of chunks with ignored rows (their loss and gradient are 0, and they are dropped).

Under ``jit`` with sharded inputs the loop runs shard by shard on the local tokens (never scanning over a
sharded axis): the kernel and bias are whole (an FSDP-sharded kernel is gathered), the kernel and bias gradients
are summed over the shards, and a mean divides by the non-ignored labels of all shards
(:mod:`liger_jax._sharding`). Under ``jax.vmap`` each example is one loop (``lax.map``): means per example.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from liger_core import cross_entropy as ce_core
from liger_core import fused_linear_cross_entropy as core
from liger_core.launch import FLOAT_DTYPES, check_bool

from ._launch import as_array, dtype_name, info, optional_info, run_plan, undifferentiated
from ._sharding import ROWS, WHOLE, like, partitioned, rows_rule
from .cross_entropy import _mapped_over_batch, check_labels, scale_grad_op, sum_over_shards


def _logits(xc, kernel, bias, layout, dtype):
    # (C, H) x kernel -> (C, V): contract H with the kernel's H axis, whichever layout it is stored in.
    dims = (((1,), (0 if layout == "hv" else 1,)), ((), ()))
    logits = jax.lax.dot_general(xc, kernel, dims)
    if bias is not None:
        logits = logits + bias
    return logits.astype(dtype)


def scan_from_first_chunk(body, chunks):
    """``lax.scan(body, init, chunks)`` where the first chunk runs outside the scan as ``body(None, first)`` and
    its carry (the first chunk's weight-gradient sums) starts the loop: no weight-sized zero fill, and no read of
    one in the first accumulation. The per-chunk outputs are joined again (a copy of dx: N x H, small next to
    the W-sized accumulator)."""
    carry, y_first = body(None, jax.tree.map(lambda a: a[0], chunks))
    carry, ys = jax.lax.scan(body, carry, jax.tree.map(lambda a: a[1:], chunks))
    return carry, jax.tree.map(lambda first, rest: jnp.concatenate([first[None], rest]), y_first, ys)


def _chunk_loop(x, kernel, labels, bias, ce_weight, static, compute_grad, grad_scale=None, shards=None):
    """Per-row fp32 losses (and z parts), and with ``compute_grad`` the gradients of x, kernel, bias (fp32
    accumulators for kernel and bias) for an incoming gradient of 1, or of ``grad_scale`` per row. In one shard
    of the rows (``shards``) a mean's denominators are those of all shards."""
    opts, layout, chunk_size, accum_fp32 = static[:4]
    n, hidden = x.shape
    vocab = kernel.shape[1 if layout == "hv" else 0]
    dtype = dtype_name(x.dtype)
    # accumulation only matters when the kernel's gradient is computed (else one chunk saves no accumulator)
    rows, fp32_acc = core.chunking(n, vocab, hidden, dtype, dtype_name(kernel.dtype), chunk_size,
                                   accum_fp32 and compute_grad)
    n_chunks = -(-n // rows)
    pad = n_chunks * rows - n
    denom = None
    if opts["reduction"] == "mean":
        plan = core.denominators_plan(n, dtype_name(labels.dtype), optional_info(ce_weight), vocab,
                                      opts["ignore_index"])
        (denom,) = run_plan(plan, target=labels, weight=ce_weight)
        if shards is not None:
            denom = shards.sum(denom)
    xs = jnp.pad(x, ((0, pad), (0, 0))).reshape(n_chunks, rows, hidden)
    ls = jnp.pad(labels, (0, pad), constant_values=opts["ignore_index"]).reshape(n_chunks, rows)
    gs = None if grad_scale is None else jnp.pad(grad_scale, (0, pad)).reshape(n_chunks, rows)
    plan = core.chunk_plan(rows, vocab, dtype, dtype_name(labels.dtype), optional_info(ce_weight),
                           compute_grad=compute_grad,
                           grad_scale_dtype=None if grad_scale is None else dtype_name(grad_scale.dtype), **opts)
    acc_dtype = jnp.float32 if fp32_acc else kernel.dtype  # an fp32 master kernel's: its gradient accumulates
    kernel = kernel.astype(x.dtype)  # the matmuls' copy of a master kernel (else itself)

    def body(carry, chunk):
        xc, lc, gc = chunk
        logits = _logits(xc, kernel, bias, layout, x.dtype)
        outs = run_plan(plan, logits=logits, target=lc, weight=ce_weight, denom=denom, grad_scale=gc)
        z = outs[1] if opts["return_z_loss"] else jnp.zeros((0,), jnp.float32)
        if not compute_grad:
            return carry, (outs[0], z)
        dlogits = outs[-1]
        # dx = dlogits @ W (contract V); dW += x^T dlogits (hv) or dlogits^T x (vh), accumulated in acc_dtype.
        dx = jax.lax.dot_general(dlogits, kernel, (((1,), (1 if layout == "hv" else 0,)), ((), ())))
        if layout == "hv":
            dw = jax.lax.dot_general(xc, dlogits, (((0,), (0,)), ((), ())), preferred_element_type=acc_dtype)
        else:
            dw = jax.lax.dot_general(dlogits, xc, (((0,), (0,)), ((), ())), preferred_element_type=acc_dtype)
        gw = dw.astype(acc_dtype)
        gb = None if bias is None else jnp.sum(dlogits, axis=0, dtype=jnp.float32)
        if carry is not None:  # None: the first chunk, whose sums start the accumulators
            gw = carry[0] + gw
            gb = None if gb is None else carry[1] + gb
        return (gw, gb), (outs[0], z, dx.astype(x.dtype))

    if compute_grad:
        carry, ys = scan_from_first_chunk(body, (xs, ls, gs))
    else:
        carry, ys = jax.lax.scan(body, None, (xs, ls, gs))
    losses = ys[0].reshape(-1)[:n]
    z = ys[1].reshape(-1)[:n] if opts["return_z_loss"] else None
    if not compute_grad:
        return losses, z, None
    grad_x = ys[2].reshape(-1, hidden)[:n]
    return losses, z, (grad_x, carry[0], carry[1])


@functools.lru_cache(maxsize=None)
def _loop_op(static, compute_grad: bool, has_bias: bool, has_ce_weight: bool, has_grad_scale: bool):
    """``(x (..., H), kernel, labels (...)[, bias][, ce_weight][, grad_scale (...)]) -> (losses (...)[, z (...)]
    [, grad_x, grad_kernel[, grad_bias]])``: the chunk loop over one shard's tokens (or all of them)."""
    return_z = static[0]["return_z_loss"]

    def loop(x, kernel, labels, *rest, shards=None):
        rest = list(rest)
        bias = rest.pop(0) if has_bias else None
        ce_weight = rest.pop(0) if has_ce_weight else None
        grad_scale = rest.pop(0).reshape(-1) if has_grad_scale else None
        rows, z, grads = _chunk_loop(x.reshape(-1, x.shape[-1]), kernel, labels.reshape(-1), bias, ce_weight,
                                     static, compute_grad, grad_scale=grad_scale, shards=shards)
        outs = (rows.reshape(labels.shape),) + ((z.reshape(labels.shape),) if return_z else ())
        if compute_grad:
            outs += (grads[0].reshape(x.shape), grads[1]) + ((grads[2],) if has_bias else ())
        return outs

    operands = (ROWS, WHOLE, ROWS) + (WHOLE,) * (int(has_bias) + int(has_ce_weight)) + (ROWS,) * has_grad_scale
    results = (ROWS,) * (1 + int(return_z))
    sums = ()
    if compute_grad:
        results += (ROWS,) + (WHOLE,) * (1 + int(has_bias))
        sums = tuple(range(len(results) - 1 - int(has_bias), len(results)))
    rule = rows_rule(operands, results, sums=sums)
    return _mapped_over_batch(partitioned(loop, rule), len(results))


def _loop(x, kernel, labels, bias, ce_weight, static, compute_grad, grad_scale=None):
    """``(losses, z or None, grads or None)``, each of its row's shape (the labels', x's)."""
    optional = [a for a in (bias, ce_weight, grad_scale) if a is not None]
    op = _loop_op(static, compute_grad, bias is not None, ce_weight is not None, grad_scale is not None)
    outs = list(op(x, kernel, labels, *optional))
    rows = outs.pop(0)
    z = outs.pop(0) if static[0]["return_z_loss"] else None
    if not compute_grad:
        return rows, z, None
    return rows, z, (outs[0], outs[1], outs[2] if bias is not None else None)


@functools.lru_cache(maxsize=None)
def _sum_rows_op(dtype: str):
    """fp32 per-row values (any shape) -> their sum in ``dtype``, summed over the shards of the rows."""

    def total(rows, shards=None):
        if shards is not None:
            return (sum_over_shards(rows, shards, dtype),)
        return run_plan(core.loss_plan(rows.size, dtype), rows=rows.reshape(-1))

    rule = rows_rule((ROWS,), (WHOLE,), n_rows=lambda shapes: len(shapes[0]))
    return _mapped_over_batch(partitioned(total, rule), 1)


def sum_rows(rows, dtype):
    (total,) = _sum_rows_op(dtype_name(dtype))(rows)
    return total


def _reduce(rows, reduction, dtype):
    if reduction == "none":
        return rows.astype(dtype)
    return sum_rows(rows, dtype)


def _outputs(rows, z, static, dtype):
    reduction = static[0]["reduction"]
    loss = _reduce(rows, reduction, dtype)
    if static[0]["return_z_loss"]:
        return loss, _reduce(z, reduction, dtype)
    return loss


def scaled(grad, scale, dtype):
    """``grad * scale`` (an fp32 scalar, or None for 1) in ``dtype``, the product in fp32 and rounded once. A
    gradient already in ``dtype`` is scaled in place by the cross-entropy's scale kernel (elementwise, so right
    under any sharding), which moves nothing for ``jax.grad``'s cotangent of 1; an fp32 accumulator is scaled
    and rounded in one fused XLA pass."""
    if scale is None:
        return grad.astype(dtype)
    if grad.dtype == dtype:
        (out,) = scale_grad_op("mean", pointwise=True)(grad, scale)
        return out
    return (grad.astype(jnp.float32) * scale).astype(dtype)


DTYPE_REMEDY = ("cast them to one dtype, or pass dtype= (Flax's dtype: the matmuls' dtype; an fp32 kernel then "
                "stays the fp32 master of its gradient)")


def in_matmul_dtype(dtype, x, kernel, bias=None):
    """``(x, kernel, bias)`` for matmuls in ``dtype``: x and bias cast to it, the kernel too unless it is an fp32
    master kernel of a bf16/fp16 ``dtype`` (the loop casts that one itself)."""
    dtype = jnp.dtype(dtype)
    if dtype_name(dtype) not in FLOAT_DTYPES:
        raise TypeError(f"dtype (the matmuls' dtype) must be one of {FLOAT_DTYPES}, got {dtype.name}")
    if not core.is_master_weight(dtype_name(kernel.dtype), dtype_name(dtype)):
        kernel = kernel.astype(dtype)
    return x.astype(dtype), kernel, None if bias is None else bias.astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flce(x, kernel, labels, bias, ce_weight, static):
    rows, z, _ = _loop(x, kernel, labels, bias, ce_weight, static, False)
    return _outputs(rows, z, static, jnp.float32)


def _flce_fwd(x, kernel, labels, bias, ce_weight, static):
    if static[0]["reduction"] == "none":
        rows, z, _ = _loop(x, kernel, labels, bias, ce_weight, static, False)
        return _outputs(rows, z, static, jnp.float32), (x, kernel, labels, bias, ce_weight, None)
    rows, z, grads = _loop(x, kernel, labels, bias, ce_weight, static, True)
    # the kernel and bias (parameters, alive anyway) only for their shardings
    return _outputs(rows, z, static, jnp.float32), (None, kernel, None, bias, None, grads)


def _flce_bwd(static, residuals, cotangent):
    g = cotangent[0] if static[0]["return_z_loss"] else cotangent  # z_loss is for logging: cotangent dropped
    x, kernel, labels, bias, ce_weight, grads = residuals
    if grads is None:  # reduction='none': run the loop again, the per-row cotangent folded into the kernel
        _, _, grads = _loop(x, kernel, labels, bias, ce_weight, static, True, grad_scale=g.astype(jnp.float32))
        scale = None
    else:
        scale = g.astype(jnp.float32)
    grad_x, grad_w, grad_b = (None if grad is None else scaled(grad, scale, dtype)
                              for grad, dtype in zip(grads, static[5]))
    return like((grad_x, grad_w, None, grad_b, None), (None, kernel, None, bias, None))


_flce.defvjp(_flce_fwd, _flce_bwd)


def fused_linear_cross_entropy(x, kernel, labels, bias=None, *, transpose: bool = False, ce_weight=None,
                               ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                               lse_square_scale: float = 0.0, softcap: float | None = None,
                               return_z_loss: bool = False, chunk_size: int | None = None,
                               accum_dtype_fp32: bool | None = None, dtype=None):
    """``cross_entropy(x @ kernel + bias, labels)`` for x (..., H) and a Flax ``nnx.Linear`` kernel (H, V),
    without materialising the (N, V) logits. ``transpose=True`` takes a (V, H) matrix instead, used as
    ``x @ kernel.T`` (a tied ``nnx.Embed.embedding``).

    Tokens go through a ``lax.scan`` in chunks of ``chunk_size`` rows (default: a fixed logits workspace of
    ``liger_core.fused_linear_cross_entropy.DEFAULT_WORKSPACE_BYTES``, whatever N; or one chunk when all the
    logits take no more than the fp32 weight-gradient accumulator that chunks need, N <= 2H in bf16: no
    accumulator then, the weight gradient is one matmul summed in fp32 and rounded once). ``ce_weight`` is the class
    weight; the other options are :func:`liger_jax.cross_entropy`'s (labels checked when concrete; under
    ``jit`` a bad label makes the loss NaN). ``accum_dtype_fp32``: accumulate the kernel's gradient in fp32
    (default: on for bf16/fp16 kernels). ``dtype``: the matmuls' dtype, as Flax's ``dtype`` (default: x's,
    and the kernel must have it): x and bias are cast to it, and the kernel too unless it is an fp32 kernel of a
    bf16/fp16 ``dtype`` (``param_dtype=float32``): that master kernel is cast once inside the loop and its
    gradient accumulated in fp32 straight into the fp32 gradient (no accumulator beside it, no bf16 gradient
    cast back; chunks of the default workspace whatever N). Differentiable in x, kernel and bias. The loss (and
    z-loss) is fp32 whatever x's dtype, as the fp32 losses of HF's loss functions and Liger-Kernel: a bf16 loss
    near 12 would be rounded to multiples of 1/16.
    """
    x = as_array("x", x)
    kernel = as_array("kernel", kernel)
    labels = as_array("labels", labels)
    bias = None if bias is None else as_array("bias", bias)
    ce_weight = None if ce_weight is None else undifferentiated(
        "fused_linear_cross_entropy", "x, kernel and bias", "ce_weight", as_array("ce_weight", ce_weight))
    layout = "vh" if transpose else "hv"
    if dtype is not None:
        x, kernel, bias = in_matmul_dtype(dtype, x, kernel, bias)
    ce_core.check_options(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
                          lse_square_scale=lse_square_scale, softcap=softcap)
    vocab = core.check_inputs(info(x), info(kernel), info(labels), optional_info(bias), optional_info(ce_weight),
                              layout=layout, weight_name="kernel", target_name="labels",
                              dtype_remedy=DTYPE_REMEDY, master_weight_ok=dtype is not None)
    core.chunk_rows(1, vocab, dtype_name(x.dtype), chunk_size)  # validates chunk_size
    check_labels(labels, vocab, ignore_index)
    opts = dict(ignore_index=int(ignore_index), reduction=reduction, label_smoothing=float(label_smoothing),
                lse_square_scale=float(lse_square_scale), softcap=None if softcap is None else float(softcap),
                return_z_loss=check_bool(return_z_loss, "return_z_loss"))
    accum_fp32 = core.accumulate_in_fp32(dtype_name(kernel.dtype), accum_dtype_fp32)
    dtypes = (x.dtype, kernel.dtype, None if bias is None else bias.dtype)
    static = _Static(opts, layout, chunk_size, accum_fp32, tuple(x.shape), dtypes)
    return _flce(x, kernel, labels, bias, ce_weight, static)


class _Static(tuple):
    """The non-differentiable, hashable configuration: (opts, layout, chunk_size, accum_fp32, x_shape, dtypes)."""

    def __new__(cls, opts, layout, chunk_size, accum_fp32, x_shape, dtypes):
        return super().__new__(cls, (_FrozenDict(opts), layout, chunk_size, accum_fp32, x_shape, dtypes))


class _FrozenDict(dict):
    def __hash__(self):
        return hash(tuple(sorted(self.items())))

"""Fused residual add + RMSNorm for jax: ``custom_vjp`` wiring around :mod:`liger_core.fused_add_rms_norm`.

Under ``jax.vmap`` the batch axis is folded into the kernel's rows (one launch, no per-example loop); the
backward then asks the kernel for one weight gradient per example (``groups``). A batched scale (a different
scale per example) falls back to one launch per example. Under ``jit`` with sharded inputs the rows stay sharded
and the weight gradient is summed over the shards (:mod:`liger_jax._sharding`).
"""

from __future__ import annotations

import functools
import math

import jax

from liger_core import fused_add_rms_norm as core
from liger_core.launch import as_real

from ._launch import as_array, broadcast_unbatched, dtype_name, info, map_over_batch, num_sms, optional_info, run_plan
from ._sharding import ROWS, WHOLE, group_axes, like, partitioned, rows_rule


@functools.lru_cache(maxsize=None)
def _forward_op(epsilon: float, offset: float, casting_mode: str, has_scale: bool):
    def forward(x, residual, *scale, shards=None):
        plan = core.forward_plan(info(x), info(residual), info(scale[0]) if has_scale else None, eps=epsilon,
                                 offset=offset, casting_mode=casting_mode)
        return run_plan(plan, x=x, residual=residual, weight=scale[0] if has_scale else None)

    # x, residual, [scale] -> y, h, rstd: rows stay sharded, the scale is whole
    kinds = (ROWS, ROWS, WHOLE)[:2 + has_scale]
    op = jax.custom_batching.custom_vmap(partitioned(forward, rows_rule(kinds, (ROWS, ROWS, ROWS))))

    @op.def_vmap
    def _fold_batch(axis_size, in_batched, x, residual, *scale):
        if has_scale and in_batched[2]:
            return map_over_batch(op, axis_size, in_batched, (x, residual, *scale)), (True, True, True)
        x, residual = broadcast_unbatched(axis_size, in_batched[:2], (x, residual))
        return op(x, residual, *scale), (True, True, True)

    return op


@functools.lru_cache(maxsize=None)
def _backward_kernel(offset: float, casting_mode: str, has_scale: bool, x_dtype: str, residual_dtype: str,
                     n_group_axes: int):
    """``(dy, dh, h, rstd[, scale]) -> (dx[, dresidual][, dscale])``, dscale of shape
    ``h.shape[:n_group_axes] + (H,)`` (one per example of a folded vmap batch), summed over the shards of the
    other rows."""
    separate = x_dtype != residual_dtype
    n_outputs = 1 + int(separate) + int(has_scale)

    def backward(dy, dh, h, rstd, *scale, shards=None):
        plan = core.backward_plan(info(dy), info(dh), info(h), info(scale[0]) if has_scale else None,
                                  x_dtype=x_dtype, residual_dtype=residual_dtype, offset=offset,
                                  casting_mode=casting_mode, num_sms=num_sms(), in_place=True,
                                  separate_residual_grad=separate, groups=math.prod(h.shape[:n_group_axes]))
        grads = run_plan(plan, dy=dy, dh=dh, h=h, rstd=rstd, weight=scale[0] if has_scale else None)
        if has_scale:
            grads = tuple(grads[:-1]) + (grads[-1].reshape(h.shape[:n_group_axes] + h.shape[-1:]),)
        return grads

    kinds = (ROWS, ROWS, ROWS, ROWS, WHOLE)[:4 + has_scale]
    return partitioned(backward, rows_rule(kinds, (ROWS,) * n_outputs, sums=(n_outputs - 1,) if has_scale else (),
                                           group_axes=n_group_axes))


@functools.lru_cache(maxsize=None)
def _backward_op(offset: float, casting_mode: str, has_scale: bool, x_dtype: str, residual_dtype: str,
                 groups: int):
    """``(dy, dh, h, rstd[, scale]) -> (dx[, dresidual][, dscale])``; dresidual only when its dtype differs
    from x's (jax arrays are immutable: one array can be both gradients)."""
    separate = x_dtype != residual_dtype
    n_outputs = 1 + int(separate) + int(has_scale)

    def backward(dy, dh, h, rstd, *scale):
        kernel = _backward_kernel(offset, casting_mode, has_scale, x_dtype, residual_dtype,
                                  group_axes(h.shape, groups) if groups > 1 else 0)
        return kernel(dy, dh, h, rstd, *scale)

    op = jax.custom_batching.custom_vmap(backward)

    @op.def_vmap
    def _fold_batch(axis_size, in_batched, dy, dh, h, rstd, *scale):
        out_batched = (True,) * n_outputs
        if has_scale and in_batched[4]:
            return map_over_batch(op, axis_size, in_batched, (dy, dh, h, rstd, *scale)), out_batched
        dy, dh, h, rstd = broadcast_unbatched(axis_size, in_batched[:4], (dy, dh, h, rstd))
        grads = _backward_op(offset, casting_mode, has_scale, x_dtype, residual_dtype,
                             groups * axis_size)(dy, dh, h, rstd, *scale)
        if has_scale:  # (axis_size * groups, H) -> one weight gradient per example
            dw = grads[-1].reshape((axis_size,) + ((groups,) if groups > 1 else ()) + grads[-1].shape[-1:])
            grads = tuple(grads[:-1]) + (dw,)
        return grads, out_batched

    return op


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _fused_add_rms_norm(x, residual, scale, epsilon, offset, casting_mode, x_dtype, residual_dtype):
    return _fused_fwd(x, residual, scale, epsilon, offset, casting_mode, x_dtype, residual_dtype)[0]


def _fused_fwd(x, residual, scale, epsilon, offset, casting_mode, x_dtype, residual_dtype):
    scale_args = () if scale is None else (scale,)
    y, h, rstd = _forward_op(epsilon, offset, casting_mode, scale is not None)(x, residual, *scale_args)
    return (y, h), (h, scale, rstd)


def _fused_bwd(epsilon, offset, casting_mode, x_dtype, residual_dtype, residuals, cotangents):
    h, scale, rstd = residuals
    dy, dh = cotangents
    scale_args = () if scale is None else (scale,)
    grads = _backward_op(offset, casting_mode, scale is not None, x_dtype, residual_dtype, 1)(
        dy, dh, h, rstd, *scale_args)
    dx = grads[0]
    dresidual = grads[1] if x_dtype != residual_dtype else dx
    return like((dx, dresidual, grads[-1] if scale is not None else None), (h, h, scale))


_fused_add_rms_norm.defvjp(_fused_fwd, _fused_bwd)


def fused_add_rms_norm(x, residual, scale=None, *, epsilon: float = 1e-6, offset: float = 0.0,
                       casting_mode: str = "llama"):
    """``h = x + residual; y = rms_norm(h, scale)`` in one pass; returns ``(y, h)``.

    Casting modes and ``offset`` as in :func:`liger_jax.rms_norm`, with h (dtype: the promotion of x's and
    residual's) in the role of x. Differentiable (``custom_vjp``; the gradients of x and residual are the same
    values), works under ``jit``, ``grad``, ``vmap`` and ``checkpoint``."""
    x = as_array("x", x)
    residual = as_array("residual", residual)
    scale = None if scale is None else as_array("scale", scale)
    # Validate here, outside any trace, so bad input fails with the argument's name before any launch.
    epsilon, offset = as_real(epsilon, "epsilon"), as_real(offset, "offset")  # before the (cached) plan hashes them
    core.forward_plan(info(x), info(residual), optional_info(scale), eps=epsilon, offset=offset,
                      casting_mode=casting_mode, weight_name="scale", eps_name="epsilon")
    return _fused_add_rms_norm(x, residual, scale, epsilon, offset, casting_mode,
                               dtype_name(x.dtype), dtype_name(residual.dtype))

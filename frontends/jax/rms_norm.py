"""RMSNorm for jax: ``custom_vjp`` wiring around :mod:`liger_core.rms_norm`.

Under ``jax.vmap`` the batch axis is folded into the kernel's rows (one launch, no per-example loop); the
backward then asks the kernel for one weight gradient per example (``groups``). A batched weight (a different
scale per example) falls back to one launch per example. Under ``jit`` with sharded inputs the rows stay
sharded and the weight gradient is summed over the shards (:mod:`liger_jax._sharding`).
"""

from __future__ import annotations

import functools
import math

import jax

from liger_core import rms_norm as core
from liger_core.launch import as_real

from ._launch import as_array, broadcast_unbatched, info, map_over_batch, num_sms, run_plan
from ._sharding import ROWS, WHOLE, group_axes, like, partitioned, rows_rule


@functools.lru_cache(maxsize=None)
def _forward_op(epsilon: float, offset: float, casting_mode: str, has_scale: bool):
    def forward(x, *scale, shards=None):
        plan = core.forward_plan(info(x), info(scale[0]) if has_scale else None, eps=epsilon, offset=offset,
                                 casting_mode=casting_mode)
        return run_plan(plan, x=x, weight=scale[0] if has_scale else None)

    # x, [scale] -> y, rstd: rows stay sharded, the scale is whole
    op = jax.custom_batching.custom_vmap(
        partitioned(forward, rows_rule((ROWS, WHOLE)[:1 + has_scale], (ROWS, ROWS))))

    @op.def_vmap
    def _fold_batch(axis_size, in_batched, x, *scale):
        if has_scale and in_batched[1]:
            return map_over_batch(op, axis_size, in_batched, (x, *scale)), (True, True)
        (x,) = broadcast_unbatched(axis_size, in_batched[:1], (x,))
        return op(x, *scale), (True, True)

    return op


@functools.lru_cache(maxsize=None)
def _backward_kernel(offset: float, casting_mode: str, has_scale: bool, n_group_axes: int):
    """``(dy, x, rstd[, scale]) -> (dx[, dscale])``, dscale of shape ``x.shape[:n_group_axes] + (H,)``: one
    weight gradient per example of the folded vmap batch, summed over the shards of the other rows."""

    def backward(dy, x, rstd, *scale, shards=None):
        groups = math.prod(x.shape[:n_group_axes])
        plan = core.backward_plan(info(dy), info(x), info(scale[0]) if has_scale else None, offset=offset,
                                  casting_mode=casting_mode, num_sms=num_sms(), in_place=True, groups=groups)
        grads = run_plan(plan, dy=dy, x=x, rstd=rstd, weight=scale[0] if has_scale else None)
        if has_scale:
            grads = (grads[0], grads[1].reshape(x.shape[:n_group_axes] + x.shape[-1:]))
        return grads

    kinds = (ROWS, ROWS, ROWS, WHOLE)[:3 + has_scale]
    return partitioned(backward, rows_rule(kinds, (ROWS, ROWS)[:1 + has_scale], sums=(1,) if has_scale else (),
                                           group_axes=n_group_axes))


@functools.lru_cache(maxsize=None)
def _backward_op(offset: float, casting_mode: str, has_scale: bool, groups: int):
    def backward(dy, x, rstd, *scale):
        kernel = _backward_kernel(offset, casting_mode, has_scale, group_axes(x.shape, groups) if groups > 1 else 0)
        return kernel(dy, x, rstd, *scale)

    op = jax.custom_batching.custom_vmap(backward)

    @op.def_vmap
    def _fold_batch(axis_size, in_batched, dy, x, rstd, *scale):
        out_batched = (True, True) if has_scale else (True,)
        if has_scale and in_batched[3]:
            return map_over_batch(op, axis_size, in_batched, (dy, x, rstd, *scale)), out_batched
        dy, x, rstd = broadcast_unbatched(axis_size, in_batched[:3], (dy, x, rstd))
        grads = _backward_op(offset, casting_mode, has_scale, groups * axis_size)(dy, x, rstd, *scale)
        if has_scale:  # (axis_size * groups, H) -> one weight gradient per example
            dw = grads[1].reshape((axis_size,) + ((groups,) if groups > 1 else ()) + grads[1].shape[-1:])
            grads = (grads[0], dw)
        return grads, out_batched

    return op


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _rms_norm(x, scale, epsilon, offset, casting_mode):
    return _rms_norm_fwd(x, scale, epsilon, offset, casting_mode)[0]


def _rms_norm_fwd(x, scale, epsilon, offset, casting_mode):
    scale_args = () if scale is None else (scale,)
    y, rstd = _forward_op(epsilon, offset, casting_mode, scale is not None)(x, *scale_args)
    return y, (x, scale, rstd)


def _rms_norm_bwd(epsilon, offset, casting_mode, residuals, dy):
    x, scale, rstd = residuals
    scale_args = () if scale is None else (scale,)
    grads = _backward_op(offset, casting_mode, scale is not None, 1)(dy, x, rstd, *scale_args)
    return like((grads[0], grads[1] if scale is not None else None), (x, scale))


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def rms_norm(x, scale=None, *, epsilon: float = 1e-6, offset: float = 0.0, casting_mode: str = "llama"):
    """RMSNorm over the last axis: ``x * rstd * (offset + scale)``; see :mod:`liger_core.rms_norm` for
    the casting modes. Differentiable (``custom_vjp``), works under ``jit``, ``grad``, ``vmap`` and
    ``checkpoint``."""
    x = as_array("x", x)
    scale = None if scale is None else as_array("scale", scale)
    # Validate here, outside any trace, so bad input fails with the argument's name before any launch.
    epsilon, offset = as_real(epsilon, "epsilon"), as_real(offset, "offset")  # before the (cached) plan hashes them
    core.forward_plan(info(x), None if scale is None else info(scale), eps=epsilon, offset=offset,
                      casting_mode=casting_mode, weight_name="scale", eps_name="epsilon")
    return _rms_norm(x, scale, epsilon, offset, casting_mode)

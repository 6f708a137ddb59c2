"""LayerNorm for jax: ``custom_vjp`` wiring around :mod:`liger_core.layer_norm`.

Under ``jax.vmap`` the batch axis is folded into the kernel's rows (one launch, no per-example loop); the
backward then asks the kernel for one scale / bias gradient per example (``groups``). A batched scale or bias
(different parameters per example) makes the forward fall back to one launch per example. Under ``jit`` with
sharded inputs the rows stay sharded and the parameter gradients are summed over the shards
(:mod:`liger_jax._sharding`).
"""

from __future__ import annotations

import functools
import math

import jax

from liger_core import layer_norm as core
from liger_core.launch import as_real

from ._launch import as_array, broadcast_unbatched, info, map_over_batch, num_sms, optional_info, run_plan
from ._sharding import ROWS, WHOLE, group_axes, like, partitioned, rows_rule


def _params(args, has_scale: bool, has_bias: bool):
    args = list(args)
    scale = args.pop(0) if has_scale else None
    bias = args.pop(0) if has_bias else None
    return scale, bias


@functools.lru_cache(maxsize=None)
def _forward_op(epsilon: float, has_scale: bool, has_bias: bool):
    def forward(x, *params, shards=None):
        scale, bias = _params(params, has_scale, has_bias)
        x_info, s_info, b_info = info(x), optional_info(scale), optional_info(bias)
        plan = core.forward_plan(x_info, s_info, b_info, eps=epsilon,
                                 out_dtype=core.promoted_dtype(x_info, s_info, b_info))
        return run_plan(plan, x=x, weight=scale, bias=bias)

    # x, [scale], [bias] -> y, mean, rstd: rows stay sharded, the parameters are whole
    kinds = (ROWS,) + (WHOLE,) * (int(has_scale) + int(has_bias))
    op = jax.custom_batching.custom_vmap(partitioned(forward, rows_rule(kinds, (ROWS, ROWS, ROWS))))

    @op.def_vmap
    def _fold_batch(axis_size, in_batched, x, *params):
        if any(in_batched[1:]):
            return map_over_batch(op, axis_size, in_batched, (x, *params)), (True, True, True)
        (x,) = broadcast_unbatched(axis_size, in_batched[:1], (x,))
        return op(x, *params), (True, True, True)

    return op


@functools.lru_cache(maxsize=None)
def _backward_kernel(has_scale: bool, bias_dtype: str | None, n_group_axes: int):
    """``(dy, x, mean, rstd[, scale]) -> (dx[, dscale][, dbias])``, parameter gradients of shape
    ``x.shape[:n_group_axes] + (H,)`` (one per example of a folded vmap batch), summed over the shards of the
    other rows; the bias enters only through its dtype."""
    n_param_grads = int(has_scale) + int(bias_dtype is not None)

    def backward(dy, x, mean, rstd, *scale, shards=None):
        n_cols = x.shape[-1]
        bias = None if bias_dtype is None else core.ArrayInfo.contiguous((n_cols,), bias_dtype)
        plan = core.backward_plan(info(dy), info(x), info(scale[0]) if has_scale else None, bias,
                                  num_sms=num_sms(), in_place=True, groups=math.prod(x.shape[:n_group_axes]))
        grads = run_plan(plan, dy=dy, x=x, mean=mean, rstd=rstd, weight=scale[0] if has_scale else None)
        lead = x.shape[:n_group_axes]
        return (grads[0],) + tuple(g.reshape(lead + g.shape[-1:]) for g in grads[1:])

    kinds = (ROWS, ROWS, ROWS, ROWS, WHOLE)[:4 + has_scale]
    sums = tuple(range(1, 1 + n_param_grads))
    return partitioned(backward, rows_rule(kinds, (ROWS,) * (1 + n_param_grads), sums=sums,
                                           group_axes=n_group_axes))


@functools.lru_cache(maxsize=None)
def _backward_op(has_scale: bool, bias_dtype: str | None, groups: int):
    """``(dy, x, mean, rstd[, scale]) -> (dx[, dscale][, dbias])``; the bias enters only through its dtype."""
    n_param_grads = int(has_scale) + int(bias_dtype is not None)

    def backward(dy, x, mean, rstd, *scale):
        kernel = _backward_kernel(has_scale, bias_dtype, group_axes(x.shape, groups) if groups > 1 else 0)
        return kernel(dy, x, mean, rstd, *scale)

    op = jax.custom_batching.custom_vmap(backward)

    @op.def_vmap
    def _fold_batch(axis_size, in_batched, dy, x, mean, rstd, *scale):
        out_batched = (True,) * (1 + n_param_grads)
        if has_scale and in_batched[4]:
            return map_over_batch(op, axis_size, in_batched, (dy, x, mean, rstd, *scale)), out_batched
        dy, x, mean, rstd = broadcast_unbatched(axis_size, in_batched[:4], (dy, x, mean, rstd))
        grads = _backward_op(has_scale, bias_dtype, groups * axis_size)(dy, x, mean, rstd, *scale)
        # (axis_size * groups, H) -> one parameter gradient per example
        lead = (axis_size,) + ((groups,) if groups > 1 else ())
        grads = (grads[0],) + tuple(g.reshape(lead + g.shape[-1:]) for g in grads[1:])
        return grads, out_batched

    return op


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _layer_norm(x, scale, bias, epsilon):
    return _layer_norm_fwd(x, scale, bias, epsilon)[0]


def _layer_norm_fwd(x, scale, bias, epsilon):
    params = tuple(p for p in (scale, bias) if p is not None)
    y, mean, rstd = _forward_op(epsilon, scale is not None, bias is not None)(x, *params)
    return y, (x, scale, bias, mean, rstd)


def _layer_norm_bwd(epsilon, residuals, dy):
    x, scale, bias, mean, rstd = residuals  # the bias only for its dtype
    bias_dtype = None if bias is None else jax.numpy.dtype(bias.dtype).name
    scale_args = () if scale is None else (scale,)
    grads = list(_backward_op(scale is not None, bias_dtype, 1)(dy, x, mean, rstd, *scale_args))
    dx = grads.pop(0)
    dscale = grads.pop(0) if scale is not None else None
    dbias = grads.pop(0) if bias_dtype is not None else None
    return like((dx, dscale, dbias), (x, scale, bias))


_layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


def layer_norm(x, scale=None, bias=None, *, epsilon: float = 1e-6):
    """LayerNorm over the last axis: ``(x - mean) * rstd * scale + bias`` (scale and bias optional).

    Statistics and the affine map in fp32; the output has the promotion of the dtypes of x, scale and bias,
    as ``flax.nnx.LayerNorm`` computes it. Differentiable (``custom_vjp``), works under ``jit``, ``grad``,
    ``vmap`` and ``checkpoint``."""
    x = as_array("x", x)
    scale = None if scale is None else as_array("scale", scale)
    bias = None if bias is None else as_array("bias", bias)
    # Validate here, outside any trace, so bad input fails with the argument's name before any launch.
    epsilon = as_real(epsilon, "epsilon")  # before the (cached) plan hashes it
    core.forward_plan(info(x), optional_info(scale), optional_info(bias), eps=epsilon, weight_name="scale",
                      eps_name="epsilon")
    return _layer_norm(x, scale, bias, epsilon)

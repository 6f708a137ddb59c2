"""KL divergence for jax: ``custom_vjp`` wiring around :mod:`liger_core.kl_div`.

Pointwise terms summed: under ``jit`` with sharded inputs every axis may stay sharded (the class axis too); a
shard sums its terms in fp32, the shards' sums are added, and ``mean`` / ``batchmean`` divide by the global
size (:mod:`liger_jax._sharding`). Differentiated, a loss reduced to a scalar gets its gradient in the forward's
sweep (a residual; ``grad_in_forward``, the default) and the backward rule scales it by the cotangent; ``none``
computes it in the backward.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from liger_core import kl_div as core
from liger_core.launch import ArrayInfo, check_bool

from ._launch import as_array, info, run_plan, undifferentiated
from ._sharding import ROWS, WHOLE, partitioned, rows_rule
from .cross_entropy import _mapped_over_batch, scale_grad_op, sum_over_shards

# Pointwise terms: every axis is a row axis.
_POINTWISE = dict(n_rows=lambda shapes: len(shapes[0]))


def _global_scale(reduction: str, shape) -> float:
    """The divisor of a reduction over the whole (unsharded) input, as the kernels apply it."""
    return {"mean": 1.0 / math.prod(shape), "batchmean": 1.0 / shape[0]}.get(reduction, 1.0)


@functools.lru_cache(maxsize=None)
def _forward_op(reduction: str, log_target: bool, compute_grad: bool = False):
    """The loss, then with ``compute_grad`` (a reduction to a scalar) d loss / d x for a cotangent of 1."""
    def forward(x, target, shards=None):
        if shards is None or reduction == "none":
            plan = core.forward_plan(info(x), info(target), reduction=reduction, log_target=log_target,
                                     compute_grad=compute_grad)
            return run_plan(plan, input=x, target=target)
        scale = _global_scale(reduction, shards.global_shapes[0])
        plan = core.row_sums_plan(info(x), info(target), log_target=log_target,
                                  grad_scale=scale if compute_grad else None)
        rows, *grad = run_plan(plan, input=x, target=target)
        total = sum_over_shards(rows, shards, jnp.float32) * scale
        return (total.astype(core.output_dtype(info(x), info(target))), *grad)

    rule = rows_rule((ROWS, ROWS), (ROWS if reduction == "none" else WHOLE, ROWS)[:1 + int(compute_grad)],
                     **_POINTWISE)
    return _mapped_over_batch(partitioned(forward, rule), 1 + int(compute_grad))


@functools.lru_cache(maxsize=None)
def _backward_op(reduction: str, log_target: bool, x_shape: tuple, x_dtype: str):
    def backward(g, target, shards=None):
        x_info = ArrayInfo.contiguous(target.shape, x_dtype)  # input's shape is target's (this shard's)
        if shards is None or reduction == "none":
            plan = core.backward_plan(info(g), x_info, info(target), reduction=reduction, log_target=log_target)
            return run_plan(plan, grad_output=g, target=target)
        # One shard: the global divisor folded into the incoming gradient, in fp32.
        g = g.astype(jnp.float32) * _global_scale(reduction, x_shape)
        plan = core.backward_plan(info(g), x_info, info(target), reduction="sum", log_target=log_target)
        return run_plan(plan, grad_output=g, target=target)

    rule = rows_rule((ROWS if reduction == "none" else WHOLE, ROWS), (ROWS,), n_rows=lambda shapes: len(shapes[1]))
    return _mapped_over_batch(partitioned(backward, rule), 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _kl_div(x, target, reduction, log_target, grad_in_forward):
    return _forward_op(reduction, log_target)(x, target)[0]


def _kl_div_fwd(x, target, reduction, log_target, grad_in_forward):
    if grad_in_forward and reduction != "none":  # the gradient in the forward's sweep; the backward scales it
        loss, grad = _forward_op(reduction, log_target, True)(x, target)
        return loss, (grad,)
    # input's shape is target's; its dtype travels as an empty array (residuals must be arrays)
    return _kl_div(x, target, reduction, log_target, grad_in_forward), (target, jnp.zeros((0,), x.dtype))


def _kl_div_bwd(reduction, log_target, grad_in_forward, residuals, g):
    if grad_in_forward and reduction != "none":
        (grad,) = residuals
        (dx,) = scale_grad_op("mean", pointwise=True)(grad, g.astype(grad.dtype))
        return dx, None
    target, dtype_of_x = residuals
    (dx,) = _backward_op(reduction, log_target, tuple(target.shape), dtype_of_x.dtype.name)(g, target)
    return dx, None


_kl_div.defvjp(_kl_div_fwd, _kl_div_bwd)


def kl_div(log_predictions, targets, *, reduction: str = "mean", log_target: bool = False,
           grad_in_forward: bool = True):
    """``torch.nn.functional.kl_div(log_predictions, targets, ...)``: pointwise
    ``targets * (log(targets) - log_predictions)`` (``exp(targets) * (targets - log_predictions)`` with
    ``log_target``), reduced by ``none | sum | mean | batchmean``. ``optax.kl_divergence(log_predictions,
    targets)`` is ``reduction="none"`` summed over the last axis. Only ``log_predictions`` is differentiated:
    differentiating ``targets`` is a ValueError (a constant, or wrapped in ``jax.lax.stop_gradient``, is fine).

    ``grad_in_forward`` (reductions to a scalar): differentiated, the forward writes the gradient in its sweep
    and the backward scales it by the cotangent (skipped where that is exactly 1): three arrays of the inputs'
    size move instead of four, but five for a weighted loss; pass False there."""
    x = as_array("log_predictions", log_predictions)
    target = undifferentiated("kl_div", "log_predictions", "targets", as_array("targets", targets))
    core.check_inputs(info(x), info(target), reduction, "log_predictions", "targets")
    return _kl_div(x, target, reduction, check_bool(log_target, "log_target"),
                   check_bool(grad_in_forward, "grad_in_forward"))

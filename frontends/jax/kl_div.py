"""KL divergence for jax: ``custom_vjp`` wiring around :mod:`liger_core.kl_div`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from liger_core import kl_div as core
from liger_core.launch import ArrayInfo

from ._launch import as_array, info, run_plan
from .cross_entropy import _mapped_over_batch


@functools.lru_cache(maxsize=None)
def _forward_op(reduction: str, log_target: bool):
    def forward(x, target):
        return run_plan(core.forward_plan(info(x), info(target), reduction=reduction, log_target=log_target),
                        input=x, target=target)

    return _mapped_over_batch(forward, 1)


@functools.lru_cache(maxsize=None)
def _backward_op(reduction: str, log_target: bool, x_shape: tuple, x_dtype: str):
    x_info = ArrayInfo.contiguous(x_shape, x_dtype)

    def backward(g, target):
        plan = core.backward_plan(info(g), x_info, info(target), reduction=reduction, log_target=log_target)
        return run_plan(plan, grad_output=g, target=target)

    return _mapped_over_batch(backward, 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _kl_div(x, target, reduction, log_target):
    return _forward_op(reduction, log_target)(x, target)[0]


def _kl_div_fwd(x, target, reduction, log_target):
    # input's shape is target's; its dtype travels as an empty array (residuals must be arrays)
    return _kl_div(x, target, reduction, log_target), (target, jnp.zeros((0,), x.dtype))


def _kl_div_bwd(reduction, log_target, residuals, g):
    target, dtype_of_x = residuals
    (dx,) = _backward_op(reduction, log_target, tuple(target.shape), dtype_of_x.dtype.name)(g, target)
    return dx, None


_kl_div.defvjp(_kl_div_fwd, _kl_div_bwd)


def kl_div(log_predictions, targets, *, reduction: str = "mean", log_target: bool = False):
    """``torch.nn.functional.kl_div(log_predictions, targets, ...)``: pointwise
    ``targets * (log(targets) - log_predictions)`` (``exp(targets) * (targets - log_predictions)`` with
    ``log_target``), reduced by ``none | sum | mean | batchmean``. ``optax.kl_divergence(log_predictions,
    targets)`` is ``reduction="none"`` summed over the last axis. Only ``log_predictions`` is differentiated:
    ``targets`` gets a zero gradient (wrap it in ``jax.lax.stop_gradient`` to make that explicit)."""
    x = as_array("log_predictions", log_predictions)
    target = as_array("targets", targets)
    core.check_inputs(info(x), info(target), reduction, "log_predictions", "targets")
    return _kl_div(x, target, reduction, bool(log_target))

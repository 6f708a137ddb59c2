"""Cross-entropy for jax: ``custom_vjp`` wiring around :mod:`liger_core.cross_entropy`.

The forward rule computes the loss and d loss / d logits in one kernel (the gradient aliases the logits'
buffer, so XLA may reuse it when the logits are dead); the backward rule scales it by the cotangent. Called
without differentiation (the primal), no gradient is computed. Under ``jax.vmap`` each example is one launch
(``lax.map``): the mean's denominators are per example. Under ``jit`` with sharded inputs the token rows stay
sharded; a mean divides by the count (or class-weight sum) of the non-ignored labels of all shards, and the
loss is the sum of the shards' fp32 partial sums (:mod:`liger_jax._sharding`).
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from liger_core import cross_entropy as core
from liger_core.launch import check_bool

from ._launch import as_array, info, map_over_batch, run_plan, undifferentiated
from ._sharding import ROWS, WHOLE, partitioned, rows_rule


def _mapped_over_batch(fn, n_outputs: int):
    op = jax.custom_batching.custom_vmap(fn)

    @op.def_vmap
    def _rule(axis_size, in_batched, *args):
        return map_over_batch(op, axis_size, in_batched, args), (True,) * n_outputs

    return op


def sum_over_shards(rows, shards, dtype):
    """The fp32 per-row values of this shard summed (fixed order), then over all shards, in ``dtype``."""
    (total,) = run_plan(core.sum_rows_plan(rows.size, "float32"), rows=rows.reshape(-1))
    return shards.sum(total).astype(dtype)


@functools.lru_cache(maxsize=None)
def _forward_op(options: tuple, has_weight: bool, compute_grad: bool):
    ignore_index, reduction, label_smoothing, lse_square_scale, softcap, return_z_loss = options
    kw = dict(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
              lse_square_scale=lse_square_scale, softcap=softcap, return_z_loss=return_z_loss,
              compute_grad=compute_grad)

    def forward(logits, labels, *weight, shards=None):
        w, w_info = (weight[0], info(weight[0])) if has_weight else (None, None)
        if shards is None or reduction == "none":
            plan = core.forward_plan(info(logits), info(labels), w_info, in_place=True, **kw)
            return run_plan(plan, logits=logits, target=labels, weight=w)
        # One shard of the rows: the mean's denominators over all shards first, then this shard's rows, their
        # fp32 sums added over the shards.
        denom = None
        if reduction == "mean":
            (denom,) = run_plan(core.denominators_plan(info(labels), w_info, logits.shape[-1], ignore_index),
                                target=labels, weight=w)
            denom = shards.sum(denom)
        plan = core.chunk_plan(info(logits), info(labels), w_info, **kw)
        outs = run_plan(plan, logits=logits, target=labels, weight=w, denom=denom)
        sums = tuple(sum_over_shards(rows, shards, logits.dtype) for rows in outs[:1 + int(return_z_loss)])
        return sums + tuple(outs[1 + int(return_z_loss):])

    # logits, labels, [weight] -> loss, [z_loss], [grad]: per-row losses for 'none', else whole scalars
    loss_kind = ROWS if reduction == "none" else WHOLE
    kinds = (loss_kind,) * (1 + int(return_z_loss)) + (ROWS,) * int(compute_grad)
    rule = rows_rule((ROWS, ROWS, WHOLE)[:2 + has_weight], kinds)
    return _mapped_over_batch(partitioned(forward, rule), len(kinds))


@functools.lru_cache(maxsize=None)
def scale_grad_op(reduction: str, pointwise: bool = False):
    """``grad * g`` written over ``grad``: the backward of a loss whose forward computed its gradient (CE, JSD,
    KL). ``g`` is a scalar, or one value per row for ``none``. ``pointwise``: every axis of ``grad`` is a row
    axis (KL's terms, whose class axis may stay sharded); else the last is the class axis."""
    def backward(grad, g, shards=None):
        plan = core.backward_plan(info(grad), info(g), reduction=reduction, in_place=True)
        return run_plan(plan, grad=grad, grad_output=g)

    n_rows = {"n_rows": lambda shapes: len(shapes[0])} if pointwise else {}
    rule = rows_rule((ROWS, ROWS if reduction == "none" else WHOLE), (ROWS,), **n_rows)
    return _mapped_over_batch(partitioned(backward, rule), 1)


def _weight_args(weight):
    return () if weight is None else (weight,)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _cross_entropy(logits, labels, weight, options):
    outs = _forward_op(options, weight is not None, False)(logits, labels, *_weight_args(weight))
    return tuple(outs) if options[-1] else outs[0]


def _cross_entropy_fwd(logits, labels, weight, options):
    outs = _forward_op(options, weight is not None, True)(logits, labels, *_weight_args(weight))
    primal = tuple(outs[:2]) if options[-1] else outs[0]
    return primal, outs[-1]


def _cross_entropy_bwd(options, grad, cotangent):
    g = cotangent[0] if options[-1] else cotangent  # the z_loss output is for logging: its cotangent is dropped
    (dlogits,) = scale_grad_op(options[1])(grad, g.astype(grad.dtype))
    return dlogits, None, None


_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def check_labels(labels, n_classes: int, ignore_index: int, name: str = "labels") -> None:
    """Raise ValueError for a label outside [0, n_classes) that is not ignore_index, when the labels are
    concrete. Under ``jit`` (traced labels) nothing can be checked eagerly: such a row's loss (and so a mean or
    sum) and its gradient come out NaN instead."""
    if isinstance(labels, jax.core.Tracer):
        return
    values = np.asarray(labels)
    valid = (values == ignore_index) | ((values >= 0) & (values < n_classes))
    if not valid.all():
        bad = values[~valid]
        raise ValueError(core.invalid_targets_message(n_classes, ignore_index, name, int(bad[0]), bad.size,
                                                      values.size))


def cross_entropy(logits, labels, *, weight=None, ignore_index: int = -100, reduction: str = "mean",
                  label_smoothing: float = 0.0, lse_square_scale: float = 0.0, softcap: float | None = None,
                  return_z_loss: bool = False):
    """Cross-entropy of ``logits`` (..., V) against integer ``labels`` (...), with torch's options.

    ``reduction="none"`` gives ``optax.softmax_cross_entropy_with_integer_labels(logits, labels)`` (for
    labels in range); ``mean`` averages over non-ignored labels (weighted by ``weight[labels]`` with a class
    ``weight``), 0 when all are ignored. ``lse_square_scale`` adds the z-loss
    ``lse_square_scale * logsumexp**2`` per non-ignored row; with ``return_z_loss`` the result is
    ``(loss, z_loss)``, ``z_loss`` being that part of ``loss`` (its cotangent is ignored). ``softcap`` maps the
    logits to ``softcap * tanh(logits / softcap)`` first (Gemma 2). The loss has the logits' dtype; ``weight``
    is not differentiated (a ValueError if asked). Labels are checked when concrete (ValueError); under ``jit``
    a bad label makes the loss NaN. Works under ``jit``, ``grad``, ``vmap`` and ``checkpoint``.
    """
    logits = as_array("logits", logits)
    labels = as_array("labels", labels)
    weight = None if weight is None else undifferentiated("cross_entropy", "the logits", "weight",
                                                          as_array("weight", weight))
    # Validate here, outside any trace, so bad input fails with the argument's name before any launch.
    core.check_options(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
                       lse_square_scale=lse_square_scale, softcap=softcap)
    core.check_inputs(info(logits), info(labels), None if weight is None else info(weight),
                      target_name="labels")
    check_labels(labels, logits.shape[-1], ignore_index)
    options = (int(ignore_index), reduction, float(label_smoothing), float(lse_square_scale),
               None if softcap is None else float(softcap), check_bool(return_z_loss, "return_z_loss"))
    return _cross_entropy(logits, labels, weight, options)

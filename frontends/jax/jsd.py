"""Generalized JSD for jax: ``custom_vjp`` wiring around :mod:`liger_core.jsd`.

The forward rule computes the loss and d loss / d student in one kernel; the backward rule scales that
gradient by the cotangent. Called without differentiation (the primal), no gradient is computed. Under
``jax.vmap`` each example is one launch (``lax.map``): the mean is per example. Under ``jit`` with sharded
inputs the rows stay sharded: the mean divides by the rows (or non-ignored labels) of all shards, and the loss
adds the shards' fp32 partial sums (:mod:`liger_jax._sharding`).
"""

from __future__ import annotations

import functools
import math

import jax

from liger_core import jsd as core

from ._launch import as_array, info, run_plan, undifferentiated
from ._sharding import ROWS, WHOLE, partitioned, rows_rule
from .cross_entropy import _mapped_over_batch, scale_grad_op, sum_over_shards


@functools.lru_cache(maxsize=None)
def _forward_op(beta: float, ignore_index: int, has_labels: bool, compute_grad: bool):
    def forward(student, teacher, *labels, shards=None):
        labels = labels[0] if has_labels else None
        l_info = None if labels is None else info(labels)
        if shards is None:
            plan = core.forward_plan(info(student), info(teacher), l_info, beta=beta, ignore_index=ignore_index,
                                     compute_grad=compute_grad)
            return run_plan(plan, student=student, teacher=teacher, labels=labels)
        denom = None
        if labels is not None:  # the kept rows of all shards
            (denom,) = run_plan(core.count_plan(labels.size, l_info.dtype, ignore_index), labels=labels.reshape(-1))
            denom = shards.sum(denom)
        plan = core.shard_rows_plan(info(student), info(teacher), l_info, beta=beta, ignore_index=ignore_index,
                           n_total_rows=math.prod(shards.global_shapes[0][:-1]), compute_grad=compute_grad)
        outs = run_plan(plan, student=student, teacher=teacher, labels=labels, denom=denom)
        loss = sum_over_shards(outs[0], shards, core.output_dtype(info(student), info(teacher)))
        return (loss,) + tuple(outs[1:])

    # student, teacher, [labels] -> loss, [grad]
    rule = rows_rule((ROWS, ROWS, ROWS)[:2 + has_labels], (WHOLE, ROWS)[:1 + int(compute_grad)])
    return _mapped_over_batch(partitioned(forward, rule), 1 + int(compute_grad))


def _label_args(labels):
    return () if labels is None else (labels,)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _jsd(student, teacher, labels, beta, ignore_index):
    return _forward_op(beta, ignore_index, labels is not None, False)(student, teacher, *_label_args(labels))[0]


def _jsd_fwd(student, teacher, labels, beta, ignore_index):
    loss, grad = _forward_op(beta, ignore_index, labels is not None, True)(student, teacher, *_label_args(labels))
    return loss, grad


def _jsd_bwd(beta, ignore_index, grad, g):
    (dstudent,) = scale_grad_op("mean")(grad, g.astype(grad.dtype))
    return dstudent, None, None  # the teacher is a constant: zero cotangent


_jsd.defvjp(_jsd_fwd, _jsd_bwd)


def jsd(student_logprobs, teacher_logprobs, labels=None, *, beta: float = 0.5, ignore_index: int = -100):
    """Generalized Jensen-Shannon divergence between student and teacher log-probabilities (..., V).

    With P = teacher probabilities, Q = student probabilities and M = beta * P + (1 - beta) * Q, each row's
    loss is ``beta * KL(P||M) + (1 - beta) * KL(Q||M)`` for 0 < beta < 1, the forward KL ``KL(P||Q)`` for
    beta = 0 and the reverse KL ``KL(Q||P)`` for beta = 1 (TRL's GKD convention; see :mod:`liger_core.jsd`).
    The result is the mean over rows whose integer ``labels`` (...) are not ``ignore_index`` (all rows without
    labels); 0 with a zero gradient if every row is ignored. The loss has the promoted dtype of the two inputs.
    Only ``student_logprobs`` is differentiated: differentiating ``teacher_logprobs`` is a ValueError (wrap it
    in ``jax.lax.stop_gradient``). Works under ``jit``, ``grad`` and ``vmap``.
    """
    student = as_array("student_logprobs", student_logprobs)
    teacher = undifferentiated("jsd", "the student", "teacher_logprobs", as_array("teacher_logprobs", teacher_logprobs))
    labels = None if labels is None else as_array("labels", labels)
    core.check_options(beta=beta, ignore_index=ignore_index)
    core.check_inputs(info(student), info(teacher), None if labels is None else info(labels))
    return _jsd(student, teacher, labels, float(beta), int(ignore_index))

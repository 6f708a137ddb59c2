"""Fused linear JSD: the generalized JSD of :mod:`liger_core.jsd` between ``log_softmax(xs @ Ws^T / T)``
(student) and ``log_softmax(xt @ Wt^T / T)`` (teacher) without either full (N, V) logits tensor.

The frontends orchestrate, with their own matmuls (as for :mod:`liger_core.fused_linear_cross_entropy`), a
loop over chunks of tokens: for each chunk, both heads' logits (in the activations' dtypes), then the JSD
kernel on those logits: it forms the temperature-scaled log-softmax in fp32 in registers (a logsumexp sweep
first), sums the chunk's losses and writes d loss / d student logits (``(g - softmax * sum g) / T``) over the
student logits; then ``grad_xs[chunk] = dz @ Ws`` and ``grad_Ws += dz^T @ xs_chunk``. The mean's divisor
(non-ignored labels, or all rows) is that of the whole batch, counted first, so every chunk's gradient is
already the full loss's.
The teacher is a constant: neither its hidden states nor its head get a gradient.

The loss is not multiplied by ``T**2`` (the Hinton et al. convention); scale it yourself if you want it.

This module holds what is framework-free: validation, the chunk size and the plans of each step.
"""

from __future__ import annotations

import functools

from . import fused_linear_cross_entropy as flce
from . import jsd
from .launch import ITEMSIZE, ArrayInfo, Plan, as_real

# A chunk holds the two heads' (rows, V) logits; the student's in at most this many bytes (the fused linear
# cross-entropy's tuned workspace: 2048 rows of a 128256-token vocabulary in bf16), the teacher's alike in its
# dtype. Fewer rows cost more: each chunk's weight-gradient matmul has K = rows and adds into an fp32 V x H
# accumulator (H200, scripts/tune_flce.py: K=512 chunks 25.8 ms, K=2048 14.6 ms, one K=8192 matmul 13.2 ms).
WORKSPACE_BYTES = flce.DEFAULT_WORKSPACE_BYTES
LAYOUTS = flce.LAYOUTS
accumulate_in_fp32 = flce.accumulate_in_fp32


def chunk_rows(n_rows: int, vocab: int, dtype: str, chunk_size: int | None = None) -> int:
    """Rows per chunk: ``chunk_size`` if given, else as many as fit the student's (rows, V) logits in ``dtype``
    in :data:`WORKSPACE_BYTES` (the fused linear cross-entropy's chunk-size logic)."""
    return flce.chunk_rows(n_rows, vocab, dtype, chunk_size, workspace_bytes=WORKSPACE_BYTES)


def chunking(n_rows: int, vocab: int, hidden: int, student_dtype: str, teacher_dtype: str, weight_dtype: str,
             chunk_size: int | None, accum_fp32: bool) -> tuple[int, bool]:
    """``(rows per chunk, fp32 accumulator?)``: :func:`chunk_rows`, or one chunk when both heads' logits of all
    rows take no more than the student head's fp32 gradient accumulator that chunks would need (N <= H in bf16);
    see :func:`liger_core.fused_linear_cross_entropy.chunking`."""
    row_bytes = vocab * (ITEMSIZE[student_dtype] + ITEMSIZE[teacher_dtype])
    return flce.chunking(n_rows, vocab, hidden, student_dtype, weight_dtype, chunk_size, accum_fp32,
                         row_bytes=row_bytes, workspace_bytes=WORKSPACE_BYTES)


def check_options(*, beta, ignore_index, temperature) -> None:
    jsd.check_options(beta=beta, ignore_index=ignore_index)
    if not 0.0 < as_real(temperature, "temperature") < float("inf"):  # NaN fails too
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")


def check_inputs(student_x: ArrayInfo, student_w: ArrayInfo, teacher_x: ArrayInfo, teacher_w: ArrayInfo,
                 labels: ArrayInfo | None, *, layout: str = "vh", student_x_name: str = "student_input",
                 student_w_name: str = "student_weight", teacher_x_name: str = "teacher_input",
                 teacher_w_name: str = "teacher_weight", labels_name: str = "labels",
                 master_weight_ok: bool = False) -> int:
    """Validate shapes and dtypes; returns the vocabulary size V. ``layout`` is both heads': "vh" (torch's
    (V, H)) or "hv" (Flax kernel, (H, V)). Each head has its input's dtype; student and teacher may differ.
    ``master_weight_ok``: the student head may be an fp32 master weight of a bf16/fp16 student input."""
    # the fused linear cross-entropy's checks of one (x, weight) pair; a stand-in target when there are no labels
    rows_target = labels if labels is not None else ArrayInfo.contiguous(student_x.shape[:-1], "int64")
    vocab = flce.check_inputs(student_x, student_w, rows_target, None, None, layout=layout, x_name=student_x_name,
                              weight_name=student_w_name, target_name=labels_name,
                              master_weight_ok=master_weight_ok)
    if tuple(teacher_x.shape[:-1]) != tuple(student_x.shape[:-1]):
        raise ValueError(f"{teacher_x_name} must have {student_x_name}'s leading shape "
                         f"{tuple(student_x.shape[:-1])} (one teacher row per student row), got {teacher_x.shape}")
    teacher_vocab = flce.check_inputs(teacher_x, teacher_w, ArrayInfo.contiguous(teacher_x.shape[:-1], "int64"),
                                      None, None, layout=layout, x_name=teacher_x_name, weight_name=teacher_w_name)
    if teacher_vocab != vocab:
        raise ValueError(f"{teacher_w_name} must have the student's vocabulary size V={vocab} "
                         f"({student_w_name} {student_w.shape}), got {teacher_w.shape}")
    return vocab


@functools.lru_cache(maxsize=1024)  # plans are pure functions of hashable arguments
def count_plan(n_rows: int, labels_dtype: str, ignore_index: int) -> Plan:
    """``denom`` for the whole (flattened, contiguous) labels: input ``labels``."""
    return jsd.count_plan(n_rows, labels_dtype, ignore_index)


@functools.lru_cache(maxsize=1024)  # plans are pure functions of hashable arguments
def chunk_plan(rows: int, vocab: int, student_dtype: str, teacher_dtype: str, labels_dtype: str | None, *,
               beta: float, ignore_index: int, n_total_rows: int, temperature: float, compute_grad: bool) -> Plan:
    """The JSD step of one chunk of the two heads' contiguous (rows, V) logits; see
    :func:`liger_core.jsd.chunk_plan` (inputs ``student``, ``teacher``, [``labels``, ``denom``]; outputs fp32
    ``loss_rows`` and [``grad``: d loss / d student logits, written over them])."""
    return jsd.chunk_plan(rows, vocab, student_dtype, teacher_dtype, labels_dtype, beta=beta,
                          ignore_index=ignore_index, n_total_rows=n_total_rows, temperature=temperature,
                          compute_grad=compute_grad)


@functools.lru_cache(maxsize=1024)  # plans are pure functions of hashable arguments
def loss_plan(n_rows: int, dtype: str) -> Plan:
    """Sum of the fp32 per-row losses ``rows`` into ``total`` (shape (), ``dtype``), in a fixed order."""
    return jsd.loss_plan(n_rows, dtype)

"""Fused linear cross-entropy: ``CE(x @ W^T + b, target)`` without the full (N, V) logits.

The frontends orchestrate, with their own matmuls (cuBLAS through torch, XLA through jax), a loop over
chunks of tokens: for each chunk, ``logits = x_chunk @ W^T + b`` (a bounded workspace of
``chunk x V``), then the cross-entropy kernel of :mod:`liger_core.cross_entropy` on it, which writes
d loss / d logits over the chunk's logits, then ``grad_x[chunk] = dlogits @ W``,
``grad_W += dlogits^T @ x_chunk`` and ``grad_b += sum(dlogits)``. ``mean``'s divisors (the number, or class
weight, of non-ignored targets) are counted over the whole batch first, so every chunk's gradient is already
that of the full loss.

This module holds what is framework-free: validation, the chunking (a memory budget, independent of N
beyond the weight-sized fp32 accumulator it may replace: :func:`chunking`), and the plans each step launches.
"""

from __future__ import annotations

import functools

from . import cross_entropy as ce
from .launch import (
    ArrayInfo, ITEMSIZE, Plan, check_bool, check_float, check_nonempty, check_positive_int, next_power_of_2,
)

# Bytes of chunk logits (in the activations' dtype) the loop may hold at once without an fp32 accumulator (a
# forward alone, or bf16 accumulation): 512 MiB is 2048 rows of a 128256-token vocabulary in bf16. With one,
# :func:`chunking` lets a chunk grow to half its bytes, or all rows go as one chunk. Measured on an H200 at
# H=4096, V=128256 (scripts/tune_flce.py, docs/perf-log.md, 2026-12-04): N=8192 one chunk 35.2 ms against
# 40.0 in 2048-row chunks; N=16384 4096-row chunks 77.1 against 80.4; peak 3.07-3.13 GB in every case.
DEFAULT_WORKSPACE_BYTES = 512 * 2**20
# Chunks are rounded down to a multiple of this many rows (matmul tiles) when they hold more.
_ROW_QUANTUM = 64
LAYOUTS = ("vh", "hv")


def chunk_rows(n_rows: int, vocab: int, dtype: str, chunk_size: int | None = None,
               workspace_bytes: int = DEFAULT_WORKSPACE_BYTES) -> int:
    """Rows per chunk: ``chunk_size`` if given, else as many as fit ``workspace_bytes`` of chunk logits."""
    if chunk_size is not None:
        return max(1, min(check_positive_int(chunk_size, "chunk_size"), n_rows))
    rows = quantized_rows(int(workspace_bytes) // (vocab * ITEMSIZE[dtype]))
    return max(1, min(rows, n_rows))


def check_loop_options(*, return_z_loss: bool = False, chunk_size: int | None = None,
                       accum_dtype_fp32: bool | None = None) -> None:
    """The chunk loop's options, checked where a module takes them (the functions check them when called)."""
    check_bool(return_z_loss, "return_z_loss")
    if chunk_size is not None:
        check_positive_int(chunk_size, "chunk_size")
    if accum_dtype_fp32 is not None:
        check_bool(accum_dtype_fp32, "accum_dtype_fp32")


def quantized_rows(rows: int) -> int:
    """``rows`` rounded down to a multiple of the matmul tile's rows (to a power of two below one tile), >= 1."""
    rows = max(1, rows)
    if rows >= _ROW_QUANTUM:
        return rows - rows % _ROW_QUANTUM
    return next_power_of_2(rows + 1) // 2


def accumulate_in_fp32(weight_dtype: str, flag: bool | None) -> bool:
    """Whether grad_W is accumulated over chunks in fp32: ``flag``, by default on for bf16/fp16 weights."""
    if flag is None:
        return weight_dtype in ("bfloat16", "float16")
    return check_bool(flag, "accum_dtype_fp32")


def is_master_weight(weight_dtype: str, dtype: str) -> bool:
    """Whether a weight of ``weight_dtype`` is an fp32 master weight used in the matmuls of low-precision
    activations (``torch.autocast``; Flax's ``param_dtype=float32`` with ``dtype=bfloat16``). The loop then
    casts it once to the activations' dtype and accumulates its gradient in fp32 straight into a gradient of
    the weight's own dtype: no accumulator beside it, no low-precision gradient to cast back, one rounding."""
    return weight_dtype == "float32" and dtype in ("bfloat16", "float16")


def chunking(n_rows: int, vocab: int, hidden: int, dtype: str, weight_dtype: str, chunk_size: int | None,
             accum_fp32: bool, row_bytes: int | None = None,
             workspace_bytes: int = DEFAULT_WORKSPACE_BYTES) -> tuple[int, bool]:
    """``(rows per chunk, fp32 accumulator?)`` of a fused linear loss's loop. grad_W gets an fp32 accumulator
    beside it when fp32 accumulation is asked for a low-precision weight over more than one chunk: one chunk's
    grad_W is a single matmul over all rows, summed in fp32 inside it and rounded once (an fp32 master weight's
    gradient is its own fp32 accumulator: chunks of ``workspace_bytes`` then). Without ``chunk_size``
    all rows go as one chunk when their logits (``row_bytes`` a row: by default one (V,) row in ``dtype``) take
    no more than the fp32 accumulator that chunking would need (N <= 2H for bf16 cross-entropy logits): the peak
    is no higher (chunking ends its backward holding the accumulator and the gradient's rounded copy), and the
    accumulator's read-modify-write passes (~1 ms each at V x H = 128256 x 4096 on an H200) and its rounding pass
    are gone."""
    low_precision_fp32_acc = accum_fp32 and weight_dtype != "float32"
    accumulator = vocab * hidden * 4 if low_precision_fp32_acc else 0
    row_bytes = vocab * ITEMSIZE[dtype] if row_bytes is None else row_bytes
    if chunk_size is None and n_rows * row_bytes <= accumulator:
        rows = max(1, n_rows)
    else:
        rows = chunk_rows(n_rows, vocab, dtype, chunk_size, workspace_bytes)
        if chunk_size is None and accumulator:
            # chunks of up to half the accumulator's bytes: the forward then holds no more (accumulator + one
            # chunk) than the backward's end (accumulator + the gradient's rounded copy), and fewer, longer
            # chunks pass over the accumulator fewer times
            rows = min(n_rows, max(rows, quantized_rows(accumulator // 2 // row_bytes)))
    return rows, low_precision_fp32_acc and rows < n_rows


DTYPE_REMEDY = "cast them to one dtype"


def _check_dtype_of_x(a: ArrayInfo, name: str, x: ArrayInfo, x_name: str, remedy: str) -> None:
    # the logits matmul takes one dtype; both dtypes are named, since either side may be the one to change
    if a.dtype != x.dtype:
        raise TypeError(f"{name} must have {x_name}'s dtype {x.dtype}, got {a.dtype}; {remedy}")


def check_inputs(x: ArrayInfo, weight: ArrayInfo, target: ArrayInfo, bias: ArrayInfo | None,
                 ce_weight: ArrayInfo | None, *, layout: str = "vh", x_name: str = "x", weight_name: str = "weight",
                 target_name: str = "target", bias_name: str = "bias", dtype_remedy: str = DTYPE_REMEDY,
                 master_weight_ok: bool = False) -> int:
    """Validate shapes and dtypes; returns the vocabulary size V. ``layout`` is weight's: "vh" (torch's
    ``nn.Linear`` / ``nn.Embedding``, (V, H)) or "hv" (Flax ``nnx.Linear`` kernel, (H, V)). ``dtype_remedy``
    ends the message of a weight or bias whose dtype is not x's (a frontend names its own way out).
    ``master_weight_ok``: the weight may also be an fp32 master weight of a bf16/fp16 x
    (:func:`is_master_weight`)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    check_nonempty(x, x_name)
    check_float(x, x_name)
    check_float(weight, weight_name)
    hidden = x.shape[-1]
    expect = "(V, H)" if layout == "vh" else "(H, V)"
    if weight.ndim != 2 or weight.shape[1 if layout == "vh" else 0] != hidden:
        raise ValueError(f"{weight_name} must have shape {expect} with H={hidden} (x's last dimension), "
                         f"got {weight.shape}")
    vocab = weight.shape[0 if layout == "vh" else 1]
    check_nonempty(weight, weight_name)  # a vocabulary of 0 classes
    if not (master_weight_ok and is_master_weight(weight.dtype, x.dtype)):
        _check_dtype_of_x(weight, weight_name, x, x_name, dtype_remedy)
    if bias is not None:
        check_float(bias, bias_name)
        if tuple(bias.shape) != (vocab,):
            raise ValueError(f"{bias_name} must have shape ({vocab},), got {bias.shape}")
        _check_dtype_of_x(bias, bias_name, x, x_name, dtype_remedy)
    ce.check_target(target, x.shape[:-1], target_name)
    ce.check_class_weight(ce_weight, vocab, "ce_weight")
    return vocab


@functools.lru_cache(maxsize=1024)  # plans are pure functions of hashable arguments
def denominators_plan(n_rows: int, target_dtype: str, ce_weight: ArrayInfo | None, vocab: int,
                      ignore_index: int) -> Plan:
    """``denom`` for the whole (flattened, contiguous) target: input ``target`` (and ``weight``)."""
    return ce.denominators_plan(ArrayInfo.contiguous((n_rows,), target_dtype), ce_weight, vocab, ignore_index)


@functools.lru_cache(maxsize=1024)  # plans are pure functions of hashable arguments
def chunk_plan(rows: int, vocab: int, logits_dtype: str, target_dtype: str, ce_weight: ArrayInfo | None, *,
               ignore_index: int, reduction: str, label_smoothing: float, lse_square_scale: float,
               softcap: float | None, return_z_loss: bool, compute_grad: bool,
               grad_scale_dtype: str | None = None) -> Plan:
    """The cross-entropy step of one chunk of contiguous (rows, V) logits; see
    :func:`liger_core.cross_entropy.chunk_plan` (inputs ``logits``, ``target``, [``weight``], [``denom``],
    [``grad_scale``]; outputs fp32 ``loss_rows``, [``z_rows``], [``grad`` over the logits])."""
    grad_scale = None if grad_scale_dtype is None else ArrayInfo.contiguous((rows,), grad_scale_dtype)
    return ce.chunk_plan(
        ArrayInfo.contiguous((rows, vocab), logits_dtype), ArrayInfo.contiguous((rows,), target_dtype), ce_weight,
        ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
        lse_square_scale=lse_square_scale, softcap=softcap, return_z_loss=return_z_loss,
        compute_grad=compute_grad, grad_scale=grad_scale)


@functools.lru_cache(maxsize=1024)  # plans are pure functions of hashable arguments
def loss_plan(n_rows: int, dtype: str) -> Plan:
    """Sum of the fp32 per-row losses ``rows`` into ``total`` (shape (), ``dtype``), in a fixed order."""
    return ce.sum_rows_plan(n_rows, dtype)

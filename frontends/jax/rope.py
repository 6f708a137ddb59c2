"""RoPE for jax: ``custom_vjp`` wiring around :mod:`liger_core.rope`, q and k in one launch.

q (B, T, H_q, D) and k (B, T, H_kv, D), the layout Flax attention uses; the kernel reads it by strides (no
transpose). The backward is the same kernel running the transposed rotation; both write over their input
(``input_output_aliases``: XLA copies first when the input is still needed). Under ``jax.vmap`` the batch axis
is folded into the kernel's batch: one launch, no loop. Under ``jit`` with sharded inputs the batch, sequence and
head axes stay sharded (cos/sin follow the sequence, or stay whole as tables indexed by position_ids; the head
dimension is whole; :mod:`liger_jax._sharding`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from liger_core import rope as core
from liger_core.launch import check_bool

from ._launch import as_array, broadcast_unbatched, dtype_name, info, optional_info, run_plan, undifferentiated
from ._sharding import Rule, partitioned

_HEAD_AXIS = 2  # (B, T, H, D)


def _rule(operand_shapes, result_shapes) -> Rule:
    """q (b t hq d), k (b t hk d), cos/sin ([b] t d) or, with position ids ([b] t), tables ([b] s d). A table's
    batch axis of size 1 (broadcast), its positions s and the head dimension d are whole."""
    q, cos = operand_shapes[0], operand_shapes[2]
    has_pos = len(operand_shapes) == 5
    d = f"w_{q[-1]}"

    def batch(shape, base_ndim):
        if len(shape) == base_ndim:
            return ()
        return ("b",) if shape[0] == q[0] else (f"w1_{shape[0]}",)

    table = batch(cos, 2) + ((f"s_{cos[-2]}",) if has_pos else ("t",)) + (f"e_{q[-1]}",)  # e: no tie to q's d
    operands = [("b", "t", "hq", d), ("b", "t", "hk", d), table, table]
    if has_pos:
        operands.append(batch(operand_shapes[4], 1) + ("t",))
    return Rule(tuple(operands), (operands[0], operands[1]), frozenset({"b", "t", "hq", "hk"}))


def _fold_table(x, batched: bool, axis_size: int, batch: int, base_ndim: int):
    """cos/sin ((T, D) or (1 or B, T, D)) or position ids ((T,) or (1 or B, T)) for q/k whose vmap axis was
    folded into their batch: (N, B, ...) -> (N * B, ...). Tables shared by the whole batch stay as they are."""
    if not batched:
        if x.ndim == base_ndim or x.shape[0] == 1:
            return x  # broadcast over every row of the folded batch by a zero stride
        x = jnp.broadcast_to(x, (axis_size,) + x.shape)
    elif x.ndim == base_ndim + 1:
        x = x[:, None]
    x = jnp.broadcast_to(x, (axis_size, batch) + x.shape[2:])
    return x.reshape((axis_size * batch,) + x.shape[2:])


@functools.lru_cache(maxsize=None)
def _rope_op(interleaved: bool, backward: bool, has_pos: bool, q_dtype: str, k_dtype: str):
    def run(q, k, cos, sin, *pos, shards=None):
        position_ids = pos[0] if has_pos else None
        if backward:
            plan = core.backward_plan(info(q), info(k), info(cos), info(sin), optional_info(position_ids),
                                      head_axis=_HEAD_AXIS, q_dtype=q_dtype, k_dtype=k_dtype,
                                      interleaved=interleaved, in_place=True)
        else:
            plan = core.forward_plan(info(q), info(k), info(cos), info(sin), optional_info(position_ids),
                                     head_axis=_HEAD_AXIS, interleaved=interleaved, in_place=True)
        return run_plan(plan, q=q, k=k, cos=cos, sin=sin, position_ids=position_ids)

    op = jax.custom_batching.custom_vmap(partitioned(run, _rule))

    @op.def_vmap
    def _fold_batch(axis_size, in_batched, q, k, cos, sin, *pos):
        q, k = broadcast_unbatched(axis_size, in_batched[:2], (q, k))
        batch = q.shape[1]
        tables = [_fold_table(x, b, axis_size, batch, base)
                  for x, b, base in zip((cos, sin, *pos), in_batched[2:], (2, 2, 1))]
        outs = op(q.reshape((-1,) + q.shape[2:]), k.reshape((-1,) + k.shape[2:]), *tables)
        return tuple(o.reshape((axis_size, batch) + o.shape[1:]) for o in outs), (True, True)

    return op


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _rope(q, k, cos, sin, position_ids, interleaved, dtypes):
    pos = () if position_ids is None else (position_ids,)
    return _rope_op(interleaved, False, position_ids is not None, *dtypes)(q, k, cos, sin, *pos)


def _rope_fwd(q, k, cos, sin, position_ids, interleaved, dtypes):
    pos = () if position_ids is None else (position_ids,)
    out = _rope_op(interleaved, False, position_ids is not None, *dtypes)(q, k, cos, sin, *pos)
    return out, (cos, sin, position_ids)


def _rope_bwd(interleaved, dtypes, residuals, cts):
    cos, sin, position_ids = residuals
    dq, dk = cts
    pos = () if position_ids is None else (position_ids,)
    dq, dk = _rope_op(interleaved, True, position_ids is not None, *dtypes)(dq, dk, cos, sin, *pos)
    return dq, dk, None, None, None


_rope.defvjp(_rope_fwd, _rope_bwd)


def _check_positions(position_ids, n_rows: int) -> None:
    """ValueError for a concrete position outside cos/sin's rows. Under ``jit`` (traced ids) nothing can be
    checked eagerly."""
    if position_ids is None or isinstance(position_ids, jax.core.Tracer):
        return
    values = np.asarray(position_ids)
    if not ((values >= 0) & (values < n_rows)).all():
        raise ValueError(core.invalid_positions_message(n_rows))


def rope(q, k, cos, sin, *, position_ids=None, interleaved: bool = False):
    """Rotary position embedding of q (B, T, H_q, D) and k (B, T, H_kv, D); returns ``(q_embed, k_embed)``.

    cos/sin have shape (T, D) or (1 or B, T, D); with ``position_ids`` ((T,) or (1 or B, T), integer) token
    (b, t) uses row ``position_ids[b, t]`` of cos/sin. ``q * cos + rotate_half(q) * sin`` (HF convention), or
    with ``interleaved`` the GPT-J pairs (2j, 2j+1). Output dtype: q's (k's) promoted with cos's. No gradient
    flows to cos/sin (an error says so if one is asked for). Position ids outside cos/sin's rows raise
    ValueError when concrete. Works under ``jit``, ``grad``, ``vmap`` and ``checkpoint``."""
    q, k, cos, sin = (as_array(n, x) for n, x in (("q", q), ("k", k), ("cos", cos), ("sin", sin)))
    # HF's rotary embedding computes cos/sin without gradient: asking for one is an error, not a zero
    cos, sin = (undifferentiated("rope", "q and k", n, t) for n, t in (("cos", cos), ("sin", sin)))
    position_ids = None if position_ids is None else as_array("position_ids", position_ids)
    # Validate here, outside any trace, so bad input fails with the argument's name before any launch.
    core.forward_plan(info(q), info(k), info(cos), info(sin), optional_info(position_ids), head_axis=_HEAD_AXIS,
                      interleaved=interleaved)
    _check_positions(position_ids, core.n_positions(info(cos)))
    return _rope(q, k, cos, sin, position_ids, check_bool(interleaved, "interleaved"),
                 (dtype_name(q.dtype), dtype_name(k.dtype)))

"""SPMD partitioning of the kernel ops: under ``jax.jit`` with sharded inputs each op runs shard by shard.

A kernel call is opaque to XLA (a custom call, or a host callback on the CPU), so without a rule the SPMD
partitioner gathers every operand onto each device (or onto one). Each op here is a
``jax.experimental.custom_partitioning`` function with a :class:`Rule`: a factor name for every axis of every
operand and result, as in an einsum. *Row* factors (the leading axes of a row-wise kernel: tokens, batch,
heads) may stay sharded, so a batch-sharded ``x`` is never gathered; every other factor (the normalised
feature, the vocabulary, a weight's axes) is replicated, so an FSDP-sharded weight is gathered before the call,
which is what FSDP does. Results flagged as *sums* (weight gradients) are computed per shard and ``psum``-ed
over the mesh axes of the row factors they lack (in fp32 for 16-bit results). A body that needs a global
quantity gets a :class:`Shards` and reduces it itself: the non-ignored count a ``mean`` divides by, before its
kernels run; a scalar loss, from the shards' fp32 partial sums (rounded to the loss dtype once, after the sum).

The same rule serves both partitioners: Shardy (jax's default) through ``sharding_rule``, GSPMD through
``infer_sharding_from_operands``; ``partition`` decides the shardings in both. The op bodies call
``run_plan`` as everywhere; inside a shard they are traced under :func:`liger_jax._launch.partition_body`.
With explicit sharding (mesh axes of ``AxisType.Explicit``, the default of ``jax.make_mesh``) the shardings
are known from the types while tracing, and the same rule is applied through ``shard_map`` instead.
Under ``jax.vmap`` these ops are never batched directly: each family's ``custom_vmap`` rule calls them on
folded arrays (custom_partitioning has no batching rule).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import ArrayMapping, SdyShardingRule, custom_partitioning
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from ._launch import partition_body

ROWS = "rows"  # kind: the op's row axes, then axes that stay whole (replicated)
WHOLE = "whole"  # kind: every axis replicated (weights, tables, scalars)


@dataclass(frozen=True)
class Rule:
    """Factor names per axis of each operand and result; ``rows``: the factors that may stay sharded;
    ``sums``: indices of results that are partial sums over the row factors they lack."""

    operands: tuple[tuple[str, ...], ...]
    results: tuple[tuple[str, ...], ...]
    rows: frozenset
    sums: frozenset = frozenset()


@dataclass(frozen=True)
class Shards:
    """What an op body sees of the partition inside one shard: the mesh axes its rows are split across and
    the operands' global shapes."""

    axes: tuple[str, ...]
    global_shapes: tuple[tuple[int, ...], ...]

    def sum(self, x):
        """The sum of ``x`` over the shards of the rows (fp32 for 16-bit values, then back)."""
        if jnp.dtype(x.dtype).itemsize < 4 and jnp.issubdtype(x.dtype, jnp.floating):
            return jax.lax.psum(x.astype(jnp.float32), self.axes).astype(x.dtype)
        return jax.lax.psum(x, self.axes)


def _trailing(shape) -> tuple[str, ...]:
    """Names of the whole trailing axes of row-wise arrays, by position from the end and size (equal names,
    equal sizes): the feature axis of x and of y is one factor."""
    return tuple(f"w{len(shape) - i}_{d}" for i, d in enumerate(shape))


def _own(tag: str, shape) -> tuple[str, ...]:
    """Factors of one whole array (a weight, a scalar) shared with no other array: the partitioner must not
    carry a weight's FSDP sharding over to the activations' feature axis, or back."""
    return tuple(f"{tag}_{i}" for i in range(len(shape)))


def rows_rule(operand_kinds: Sequence[str], result_kinds: Sequence[str], *, n_rows: Callable | None = None,
              sums: Sequence[int] = (), group_axes: int = 0):
    """A rule for a row-wise kernel: ``n_rows(operand_shapes)`` leading axes (default: all but the last of the
    first operand) are row factors ``r0, r1, ...`` shared by every ``ROWS`` operand and result; ``WHOLE``
    arrays (each with factors of its own) and the trailing axes are replicated. A ``sums`` result of kind
    ``ROWS`` keeps only the first ``group_axes`` row factors (per-example weight gradients of a folded vmap
    batch)."""

    def rule(operand_shapes, result_shapes) -> Rule:
        n = len(operand_shapes[0]) - 1 if n_rows is None else n_rows(operand_shapes)
        rows = tuple(f"r{i}" for i in range(n))

        def factors(kind, shape, tag, is_sum=False):
            if kind == WHOLE:
                return _own(tag, shape)
            if is_sum:  # a weight-shaped gradient: tied to the rows it keeps, not to the activations' features
                return rows[:group_axes] + _own(tag, shape[group_axes:])
            return rows[:n] + _trailing(shape[n:])

        operands = tuple(factors(k, s, f"in{i}") for i, (k, s) in enumerate(zip(operand_kinds, operand_shapes)))
        results = tuple(factors(k, s, f"out{i}", i in sums)
                        for i, (k, s) in enumerate(zip(result_kinds, result_shapes)))
        return Rule(operands, results, frozenset(rows), frozenset(sums))

    return rule


# ---------------------------------------------------------------------------------------------------------
# The partitioning callbacks


def _spec(sharding, ndim: int) -> tuple[tuple[str, ...], ...]:
    """Mesh axes per array axis (empty: not sharded); an unknown kind of sharding counts as replicated."""
    entries = list(sharding.spec) if isinstance(sharding, NamedSharding) else []
    entries += [None] * (ndim - len(entries))
    out = []
    for entry in entries[:ndim]:
        if entry is None or entry is PartitionSpec.UNCONSTRAINED:
            out.append(())
        else:
            out.append(tuple(entry) if isinstance(entry, (tuple, list)) else (entry,))
    return tuple(out)


def _assign(rule: Rule, mesh, shardings, shapes) -> dict:
    """Row factor -> mesh axes, from the first operand sharded along it. Factors of one array never share a
    mesh axis, and a factor stays whole unless its size divides evenly (padding rows would enter the sums)."""
    arrays = rule.operands + rule.results
    axes_of = {}
    for factors, sharding, shape in zip(rule.operands, shardings, shapes):
        for factor, entry, size in zip(factors, _spec(sharding, len(shape)), shape):
            if factor not in rule.rows or factor in axes_of:
                continue
            taken = {a for m in arrays if factor in m for f in m if f in axes_of for a in axes_of[f]}
            entry = tuple(a for a in entry if a not in taken)
            while entry and size % math.prod(mesh.shape[a] for a in entry):
                entry = entry[:-1]
            if entry:
                axes_of[factor] = entry
    return axes_of


def _sharding(mesh, factors, axes_of) -> NamedSharding:
    spec = [axes_of.get(f) for f in factors]
    spec = [None if not e else (e[0] if len(e) == 1 else e) for e in spec]
    return NamedSharding(mesh, PartitionSpec(*spec))


def _usable_mesh(mesh, shardings):
    """The mesh to build shardings on: the op's, else one over the devices of a sharding XLA proposed."""
    if not mesh.empty:
        return mesh
    devices = getattr(shardings[0], "_device_assignment", None) or sorted(shardings[0].device_set, key=id)
    return Mesh(np.array(devices), ("_liger_replicated",))


def _shapes(tree) -> list:
    return list(jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct)))


def _shard_body(body, r: Rule, axes_of: dict, global_shapes):
    """The per-shard function: the body on local blocks, its ``sums`` results reduced over the shards."""
    shards = None
    if axes_of:
        shards = Shards(tuple(a for f in sorted(axes_of) for a in axes_of[f]), tuple(map(tuple, global_shapes)))
    reduce_over = [tuple(a for f in sorted(axes_of) if f not in r.results[i] for a in axes_of[f])
                   if i in r.sums else () for i in range(len(r.results))]

    def local(*arrays):
        outs = tuple(body(*arrays, shards=shards))
        return tuple(Shards(axes, ()).sum(o) if axes else o for o, axes in zip(outs, reduce_over))

    return local


def _explicit_mesh(arrays):
    """The mesh of the arguments' types when all its axes are Explicit (sharding in types), else None."""
    for a in arrays:
        mesh = jax.typeof(a).sharding.mesh
        if not mesh.empty:
            return mesh if all(t == AxisType.Explicit for t in mesh.axis_types) else None
    return None


def _shard_mapped(body, rule, mesh, arrays):
    """Explicit sharding: the shardings are in the types at trace time, so the rule applies directly, through
    ``shard_map`` (custom_partitioning would trace the body on sharded global types, where e.g. a scan over
    sharded rows is refused). Operands are first resharded to what the rule keeps (weights made whole)."""
    unsharded = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
    results = jax.eval_shape(lambda *a: tuple(body(*a, shards=None)), *unsharded)
    shapes = [tuple(a.shape) for a in arrays]
    r = rule(shapes, [tuple(o.shape) for o in results])
    types = [jax.typeof(a).sharding for a in arrays]
    axes_of = _assign(r, mesh, types, shapes)
    in_specs = [_sharding(mesh, f, axes_of) for f in r.operands]
    arrays = [a if _spec(t, a.ndim) == _spec(want, a.ndim) else jax.sharding.reshard(a, want)
              for a, t, want in zip(arrays, types, in_specs)]
    out_specs = tuple(_sharding(mesh, f, axes_of).spec for f in r.results)
    local = _shard_body(body, r, axes_of, shapes)
    return jax.shard_map(local, mesh=mesh, in_specs=tuple(w.spec for w in in_specs), out_specs=out_specs,
                         check_vma=False)(*arrays)


def like(grads, primals):
    """Gradients typed as their primals under explicit sharding (a custom_vjp must return cotangents of the
    primals' types: an FSDP weight's gradient is resharded like the weight). A no-op otherwise."""
    def one(g, p):
        if g is None or p is None or _explicit_mesh([p]) is None:
            return g
        want = jax.typeof(p).sharding
        return g if _spec(jax.typeof(g).sharding, g.ndim) == _spec(want, g.ndim) else jax.sharding.reshard(g, want)

    return tuple(one(g, p) for g, p in zip(grads, primals))


def partitioned(body: Callable, rule: Callable) -> Callable:
    """``body(*arrays, shards=None) -> tuple of arrays``, partitioned by ``rule(operand_shapes, result_shapes)``.

    Outside a partition (one device, or inside a ``shard_map``) the body runs as is with ``shards=None``.
    In a shard it runs on the local blocks; when some row factor is sharded it gets a :class:`Shards`, and its
    ``sums`` results are reduced over the shards. Arguments typed with an explicit sharding go through
    ``shard_map`` with the same rule instead."""

    op = custom_partitioning(lambda *arrays: tuple(body(*arrays, shards=None)))

    def resolve(mesh, arg_shapes, result_shape):
        arg_shapes, result_shapes = _shapes(arg_shapes), _shapes(result_shape)
        r = rule([tuple(a.shape) for a in arg_shapes], [tuple(o.shape) for o in result_shapes])
        shardings = [a.sharding for a in arg_shapes]
        mesh = _usable_mesh(mesh, shardings)
        axes_of = _assign(r, mesh, shardings, [a.shape for a in arg_shapes])
        return r, mesh, axes_of, arg_shapes

    def infer_sharding_from_operands(mesh, arg_shapes, result_shape):
        r, mesh, axes_of, _ = resolve(mesh, arg_shapes, result_shape)
        return tuple(_sharding(mesh, f, axes_of) for f in r.results)

    def partition(mesh, arg_shapes, result_shape):
        r, mesh, axes_of, arg_shapes = resolve(mesh, arg_shapes, result_shape)
        local = _shard_body(body, r, axes_of, [a.shape for a in arg_shapes])

        def lower(*arrays):
            with partition_body():
                return local(*arrays)

        return (mesh, lower, tuple(_sharding(mesh, f, axes_of) for f in r.results),
                tuple(_sharding(mesh, f, axes_of) for f in r.operands))

    def sharding_rule(mesh, operand_types, result_types):
        shape = lambda t: tuple(t.shape)  # noqa: E731  (MLIR ranked tensor types)
        r = rule([shape(t) for t in operand_types], [shape(t) for t in result_types])
        # special factors in the order Shardy numbers factors: by first appearance
        whole = tuple(dict.fromkeys(f for m in r.operands + r.results for f in m if f not in r.rows))
        return SdyShardingRule(tuple(ArrayMapping(*m) for m in r.operands),
                               tuple(ArrayMapping(*m) for m in r.results), need_replication_factors=whole)

    op.def_partition(partition, infer_sharding_from_operands=infer_sharding_from_operands,
                     sharding_rule=sharding_rule)

    @jax.custom_jvp
    def call(*arrays):
        mesh = _explicit_mesh(arrays)
        return op(*arrays) if mesh is None else _shard_mapped(body, rule, mesh, arrays)

    call.defjvp(_refuse_jvp)
    return call


def _refuse_jvp(primals, tangents):
    """A kernel's JVP is asked for only past first order: the ops' custom_vjp rules give gradients without
    differentiating the kernels, so this is a gradient of a gradient (jax.hessian, grad of grad), whose error
    would otherwise name an internal primitive (custom_partitioning)."""
    raise NotImplementedError(
        "liger_jax kernels are differentiable once (grad, vjp, value_and_grad, jacrev): derivatives of higher order "
        "(grad of grad, jax.hessian, jacfwd of a gradient) are not supported; use the jnp reference formulas there")


def group_axes(shape, groups: int) -> int:
    """How many leading axes of ``shape`` a folded vmap batch of ``groups`` examples spans (their product)."""
    k, size = 0, 1
    while size != groups:
        if k >= len(shape) - 1:
            raise AssertionError(f"groups={groups} is no product of leading axes of {shape}")
        size *= shape[k]
        k += 1
    return k

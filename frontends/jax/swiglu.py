"""SwiGLU / GeGLU for jax: ``custom_vjp`` wiring around :mod:`liger_core.swiglu`.

The backward recomputes the activation and writes da over a and db over b (``input_output_aliases``; XLA
copies first when a or b is still needed elsewhere, so this is always safe). Elementwise, so ``jax.vmap``
folds trivially: the batched arrays are the kernel's rows; and under ``jit`` every axis may stay sharded (the
intermediate axis too, as tensor parallelism shards it; :mod:`liger_jax._sharding`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from liger_core import swiglu as core

from ._launch import as_array, broadcast_unbatched, info, run_plan
from ._sharding import ROWS, like, partitioned, rows_rule

# Elementwise: every axis is a row axis.
_ELEMENTWISE = dict(n_rows=lambda shapes: len(shapes[0]))


@functools.lru_cache(maxsize=None)
def _forward_op(activation: str):
    def forward(a, b, shards=None):
        return run_plan(core.forward_plan(info(a), info(b), activation=activation), a=a, b=b)

    kernel = partitioned(forward, rows_rule((ROWS, ROWS), (ROWS,), **_ELEMENTWISE))
    op = jax.custom_batching.custom_vmap(lambda a, b: kernel(a, b)[0])

    @op.def_vmap
    def _fold_batch(axis_size, in_batched, a, b):
        return op(*broadcast_unbatched(axis_size, in_batched, (a, b))), True

    return op


@functools.lru_cache(maxsize=None)
def _backward_op(activation: str):
    def backward(dc, a, b, shards=None):
        plan = core.backward_plan(info(dc), info(a), info(b), activation=activation, in_place=True)
        return run_plan(plan, dc=dc, a=a, b=b)

    op = jax.custom_batching.custom_vmap(partitioned(backward, rows_rule((ROWS,) * 3, (ROWS, ROWS), **_ELEMENTWISE)))

    @op.def_vmap
    def _fold_batch(axis_size, in_batched, dc, a, b):
        return op(*broadcast_unbatched(axis_size, in_batched, (dc, a, b))), (True, True)

    return op


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _gated(a, b, activation):
    return _forward_op(activation)(a, b)


def _gated_fwd(a, b, activation):
    return _forward_op(activation)(a, b), (a, b)


def _gated_bwd(activation, residuals, dc):
    a, b = residuals
    return like(tuple(_backward_op(activation)(dc, a, b)), (a, b))


_gated.defvjp(_gated_fwd, _gated_bwd)


def _call(a, b, activation):
    a, b = as_array("a", a), as_array("b", b)
    core.forward_plan(info(a), info(b), activation=activation)  # validate before any trace or launch
    return _gated(a, b, activation)


def swiglu(a, b):
    """``silu(a) * b``; differentiable, works under ``jit``, ``grad``, ``vmap`` and ``checkpoint``."""
    return _call(a, b, "silu")


def geglu(a, b, *, approximate: str = "tanh"):
    """``gelu(a) * b`` with ``approximate="tanh"`` (``jax.nn.gelu``'s default, HF ``gelu_pytorch_tanh``) or
    ``"none"`` (exact erf, ``jax.nn.gelu(approximate=False)``)."""
    return _call(a, b, core.gelu_activation(approximate))


def _gated_linear(a, b, kernel, bias, gate, activation):
    a, b, kernel = as_array("a", a), as_array("b", b), as_array("kernel", kernel)
    bias = None if bias is None else as_array("bias", bias)
    core.check_inputs(info(a), info(b), activation)  # a and b first, then the projection
    core.check_linear(info(a), info(kernel), None if bias is None else info(bias), layout="io", weight_name="kernel")

    def f(a, b, kernel, bias):
        y = jnp.matmul(gate(a, b), kernel)
        return y if bias is None else y + bias

    # Rematerialised: the backward recomputes the product from a and b (the saved residuals) for the kernel's
    # gradient instead of keeping it; the matmul's output is not needed there, so XLA does not recompute it.
    return jax.checkpoint(f)(a, b, kernel, bias)


def swiglu_linear(a, b, kernel, bias=None):
    """``silu(a) * b @ kernel + bias`` with ``kernel`` in Flax's (I, O) layout, keeping a and b for the backward
    but not their product (recomputed there): one (..., I) activation less per MLP than
    ``swiglu(a, b) @ kernel``."""
    return _gated_linear(a, b, kernel, bias, swiglu, "silu")


def geglu_linear(a, b, kernel, bias=None, *, approximate: str = "tanh"):
    """:func:`swiglu_linear` with ``gelu(a) * b`` (``approximate`` as for :func:`geglu`)."""
    return _gated_linear(a, b, kernel, bias, functools.partial(geglu, approximate=approximate),
                         core.gelu_activation(approximate))

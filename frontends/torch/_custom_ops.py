"""torch.compile support: each family's forward and backward registered as ``torch.library`` custom ops.

Eager calls keep going through the families' ``torch.autograd.Function`` s: a custom op costs about 20 us more
host time per call with autograd on (measured on the CPU with a trivial body: 10 us for the Function, 32 us for
the op), and the small-size ops are bound by host overhead. Under ``torch.compile`` the functional API (which the
modules call) sees ``compiling()`` and calls ``torch.ops.liger.<family>_forward`` instead, whose registered
autograd calls ``torch.ops.liger.<family>_backward``. Both paths run the same forward/backward helpers of the
family's file, so each op's logic exists once; the op files only add a schema, a fake implementation (output
shapes and dtypes, for tracing) and the autograd wiring.

Under compile no op writes over its inputs (the eager ``in_place`` options are ignored there): a custom op may
not return an alias of an input, and declaring the input in ``mutates_args`` instead makes functionalization
clone it first (``auto_functionalized``), which allocates the very buffer the in-place write would save.
"""

from __future__ import annotations

import torch

from ._launch import _TORCH_DTYPES


def compiling() -> bool:
    """True while torch.compile traces the caller (a constant to dynamo; about 0.1 us in eager)."""
    return torch.compiler.is_compiling()


def define(name: str, schema: str, impl, fake, *, setup_context=None, backward=None):
    """The custom op ``liger::<name>`` with ``schema`` (``"(Tensor x, float eps) -> Tensor"``): ``impl`` runs the
    kernels, ``fake`` returns empty outputs of the right shapes and dtypes; ``backward`` / ``setup_context``
    as for ``torch.library.register_autograd``. Nothing is mutated (see the module docstring)."""
    op = torch.library.custom_op(f"liger::{name}", impl, mutates_args=(), schema=schema)
    op.register_fake(fake)
    if backward is not None:
        op.register_autograd(backward, setup_context=setup_context)
    return op


def empty_like(t: torch.Tensor, dtype: str | torch.dtype | None = None, shape=None, strides=None) -> torch.Tensor:
    """A fresh tensor with t's shape (or ``shape``) and dtype (or ``dtype``, a torch dtype or a liger_core dtype
    name), contiguous or laid out by ``strides``: what the executor allocates for a plan's fresh output."""
    if isinstance(dtype, str):
        dtype = _TORCH_DTYPES[dtype]
    shape = t.shape if shape is None else shape
    if strides is not None:
        return t.new_empty_strided(shape, strides, dtype=dtype or t.dtype)
    return t.new_empty(shape, dtype=dtype or t.dtype)


def absent(like: torch.Tensor) -> torch.Tensor:
    """What an op returns for an output that does not exist (a gradient of a None input): custom ops return
    tensors, so an empty one. The autograd wiring turns it back into None."""
    return like.new_empty(0)

"""``liger_jax.nnx.SwiGLUMLP`` / ``GeGLUMLP``: gated MLPs (LLaMA's, Gemma's) on the gated-activation kernel."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import initializers
from flax.nnx.nn.linear import default_kernel_init

from ..swiglu import geglu, swiglu


def gated_down(down_proj: nnx.Linear, gate, a, b):
    """``down_proj(gate(a, b))``, rematerialised: the backward recomputes ``gate(a, b)`` from a and b for the
    down projection's kernel gradient instead of keeping that (..., I) activation (as
    :func:`liger_jax.swiglu_linear`, with the module's own dtype handling)."""
    return nnx.remat(lambda down, a, b: down(gate(a, b)))(down_proj, a, b)


class _GatedMLP(nnx.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, *, use_bias: bool = False, dtype=None,
                 param_dtype=jnp.float32, kernel_init=default_kernel_init, bias_init=initializers.zeros_init(),
                 rngs: nnx.Rngs):
        kw = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init,
                  bias_init=bias_init, rngs=rngs)
        self.gate_proj = nnx.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nnx.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nnx.Linear(intermediate_size, hidden_size, **kw)
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size

    def _gate(self, a, b):
        raise NotImplementedError

    def __call__(self, x):
        return gated_down(self.down_proj, self._gate, self.gate_proj(x), self.up_proj(x))


class SwiGLUMLP(_GatedMLP):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` with ``nnx.Linear`` submodules named as in HF's
    ``LlamaMLP`` (``gate_proj``, ``up_proj``, ``down_proj``); the Linear options apply to all three."""

    def _gate(self, a, b):
        return swiglu(a, b)


class GeGLUMLP(_GatedMLP):
    """``down_proj(gelu(gate_proj(x)) * up_proj(x))`` (Gemma's MLP); ``approximate`` is ``"tanh"`` (Gemma's
    ``gelu_pytorch_tanh``) or ``"none"`` (exact erf)."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, approximate: str = "tanh", **kwargs):
        if approximate not in ("tanh", "none"):
            raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
        super().__init__(hidden_size, intermediate_size, **kwargs)
        self.approximate = approximate

    def _gate(self, a, b):
        return geglu(a, b, approximate=self.approximate)

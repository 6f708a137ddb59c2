"""liger_jax: the JAX frontend of the kernel library (custom_vjp functions; Flax NNX modules in liger_jax.nnx).

On an NVIDIA GPU the kernels launch through ``jax_triton.triton_call``; without one they run in Triton's
interpreter behind ``jax.pure_callback`` (needs torch, CPU build). Under ``jax.jit`` with sharded inputs each
kernel runs shard by shard: rows stay sharded, weights are gathered, weight gradients and losses are summed
over the shards (``liger_jax._sharding``).
"""

import liger_core

from .rms_norm import rms_norm
from .cross_entropy import cross_entropy
from .kl_div import kl_div
from .jsd import jsd
from .fused_linear_jsd import fused_linear_jsd
from .fused_linear_cross_entropy import fused_linear_cross_entropy
from .layer_norm import layer_norm
from .fused_add_rms_norm import fused_add_rms_norm
from .rope import rope
from .swiglu import geglu, geglu_linear, swiglu, swiglu_linear

INTERPRET = liger_core.INTERPRET


def __getattr__(name):
    if name == "nnx":  # flax is only needed for the modules
        import importlib

        return importlib.import_module(".nnx", __name__)
    raise AttributeError(name)


__all__ = ["INTERPRET", "rms_norm", "nnx", "cross_entropy", "fused_linear_cross_entropy", "kl_div", "jsd", "fused_linear_jsd", "layer_norm", "fused_add_rms_norm", "rope", "swiglu", "geglu", "swiglu_linear", "geglu_linear"]
__version__ = liger_core.__version__

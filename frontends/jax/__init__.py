"""liger_jax: the JAX frontend of the kernel library (custom_vjp functions; Flax NNX modules in liger_jax.nnx).

On an NVIDIA GPU the kernels launch through ``jax_triton.triton_call``; without one they run in Triton's
interpreter behind ``jax.pure_callback`` (needs torch, CPU build).
"""

import liger_core

from .rms_norm import rms_norm

INTERPRET = liger_core.INTERPRET


def __getattr__(name):
    if name == "nnx":  # flax is only needed for the modules
        import importlib

        return importlib.import_module(".nnx", __name__)
    raise AttributeError(name)


__all__ = ["INTERPRET", "rms_norm", "nnx"]
__version__ = liger_core.__version__

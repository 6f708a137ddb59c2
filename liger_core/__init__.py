"""Framework-agnostic Triton kernels and their launch logic (no torch or jax imports here).

Importing this package decides, once, whether kernels are compiled for the GPU or run in Triton's
interpreter (see :mod:`liger_core.runtime`); that must happen before any ``@triton.jit`` is decorated, so the
kernel modules are imported after it.
"""

from . import runtime

INTERPRET = runtime.configure()

from . import cross_entropy, fused_add_rms_norm, fused_linear_cross_entropy, kl_div, launch, layer_norm, reduce, rms_norm, rope, swiglu  # noqa: E402  (after the interpreter decision)
from . import fused_linear_jsd, jsd  # noqa: E402
from .launch import ArrayInfo, Buf, Launch, NewBuffer, Plan  # noqa: E402

# Programs per "multiprocessor" when kernels run in the interpreter: fixed, so that the torch and the jax
# frontends pick identical grids (and so bitwise identical reductions) on the CPU.
INTERPRETER_NUM_SMS = 4

__all__ = ["INTERPRET", "INTERPRETER_NUM_SMS", "ArrayInfo", "Buf", "Launch", "NewBuffer", "Plan",
           "launch", "reduce", "rms_norm", "runtime", "layer_norm", "fused_add_rms_norm"]
__version__ = "0.1.0"

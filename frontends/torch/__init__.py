"""liger_torch: the PyTorch frontend of the kernel library (autograd functions, modules, functional API)."""

import liger_core

from .rms_norm import LigerRMSNormFunction, RMSNorm, rms_norm

INTERPRET = liger_core.INTERPRET

__all__ = ["INTERPRET", "LigerRMSNormFunction", "RMSNorm", "rms_norm"]
__version__ = liger_core.__version__

"""liger_torch: the PyTorch frontend of the kernel library (autograd functions, modules, functional API)."""

import liger_core

from .rms_norm import LigerRMSNormFunction, RMSNorm, rms_norm
from .cross_entropy import CrossEntropyLoss, LigerCrossEntropyFunction, cross_entropy
from .kl_div import KLDivLoss, LigerKLDivFunction, kl_div
from .fused_linear_cross_entropy import (FusedLinearCrossEntropyLoss, LigerFusedLinearCrossEntropyFunction,
                                         fused_linear_cross_entropy)
from .layer_norm import LayerNorm, LigerLayerNormFunction, layer_norm
from .fused_add_rms_norm import FusedAddRMSNorm, LigerFusedAddRMSNormFunction, fused_add_rms_norm
from .rope import LigerRopeFunction, rope
from .swiglu import GeGLUMLP, LigerGatedActivationFunction, SwiGLUMLP, geglu, swiglu

INTERPRET = liger_core.INTERPRET

__all__ = ["INTERPRET", "LigerRMSNormFunction", "RMSNorm", "rms_norm",
           "CrossEntropyLoss", "LigerCrossEntropyFunction", "cross_entropy",
           "KLDivLoss", "LigerKLDivFunction", "kl_div",
           "FusedLinearCrossEntropyLoss", "LigerFusedLinearCrossEntropyFunction", "fused_linear_cross_entropy",
           "LayerNorm", "LigerLayerNormFunction", "layer_norm",
           "FusedAddRMSNorm", "LigerFusedAddRMSNormFunction", "fused_add_rms_norm",
           "LigerRopeFunction", "rope", "GeGLUMLP", "LigerGatedActivationFunction", "SwiGLUMLP", "geglu", "swiglu"]
__version__ = liger_core.__version__

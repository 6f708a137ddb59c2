"""liger_torch: the PyTorch frontend of the kernel library (autograd functions, modules, functional API)."""

import liger_core

from .rms_norm import LigerRMSNormFunction, RMSNorm, recompute_norm_outputs, rms_norm
from .cross_entropy import CrossEntropyLoss, LigerCrossEntropyFunction, cross_entropy
from .kl_div import KLDivLoss, LigerKLDivFunction, kl_div
from .fused_linear_cross_entropy import (FusedLinearCrossEntropyLoss, LigerFusedLinearCrossEntropyFunction,
                                         fused_linear_cross_entropy)
from .layer_norm import LayerNorm, LigerLayerNormFunction, layer_norm
from .fused_add_rms_norm import FusedAddRMSNorm, LigerFusedAddRMSNormFunction, fused_add_rms_norm
from .rope import LigerRopeFunction, rope
from .swiglu import (GeGLUMLP, LigerGatedActivationFunction, LigerGatedLinearFunction, SwiGLUMLP, geglu,
                     geglu_linear, swiglu, swiglu_linear)
from .jsd import JSD, LigerJSDFunction, jsd
from .fused_linear_jsd import FusedLinearJSD, LigerFusedLinearJSDFunction, fused_linear_jsd

INTERPRET = liger_core.INTERPRET

__all__ = ["INTERPRET", "LigerRMSNormFunction", "RMSNorm", "rms_norm", "recompute_norm_outputs",
           "CrossEntropyLoss", "LigerCrossEntropyFunction", "cross_entropy",
           "KLDivLoss", "LigerKLDivFunction", "kl_div",
           "FusedLinearCrossEntropyLoss", "LigerFusedLinearCrossEntropyFunction", "fused_linear_cross_entropy",
           "LayerNorm", "LigerLayerNormFunction", "layer_norm",
           "FusedAddRMSNorm", "LigerFusedAddRMSNormFunction", "fused_add_rms_norm",
           "JSD", "LigerJSDFunction", "jsd", "FusedLinearJSD", "LigerFusedLinearJSDFunction", "fused_linear_jsd",
           "LigerRopeFunction", "rope", "GeGLUMLP", "LigerGatedActivationFunction", "SwiGLUMLP", "geglu", "swiglu",
           "LigerGatedLinearFunction", "swiglu_linear", "geglu_linear"]
__version__ = liger_core.__version__

# Hugging Face integration (liger_torch.transformers), re-exported lazily: importing liger_torch does not import
# transformers; the first access to one of these names does.
_HF_NAMES = ("AutoLigerKernelForCausalLM", "apply_liger_kernel", "revert_liger_kernel", "liger_kernel_patched",
             "apply_liger_kernel_to_llama", "apply_liger_kernel_to_mistral", "apply_liger_kernel_to_mixtral",
             "apply_liger_kernel_to_gemma", "apply_liger_kernel_to_gemma2", "apply_liger_kernel_to_gemma3",
             "apply_liger_kernel_to_gemma3_text", "apply_liger_kernel_to_qwen2", "apply_liger_kernel_to_qwen3",
             "apply_liger_kernel_to_qwen3_moe", "apply_liger_kernel_to_phi3", "apply_liger_kernel_to_olmo2",
             "apply_liger_kernel_to_granite")
__all__ += list(_HF_NAMES)


def __getattr__(name):
    if name in _HF_NAMES:
        from . import transformers as _hf

        return getattr(_hf, name)
    raise AttributeError(f"module 'liger_torch' has no attribute {name!r}")

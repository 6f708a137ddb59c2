"""Flax NNX modules on the kernels, drop-in for their ``flax.nnx`` namesakes (same parameter names)."""

from .rms_norm import RMSNorm
from .layer_norm import LayerNorm
from .swiglu import GeGLUMLP, SwiGLUMLP

__all__ = ["RMSNorm", "LayerNorm", "SwiGLUMLP", "GeGLUMLP"]

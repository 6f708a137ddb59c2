"""Flax NNX modules on the kernels, drop-in for their ``flax.nnx`` namesakes (same parameter names)."""

from .rms_norm import RMSNorm

__all__ = ["RMSNorm"]

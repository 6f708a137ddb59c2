"""``liger_jax.nnx.RMSNorm``: a drop-in for ``flax.nnx.RMSNorm`` running on the RMSNorm kernel."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes, initializers
from liger_core.launch import check_eps, check_positive_int

from ..rms_norm import rms_norm


class RMSNorm(nnx.Module):
    """Same constructor, parameter (``scale``) and numerics as ``flax.nnx.RMSNorm``.

    Flax computes the statistic and the scaling in fp32 and casts to ``dtype`` (default: the promotion of the
    input's and the parameter's dtypes), which is the kernel's ``gemma`` casting mode with offset 0. Only the
    last axis can be normalised; ``axis_name`` (cross-device statistics) and ``mask`` are not supported.
    """

    def __init__(self, num_features: int, *, epsilon: float = 1e-6, dtype=None, param_dtype=jnp.float32,
                 use_scale: bool = True, scale_init=initializers.ones, reduction_axes=-1, feature_axes=-1,
                 axis_name=None, axis_index_groups=None, use_fast_variance: bool = True,
                 promote_dtype=dtypes.promote_dtype, rngs: nnx.Rngs, scale_metadata=None):
        for name, value in (("reduction_axes", reduction_axes), ("feature_axes", feature_axes)):
            if value not in (-1, (-1,)):
                raise ValueError(f"{name} must be -1 (the last axis) for liger_jax.nnx.RMSNorm, got {value!r}")
        if axis_name is not None or axis_index_groups is not None:
            raise ValueError("axis_name / axis_index_groups (cross-device statistics) are not supported by "
                             "liger_jax.nnx.RMSNorm; use flax.nnx.RMSNorm")
        num_features = check_positive_int(num_features, "num_features")
        check_eps(epsilon, "epsilon")
        if use_scale:
            self.scale = nnx.Param(scale_init(rngs.params(), (num_features,), param_dtype),
                                   **dict(scale_metadata or {}))
        else:
            self.scale = nnx.data(None)
        self.num_features = num_features
        self.epsilon = epsilon
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.use_scale = use_scale
        self.reduction_axes = reduction_axes
        self.feature_axes = feature_axes
        self.axis_name = axis_name
        self.axis_index_groups = axis_index_groups
        self.use_fast_variance = use_fast_variance
        self.promote_dtype = promote_dtype

    def __call__(self, x, mask=None):
        if mask is not None:
            raise ValueError("mask is not supported by liger_jax.nnx.RMSNorm; use flax.nnx.RMSNorm")
        scale = self.scale[...] if self.scale is not None else None
        x, scale = self.promote_dtype((x, scale), dtype=self.dtype)
        out_dtype = dtypes.canonicalize_dtype(*[a for a in (x, scale) if a is not None], dtype=self.dtype)
        y = rms_norm(x, scale, epsilon=self.epsilon, casting_mode="gemma")
        return y.astype(out_dtype)

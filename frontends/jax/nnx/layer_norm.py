"""``liger_jax.nnx.LayerNorm``: a drop-in for ``flax.nnx.LayerNorm`` running on the LayerNorm kernel."""

from __future__ import annotations

from types import MappingProxyType

import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes, initializers
from liger_core.launch import check_eps, check_positive_int

from ..layer_norm import layer_norm


class LayerNorm(nnx.Module):
    """Same constructor, parameters (``scale``, ``bias``) and numerics as ``flax.nnx.LayerNorm``.

    Flax promotes the input and the parameters to ``dtype`` (default: their common dtype), computes the
    statistics and the affine map in fp32 and casts the result to that dtype; the kernel does the same. The
    variance is always the two-pass ``mean((x - mean)^2)`` (Flax's ``use_fast_variance=False``; the default fast
    ``E[x^2] - E[x]^2`` differs only by fp32 rounding unless the mean dwarfs the spread, where ours is the
    accurate one). Only the last axis can be normalised; ``axis_name`` (cross-device statistics) and ``mask``
    are not supported.
    """

    def __init__(self, num_features: int, *, epsilon: float = 1e-6, dtype=None, param_dtype=jnp.float32,
                 use_bias: bool = True, use_scale: bool = True, bias_init=initializers.zeros_init(),
                 scale_init=initializers.ones_init(), reduction_axes=-1, feature_axes=-1, axis_name=None,
                 axis_index_groups=None, use_fast_variance: bool = True, promote_dtype=dtypes.promote_dtype,
                 rngs: nnx.Rngs, bias_metadata=MappingProxyType({}), scale_metadata=MappingProxyType({})):
        for name, value in (("reduction_axes", reduction_axes), ("feature_axes", feature_axes)):
            if value not in (-1, (-1,)):
                raise ValueError(f"{name} must be -1 (the last axis) for liger_jax.nnx.LayerNorm, got {value!r}")
        if axis_name is not None or axis_index_groups is not None:
            raise ValueError("axis_name / axis_index_groups (cross-device statistics) are not supported by "
                             "liger_jax.nnx.LayerNorm; use flax.nnx.LayerNorm")
        num_features = check_positive_int(num_features, "num_features")
        check_eps(epsilon, "epsilon")
        feature_shape = (num_features,)
        if use_scale:
            self.scale = nnx.Param(scale_init(rngs.params(), feature_shape, param_dtype), **dict(scale_metadata))
        else:
            self.scale = nnx.data(None)
        if use_bias:
            self.bias = nnx.Param(bias_init(rngs.params(), feature_shape, param_dtype), **dict(bias_metadata))
        else:
            self.bias = nnx.data(None)
        self.num_features = num_features
        self.epsilon = epsilon
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.use_bias = use_bias
        self.use_scale = use_scale
        self.reduction_axes = reduction_axes
        self.feature_axes = feature_axes
        self.axis_name = axis_name
        self.axis_index_groups = axis_index_groups
        self.use_fast_variance = use_fast_variance
        self.promote_dtype = promote_dtype

    def __call__(self, x, *, mask=None):
        if mask is not None:
            raise ValueError("mask is not supported by liger_jax.nnx.LayerNorm; use flax.nnx.LayerNorm")
        scale = self.scale[...] if self.scale is not None else None
        bias = self.bias[...] if self.bias is not None else None
        x, scale, bias = self.promote_dtype((x, scale, bias), dtype=self.dtype)
        out_dtype = dtypes.canonicalize_dtype(*[a for a in (x, scale, bias) if a is not None], dtype=self.dtype)
        y = layer_norm(x, scale, bias, epsilon=self.epsilon)
        return y.astype(out_dtype)

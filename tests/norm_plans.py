"""The three norm forwards by family name, for tests and probes that sweep all of them (no torch or jax here:
tests/core/ptx_worker.py and scripts/sass_loops.py import it too)."""

from liger_core import fused_add_rms_norm, layer_norm, rms_norm

NORM_FAMILIES = ("rms_norm", "layer_norm", "fused_add_rms_norm")


def norm_forward_plan(family, x, w, **overrides):
    """``family``'s forward plan on rows like ArrayInfo ``x`` with parameters like ``w`` (LayerNorm's bias shaped as
    the weight, fused add+RMSNorm's residual as x). Its ``inputs`` name the arrays a run needs: x, weight, and bias
    or residual."""
    if family == "rms_norm":
        return rms_norm.forward_plan(x, w, eps=1e-6, **overrides)
    if family == "layer_norm":
        return layer_norm.forward_plan(x, w, w, eps=1e-5, **overrides)
    if family == "fused_add_rms_norm":
        return fused_add_rms_norm.forward_plan(x, x, w, eps=1e-6, **overrides)
    raise ValueError(f"family must be one of {NORM_FAMILIES}, got {family!r}")


def norm_backward_plan(family, x, w, **overrides):
    """``family``'s backward plan (not in place) for :func:`norm_forward_plan`'s forward on the same ArrayInfo:
    its inputs are named dy (and dh), x or h, weight, and the forward's mean and rstd."""
    if family == "rms_norm":
        return rms_norm.backward_plan(x, x, w, num_sms=3, in_place=False, **overrides)
    if family == "layer_norm":
        return layer_norm.backward_plan(x, x, w, w, num_sms=3, in_place=False, **overrides)
    if family == "fused_add_rms_norm":
        return fused_add_rms_norm.backward_plan(x, x, x, w, x_dtype=x.dtype, residual_dtype=x.dtype, num_sms=3,
                                                in_place=False, **overrides)
    raise ValueError(f"family must be one of {NORM_FAMILIES}, got {family!r}")

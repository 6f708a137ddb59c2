"""Tolerances by dtype and comparison helpers shared by the tests."""

import numpy as np
import torch

# (atol, rtol) against a float64 reference computed from the same (rounded) inputs.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def tolerance(dtype):
    if not isinstance(dtype, torch.dtype):
        dtype = DTYPES[np.dtype(dtype).name]
    return TOLERANCES[dtype]


def assert_close(actual, expected, dtype, name="", scale=1.0):
    """Elementwise |actual - expected| <= scale * (atol + rtol * |expected|), NaN never passes.

    ``scale`` widens the bound for quantities that are sums over many rows (weight gradients), where the
    rounding of each term adds up; it is stated at each use."""
    actual = torch.as_tensor(np.asarray(actual, dtype=np.float64)) if not isinstance(actual, torch.Tensor) else actual
    expected = torch.as_tensor(np.asarray(expected, dtype=np.float64)) if not isinstance(expected, torch.Tensor) else expected
    actual = actual.detach().to("cpu", torch.float64)
    expected = expected.detach().to("cpu", torch.float64)
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert not torch.isnan(actual).any(), f"{name}: NaN in the result (unwritten or poisoned element?)"
    atol, rtol = tolerance(dtype)
    bound = scale * (atol + rtol * expected.abs())
    err = (actual - expected).abs()
    worst = (err - bound).argmax()
    assert (err <= bound).all(), (
        f"{name}: {int((err > bound).sum())} of {err.numel()} elements off; worst at flat index {int(worst)}: "
        f"{actual.flatten()[worst].item()} vs {expected.flatten()[worst].item()} (dtype {dtype})")


def bf16_safe(array):
    """numpy view of a torch tensor for jax (bf16 through float32, exact)."""
    t = array.detach().cpu()
    return t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()


def x64():
    """Context in which jax computes in float64 (for references only; the kernels never see float64)."""
    import jax

    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax.experimental import enable_x64

    return enable_x64()


def assert_parity(torch_result, jax_result, name=""):
    """torch-vs-jax frontend results: bitwise equal in the interpreter (same kernel, same grid, same
    arithmetic). On the GPU jax_triton compiles the kernel through its own pipeline (its own compile options
    and specialisation), and fp32 results were seen to differ by 1 ulp in a few elements (H200, 2026-12-02):
    there, at most 2 units in the last place of the result's own dtype are allowed."""
    import liger_core

    t = torch_result.detach().cpu()
    a = t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()
    b = np.asarray(jax_result).astype(a.dtype) if str(np.asarray(jax_result).dtype) == "bfloat16" else np.asarray(jax_result)
    if liger_core.INTERPRET:
        np.testing.assert_array_equal(a, b, err_msg=name)
        return
    if t.dtype == torch.bfloat16:  # bf16 ulp in fp32 bit patterns: 2**16
        np.testing.assert_array_max_ulp(a, b.astype(np.float32), maxulp=2 * 2**16)
    else:
        np.testing.assert_array_max_ulp(a, b, maxulp=2)

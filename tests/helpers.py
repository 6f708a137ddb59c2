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


def assert_close(actual, expected, dtype, name="", scale=1.0, magnitude=None):
    """Elementwise |actual - expected| <= scale * (atol + rtol * |expected|), NaN never passes.

    ``scale`` widens the bound for quantities that are sums over many rows (weight gradients), where the
    rounding of each term adds up; it is stated at each use. ``magnitude`` replaces |expected| as the size the
    relative part scales with, for results summed from terms rounded to the dtype one by one (where cancelling
    terms leave a small result with their larger rounding error)."""
    actual = torch.as_tensor(np.asarray(actual, dtype=np.float64)) if not isinstance(actual, torch.Tensor) else actual
    expected = torch.as_tensor(np.asarray(expected, dtype=np.float64)) if not isinstance(expected, torch.Tensor) else expected
    actual = actual.detach().to("cpu", torch.float64)
    expected = expected.detach().to("cpu", torch.float64)
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert not torch.isnan(actual).any(), f"{name}: NaN in the result (unwritten or poisoned element?)"
    atol, rtol = tolerance(dtype)
    if magnitude is not None and not isinstance(magnitude, torch.Tensor):
        magnitude = torch.as_tensor(np.asarray(magnitude, dtype=np.float64))
    size = expected.abs() if magnitude is None else magnitude.detach().to("cpu", torch.float64)
    bound = scale * (atol + rtol * size)
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
    """torch-vs-jax frontend results of the same kernel.

    In the interpreter both frontends run the same kernel with the same grid and the same arithmetic, so the
    results must be bitwise equal. On the GPU, jax_triton compiles the kernel through its own pipeline: it does
    not mark integer arguments as divisible by 16 as Triton's own launcher does, so the compiler may choose
    another register layout, and a ``tl.sum`` then adds in another order. Results were seen to differ by a few
    units in the last place (H200, 2026-12-02; up to 5 ulp in an element of dx near zero after cancellation).
    There the bound is elementwise 4 eps(dtype) * (|a| + max|a|): rounding-level, far below any real error.

    In the interpreter, jax runs the kernel inside a host callback on an XLA thread, whose CPU flushes fp32
    denormals to zero (FTZ/DAZ), inputs and intermediates alike; tests/parity/conftest.py sets the same flags for
    the torch side, so the comparison stays bitwise. (Without them a geglu da of 1.4e-42 through torch was 0
    through jax, a geglu_tanh output of 1.9e-38 was 0, and a threshold on such values was crossed by a da of
    3.5e-36.)"""
    import liger_core

    if isinstance(torch_result, torch.Tensor):
        t = torch_result.detach().cpu()
        a = t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()
        half = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}.get(t.dtype)
    else:
        a = np.asarray(torch_result)
        half = {"bfloat16": 2.0**-8, "float16": 2.0**-11}.get(str(a.dtype))
        a = a.astype(np.float32) if str(a.dtype) == "bfloat16" else a
    b = np.asarray(jax_result)
    b = b.astype(np.float32) if str(b.dtype) == "bfloat16" else b.astype(a.dtype)
    assert a.shape == b.shape, f"{name}: shape {a.shape} != {b.shape}"
    if liger_core.INTERPRET:
        np.testing.assert_array_equal(a, b, err_msg=name)
        return
    eps = half or float(np.finfo(a.dtype).eps)
    scale = float(np.max(np.abs(a))) if a.size else 0.0
    np.testing.assert_allclose(a, b, rtol=4 * eps, atol=4 * eps * scale, err_msg=name)


def to_torch(array, device):
    """numpy (or jax) array -> torch tensor on device, bit for bit (bf16 through a 16-bit view)."""
    import jax.numpy as jnp

    array = np.asarray(array)
    if array.dtype == jnp.bfloat16:
        return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16).to(device)
    return torch.from_numpy(array.copy()).to(device)


def as_numpy(t):
    """torch tensor -> numpy array, bit for bit (bf16 as ml_dtypes' bfloat16 through a 16-bit view)."""
    import jax.numpy as jnp

    t = t.detach().cpu()
    return t.view(torch.int16).numpy().view(jnp.bfloat16) if t.dtype == torch.bfloat16 else t.numpy()


def f32(a):
    """A jax array as a float32 numpy array (for assert_close)."""
    import jax.numpy as jnp

    return np.asarray(a.astype(jnp.float32))


def non_contiguous(layout, gen, device):
    """A non-contiguous float32 x with 123 columns, drawn from gen, in one of three layouts."""
    if layout == "row_slice":  # rows of a wider buffer: handled by strides, no copy
        x = torch.randn(7, 200, generator=gen).to(device)[:, 11:134]
    elif layout == "transposed_leading":  # leading axes that do not fold: copied
        x = torch.randn(5, 3, 123, generator=gen).to(device).transpose(0, 1)
    else:  # every other column
        assert layout == "strided_columns", layout
        x = torch.randn(7, 246, generator=gen).to(device)[:, ::2]
    assert not x.is_contiguous()
    return x


def assert_checkpoint_same_grad(f, args):
    """jax.grad of f equals jax.grad of jax.checkpoint(f) under jit, bit for bit (all arguments)."""
    import jax

    argnums = tuple(range(len(args)))
    plain = jax.grad(f, argnums=argnums)(*args)
    remat = jax.jit(jax.grad(jax.checkpoint(f), argnums=argnums))(*args)
    for a, b in zip(plain, remat):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def assert_grad_deterministic(f, args):
    """Two calls of the same jitted jax.grad of f (all arguments) give bitwise equal gradients."""
    import jax

    g = jax.jit(jax.grad(f, argnums=tuple(range(len(args)))))
    for a, b in zip(g(*args), g(*args)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


class HandOverGradient(torch.autograd.Function):
    """The identity, whose backward passes on a fresh copy of its gradient (held by nothing else, as most
    gradients in a model are) and records that copy's address in ``addresses``: a test can then tell whether
    the next backward wrote its result over it."""

    @staticmethod
    def forward(ctx, x, addresses):
        ctx.addresses = addresses
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        fresh = grad.clone()
        ctx.addresses.append(fresh.data_ptr())
        return fresh, None

"""Inputs past 2**31 elements (GPU only): the int32-offset overflow class (RMSNorm at a million tokens, a
cross-entropy whose N * V exceeds 2**31, the fused linear cross-entropy with one chunk that large).

Each tensor is a few GB, so no full reference is computed: the incoming gradient (or the set of non-ignored
targets) is non-zero only on a few CHECK rows around the 2**31-element boundary and at both ends, which makes
every gradient a function of those rows alone. Those rows are compared with a float64 reference computed on them
only; every other row must come out exactly zero (a write through a wrapped 32-bit offset lands somewhere it
should not), and every output must be finite (outputs are poisoned with NaN: a row the kernel never reached stays
NaN). A test skips, saying why, when the GPU has too little free memory; memory is released after each.
"""

import gc

import numpy as np
import pytest
import torch

import liger_torch
from helpers import assert_close, to_torch
from test_cross_entropy_torch import reference as ce_reference
from test_rms_norm_torch import reference as rms_reference

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16
LIMIT = 2**31  # elements


@pytest.fixture(autouse=True)
def release_memory():
    gc.collect()
    torch.cuda.empty_cache()
    yield
    gc.collect()
    torch.cuda.empty_cache()


def need_gib(gib):
    free, _ = torch.cuda.mem_get_info()
    if free < gib * 2**30:
        pytest.skip(f"needs about {gib} GiB of free GPU memory, {free / 2**30:.1f} GiB free")


def nonzero_rows(t):
    """Indices of the rows of a 2-d tensor with any non-zero element (on the host)."""
    return set(torch.nonzero(torch.any(t != 0, dim=1)).flatten().tolist())


# ----------------------------------------------------------------------------------------------- RMSNorm
RMS_H = 2048
RMS_BOUNDARY = LIMIT // RMS_H          # the first row whose first element is past 2**31
RMS_ROWS = RMS_BOUNDARY + 3            # 2**31 + 6144 elements (4.3 GB in bf16)
RMS_CHECK = [0, 1, RMS_BOUNDARY - 2, RMS_BOUNDARY - 1, RMS_BOUNDARY, RMS_BOUNDARY + 1, RMS_BOUNDARY + 2]


def _rms_inputs(gen_seed):
    gen = torch.Generator(device="cuda").manual_seed(gen_seed)
    x = torch.randn(RMS_ROWS, RMS_H, generator=gen, device="cuda", dtype=BF16)
    w = (torch.randn(RMS_H, generator=gen, device="cuda") * 0.5 + 1).to(BF16)
    dy = torch.zeros(RMS_ROWS, RMS_H, device="cuda", dtype=BF16)
    dy[RMS_CHECK] = torch.randn(len(RMS_CHECK), RMS_H, generator=gen, device="cuda", dtype=BF16)
    return x, w, dy


def _rms_check(x_rows, w, dy_rows, y_rows, dx_rows, dw, label):
    xr, wr = x_rows.double().requires_grad_(True), w.double().requires_grad_(True)
    y_ref = rms_reference(xr, wr, 1e-6, 0.0, "llama")
    y_ref.backward(dy_rows.double())
    assert_close(y_rows, y_ref, BF16, f"{label} y at rows {RMS_CHECK}")
    assert_close(dx_rows, xr.grad, BF16, f"{label} dx at rows {RMS_CHECK}")
    assert_close(dw, wr.grad, BF16, f"{label} dw (from the check rows only)", scale=2.0)


def test_rms_norm_torch_past_2_31_elements():
    need_gib(24)
    x, w, dy = _rms_inputs(0)
    assert x.numel() > LIMIT and RMS_BOUNDARY * RMS_H == LIMIT
    dy_rows = dy[RMS_CHECK].clone()
    xl, wl = x.requires_grad_(True), w.clone().requires_grad_(True)
    y = liger_torch.rms_norm(xl, wl)
    assert bool(torch.isfinite(y).all()), "rows left unwritten (NaN poison) or overflowed"
    y_rows = y[RMS_CHECK].detach().clone()
    y.backward(dy)  # dx is written over dy (in place)
    del y
    dx = xl.grad
    assert nonzero_rows(dx) <= set(RMS_CHECK), "dx written outside the rows that have a gradient"
    _rms_check(x.detach()[RMS_CHECK], w, dy_rows, y_rows, dx[RMS_CHECK], wl.grad, "torch")


def test_rms_norm_jax_past_2_31_elements():
    need_gib(40)
    import jax
    import jax.numpy as jnp

    import liger_jax

    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    rows = jnp.asarray(RMS_CHECK)
    x = jax.random.normal(keys[0], (RMS_ROWS, RMS_H), jnp.bfloat16)
    s = (jax.random.normal(keys[1], (RMS_H,), jnp.float32) * 0.5 + 1).astype(jnp.bfloat16)
    dy = jnp.zeros((RMS_ROWS, RMS_H), jnp.bfloat16).at[rows].set(
        jax.random.normal(keys[2], (len(RMS_CHECK), RMS_H), jnp.bfloat16))
    y, vjp = jax.vjp(lambda a, b: liger_jax.rms_norm(a, b), x, s)
    assert bool(jnp.isfinite(y).all()), "rows left unwritten or overflowed"
    y_rows = np.asarray(y[rows])
    del y
    dx, ds = vjp(dy)
    stray = set(np.nonzero(np.asarray(jnp.any(dx != 0, axis=1)))[0].tolist())
    assert stray <= set(RMS_CHECK), "dx written outside the rows that have a gradient"
    cpu = lambda a: to_torch(np.asarray(a), "cpu")  # noqa: E731
    _rms_check(cpu(x[rows]), cpu(s), cpu(dy[rows]), cpu(y_rows), cpu(dx[rows]), cpu(ds), "jax")
    del x, dy, dx, ds, vjp


# --------------------------------------------------------------------------------- wide norm forwards
@pytest.mark.parametrize("width", [32768, 65536])  # bf16 rows: held at 32768, chunked at 65536
@pytest.mark.parametrize("family", ["rms_norm", "layer_norm", "fused_add_rms_norm"])
def test_wide_norm_forwards_past_2_31_elements(family, width):
    """The forwards of rows over 16384 columns (held up to 32768, chunked past it) past 2**31 elements: every row
    written and finite, the rows around the boundary against the reference."""
    from test_fused_add_rms_norm_torch import reference as fa_reference
    from test_layer_norm_torch import reference as ln_reference

    boundary = LIMIT // width  # the first row past 2**31 elements
    n_rows = boundary + 2
    check = [0, boundary - 1, boundary, boundary + 1]
    need_gib(20 if family == "fused_add_rms_norm" else 10)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n_rows, width, generator=gen, device="cuda", dtype=BF16)
    w = (torch.rand(width, generator=gen, device="cuda") + 0.5).to(BF16)
    with torch.no_grad():
        if family == "rms_norm":
            y, want = liger_torch.rms_norm(x, w), lambda r: rms_reference(x[r], w, 1e-6, 0.0, "llama")
        elif family == "layer_norm":
            b = torch.randn(width, generator=gen, device="cuda", dtype=BF16)
            y, want = liger_torch.layer_norm(x, w, b), lambda r: ln_reference(x[r], w, b, 1e-5)
        else:
            res = torch.randn(n_rows, width, generator=gen, device="cuda", dtype=BF16)
            y, h = liger_torch.fused_add_rms_norm(x, res, w)
            assert torch.equal(h[check], x[check] + res[check])
            del h
            want = lambda r: fa_reference(x[r], res[r], w, 1e-6, 0.0, "llama")[0]  # noqa: E731
    assert bool(torch.isfinite(y).all()), "rows left unwritten (NaN poison) or overflowed"
    assert_close(y[check], want(check), BF16, f"{family} y at rows {check}")


# ----------------------------------------------------------------------------------------- cross-entropy
CE_V = 131072
CE_BOUNDARY = LIMIT // CE_V            # 16384: the first row past 2**31 elements
CE_N = CE_BOUNDARY + 27                # 16411 x 131072 = 2**31 + 3.5M elements (4.3 GB in bf16)
CE_IGNORED = CE_BOUNDARY + 5
CE_CHECK = [0, CE_BOUNDARY - 1, CE_BOUNDARY, CE_BOUNDARY + 1, CE_IGNORED, CE_N - 1]


@pytest.mark.parametrize("lagged", [False, True], ids=["two_pass", "lagged"])
def test_cross_entropy_past_2_31_elements(lagged, request):
    need_gib(20)
    # the lagged kernel (rows of 131072 columns: 16 segments) or the two-pass one, whatever the default
    request.getfixturevalue("lagged_from_65536" if lagged else "lagged_off")
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(CE_N, CE_V, generator=gen, device="cuda", dtype=BF16).mul_(2)
    assert x.numel() > LIMIT
    t = torch.randint(0, CE_V, (CE_N,), generator=gen, device="cuda")
    t[CE_IGNORED] = -100
    g = torch.randn(CE_N, generator=gen, device="cuda", dtype=BF16)
    x_rows = x[CE_CHECK].clone()

    leaf = x.requires_grad_(True)
    loss = liger_torch.cross_entropy(leaf, t, reduction="none")
    loss.backward(g)
    assert bool(torch.isfinite(loss).all())
    dx = leaf.grad
    assert bool(torch.isfinite(dx).all()), "gradient rows left unwritten (NaN poison) or overflowed"
    assert torch.equal(dx[CE_IGNORED], torch.zeros_like(dx[CE_IGNORED]))

    xr = x_rows.double().requires_grad_(True)
    loss_ref = ce_reference(xr, t[CE_CHECK], reduction="none")[0]
    loss_ref.backward(g[CE_CHECK].double())
    assert_close(loss[CE_CHECK], loss_ref, BF16, f"loss at rows {CE_CHECK}")
    assert_close(dx[CE_CHECK], xr.grad, BF16, f"dlogits at rows {CE_CHECK}")
    rows_none = loss.detach().double()
    del loss, dx
    leaf.grad = None

    mean = liger_torch.cross_entropy(x.detach(), t)  # no gradient: the denominators and the fixed-order sum
    kept = t != -100
    assert_close(mean, rows_none[kept].sum() / kept.sum(), BF16, "mean over all rows")


def test_scale_by_a_scalar_past_2_31_elements():
    """The mean/sum backward's scale (a fixed number of programs striding over the tiles) reaches every element
    past 2**31, exactly (one fp32 multiplication of a bf16 value by 0.5 is exact)."""
    from liger_core import cross_entropy as core
    from liger_torch._launch import info, run_plan

    need_gib(12)
    gen = torch.Generator(device="cuda").manual_seed(2)
    grad = torch.randn(CE_N, CE_V, generator=gen, device="cuda", dtype=BF16)
    assert grad.numel() > LIMIT
    expected = grad * 0.5
    g = torch.tensor(0.5, device="cuda", dtype=BF16)
    (out,) = run_plan(core.backward_plan(info(grad), info(g), reduction="mean"), grad=grad, grad_output=g)
    assert out.data_ptr() == grad.data_ptr()
    assert torch.equal(out, expected)


# ---------------------------------------------------------------------------- fused linear cross-entropy
FL_H = 256


def _flce_rows_reference(x, w, t):
    """float64 sum-reduced loss of x @ w.T with the logits rounded to bf16 as the lm_head's output is (the
    rounding passes the gradient straight through)."""
    z = x @ w.t()
    z = z + (z.to(BF16).double() - z).detach()
    return torch.nn.functional.cross_entropy(z, t, ignore_index=-100, reduction="sum")


@pytest.mark.parametrize("chunk_size", [None, CE_N], ids=["default_chunks", "one_chunk_past_2_31"])
def test_fused_linear_cross_entropy_past_2_31_logits(chunk_size):
    """N * V > 2**31 logits, in the default bounded chunks and in one chunk holding all of them."""
    need_gib(8 if chunk_size is None else 16)
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(CE_N, FL_H, generator=gen, device="cuda", dtype=BF16)
    w = (torch.randn(CE_V, FL_H, generator=gen, device="cuda") * 0.1).to(BF16)
    t = torch.full((CE_N,), -100, device="cuda")
    kept = [r for r in CE_CHECK if r != CE_IGNORED]
    t[kept] = torch.randint(0, CE_V, (len(kept),), generator=gen, device="cuda")

    xl, wl = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    loss = liger_torch.fused_linear_cross_entropy(xl, wl, t, reduction="sum", chunk_size=chunk_size)
    loss.backward()
    assert nonzero_rows(xl.grad) <= set(kept), "dx written for ignored rows"
    xr, wr = x[CE_CHECK].double().requires_grad_(True), w.double().requires_grad_(True)
    loss_ref = _flce_rows_reference(xr, wr, t[CE_CHECK])
    loss_ref.backward()
    assert_close(loss, loss_ref, BF16, "loss (the check rows are the only kept ones)")
    assert_close(xl.grad[CE_CHECK], xr.grad, BF16, f"dx at rows {CE_CHECK}")
    assert bool(torch.isfinite(wl.grad).all())
    assert_close(wl.grad, wr.grad, BF16, "dW", scale=2.0)


# ----------------------------------------------------------------------------------------------- KL divergence
KL_N = 1_100_000_000  # one flattened row: 67k forward chunks and 269k backward blocks, past grid axis 1's 65535


@pytest.mark.parametrize("grad_in_forward", [True, False])
def test_kl_div_of_a_flattened_array_past_grid_axis_1(grad_in_forward):
    """KL divergence of one 1.1G-element row (2.2 GB a bf16 array): its column blocks exceed CUDA's 65535
    programs on grid axis 1, so the launches run on one axis decoded in the kernel (launch.rows_by_blocks_grid).
    The sum is checked against an fp64 sum over slices; the gradient (-exp(target) * g) is written everywhere
    (poisoned NaN otherwise) and exact at both ends and around the block counts where axis 1 used to stop."""
    need_gib(12)
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(KL_N, generator=gen, device="cuda", dtype=BF16).mul_(0.5).sub_(3)
    t = torch.randn(KL_N, generator=gen, device="cuda", dtype=BF16).mul_(0.5).sub_(3)
    leaf = x.requires_grad_(True)
    loss = liger_torch.kl_div(leaf, t, "sum", log_target=True, grad_in_forward=grad_in_forward)
    loss.backward(torch.tensor(0.5, device="cuda", dtype=BF16))
    step = 2**27
    expected = sum(float(torch.nn.functional.kl_div(x[i:i + step].double(), t[i:i + step].double(),
                                                    reduction="sum", log_target=True))
                   for i in range(0, KL_N, step))
    # the kernel sums in fp32 and rounds once: the bf16 result is good to its own rounding
    assert_close(loss, torch.tensor(expected, dtype=torch.float64), BF16, "sum")
    dx = leaf.grad
    assert bool(torch.isfinite(dx).all()), "gradient blocks left unwritten (NaN poison)"
    for at in (0, 65535 * 4096 - 5, 65535 * 16384 - 5, KL_N - 8):
        window = slice(at, at + 8)
        assert_close(dx[window], -t[window].double().exp() * 0.5, BF16, f"dinput at {at}")

"""liger_torch.kl_div and liger_jax.kl_div on the same numpy inputs: bitwise equal (same kernels, same grids)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liger_jax
import liger_torch
from helpers import assert_parity, as_numpy, to_torch


@pytest.mark.parametrize("reduction", ["none", "sum", "batchmean"])
@pytest.mark.parametrize("log_target", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("grad_in_forward", [True, False])
def test_kl_div_parity(reduction, log_target, dtype, grad_in_forward, device, seed):
    rng = np.random.default_rng(seed)
    shape = (5, 259)
    x = np.asarray(jax.nn.log_softmax(rng.standard_normal(shape), -1), jnp.dtype(dtype))
    t = rng.standard_normal(shape)
    t = np.asarray(jax.nn.log_softmax(t, -1) if log_target else jax.nn.softmax(t, -1), jnp.dtype(dtype))
    g = np.asarray(rng.standard_normal(shape) if reduction == "none" else 0.7, jnp.dtype(dtype))
    xt = to_torch(x, device).requires_grad_(True)
    loss_t = liger_torch.kl_div(xt, to_torch(t, device), reduction, log_target, grad_in_forward=grad_in_forward)
    loss_t.backward(to_torch(g, device))
    f = lambda a: liger_jax.kl_div(a, jnp.asarray(t), reduction=reduction, log_target=log_target,
                                   grad_in_forward=grad_in_forward)
    loss_j, vjp = jax.vjp(jax.jit(f), jnp.asarray(x))
    (dx_j,) = vjp(jnp.asarray(g))
    assert_parity(as_numpy(loss_t), np.asarray(loss_j), "loss")
    assert_parity(as_numpy(xt.grad), np.asarray(dx_j), "dx")


@pytest.mark.parametrize("reduction", ["none", "batchmean"])
def test_kl_div_parity_on_one_grid_axis(reduction, device, seed, monkeypatch):
    """The launches past CUDA's 65535 programs on grid axis 1 (one decoded axis of rows x blocks), forced here on
    small rows by lowering the limit: both frontends plan them alike and agree bit for bit."""
    from liger_core import kl_div, launch

    monkeypatch.setattr(launch, "MAX_GRID_YZ", 1)
    monkeypatch.setattr(kl_div, "FORWARD_CHUNK", 4096)  # 3 chunks a row in the forward, 3 blocks in the backward
    planned = []  # (frontend, flat) of every grid the KL plans lay out

    def recording(n_rows, n_blocks):
        grid, flat = launch.rows_by_blocks_grid(n_rows, n_blocks)
        planned.append((frontend, flat))
        return grid, flat

    monkeypatch.setattr(kl_div, "rows_by_blocks_grid", recording)
    for plan in (kl_div.forward_plan, kl_div.row_sums_plan, kl_div.backward_plan):
        plan.cache_clear()
    rng = np.random.default_rng(seed)
    shape = (5, 9001)
    x = np.asarray(jax.nn.log_softmax(rng.standard_normal(shape), -1), np.float32)
    t = np.asarray(jax.nn.log_softmax(rng.standard_normal(shape), -1), np.float32)
    g = np.asarray(rng.standard_normal(shape) if reduction == "none" else 0.7, np.float32)
    frontend = "torch"
    xt = to_torch(x, device).requires_grad_(True)
    loss_t = liger_torch.kl_div(xt, to_torch(t, device), reduction, True, grad_in_forward=False)
    loss_t.backward(to_torch(g, device))
    frontend = "jax"
    for plan in (kl_div.forward_plan, kl_div.row_sums_plan, kl_div.backward_plan):
        plan.cache_clear()  # the jax side plans its own launches
    f = lambda a: liger_jax.kl_div(a, jnp.asarray(t), reduction=reduction, log_target=True,  # noqa: E731
                                   grad_in_forward=False)
    loss_j, vjp = jax.vjp(jax.jit(f), jnp.asarray(x))
    (dx_j,) = vjp(jnp.asarray(g))
    assert {p for p in planned} == {("torch", True), ("jax", True)}, planned  # forward and backward, both flat
    assert len(planned) >= 4
    monkeypatch.undo()
    for plan in (kl_div.forward_plan, kl_div.row_sums_plan, kl_div.backward_plan):
        plan.cache_clear()
    assert_parity(as_numpy(loss_t), np.asarray(loss_j), "loss")
    assert_parity(as_numpy(xt.grad), np.asarray(dx_j), "dx")

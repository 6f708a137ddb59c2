"""The chunked norm forwards (rows over their held_up_to; ``chunk`` forces them on small rows) with
several rows a program (``block_m``, ROWS), and the column-split backwards (``column_block`` forces them),
launched from the same plan by both frontends' launchers: the same outputs, bit for bit. The public ops take one
row a program by default, which the per-family parity tests cover at 16400 columns (LayerNorm's forward in chunks,
the RMSNorms' held)."""

import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_parity, as_numpy, to_torch
from norm_plans import NORM_FAMILIES, norm_backward_plan, norm_forward_plan


def _plan_and_inputs(family, rng, shape):
    from liger_core.launch import ArrayInfo

    x, r = (np.asarray(rng.standard_normal(shape) * 2 + 0.5, jnp.bfloat16) for _ in range(2))
    w, b = (np.asarray(rng.standard_normal(shape[-1]), jnp.bfloat16) for _ in range(2))
    plan = norm_forward_plan(family, ArrayInfo.contiguous(shape, "bfloat16"),
                             ArrayInfo.contiguous((shape[-1],), "bfloat16"), chunk=16, block_m=4)
    arrays = dict(x=x, residual=r, weight=w, bias=b)
    return plan, {name: arrays[name] for name in plan.inputs}


@pytest.mark.parametrize("family", NORM_FAMILIES)
@pytest.mark.parametrize("shape", [(7, 123), (6, 96)])
def test_chunked_forward_several_rows_parity(family, shape, device, seed):
    """7 rows of 123 columns, 4 rows a program: the last program's short, its extra rows the last again; 96
    columns: whole chunks, the kernels without column masks (FULL_CHUNKS)."""
    from liger_jax._launch import run_plan as run_jax
    from liger_torch._launch import run_plan as run_torch

    plan, inputs = _plan_and_inputs(family, np.random.default_rng(seed), shape)
    assert plan.launches[0].constexprs["FULL_CHUNKS"] == (shape[1] % 16 == 0)
    got_torch = run_torch(plan, **{k: to_torch(v, device) for k, v in inputs.items()})
    got_jax = run_jax(plan, **{k: jnp.asarray(v) for k, v in inputs.items()})
    assert len(got_torch) == len(got_jax) == len(plan.outputs)
    for name, t, j in zip(plan.outputs, got_torch, got_jax):
        assert_parity(as_numpy(t), np.asarray(j), name)


@pytest.mark.parametrize("family", NORM_FAMILIES)
@pytest.mark.parametrize("column_block", [16, 32])
def test_column_split_backward_parity(family, column_block, device, seed):
    """The column-split backward (its row sums swept in chunks of the block's width; ``column_block`` forces it on
    small rows) through both launchers, 6 rows of 96 columns in 16- and 32-column blocks (whole chunks:
    FULL_CHUNKS, no masks), bit for bit; the forward's statistics come from the torch launcher."""
    plan = _assert_backward_parity(family, (6, 96), device, seed, column_block=column_block)
    assert plan.launches[0].constexprs["FULL_CHUNKS"] is True, "the row sums come first, on whole chunks"


def _assert_backward_parity(family, shape, device, seed, **overrides):
    """``family``'s backward plan (``overrides``) on bf16 rows of ``shape`` through both launchers, bit for bit;
    the forward's statistics come from the torch launcher. Returns the plan."""
    from liger_core.launch import ArrayInfo
    from liger_jax._launch import run_plan as run_jax
    from liger_torch._launch import run_plan as run_torch

    rng = np.random.default_rng(seed)
    x_info, w_info = ArrayInfo.contiguous(shape, "bfloat16"), ArrayInfo.contiguous((shape[-1],), "bfloat16")
    forward, inputs = _plan_and_inputs(family, rng, shape)
    stats = dict(zip(forward.outputs, run_torch(forward, **{k: to_torch(v, device) for k, v in inputs.items()})))
    arrays = {**inputs, **{k: as_numpy(v) for k, v in stats.items()}}
    arrays.update(dy=np.asarray(rng.standard_normal(shape), jnp.bfloat16),
                  dh=np.asarray(rng.standard_normal(shape), jnp.bfloat16))
    plan = norm_backward_plan(family, x_info, w_info, **overrides)
    needed = {name: arrays[name] for name in plan.inputs}
    got_torch = run_torch(plan, **{k: to_torch(v, device) for k, v in needed.items()})
    got_jax = run_jax(plan, **{k: jnp.asarray(v) for k, v in needed.items()})
    for name, t, j in zip(plan.outputs, got_torch, got_jax):
        assert_parity(as_numpy(t), np.asarray(j), name)
    return plan



@pytest.mark.parametrize("family,chain_dw", [("rms_norm", False), ("fused_add_rms_norm", False),
                                             ("rms_norm", True)])
def test_lagged_backward_parity(family, chain_dw, norm_lagged, device, seed):
    """The lagged backward (rows in blocks of 4, 32-column segments, lag 1; the weight gradient from partial
    rows or chained) through both launchers, 9 rows of 100 columns, bit for bit; the forward's statistics come
    from the torch launcher."""
    norm_lagged(rows=4, lag_bytes=1, block=16, chain_dw=chain_dw)
    plan = _assert_backward_parity(family, (9, 100), device, seed, lagged=32)
    assert plan.launches[0].kernel.fn.__name__ == "_rms_norm_lagged_backward_kernel"


@pytest.mark.parametrize("n_cols,chunk", [(32800, 8192), (65541, 16384)])
def test_layer_norm_wide_default_forward_parity(n_cols, chunk, device, seed):
    """LayerNorm's chunked forward at its default launch by width past its held rows (layer_norm._CHUNKED_BY_WIDTH:
    8192-column chunks from 32768 columns, 16384 with prefetch from 65536, here with a 32- and a 5-column partial
    last chunk) through both launchers, bit for bit."""
    from liger_core import layer_norm
    from liger_core.launch import ArrayInfo
    from liger_jax._launch import run_plan as run_jax
    from liger_torch._launch import run_plan as run_torch

    rng = np.random.default_rng(seed)
    shape = (2, n_cols)
    x, w, b = (np.asarray(rng.standard_normal(s) * 2 + 0.5, jnp.bfloat16) for s in (shape, n_cols, n_cols))
    vector = ArrayInfo.contiguous((n_cols,), "bfloat16")
    plan = layer_norm.forward_plan(ArrayInfo.contiguous(shape, "bfloat16"), vector, vector, eps=1e-5)
    assert plan.launches[0].constexprs["CHUNK"] == chunk
    inputs = dict(x=x, weight=w, bias=b)
    got_torch = run_torch(plan, **{k: to_torch(v, device) for k, v in inputs.items()})
    got_jax = run_jax(plan, **{k: jnp.asarray(v) for k, v in inputs.items()})
    for name, t, j in zip(plan.outputs, got_torch, got_jax):
        assert_parity(as_numpy(t), np.asarray(j), name)


@pytest.mark.parametrize("family", NORM_FAMILIES)
def test_held_row_past_16384_columns_parity(family, device, seed):
    """A held 16400-column row (a 32768-wide block at 16 warps; LayerNorm's w and b loaded after the reductions,
    the RMSNorms' default there; LayerNorm holds bf16 rows by default from 28672 columns) through both launchers,
    bit for bit."""
    from liger_core.launch import ArrayInfo
    from liger_jax._launch import run_plan as run_jax
    from liger_torch._launch import run_plan as run_torch

    rng = np.random.default_rng(seed)
    shape = (2, 16400)
    x, r = (np.asarray(rng.standard_normal(shape) * 2 + 0.5, jnp.bfloat16) for _ in range(2))
    w, b = (np.asarray(rng.standard_normal(shape[-1]), jnp.bfloat16) for _ in range(2))
    plan = norm_forward_plan(family, ArrayInfo.contiguous(shape, "bfloat16"),
                             ArrayInfo.contiguous((shape[-1],), "bfloat16"), chunk=0)
    launch = plan.launches[0]
    assert launch.kernel.fn.__name__ == f"_{family}_forward_kernel" and launch.constexprs["BLOCK_N"] == 32768
    arrays = dict(x=x, residual=r, weight=w, bias=b)
    inputs = {name: arrays[name] for name in plan.inputs}
    got_torch = run_torch(plan, **{k: to_torch(v, device) for k, v in inputs.items()})
    got_jax = run_jax(plan, **{k: jnp.asarray(v) for k, v in inputs.items()})
    for name, t, j in zip(plan.outputs, got_torch, got_jax):
        assert_parity(as_numpy(t), np.asarray(j), name)

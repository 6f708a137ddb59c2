"""The kernels under ``jax.jit`` with sharded inputs on a 4-device CPU mesh, against the unsharded result.

Rows (tokens, batch, heads) are sharded over "data"; each op must run shard by shard (no all-gather of a
row-sharded operand in the compiled HLO), reduce weight gradients and losses over the shards, and divide a
mean by the global count. Row-wise outputs are the same kernel on the same rows: bitwise equal; reductions
differ only by summation order. On a 2x2 ("data", "model") mesh the weights are FSDP-sharded on "model": they
(and nothing else) are gathered.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import liger_jax
from helpers import assert_close

pytestmark = pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (conftest forces 4 CPU devices)")


def _mesh(shape=(4,), names=("data",), explicit=False):
    """Auto axes (shardings given to jit, partitioned by the rules in the compiler) or Explicit ones
    (sharding in types, jax.make_mesh's default here: the rules applied through shard_map while tracing)."""
    kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(shape))


def _sharded(fn, args, specs, mesh):
    """fn under jit on ``args`` placed with ``specs`` (None: leave the argument out); its result and HLO."""
    placed = [a if s is None else jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
    compiled = jax.jit(fn).lower(*placed).compile()
    return compiled(*placed), compiled.as_text()


def _gathered(hlo):
    """Result shapes of every all-gather in the HLO."""
    shapes = []
    for result_type in re.findall(r"=\s*(.*?)\sall-gather(?:-start)?\(", hlo):  # "%x = f32[4,5]{1,0} all-gather("
        shapes += [tuple(int(d) for d in dims.split(",") if d) for dims in re.findall(r"\w+\[([\d,]*)\]", result_type)]
    assert shapes or "all-gather" not in hlo.replace("all-gather-", ""), "an all-gather the pattern missed"
    return shapes


def _assert_no_gather(hlo, allowed=()):
    bad = [s for s in _gathered(hlo) if s not in {tuple(a) for a in allowed}]
    assert not bad, f"all-gathers of {bad} in the compiled HLO (allowed: {list(allowed)})"


def _exact(got, want, name):
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32), err_msg=name)


def _check(got, want, exact, dtype=jnp.float32, scale=4.0):
    """Per-output comparison: ``exact`` names the row-wise outputs, the rest are reductions."""
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype, f"output {i}: {g.shape} {g.dtype} vs {w.shape} {w.dtype}"
        if i in exact:
            _exact(g, w, f"output {i}")
        else:
            assert_close(np.asarray(g, np.float32), np.asarray(w, np.float32), dtype, f"output {i}", scale=scale)


def _probe_loss(fn, probes):
    """A scalar of fn's outputs weighted by fixed probes, so every output element gets its own cotangent."""
    def loss(*args):
        outs = jax.tree.leaves(fn(*args))
        return sum(jnp.sum(o.astype(jnp.float32) * p) for o, p in zip(outs, probes))
    return loss


def _probes(seed, fn, args):
    outs = jax.tree.leaves(jax.eval_shape(fn, *args))
    keys = jax.random.split(jax.random.key(seed), len(outs))
    return [jax.random.normal(k, o.shape, jnp.float32) for k, o in zip(keys, outs)]


def _normal(seed, *shapes, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return [jax.random.normal(k, s, jnp.float32).astype(dtype) for k, s in zip(keys, shapes)]


def _fwd_and_grad(fn, args, specs, argnums, seed, mesh, exact_fwd, exact_grad, dtype=jnp.float32,
                  allowed_gathers=(), scale=4.0):
    """Forward and gradient, sharded vs unsharded; no all-gather beyond ``allowed_gathers``."""
    want = jax.jit(fn)(*args)
    got, hlo = _sharded(fn, args, specs, mesh)
    _check(got, want, exact_fwd, dtype, scale)
    _assert_no_gather(hlo, allowed_gathers)
    grad = jax.grad(_probe_loss(fn, _probes(seed, fn, args)), argnums=argnums)
    want = jax.jit(grad)(*args)
    got, hlo = _sharded(grad, args, specs, mesh)
    _check(got, want, exact_grad, dtype, scale)
    _assert_no_gather(hlo, allowed_gathers)


# ---------------------------------------------------------------------------------------------------------
# Norms and elementwise kernels


@pytest.mark.parametrize("dtype,explicit", [(jnp.float32, False), (jnp.float32, True), (jnp.bfloat16, False)])
def test_rms_norm_batch_sharded(dtype, explicit, seed):
    x, scale = _normal(seed, (8, 3, 32), (32,), dtype=dtype)
    fn = lambda a, s: liger_jax.rms_norm(a, s)  # noqa: E731
    mesh = _mesh(explicit=explicit)
    y, hlo = _sharded(fn, (x, scale), (P("data"), P()), mesh)
    assert "all-gather" not in hlo and "all-reduce" not in hlo, "the batch-sharded forward must not communicate"
    assert y.sharding.spec[0] == "data"
    _exact(y, jax.jit(fn)(x, scale), "y")
    _fwd_and_grad(fn, (x, scale), (P("data"), P()), (0, 1), seed, mesh, exact_fwd={0}, exact_grad={0},
                  dtype=dtype)


def test_rms_norm_fsdp_scale_and_two_row_axes(seed):
    """2x2 mesh: rows sharded over both axes, or over "data" with the scale sharded (FSDP) on "model"."""
    x, scale = _normal(seed, (4, 6, 32), (32,))
    fn = lambda a, s: liger_jax.rms_norm(a, s, offset=1.0)  # noqa: E731
    _fwd_and_grad(fn, (x, scale), (P("data", "model"), P()), (0, 1), seed, _mesh((2, 2), ("data", "model")),
                  {0}, {0})
    for explicit in (False, True):
        _fwd_and_grad(fn, (x, scale), (P("data"), P("model")), (0, 1), seed,
                      _mesh((2, 2), ("data", "model"), explicit), {0}, {0}, allowed_gathers=[(32,)])


def test_rms_norm_vmap_over_a_sharded_batch(seed):
    """vmap folds the batch into the rows; the per-example scale gradients stay with their shard."""
    x, scale, probe = _normal(seed, (4, 6, 32), (32,), (4, 6, 32))
    per_example = jax.grad(lambda a, s, p: jnp.sum(liger_jax.rms_norm(a, s) * p), argnums=(0, 1))
    fn = jax.vmap(per_example, in_axes=(0, None, 0))
    want = jax.jit(fn)(x, scale, probe)
    got, hlo = _sharded(fn, (x, scale, probe), (P("data"), P(), P("data")), _mesh())
    _check(got, want, exact={0})
    assert got[1].shape == (4, 32)
    _assert_no_gather(hlo)


def test_rms_norm_uneven_rows_are_not_padded_into_the_sums(seed):
    """6 rows cannot split over 4 devices: the op takes them whole (padding rows would enter dW)."""
    x, scale = _normal(seed, (8, 32), (32,))
    fn = lambda a, s: liger_jax.rms_norm(a[:6], s)  # noqa: E731
    # (explicit sharding refuses the uneven slice itself: Auto axes only)
    _fwd_and_grad(fn, (x, scale), (P("data"), P()), (0, 1), seed, _mesh(), {0}, {0},
                  allowed_gathers=[(8, 32), (6, 32), (6,), (8,)])


def test_gspmd_partitioner(seed):
    """The same rules through GSPMD's infer_sharding_from_operands, where that partitioner still exists."""
    if not hasattr(jax.config, "jax_use_shardy_partitioner"):
        pytest.skip("no GSPMD switch in this jax")
    x, scale = _normal(seed, (8, 32), (32,))
    logits, = _normal(seed + 1, (8, 3, 17))
    labels = jnp.arange(24).reshape(8, 3) % 17
    saved = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        _fwd_and_grad(lambda a, s: liger_jax.rms_norm(a, s), (x, scale), (P("data"), P()), (0, 1), seed, _mesh(),
                      {0}, {0})
        _fwd_and_grad(lambda a, t: liger_jax.cross_entropy(a, t), (logits, labels), (P("data"), P("data")), 0,
                      seed, _mesh(), set(), {0})
    finally:
        jax.config.update("jax_use_shardy_partitioner", saved)


def test_layer_norm_batch_sharded(seed):
    x, scale, bias = _normal(seed, (4, 5, 24), (24,), (24,))
    _fwd_and_grad(lambda a, s, b: liger_jax.layer_norm(a, s, b), (x, scale, bias), (P("data"), P(), P()),
                  (0, 1, 2), seed, _mesh(), {0}, {0})


def test_layer_norm_fsdp(seed):
    x, scale, bias = _normal(seed, (4, 4, 24), (24,), (24,))
    _fwd_and_grad(lambda a, s, b: liger_jax.layer_norm(a, s, b), (x, scale, bias),
                  (P("data"), P("model"), P("model")), (0, 1, 2), seed, _mesh((2, 2), ("data", "model"), True),
                  {0}, {0}, allowed_gathers=[(24,)])


def test_fused_add_rms_norm_batch_sharded(seed):
    x, residual, scale = _normal(seed, (8, 16), (8, 16), (16,))
    _fwd_and_grad(lambda a, r, s: liger_jax.fused_add_rms_norm(a, r, s), (x, residual, scale),
                  (P("data"), P("data"), P()), (0, 1, 2), seed, _mesh(), {0, 1}, {0, 1})


def test_swiglu_rows_and_intermediate_axis_stay_sharded(seed):
    """Elementwise: rows over "data" and the intermediate axis over "model" (tensor parallel), no gather."""
    a, b = _normal(seed, (4, 3, 20), (4, 3, 20))
    for fn in (liger_jax.swiglu, liger_jax.geglu):
        _fwd_and_grad(fn, (a, b), (P("data"), P("data")), (0, 1), seed, _mesh(), {0}, {0, 1})
        _fwd_and_grad(fn, (a, b), (P("data", None, "model"),) * 2, (0, 1), seed,
                      _mesh((2, 2), ("data", "model"), True), {0}, {0, 1})


def test_rope_batch_heads_and_sequence_sharded(seed):
    q, k, cos, sin = _normal(seed, (2, 4, 2, 8), (2, 4, 4, 8), (4, 8), (4, 8))
    fn = lambda a, b, c, s: liger_jax.rope(a, b, c, s)  # noqa: E731
    args = (q, k, cos, sin)
    # batch over "data", heads over "model" (q's 2 and k's 4 heads are separate factors)
    _fwd_and_grad(fn, args, (P("data", None, "model"),) * 2 + (P(), P()), (0, 1), seed,
                  _mesh((2, 2), ("data", "model"), True), {0, 1}, {0, 1})
    # the sequence over "data", cos/sin sliced along it
    _fwd_and_grad(fn, args, (P(None, "data"), P(None, "data"), P("data"), P("data")), (0, 1), seed, _mesh(),
                  {0, 1}, {0, 1})
    # the sequence over "data", positions from position_ids into whole tables
    table_cos, table_sin = _normal(seed + 1, (11, 8), (11, 8))
    pos = (jnp.arange(2 * 4).reshape(2, 4) * 3) % 11
    fn = lambda a, b, c, s, p: liger_jax.rope(a, b, c, s, position_ids=p)  # noqa: E731
    _fwd_and_grad(fn, (q, k, table_cos, table_sin, pos), (P(None, "data"),) * 2 + (P(), P(), P(None, "data")),
                  (0, 1), seed, _mesh(), {0, 1}, {0, 1})


# ---------------------------------------------------------------------------------------------------------
# Losses: the mean divides by the global count


def _labels(seed, shape, vocab, ignore_first=5):
    """Labels with the first ``ignore_first`` rows ignored: the shards keep different counts of rows."""
    labels = jax.random.randint(jax.random.key(seed), shape, 0, vocab)
    flat = labels.reshape(-1)
    return flat.at[:ignore_first].set(-100).reshape(shape)


@pytest.mark.parametrize("reduction,kw,explicit", [
    ("mean", {}, False),
    ("mean", dict(label_smoothing=0.1, lse_square_scale=1e-2, return_z_loss=True), True),
    ("sum", {}, True),
    ("none", {}, False),
])
def test_cross_entropy_token_sharded(reduction, kw, explicit, seed):
    logits, = _normal(seed, (8, 3, 33))
    labels = _labels(seed, (8, 3), 33)
    weight = jnp.linspace(0.5, 1.5, 33)
    fn = lambda a, t, w: liger_jax.cross_entropy(a, t, weight=w, reduction=reduction, **kw)  # noqa: E731
    exact = {0, 1} if reduction == "none" else set()
    _fwd_and_grad(fn, (logits, labels, weight), (P("data"), P("data"), P()), 0, seed, _mesh(explicit=explicit),
                  exact, {0})


def test_cross_entropy_all_ignored_on_one_shard(seed):
    logits, = _normal(seed, (8, 17))
    labels = _labels(seed, (8,), 17, ignore_first=2)  # device 0 keeps no label
    _fwd_and_grad(lambda a, t: liger_jax.cross_entropy(a, t), (logits, labels), (P("data"), P("data")), 0, seed,
                  _mesh(), set(), {0})


@pytest.mark.parametrize("reduction", ["mean", "batchmean", "sum", "none"])
def test_kl_div_sharded(reduction, seed):
    x, t = _normal(seed, (8, 20), (8, 20))
    x, t = jax.nn.log_softmax(x), jax.nn.softmax(t)
    fn = lambda a, b: liger_jax.kl_div(a, b, reduction=reduction)  # noqa: E731
    exact = {0} if reduction == "none" else set()
    _fwd_and_grad(fn, (x, t), (P("data"), P("data")), 0, seed, _mesh(), exact, set())
    # every axis may stay sharded: the class axis too
    _fwd_and_grad(fn, (x, t), (P("data", "model"),) * 2, 0, seed, _mesh((2, 2), ("data", "model"), True), exact,
                  set())


@pytest.mark.parametrize("with_labels,explicit", [(False, False), (True, True)])
def test_jsd_sharded(with_labels, explicit, seed):
    s, t = _normal(seed, (4, 3, 19), (4, 3, 19))
    s, t = jax.nn.log_softmax(s), jax.nn.log_softmax(t)
    args = (s, t) + ((_labels(seed, (4, 3), 19),) if with_labels else ())
    _fwd_and_grad(lambda *a: liger_jax.jsd(*a, beta=0.3), args, (P("data"),) * len(args), 0, seed,
                  _mesh(explicit=explicit), set(), set())


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fused_linear_cross_entropy_sharded(reduction, seed):
    x, kernel, bias = _normal(seed, (8, 3, 16), (16, 40), (40,))
    labels = _labels(seed, (8, 3), 40)
    fn = lambda a, w, b, t: liger_jax.fused_linear_cross_entropy(a, w, t, b, reduction=reduction,  # noqa: E731
                                                               chunk_size=2)
    args = (x, kernel, bias, labels)
    _fwd_and_grad(fn, args, (P("data"), P(), P(), P("data")), (0, 1, 2), seed, _mesh(), set(), set())
    # FSDP: the kernel and bias sharded on "model" are gathered, the tokens are not
    _fwd_and_grad(fn, args, (P("data"), P(None, "model"), P("model"), P("data")), (0, 1, 2), seed,
                  _mesh((2, 2), ("data", "model"), True), set(), set(), allowed_gathers=[(16, 40), (40,)])


def test_fused_linear_jsd_sharded(seed):
    xs, ws, xt, wt = _normal(seed, (8, 2, 12), (12, 30), (8, 2, 10), (10, 30))
    labels = _labels(seed, (8, 2), 30)
    fn = lambda a, w, b, v, t: liger_jax.fused_linear_jsd(a, w, b, v, t, beta=0.4)  # noqa: E731
    args = (xs, ws, xt, wt, labels)
    _fwd_and_grad(fn, args, (P("data"), P(), P("data"), P(), P("data")), (0, 1), seed, _mesh(), set(), set())
    _fwd_and_grad(fn, args, (P("data"), P(None, "model"), P("data"), P(), P("data")), (0, 1), seed,
                  _mesh((2, 2), ("data", "model"), True), set(), set(), allowed_gathers=[(12, 30)])


# ---------------------------------------------------------------------------------------------------------
# Inside a user's shard_map the ops are local (the body runs per device, no partitioning)


def test_inside_shard_map_the_op_is_local(seed):
    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:
        from jax.experimental.shard_map import shard_map
    x, scale = _normal(seed, (8, 32), (32,))
    mesh = _mesh()
    fn = shard_map(lambda a, s: liger_jax.rms_norm(a, s), mesh=mesh, in_specs=(P("data"), P()),
                   out_specs=P("data"))
    _exact(jax.jit(fn)(x, scale), jax.jit(liger_jax.rms_norm)(x, scale), "y")
    logits, = _normal(seed + 1, (8, 17))
    labels = _labels(seed, (8,), 17, ignore_first=3)
    per_shard = shard_map(lambda a, t: liger_jax.cross_entropy(a, t, reduction="sum")[None], mesh=mesh,
                          in_specs=(P("data"), P("data")), out_specs=P("data"))
    got = jax.jit(per_shard)(logits, labels)
    want = [liger_jax.cross_entropy(logits[i:i + 2], labels[i:i + 2], reduction="sum") for i in range(0, 8, 2)]
    _exact(got, jnp.stack(want), "per-shard sums")
    assert math.isclose(float(got.sum()), float(liger_jax.cross_entropy(logits, labels, reduction="sum")),
                        rel_tol=1e-5)

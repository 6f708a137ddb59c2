"""liger_jax.swiglu / geglu and liger_jax.nnx.SwiGLUMLP / GeGLUMLP against float64 jnp references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liger_jax
from helpers import assert_close, x64

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
ACTS = {
    "swiglu": (liger_jax.swiglu, lambda a, b: jax.nn.silu(a) * b),
    "geglu_tanh": (lambda a, b: liger_jax.geglu(a, b, approximate="tanh"), lambda a, b: jax.nn.gelu(a) * b),
    "geglu_erf": (lambda a, b: liger_jax.geglu(a, b, approximate="none"),
                  lambda a, b: jax.nn.gelu(a, approximate=False) * b),
}


def draw(seed, shape, dtype):
    rng = np.random.default_rng(seed)
    a = jnp.asarray(rng.standard_normal(shape) * 3, dtype)
    b = jnp.asarray(rng.standard_normal(shape), dtype)
    probe = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    return a, b, probe


def check(act, a, b, probe, dtype):
    ours, ref = ACTS[act]
    c = jax.jit(ours)(a, b)
    assert c.dtype == dtype
    da, db = jax.jit(jax.grad(lambda x, y: jnp.sum(ours(x, y).astype(jnp.float32) * probe), argnums=(0, 1)))(a, b)
    assert da.dtype == dtype and db.dtype == dtype
    with x64():
        def both(x, y):
            x, y = x.astype(jnp.float64), y.astype(jnp.float64)
            return ref(x, y), jax.grad(lambda u, v: jnp.sum(ref(u, v) * probe), argnums=(0, 1))(x, y)

        c_ref, (da_ref, db_ref) = jax.jit(both)(a, b)
    for got, want, name in ((c, c_ref, "c"), (da, da_ref, "da"), (db, db_ref, "db")):
        assert_close(np.asarray(got.astype(jnp.float32)), np.asarray(want), dtype, f"{act} {name}")


@pytest.mark.parametrize("shape", [(1, 64), (2, 3, 123)])
@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_and_grads(shape, act, dtype, seed):
    a, b, probe = draw(seed, shape, dtype)
    check(act, a, b, probe, dtype)


@pytest.mark.parametrize("act", list(ACTS))
def test_activation_accurate_over_the_whole_range(act, seed):
    a = jnp.concatenate([jnp.linspace(-100, 100, 301), jnp.asarray([0.0, 1e-30, -1e-30, 88.0, -88.0, 1e4, -1e4])])
    a = a[None].astype(jnp.float32)
    probe = jnp.asarray(np.random.default_rng(seed).standard_normal(a.shape), jnp.float32)
    check(act, a, jnp.ones_like(a), probe, jnp.float32)


@pytest.mark.parametrize("in_axes", [(0, 0), (1, None), (None, 0)])
def test_vmap(in_axes, seed):
    a, b, probe = draw(seed, (3, 5, 40), jnp.float32)
    if in_axes[1] is None:
        b = b[:, 0]
    if in_axes[0] is None:
        a = a[0]
    probe = probe if in_axes[0] != 1 else jnp.swapaxes(probe, 0, 1)
    for act, (ours, ref) in ACTS.items():
        grad = lambda f: jax.vmap(jax.grad(lambda x, y, p: jnp.sum(f(x, y) * p), argnums=(0, 1)),
                                  in_axes=in_axes + (0,))
        got = jax.jit(grad(ours))(a, b, probe)
        got_fwd = jax.vmap(ours, in_axes=in_axes)(a, b)
        with x64():
            want = jax.jit(grad(ref))(a, b, probe)
            want_fwd = jax.jit(jax.vmap(ref, in_axes=in_axes))(a, b)
        # an unbatched argument's gradient comes back summed over the batch: allow a few roundings
        for g, w, name in zip((got_fwd,) + tuple(got), (want_fwd,) + tuple(want), ("c", "da", "db")):
            assert g.shape == w.shape
            assert_close(np.asarray(g), np.asarray(w), jnp.float32, f"{act} {name}", scale=2.0)


def test_checkpoint_and_determinism(seed):
    a, b, probe = draw(seed, (7, 123), jnp.float32)
    f = lambda x, y: jnp.sum(liger_jax.geglu(x, y) * probe) + jnp.sum(liger_jax.swiglu(x, y) ** 2)
    plain = jax.grad(f, argnums=(0, 1))(a, b)
    remat = jax.jit(jax.grad(jax.checkpoint(f), argnums=(0, 1)))(a, b)
    again = jax.jit(jax.grad(jax.checkpoint(f), argnums=(0, 1)))(a, b)
    for x, y, z in zip(plain, remat, again):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        np.testing.assert_array_equal(np.asarray(y), np.asarray(z))


def test_inputs_survive_the_in_place_backward(seed):
    """The backward writes da/db over a/b through input_output_aliases: XLA must keep a and b intact."""
    a, b, probe = draw(seed, (7, 123), jnp.float32)
    a0, b0 = np.asarray(a).copy(), np.asarray(b).copy()
    g = jax.jit(jax.grad(lambda x, y: jnp.sum(liger_jax.swiglu(x, y) * probe) + jnp.sum(x * y), argnums=(0, 1)))
    da, db = g(a, b)
    np.testing.assert_array_equal(np.asarray(a), a0)
    np.testing.assert_array_equal(np.asarray(b), b0)
    with x64():
        ref = jax.jit(jax.grad(lambda x, y: jnp.sum(jax.nn.silu(x) * y * probe) + jnp.sum(x * y), argnums=(0, 1)))
        da_ref, db_ref = ref(a.astype(jnp.float64), b.astype(jnp.float64))
    assert_close(np.asarray(da), np.asarray(da_ref), jnp.float32, "da")
    assert_close(np.asarray(db), np.asarray(db_ref), jnp.float32, "db")


@pytest.mark.parametrize("cls,approximate", [("SwiGLUMLP", None), ("GeGLUMLP", "tanh"), ("GeGLUMLP", "none")])
@pytest.mark.parametrize("use_bias", [False, True])
def test_nnx_mlp(cls, approximate, use_bias, seed):
    from flax import nnx

    kwargs = {} if approximate is None else {"approximate": approximate}
    mlp = getattr(liger_jax.nnx, cls)(48, 123, use_bias=use_bias, rngs=nnx.Rngs(seed % 1000), **kwargs)
    assert {"gate_proj", "up_proj", "down_proj"} <= set(vars(mlp))
    assert all(isinstance(getattr(mlp, n), nnx.Linear) for n in ("gate_proj", "up_proj", "down_proj"))
    if use_bias:  # non-zero biases, so that they are exercised
        for n in ("gate_proj", "up_proj", "down_proj"):
            lin = getattr(mlp, n)
            lin.bias.value = jnp.asarray(np.random.default_rng(seed).standard_normal(lin.bias.value.shape) * 0.1,
                                         jnp.float32)
    x = jnp.asarray(np.random.default_rng(seed).standard_normal((2, 3, 48)), jnp.float32)
    act = {None: jax.nn.silu, "tanh": jax.nn.gelu, "none": lambda v: jax.nn.gelu(v, approximate=False)}[approximate]

    def plain(m, v):
        return m.down_proj(act(m.gate_proj(v)) * m.up_proj(v))

    assert_close(np.asarray(mlp(x)), np.asarray(plain(mlp, x)), jnp.float32, "y", scale=2.0)
    g_ours = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(mlp)
    g_ref = nnx.grad(lambda m: jnp.sum(plain(m, x) ** 2))(mlp)
    for (path, got), (_, want) in zip(jax.tree_util.tree_leaves_with_path(g_ours),
                                      jax.tree_util.tree_leaves_with_path(g_ref)):
        assert_close(np.asarray(got), np.asarray(want), jnp.float32, str(path), scale=8.0)


def test_nnx_geglu_refuses_bad_approximate():
    from flax import nnx

    with pytest.raises(ValueError, match="approximate"):
        liger_jax.nnx.GeGLUMLP(8, 16, approximate="erf", rngs=nnx.Rngs(0))


@pytest.mark.parametrize("a,b,error,match", [
    (np.ones((4, 8), np.float32), np.ones((4, 7), np.float32), ValueError, "b must have the shape of a"),
    (np.ones((4, 8), np.float32), np.ones((4, 8), np.float16), TypeError, "b must have a's dtype"),
    (np.ones((4, 8), np.int32), np.ones((4, 8), np.int32), TypeError, "a must have a floating"),
    (np.ones((0, 8), np.float32), np.ones((0, 8), np.float32), ValueError, "a must not be empty"),
    ([[1.0]], np.ones((1, 1), np.float32), TypeError, "a must be a jax or numpy array"),
])
def test_bad_input(a, b, error, match):
    with pytest.raises(error, match=match):
        liger_jax.swiglu(a, b)
    with pytest.raises(error, match=match):
        liger_jax.geglu(a, b)
    with pytest.raises(ValueError, match="approximate"):
        liger_jax.geglu(np.ones((2, 2), np.float32), np.ones((2, 2), np.float32), approximate="erf")


LINEAR_ACTS = {
    "swiglu": (liger_jax.swiglu_linear, ACTS["swiglu"][1]),
    "geglu_tanh": (lambda a, b, k, bias=None: liger_jax.geglu_linear(a, b, k, bias), ACTS["geglu_tanh"][1]),
    "geglu_erf": (lambda a, b, k, bias=None: liger_jax.geglu_linear(a, b, k, bias, approximate="none"),
                  ACTS["geglu_erf"][1]),
}


def check_gated_linear(act, a, b, kernel, bias, probe):
    """swiglu_linear / geglu_linear (Flax (I, O) kernel layout): the output and the gradients of a, b, the
    kernel and the bias (None: no bias), for the loss sum(y * probe). fp32 against float64. bf16/fp16 against
    the unfused ``gate(a, b) @ kernel + bias`` in that dtype: XLA's CPU matmul rounds half-precision partial
    sums (errors of ~0.1 on sums of six products of magnitude ~10 were seen against float64 for both), so
    float64 would test XLA's CPU dot, not this op; the gate kernel itself is checked against float64 above."""
    ours, ref = LINEAR_ACTS[act]
    dtype = a.dtype

    def loss(f, *args):
        return jnp.sum(f(*args).astype(jnp.float32) * probe)

    args = (a, b, kernel) + ((bias,) if bias is not None else ())
    argnums = tuple(range(len(args)))
    y = jax.jit(ours)(*args)
    grads = jax.jit(jax.grad(lambda *t: loss(ours, *t), argnums=argnums))(*args)
    if dtype == jnp.float32:
        with x64():
            def ref_linear(x, y_, k, *rest):
                out = ref(x, y_) @ k
                return out + rest[0] if rest else out

            args64 = tuple(t.astype(jnp.float64) for t in args)
            y_ref = ref_linear(*args64)
            grads_ref = jax.grad(lambda *t: jnp.sum(ref_linear(*t) * probe), argnums=argnums)(*args64)
    else:
        gate = {"swiglu": liger_jax.swiglu, "geglu_tanh": liger_jax.geglu,
                "geglu_erf": lambda x, y_: liger_jax.geglu(x, y_, approximate="none")}[act]

        def unfused(x, y_, k, *rest):
            out = gate(x, y_) @ k
            return out + rest[0] if rest else out

        y_ref = jax.jit(unfused)(*args)
        grads_ref = jax.jit(jax.grad(lambda *t: loss(unfused, *t), argnums=argnums))(*args)
        y_ref, grads_ref = y_ref.astype(jnp.float32), [g.astype(jnp.float32) for g in grads_ref]
    assert y.dtype == dtype
    assert_close(np.asarray(y.astype(jnp.float32)), np.asarray(y_ref), dtype, "y", scale=4.0)
    for got, want, name in zip(grads, grads_ref, ("da", "db", "dkernel", "dbias")):
        assert got.dtype == dtype, name
        assert_close(np.asarray(got.astype(jnp.float32)), np.asarray(want), dtype, name, scale=4.0)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("act", list(LINEAR_ACTS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gated_linear_forward_and_grads(dtype, act, bias, seed):
    rng = np.random.default_rng(seed)
    a, b, _ = draw(seed, (2, 3, 123), dtype)
    kernel = jnp.asarray(rng.standard_normal((123, 37)) / 11, dtype)
    bb = jnp.asarray(rng.standard_normal(37), dtype) if bias else None
    probe = jnp.asarray(rng.standard_normal((2, 3, 37)), jnp.float32)
    check_gated_linear(act, a, b, kernel, bb, probe)


def test_gated_linear_keeps_a_and_b_but_not_the_product(seed):
    """The residuals the backward keeps: a and b (and the kernel), not the (N, I) product that
    ``swiglu(a, b) @ kernel`` keeps; the nnx MLPs use the same path."""
    from jax._src.ad_checkpoint import saved_residuals  # public only as print_saved_residuals

    a, b, _ = draw(seed, (5, 96), jnp.float32)
    kernel = jnp.ones((96, 16), jnp.float32)

    def n_activations(f):
        return sum(1 for aval, _ in saved_residuals(f, a, b, kernel) if tuple(aval.shape) == (5, 96))

    assert n_activations(lambda x, y, k: jnp.sum(liger_jax.swiglu_linear(x, y, k))) == 2
    assert n_activations(lambda x, y, k: jnp.sum(liger_jax.swiglu(x, y) @ k)) == 3

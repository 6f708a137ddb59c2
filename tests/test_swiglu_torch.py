"""liger_torch.swiglu / geglu and the SwiGLUMLP / GeGLUMLP modules against float64 references (HF's own
LlamaMLP / GemmaMLP in float64 for the modules), forward and backward."""

import pytest
import torch
import torch.nn.functional as F

import liger_torch
from helpers import TOLERANCES, assert_close

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 64), (7, 123), (2, 3, 123)]
# (our function, float64 reference of HF's act_fn(gate) * up)
ACTS = {
    "swiglu": (liger_torch.swiglu, lambda a, b: F.silu(a) * b),
    "geglu_tanh": (lambda a, b, **kw: liger_torch.geglu(a, b, "tanh", **kw),
                   lambda a, b: F.gelu(a, approximate="tanh") * b),
    "geglu_erf": (lambda a, b, **kw: liger_torch.geglu(a, b, "none", **kw), lambda a, b: F.gelu(a) * b),
}


def grads_of(fn, a, b, g):
    a = a.detach().clone().requires_grad_(True)
    b = b.detach().clone().requires_grad_(True)
    c = fn(a, b)
    c.backward(g)
    return c, a.grad, b.grad


def check(act, a, b, dtype, gen, **kwargs):
    ours, ref = ACTS[act]
    g = torch.randn(a.shape, generator=gen).to(a.device, dtype)
    got = grads_of(lambda x, y: ours(x, y, **kwargs), a, b, g.clone())
    want = grads_of(lambda x, y: ref(x.double(), y.double()), a, b, g.double())
    assert got[0].dtype == dtype and got[1].dtype == dtype
    for x, y, name in zip(got, want, ("c", "da", "db")):
        assert_close(x, y, dtype, f"{act} {name}")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_backward(shape, act, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    a = (torch.randn(shape, generator=gen) * 3).to(device, dtype)
    b = torch.randn(shape, generator=gen).to(device, dtype)
    check(act, a, b, dtype, gen)


@pytest.mark.parametrize("act", list(ACTS))
def test_activation_accurate_over_the_whole_range(act, device, seed):
    """fp32 tanh-from-exp / erf / sigmoid, from deep negative to large positive (no inf/NaN, saturation)."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.cat([torch.linspace(-100, 100, 301), torch.randn(200, generator=gen) * 4,
                   torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 1e4, -1e4])]).to(device)[None]
    b = torch.ones_like(a)
    check(act, a, b, torch.float32, gen)


def test_gelu_tanh_derivative_keeps_its_digits_in_the_negative_tail(device):
    """For a in [-5.5, -3], gelu_tanh'(a) is 1e-9..1e-3: an absolute tolerance would pass a 0 there, which
    is what 1 + tanh(u) (cancelling to 0 in fp32) once gave on the GPU. Relative accuracy of fp32 is required."""
    a = torch.linspace(-5.5, -3.0, 101, dtype=torch.float32)[None].to(device)
    _, da, _ = grads_of(lambda x, y: liger_torch.geglu(x, y, "tanh"), a, torch.ones_like(a), torch.ones_like(a))
    _, want, _ = grads_of(lambda x, y: F.gelu(x, approximate="tanh") * y, a.double(), torch.ones_like(a).double(),
                          torch.ones_like(a).double())
    rel = ((da.double() - want).abs() / want.abs()).max().item()
    assert rel <= 2e-5, f"gelu_tanh'(a) relative error {rel:.2e} in the negative tail"


@pytest.mark.parametrize("layout", ["chunked", "transposed", "strided_columns"])
def test_non_contiguous_inputs(layout, device, seed):
    gen = torch.Generator().manual_seed(seed)
    if layout == "chunked":  # gate and up halves of one fused projection: by strides, no copy
        a, b = torch.randn(7, 246, generator=gen).to(device).chunk(2, dim=-1)
    elif layout == "transposed":  # leading axes that do not fold: copied
        a = torch.randn(5, 3, 123, generator=gen).to(device).transpose(0, 1)
        b = torch.randn(5, 3, 123, generator=gen).to(device).transpose(0, 1)
    else:
        a = torch.randn(7, 246, generator=gen).to(device)[:, ::2]
        b = torch.randn(7, 246, generator=gen).to(device)[:, 1::2]
    assert not a.is_contiguous()
    for act in ACTS:
        check(act, a, b, torch.float32, gen)


def test_in_place_backward_is_opt_in(device, seed):
    """Default: a and b untouched. in_place=True: da/db live in a's and b's memory, and the version bump makes a
    second backward through the same graph fail loudly instead of reading gradients as activations."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(7, 123, generator=gen).to(device).requires_grad_(True)
    y = torch.randn(7, 123, generator=gen).to(device).requires_grad_(True)
    g = torch.randn(7, 123, generator=gen).to(device)
    a, b = x * 2, y * 4
    a0, b0 = a.detach().clone(), b.detach().clone()
    liger_torch.swiglu(a, b).backward(g)
    assert torch.equal(a, a0) and torch.equal(b, b0)
    ref = grads_of(lambda p, q: F.silu(p.double() * 2) * (q.double() * 4), x, y, g.double())
    a, b = x * 2, y * 4
    x.grad = y.grad = None
    c = liger_torch.swiglu(a, b, in_place=True)
    c.backward(g, retain_graph=True)
    assert_close(x.grad, ref[1], torch.float32, "dx")
    assert_close(y.grad, ref[2], torch.float32, "dy")
    assert torch.equal(a.detach(), x.grad / 2) and torch.equal(b.detach(), y.grad / 4)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        c.backward(g)


def test_same_tensor_as_gate_and_up_is_not_written_in_place(device, seed):
    x = torch.randn(7, 123, generator=torch.Generator().manual_seed(seed)).to(device).requires_grad_(True)
    h = x * 1.0
    liger_torch.swiglu(h, h, in_place=True).sum().backward()
    ref = x.detach().double().requires_grad_(True)
    (F.silu(ref) * ref).sum().backward()
    assert_close(x.grad, ref.grad, torch.float32, "dx")


def _copy_to_double(ours, hf):
    hf.load_state_dict(ours.state_dict())
    return hf.double()


@pytest.mark.parametrize("mlp_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_mlp_is_drop_in_for_llama_mlp(mlp_bias, dtype, device, seed):
    modeling = pytest.importorskip("transformers.models.llama.modeling_llama")
    torch.manual_seed(seed)
    config = modeling.LlamaConfig(hidden_size=48, intermediate_size=123, mlp_bias=mlp_bias,
                                  num_attention_heads=4, num_key_value_heads=4)
    ours = liger_torch.SwiGLUMLP(config).to(device, dtype)
    hf = modeling.LlamaMLP(config)
    assert set(ours.state_dict()) == set(hf.state_dict())
    hf = _copy_to_double(ours, hf).to(device)
    check_module(ours, hf, (2, 3, 48), dtype, device, seed)


@pytest.mark.parametrize("activation,key", [("gelu_pytorch_tanh", "hidden_act"), ("gelu", "hidden_act"),
                                            ("gelu_pytorch_tanh", "hidden_activation")])
def test_geglu_mlp_is_drop_in_for_gemma_mlp(activation, key, device, seed):
    modeling = pytest.importorskip("transformers.models.gemma.modeling_gemma")
    torch.manual_seed(seed)
    config = modeling.GemmaConfig(hidden_size=48, intermediate_size=123, hidden_act="gelu_pytorch_tanh",
                                  num_attention_heads=4, num_key_value_heads=4, head_dim=12)
    setattr(config, key, activation)
    ours = liger_torch.GeGLUMLP(config).to(device, torch.bfloat16)
    assert ours.activation == ("gelu" if activation == "gelu" else "gelu_tanh")
    config.hidden_act = activation  # HF's GemmaMLP reads hidden_act
    hf = modeling.GemmaMLP(config)
    assert set(ours.state_dict()) == set(hf.state_dict())
    hf = _copy_to_double(ours, hf).to(device)
    check_module(ours, hf, (2, 3, 48), torch.bfloat16, device, seed)


def check_module(ours, hf64, shape, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).to(device, dtype)
    g = torch.randn(shape, generator=gen).to(device, dtype)
    xa = x.clone().requires_grad_(True)
    y = ours(xa)
    y.backward(g)
    xb = x.double().requires_grad_(True)
    y_ref = hf64(xb)
    y_ref.backward(g.double())
    # Three matmuls in the module's dtype around the gate: allow a few roundings more than one op.
    assert_close(y, y_ref, dtype, "y", scale=4.0)
    assert_close(xa.grad, xb.grad, dtype, "dx", scale=4.0)
    params = dict(hf64.named_parameters())
    for name, p in ours.named_parameters():
        assert_close(p.grad, params[name].grad, dtype, f"d{name}", scale=8.0)


def test_mlp_refuses_other_activations():
    from types import SimpleNamespace

    with pytest.raises(ValueError, match="hidden_act"):
        liger_torch.SwiGLUMLP(SimpleNamespace(hidden_size=8, intermediate_size=16, hidden_act="relu"))
    with pytest.raises(ValueError, match="hidden_activation"):
        liger_torch.GeGLUMLP(SimpleNamespace(hidden_size=8, intermediate_size=16, hidden_activation="relu"))


@pytest.mark.parametrize("bad,error,match", [
    (lambda d: (torch.randn(4, 8, device=d), torch.randn(4, 7, device=d)), ValueError, "b must have the shape of a"),
    (lambda d: (torch.randn(4, 8, device=d), torch.randn(4, 8, device=d, dtype=torch.float16)), TypeError,
     "b must have a's dtype"),
    (lambda d: (torch.ones(4, 8, dtype=torch.int32, device=d), torch.ones(4, 8, dtype=torch.int32, device=d)),
     TypeError, "a must have a floating"),
    (lambda d: (torch.randn(0, 8, device=d), torch.randn(0, 8, device=d)), ValueError, "a must not be empty"),
    (lambda d: (torch.tensor(3.0, device=d), torch.tensor(3.0, device=d)), ValueError, "a must have at least one"),
    (lambda d: (torch.randn(4, 8, device=d), [1.0]), TypeError, "b must be a torch.Tensor"),
])
def test_bad_input_raises_before_launch(bad, error, match, device):
    a, b = bad(device)
    with pytest.raises(error, match=match):
        liger_torch.swiglu(a, b)
    with pytest.raises(error, match=match):
        liger_torch.geglu(a, b)


def test_bad_approximate(device):
    with pytest.raises(ValueError, match="approximate"):
        liger_torch.geglu(torch.randn(2, 8, device=device), torch.randn(2, 8, device=device), approximate="erf")


# ---------------------------------------------------------------------------------------------------------
# swiglu_linear / geglu_linear: the gate and the down projection, the product recomputed in the backward

LINEAR_ACTS = {
    "swiglu": (liger_torch.swiglu_linear, lambda a, b: F.silu(a) * b),
    "geglu_tanh": (lambda a, b, w, bias=None, **kw: liger_torch.geglu_linear(a, b, w, bias, "tanh", **kw),
                   lambda a, b: F.gelu(a, approximate="tanh") * b),
    "geglu_erf": (lambda a, b, w, bias=None, **kw: liger_torch.geglu_linear(a, b, w, bias, "none", **kw),
                  lambda a, b: F.gelu(a) * b),
}


def _linear_case(shape, out_features, dtype, device, gen, bias):
    a = (torch.randn(shape, generator=gen) * 3).to(device, dtype)
    b = torch.randn(shape, generator=gen).to(device, dtype)
    w = (torch.randn(out_features, shape[-1], generator=gen) * shape[-1] ** -0.5).to(device, dtype)
    bb = torch.randn(out_features, generator=gen).to(device, dtype) if bias else None
    g = torch.randn(*shape[:-1], out_features, generator=gen).to(device, dtype)
    return a, b, w, bb, g


def _linear_grads(fn, tensors, g, cast=lambda t: t):  # detached views keep their layout
    leaves = [None if t is None else cast(t.detach()).requires_grad_(True) for t in tensors]
    y = fn(*leaves)
    y.backward(cast(g))
    return [y] + [None if t is None else t.grad for t in leaves]


def check_gated_linear(act, a, b, w, bb, g, dtype):
    """swiglu_linear / geglu_linear (``act``) of a, b (any layout), weight w and bias bb (or None) against float64,
    for the incoming gradient g: the output and the gradients of a, b, w and bb."""
    ours, ref = LINEAR_ACTS[act]
    got = _linear_grads(lambda *t: ours(*t), (a, b, w, bb), g)
    # float64, except that the product is stored in the working dtype (forward: act(a) * b; backward: its
    # gradient), as in HF's MLP and in ours: weight gradients sum products of such rounded values over rows,
    # which no elementwise dtype bound on a float64 product would cover.
    want = _linear_grads(lambda x, y, wt, bt: F.linear(ref(x, y).to(dtype).double(), wt, bt), (a, b, w, bb), g,
                         lambda t: t.double())
    names = ("y", "da", "db", "dweight", "dbias")
    for x, y, name in zip(got[:3], want[:3], names):
        assert x.dtype == dtype, name
        # a matmul after the gate (and two in the backward): a few roundings more than one op
        assert_close(x, y, dtype, f"{act} {name}", scale=4.0)
    # dweight and dbias sum over the rows: bound by the size of the terms, (rows + 2) * eps * sum |terms|: the
    # standard error bound of a dot product (CPU half-precision matmuls round their partial sums), plus the
    # output's rounding and one unit of the stored product (computed in fp32, it may round to the neighbour of
    # the float64 product's rounding) (the product's absolute error, e.g. the tanh approximation's ~1e-7 near 0,
    # enters as the dtype's atol times sum |dy|)
    g2 = g.double().reshape(-1, g.shape[-1]).abs()
    c_abs = ref(a.double(), b.double()).reshape(-1, a.shape[-1]).abs()
    rows, atol = g2.shape[0], TOLERANCES[dtype][0]
    for x, y, terms, absolute, name in ((got[3], want[3], g2.t() @ c_abs, g2.sum(0)[:, None], "dweight"),
                                        (got[4], want[4], g2.sum(0), g2.sum(0), "dbias")):
        if y is None:
            continue
        assert x.dtype == dtype, name
        err = (x.double() - y).abs().cpu()
        # + one subnormal step: a tiny sum (fp16 below 6.1e-5) rounds to a fixed grid of 2^-24, not relative to itself
        info = torch.finfo(dtype)
        bound = ((rows + 2) * info.eps * terms + atol * absolute + info.smallest_normal * info.eps).cpu()
        assert torch.isfinite(x).all() and (err <= bound).all(), (
            f"{act} {name}: {int((err > bound).sum())} elements off, worst {float((err - bound).max()):.3g} "
            "over the bound")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 64), (7, 123), (2, 3, 123)])
@pytest.mark.parametrize("act", list(LINEAR_ACTS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_linear_forward_backward(dtype, act, shape, bias, device, seed):
    gen = torch.Generator().manual_seed(seed)
    check_gated_linear(act, *_linear_case(shape, 37, dtype, device, gen, bias), dtype)


def test_gated_linear_saves_the_inputs_but_not_the_product(device, seed):
    """What autograd keeps for the backward: a, b and the weight, not the (N, I) product that
    F.linear(swiglu(a, b), w) saves."""
    gen = torch.Generator().manual_seed(seed)
    a, b, w, _, g = _linear_case((64, 96), 16, torch.float32, device, gen, False)

    def saved_bytes(fn):
        sizes = []

        def pack(t):
            sizes.append(t.numel() * t.element_size())
            return t

        leaves = [t.clone().requires_grad_(True) for t in (a, b, w)]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = fn(*leaves)
        y.backward(g)
        return sum(sizes)

    fused = saved_bytes(liger_torch.swiglu_linear)
    unfused = saved_bytes(lambda x, y, wt: F.linear(liger_torch.swiglu(x, y), wt))
    assert fused == 3 * 64 * 96 * 4 - 64 * 96 * 4 + 16 * 96 * 4  # a, b, weight
    assert unfused - fused == 64 * 96 * 4  # the product


def test_gated_linear_frozen_weight_and_no_grad(device, seed):
    gen = torch.Generator().manual_seed(seed)
    a, b, w, bb, g = _linear_case((7, 123), 20, torch.float32, device, gen, True)
    a, b = a.requires_grad_(True), b.requires_grad_(True)
    y = liger_torch.swiglu_linear(a, b, w, bb)  # weight and bias frozen: no dW computed, a and b still get theirs
    y.backward(g)
    a64, b64 = a.detach().double().requires_grad_(True), b.detach().double().requires_grad_(True)
    F.linear(F.silu(a64) * b64, w.double(), bb.double()).backward(g.double())
    assert_close(a.grad, a64.grad, torch.float32, "da", scale=4.0)
    assert_close(b.grad, b64.grad, torch.float32, "db", scale=4.0)
    with torch.no_grad():
        assert_close(liger_torch.swiglu_linear(a, b, w, bb), F.linear(F.silu(a64) * b64, w.double(), bb.double()),
                     torch.float32, "y (no grad)", scale=4.0)


def test_mlp_with_a_hooked_or_wrapped_down_proj_calls_the_module(device, seed):
    """A down_proj that is hooked (DeepSpeed ZeRO-3 gathers its weight in a pre-hook) or not a plain nn.Linear
    (PEFT, quantised layers) is called as a module: the hook runs, the result is the same."""
    from types import SimpleNamespace

    config = SimpleNamespace(hidden_size=16, intermediate_size=40, hidden_act="silu", mlp_bias=False)
    torch.manual_seed(seed)
    mlp = liger_torch.SwiGLUMLP(config).to(device)
    x = torch.randn(3, 16, device=device)
    fused = mlp(x)
    calls = []
    handle = mlp.down_proj.register_forward_pre_hook(lambda module, args: calls.append(1))
    hooked = mlp(x)
    handle.remove()
    assert calls == [1]

    class Wrapped(torch.nn.Linear):
        pass

    wrapped = Wrapped(40, 16, bias=False).to(device)
    wrapped.weight = mlp.down_proj.weight
    mlp.down_proj = wrapped
    assert_close(hooked, fused, torch.float32, "hooked", scale=4.0)
    assert_close(mlp(x), fused, torch.float32, "wrapped", scale=4.0)

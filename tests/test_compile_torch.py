"""torch.compile of every module (and the functional rope): the ``liger::*`` custom ops trace with no graph break
(``fullgraph=True``) and give the eager results bit for bit; ``torch.library.opcheck`` of every op; DTensor
inputs are refused with the remedy.

On the CPU the compiled graphs run with ``backend="aot_eager"`` (AOT autograd, fake-tensor tracing, no code
generation: inductor would need a C++ toolchain); the gpu-marked test compiles with inductor.
"""

from types import SimpleNamespace

import pytest
import torch

import liger_torch
from helpers import assert_close

CPU_BACKEND = "aot_eager"


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch (and the many modules sharing one forward never hit the recompile limit)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------------------
# Cases: (module, inputs, the custom op its compiled graph must call). Odd sizes, random parameters.


class Rope(torch.nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.kwargs = kwargs

    def forward(self, q, k, cos, sin, position_ids=None):
        return liger_torch.rope(q, k, cos, sin, position_ids, **self.kwargs)


class LinearCE(torch.nn.Module):
    """An lm_head and the fused linear cross-entropy on its weight."""

    def __init__(self, hidden, vocab, bias=False, **kwargs):
        super().__init__()
        self.head = torch.nn.Linear(hidden, vocab, bias=bias)
        self.loss = liger_torch.FusedLinearCrossEntropyLoss(**kwargs)

    def forward(self, x, target):
        return self.loss(self.head.weight, x, target, self.head.bias)


class AutocastLinearCE(LinearCE):
    """LinearCE under torch.autocast(bf16): its fp32 head is a master weight (cast inside the op)."""

    compute_dtype = torch.bfloat16  # the op's arithmetic (and rounding) is bf16's, its inputs' fp32

    def forward(self, x, target):
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            return super().forward(x, target)


class LinearJSD(torch.nn.Module):
    """Student and (frozen) teacher heads and the fused linear JSD."""

    def __init__(self, hidden_s, hidden_t, vocab, **kwargs):
        super().__init__()
        self.student = torch.nn.Linear(hidden_s, vocab, bias=False)
        self.teacher = torch.nn.Linear(hidden_t, vocab, bias=False).requires_grad_(False)
        self.loss = liger_torch.FusedLinearJSD(**kwargs)

    def forward(self, xs, xt, labels):
        return self.loss(xs, self.student.weight, xt, self.teacher.weight, labels)


def randomize(module, gen):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.rand(p.shape, generator=gen) * 1.5 + 0.25 if p.ndim == 1 else
                    torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return module


def randn(gen, *shape, grad=True, dtype=torch.float32):
    return torch.randn(shape, generator=gen).to(dtype).requires_grad_(grad)


def targets(gen, shape, vocab):
    t = torch.randint(0, vocab, shape, generator=gen)
    t.view(-1)[1] = -100
    return t


def log_probs(gen, *shape, grad=True):
    return torch.randn(shape, generator=gen).mul(2).log_softmax(-1).requires_grad_(grad)


def case_rms_norm(gen):
    return liger_torch.RMSNorm(123), [randn(gen, 2, 7, 123)], "rms_norm_forward"


def case_rms_norm_gemma_bf16_strided(gen):
    # leading axes that do not fold into rows (copied), bf16, Gemma's casting and offset
    x = randn(gen, 7, 2, 123, dtype=torch.bfloat16, grad=False).transpose(0, 1).requires_grad_()
    module = liger_torch.RMSNorm(123, offset=1.0, casting_mode="gemma").bfloat16()
    return module, [x], "rms_norm_forward"


def case_layer_norm(gen):
    return liger_torch.LayerNorm(123), [randn(gen, 2, 7, 123)], "layer_norm_forward"


def case_layer_norm_no_bias(gen):
    return liger_torch.LayerNorm(123, bias=False), [randn(gen, 7, 123)], "layer_norm_forward"


def case_fused_add_rms_norm(gen):
    inputs = [randn(gen, 2, 7, 123), randn(gen, 2, 7, 123)]
    return liger_torch.FusedAddRMSNorm(123), inputs, "fused_add_rms_norm_forward"


def case_swiglu_mlp(gen):
    config = SimpleNamespace(hidden_size=16, intermediate_size=41, hidden_act="silu")
    return liger_torch.SwiGLUMLP(config), [randn(gen, 2, 7, 16)], "gated_activation_forward"


def case_geglu_mlp(gen):
    config = SimpleNamespace(hidden_size=16, intermediate_size=41, hidden_activation="gelu", mlp_bias=True)
    return liger_torch.GeGLUMLP(config), [randn(gen, 7, 16)], "gated_activation_forward"


def case_cross_entropy(gen):
    return liger_torch.CrossEntropyLoss(), [randn(gen, 7, 123), targets(gen, (7,), 123)], "cross_entropy_forward"


def case_cross_entropy_none_z_loss_in_place(gen):
    # in_place is an eager option: the compiled op writes a fresh gradient (the harness checks inputs are intact)
    module = liger_torch.CrossEntropyLoss(weight=torch.rand(123, generator=gen) + 0.5, reduction="none",
                                          label_smoothing=0.1, lse_square_scale=0.01, softcap=5.0,
                                          return_z_loss=True, in_place=True)
    return module, [randn(gen, 7, 123), targets(gen, (7,), 123)], "cross_entropy_forward"


def case_fused_linear_cross_entropy(gen):
    return LinearCE(16, 123, bias=True, chunk_size=3), [randn(gen, 2, 7, 16), targets(gen, (2, 7), 123)], \
        "fused_linear_cross_entropy_forward"


def case_fused_linear_cross_entropy_none(gen):
    module = LinearCE(16, 123, reduction="none", lse_square_scale=0.01, return_z_loss=True, chunk_size=4)
    return module, [randn(gen, 2, 7, 16), targets(gen, (2, 7), 123)], "fused_linear_cross_entropy_forward"


def case_fused_linear_cross_entropy_autocast_master_weight(gen):
    return AutocastLinearCE(16, 123, bias=True, chunk_size=3), [randn(gen, 2, 7, 16), targets(gen, (2, 7), 123)], \
        "fused_linear_cross_entropy_forward"


def case_kl_div(gen):
    target = log_probs(gen, 7, 123, grad=False).exp()
    return liger_torch.KLDivLoss(reduction="batchmean"), [log_probs(gen, 7, 123), target], "kl_div_forward"


def case_kl_div_none_log_target(gen):
    inputs = [log_probs(gen, 2, 7, 33), log_probs(gen, 2, 7, 33, grad=False)]
    return liger_torch.KLDivLoss(reduction="none", log_target=True), inputs, "kl_div_forward"


def case_jsd(gen):
    return liger_torch.JSD(beta=0.3), [log_probs(gen, 7, 123), log_probs(gen, 7, 123, grad=False),
                                       targets(gen, (7,), 123)], "jsd_forward"


def case_fused_linear_jsd(gen):
    return LinearJSD(16, 12, 123, beta=0.7, temperature=2.0, chunk_size=3), \
        [randn(gen, 2, 7, 16), randn(gen, 2, 7, 12, grad=False), targets(gen, (2, 7), 123)], \
        "fused_linear_jsd_forward"


def _tables(gen, positions, dim):
    angles = torch.rand(positions, dim // 2, generator=gen) * 6.0
    angles = torch.cat((angles, angles), -1)
    return angles.cos(), angles.sin()


def case_rope(gen):
    cos, sin = _tables(gen, 11, 8)
    position_ids = torch.randint(0, 11, (2, 7), generator=gen)
    return Rope(), [randn(gen, 2, 4, 7, 8), randn(gen, 2, 2, 7, 8), cos, sin, position_ids], "rope_forward"


def case_rope_interleaved_bthd(gen):
    cos, sin = _tables(gen, 7, 8)
    return Rope(unsqueeze_dim=2, interleaved=True), [randn(gen, 2, 7, 4, 8), randn(gen, 2, 7, 2, 8), cos, sin], \
        "rope_forward"


CASES = {name[len("case_"):]: fn for name, fn in globals().items() if name.startswith("case_")}


# ---------------------------------------------------------------------------------------------------------
# The harness: the same module and inputs, eager and compiled, forward and backward.


def clone_inputs(inputs):
    return [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]


def forward_backward(fn, module, inputs, gen_seed):
    """Outputs and the gradients of every input and parameter, for random output cotangents."""
    module.zero_grad(set_to_none=True)
    outputs = fn(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    gen = torch.Generator().manual_seed(gen_seed)
    total = sum((o.float() * torch.randn(o.shape, generator=gen).to(o.device)).sum()
                for o in outputs if o.requires_grad)
    total.backward()
    grads = [t.grad for t in inputs if t.requires_grad] + [p.grad for p in module.parameters() if p.requires_grad]
    return [o.detach() for o in outputs], grads


class OpRecorder:
    """A dynamo backend: aot_eager, recording the liger custom ops of each graph it is given."""

    def __init__(self, backend=CPU_BACKEND):
        self.backend = backend
        self.ops = []
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        # (dynamo may restart an analysis after a first call, e.g. to specialise float attributes: count the
        # graphs that compiled)
        compiled = torch._dynamo.lookup_backend(self.backend)(gm, example_inputs)
        self.graphs += 1
        self.ops += [str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "liger" in str(n.target)]
        return compiled


def _case_and_eager_result(case, device, seed):
    """The case's module (random parameters) and inputs on ``device``, its op name, and its eager results."""
    gen = torch.Generator().manual_seed(seed)
    module, inputs, op = CASES[case](gen)
    module = randomize(module, gen).to(device)
    inputs = [t.to(device).detach().requires_grad_(t.requires_grad) for t in inputs]
    eager_out, eager_grads = forward_backward(module, module, clone_inputs(inputs), seed)
    return module, inputs, op, eager_out, eager_grads


@pytest.mark.parametrize("case", sorted(CASES))
def test_module_compiles_in_one_graph_and_matches_eager(case, device, seed):
    module, inputs, op, eager_out, eager_grads = _case_and_eager_result(case, device, seed)

    recorder = OpRecorder()
    compiled = torch.compile(module, backend=recorder, fullgraph=True)  # fullgraph: any graph break raises
    compiled_inputs = clone_inputs(inputs)
    out, grads = forward_backward(compiled, module, compiled_inputs, seed)

    assert recorder.graphs == 1
    assert f"liger.{op}.default" in recorder.ops, recorder.ops
    pairs = [("output", a, b) for a, b in zip(out, eager_out)] + [("grad", a, b) for a, b in zip(grads, eager_grads)]
    for name, a, b in pairs:
        assert not torch.isnan(a).any(), f"{name}: NaN (an unwritten element?)"
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{case}: compiled {name} differs from eager")
    for before, after in zip(inputs, compiled_inputs):  # the compiled ops never write over their inputs
        assert torch.equal(before, after.detach())


def test_dynamic_shapes_compile_once(device, seed):
    """With ``dynamic=True`` the fake implementations give symbolic shapes: one graph serves several sizes."""
    gen = torch.Generator().manual_seed(seed)
    norm = randomize(liger_torch.RMSNorm(123), gen).to(device)
    loss = liger_torch.CrossEntropyLoss(reduction="none")

    def step(x, target):
        return loss(norm(x).reshape(-1, 123), target.reshape(-1))

    recorder = OpRecorder()
    compiled = torch.compile(step, backend=recorder, fullgraph=True, dynamic=True)
    for rows in (5, 7, 13):
        x, target = randn(gen, 1, rows, 123).to(device), targets(gen, (1, rows), 123).to(device)
        expected = step(x, target)
        torch.testing.assert_close(compiled(x, target), expected, rtol=0, atol=0)
    assert recorder.graphs == 1


def test_compiled_errors_name_the_argument(device, seed):
    """Targets are still checked under compile (inside the op: the check reads the values)."""
    gen = torch.Generator().manual_seed(seed)
    logits = randn(gen, 7, 123).to(device)
    bad = targets(gen, (7,), 123).to(device)
    bad[3] = 123
    compiled = torch.compile(liger_torch.cross_entropy, backend=CPU_BACKEND, fullgraph=True)
    with pytest.raises(ValueError, match="target has values outside"):
        compiled(logits, bad)


def test_fused_linear_cross_entropy_none_backward_of_a_sum(device, seed):
    """Regression: ``loss.sum().backward()`` of reduction='none' hands the backward an expanded (stride-0)
    gradient, which the chunk kernel read as contiguous (garbage gradients). Eager, against float64."""
    gen = torch.Generator().manual_seed(seed)
    x = randn(gen, 2, 7, 16, grad=False).to(device).requires_grad_()  # leaves on the device, not copies of leaves
    weight = randn(gen, 123, 16, grad=False).to(device).requires_grad_()
    target = targets(gen, (2, 7), 123).to(device)
    liger_torch.fused_linear_cross_entropy(x, weight, target, reduction="none", chunk_size=4).sum().backward()
    x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    torch.nn.functional.cross_entropy((x64 @ w64.T).reshape(-1, 123), target.reshape(-1),
                                      reduction="sum").backward()
    assert_close(x.grad, x64.grad, torch.float32, "dx")
    assert_close(weight.grad, w64.grad, torch.float32, "dw", scale=4.0)  # a sum over 14 rows


# ---------------------------------------------------------------------------------------------------------
# opcheck: schema (no mutation, no aliasing), autograd registration, fake tensors against real outputs, AOT
# dispatch with static and dynamic shapes (gradients through the registered backward).


def opcheck_cases(gen, device):
    def t(*shape, grad=False, dtype=torch.float32):
        return randn(gen, *shape, grad=grad, dtype=dtype).to(device).detach().requires_grad_(grad)

    x, w, b = t(5, 3, 33, grad=True), t(33, grad=True), t(33, grad=True)
    rows = t(5, 3).abs() + 0.5
    logits, target = t(7, 33, grad=True), targets(gen, (7,), 33).to(device)
    lp = log_probs(gen, 7, 33).to(device)
    teacher = log_probs(gen, 7, 33, grad=False).to(device)
    cos, sin = _tables(gen, 9, 8)
    q, k, pos = t(2, 4, 7, 8, grad=True), t(2, 2, 7, 8, grad=True), torch.randint(0, 9, (2, 7), generator=gen)
    xh, head = t(2, 7, 16, grad=True), t(33, 16, grad=True)
    flce_options = (-100, "mean", 0.1, 0.01, None, True, 3, False, True, True, True)
    flce_none = (-100, "none", 0.0, 0.0, 4.0, False, 4, False, True, True, False)  # no bias
    flce_none_bias = (-100, "none", 0.1, 0.0, None, False, 4, True, True, True, True)
    tgt2 = targets(gen, (2, 7), 33).to(device)
    return {
        "rms_norm_forward": (x, w, 1e-6, 0.0, "llama"),
        "rms_norm_backward": (t(5, 3, 33), x.detach(), w.detach(), rows, 1.0, "gemma"),
        "layer_norm_forward": (x, w, b, 1e-5),
        "layer_norm_backward": (t(5, 3, 33), x.detach(), w.detach(), None, t(5, 3), rows),
        "fused_add_rms_norm_forward": (x, t(5, 3, 33, grad=True), None, 1e-6, 0.0, "none"),
        "fused_add_rms_norm_backward": (t(5, 3, 33), t(5, 3, 33), x.detach(), w.detach(), rows, torch.float32,
                                        torch.float32, 0.0, "llama"),
        "rope_forward": (q, k, cos.to(device), sin.to(device), pos.to(device), 1, False),
        "rope_backward": (t(2, 7, 4, 8), t(2, 7, 2, 8), cos.to(device), sin.to(device), pos.to(device), 2, True,
                          torch.float32, torch.float32),
        "gated_activation_forward": (t(5, 33, grad=True), t(5, 33, grad=True), "silu"),
        "gated_activation_backward": (t(5, 33), t(5, 33), t(5, 33), "gelu_tanh"),
        "cross_entropy_forward": (logits, target, None, -100, "mean", 0.1, 0.01, 5.0, True, True),
        "cross_entropy_backward": (t(7, 33), t(7), "none"),
        "kl_div_forward": (lp, teacher.exp(), "batchmean", False),
        "kl_div_backward": (t(), teacher, torch.float32, "sum", True),
        "jsd_forward": (lp, teacher, target, 0.4, -100, True),
        "jsd_backward": (t(7, 33), t()),
        "fused_linear_cross_entropy_forward": (xh, head, tgt2, b, None, *flce_options),
        "fused_linear_cross_entropy_forward_none": (xh, head, tgt2, None, t(33).abs() + 0.5, *flce_none),
        "fused_linear_cross_entropy_backward": (xh.detach(), head.detach(), tgt2, b.detach(), None, t(2, 7),
                                                *flce_none_bias),
        "fused_linear_jsd_forward": (xh, head, t(2, 7, 12), t(33, 12), tgt2, 0.5, -100, 2.0, 3, False, True, True),
    }


OPCHECK_CASES = sorted(opcheck_cases(torch.Generator().manual_seed(0), "cpu"))


@pytest.mark.parametrize("name", OPCHECK_CASES)
def test_opcheck(name, device, seed):
    args = opcheck_cases(torch.Generator().manual_seed(seed), device)[name]
    op = getattr(torch.ops.liger, name.removesuffix("_none"))
    torch.library.opcheck(op, args)


def test_every_op_is_opchecked():
    ops = {name for name in dir(torch.ops.liger) if name.endswith(("_forward", "_backward"))}
    checked = {name.removesuffix("_none") for name in OPCHECK_CASES}
    # only fused_linear_jsd has no backward op: its backward scales the forward's gradients with torch ops
    assert ops == checked


# ---------------------------------------------------------------------------------------------------------
# DTensor inputs


def test_dtensor_input_is_refused_with_the_remedy():
    dist = torch.distributed
    if not dist.is_available():
        pytest.skip("this torch build has no torch.distributed")
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        mesh = DeviceMesh("cpu", [0])
        x = distribute_tensor(torch.randn(7, 123), mesh, [Replicate()])
        with pytest.raises(ValueError, match=r"x is a DTensor .*x\.full_tensor\(\).*x\.to_local\(\).*FSDP2"):
            liger_torch.rms_norm(x, None)
        weight = torch.nn.Parameter(distribute_tensor(torch.ones(123), mesh, [Replicate()]))
        with pytest.raises(ValueError, match=r"weight is a DTensor"):
            liger_torch.rms_norm(torch.randn(7, 123), weight)
        local = x.to_local()  # the remedy works (interpreter: CPU tensors)
        if liger_torch.INTERPRET:
            assert liger_torch.rms_norm(local, None).shape == (7, 123)
    finally:
        if own_group:
            dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------
# GPU: inductor


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(CASES))
def test_module_compiles_with_inductor(case, device, seed):
    module, inputs, op, eager_out, eager_grads = _case_and_eager_result(case, device, seed)
    compiled = torch.compile(module, backend="inductor", fullgraph=True)
    out, grads = forward_backward(compiled, module, clone_inputs(inputs), seed)
    # inductor fuses and reorders the torch ops around the kernels (matmuls, the cotangent sum, a gradient's
    # scale and upcast fused without the bf16 rounding between them): rounding-level of the compute dtype
    dtype = inputs[0].dtype if inputs[0].is_floating_point() else torch.float32
    dtype = getattr(module, "compute_dtype", dtype)
    for i, (a, b) in enumerate(zip(out + grads, eager_out + eager_grads)):
        assert_close(a, b, dtype, f"{case} [{i}]", scale=4.0)


@pytest.mark.gpu
def test_patched_hf_model_compiles_in_one_graph(device, seed):
    """A module-level patched tiny Llama, forward (fused linear cross-entropy loss) and backward, inductor."""
    pytest.importorskip("transformers")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "transformers"))
    import hf_tiny

    with liger_torch.liger_kernel_patched("llama"):
        model = hf_tiny.build("llama", seed, device, attn_implementation="sdpa")
        ids, labels = hf_tiny.batch(seed, device)
        eager = model(input_ids=ids, labels=labels).loss
        eager.backward()
        eager_grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        compiled = torch.compile(model, backend="inductor", fullgraph=True)
        loss = compiled(input_ids=ids, labels=labels).loss
        loss.backward()
    assert_close(loss, eager, torch.float32, "loss", scale=4.0)
    for (name, p), g in zip(model.named_parameters(), eager_grads):
        assert_close(p.grad, g, torch.float32, name, scale=16.0)

"""Patched tiny models under the training machinery around them: gradient checkpointing and torch.autocast.

The data-parallel stacks (DDP, FSDP2, DeepSpeed ZeRO-3) need several processes: tests/distributed/.
"""

import copy

import pytest
import torch

import liger_core
import liger_torch
from helpers import assert_close, tolerance
from liger_torch.transformers import apply_liger_kernel

from hf_tiny import batch, build

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # numpy, inside Triton's interpreter
              pytest.mark.filterwarnings("ignore:.*gradient_checkpointing_(en|dis)able.*:FutureWarning")]
F32, BF16 = torch.float32, torch.bfloat16
ON_GPU = not liger_core.INTERPRET
GRAD_SCALE = 4  # as in test_hf_patching.py: parameter gradients are sums over all tokens


def _step(model, ids, labels, autocast=None):
    model.train()
    model.zero_grad(set_to_none=True)
    if autocast is None:
        out = model(input_ids=ids, labels=labels)
    else:
        with torch.autocast(device_type=ids.device.type, dtype=autocast):
            out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()
                               if p.grad is not None}


def _checkpointing(model, use_reentrant):
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
    assert len(layers) == model.config.num_hidden_layers  # every decoder layer recomputes in the backward
    return model


def test_gradient_checkpointing_same_gradients(device, seed):
    """Patched with checkpointing (reentrant and not) vs patched without: the recomputed forward runs the same
    deterministic kernels on the same inputs, so loss and every gradient are bitwise equal on the CPU (on a
    GPU within fp32 tolerances: attention's backward there need not add in a fixed order). vs unpatched with
    checkpointing: within the fp32 tolerances of test_hf_patching.py."""
    family = "llama"
    ids, labels = batch(seed, device)
    ref = build(family, seed, device)
    patched = copy.deepcopy(ref)
    apply_liger_kernel(patched)
    calls = []  # the kernel RMSNorm of the first layer: run again in the backward under checkpointing
    patched.model.layers[0].input_layernorm.register_forward_hook(lambda *_: calls.append(1))
    plain_loss, plain_grads = _step(patched, ids, labels)
    assert len(plain_grads) == len(list(patched.parameters())) and len(calls) == 1
    for use_reentrant in (False, True):
        name = f"{family} use_reentrant={use_reentrant}"
        calls.clear()
        loss, grads = _step(_checkpointing(patched, use_reentrant), ids, labels)
        assert len(calls) == 2, f"{name}: the layer was not recomputed ({len(calls)} norm calls)"
        ref_loss, ref_grads = _step(_checkpointing(ref, use_reentrant), ids, labels)
        assert grads.keys() == plain_grads.keys() == ref_grads.keys()
        for n in plain_grads:
            if ON_GPU:
                assert_close(grads[n], plain_grads[n], F32, f"{name} grad {n} vs no checkpointing")
            else:
                assert torch.equal(grads[n], plain_grads[n]), f"{name}: grad {n} changed by checkpointing"
            assert_close(grads[n], ref_grads[n], F32, f"{name} grad {n} vs unpatched", scale=GRAD_SCALE)
        if ON_GPU:
            assert_close(loss, plain_loss, F32, f"{name} loss vs no checkpointing")
        else:
            assert torch.equal(loss, plain_loss), f"{name}: loss changed by checkpointing"
        assert_close(loss, ref_loss, F32, f"{name} loss vs unpatched")
        patched.gradient_checkpointing_disable()
        ref.gradient_checkpointing_disable()


def test_checkpointing_is_detected_without_transformers_deprecation_warnings(device, seed):
    """The patched forward asks whether checkpointing is on (it then leaves the norm outputs to HF's recompute)
    through the attribute this transformers has, without touching the deprecated alias that warns."""
    import warnings

    from liger_torch.transformers._causal_lm import _activation_checkpointing

    model = build("llama", seed, device)
    apply_liger_kernel(model)
    ids, labels = batch(seed, device)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        assert not _activation_checkpointing(model)
        _step(model, ids, labels)
        _checkpointing(model, use_reentrant=False)
        assert _activation_checkpointing(model)
        _step(model, ids, labels)


def _rel(actual, expected):
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def test_autocast_bf16_matches_unpatched(device, seed):
    """fp32 Qwen3 (its q/k norms see bf16 projections) under torch.autocast(bf16), patched vs unpatched under
    the same autocast.

    Both run lm_head's matmul in bf16 (the patched forward gives the fused linear CE the hidden states and
    weight in the autocast dtype, as F.linear under autocast does). The kernel's loss has the bf16 dtype of its
    inputs and is upcast after, so the loss may differ by one bf16 rounding (2**-8 relative). Each gradient is
    fp32, like its parameter, and norm-wise within bf16's rtol of the unpatched one: HF's RMSNorm rounds the
    gradient of its normalised output to bf16 (the ``.to(input_dtype)`` in its graph) where the kernel keeps
    fp32 until dx, which puts the q/k projections' gradients ~6e-3 apart; a wrong gradient is off by O(1)."""
    ids, labels = batch(seed, device)
    ref = build("qwen3", seed, device)
    ref_loss, ref_grads = _step(ref, ids, labels, autocast=BF16)
    model = copy.deepcopy(ref)
    apply_liger_kernel(model)
    loss, grads = _step(model, ids, labels, autocast=BF16)
    assert loss.dtype == F32 and ref_loss.dtype == F32
    assert_close(loss, ref_loss, BF16, "loss under autocast")
    assert abs(loss.item() - ref_loss.item()) <= 2.0**-8 * abs(ref_loss.item()), (loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    _, rtol = tolerance(BF16)
    for n in ref_grads:
        assert grads[n].dtype == F32, f"grad {n} is {grads[n].dtype}"
        assert _rel(grads[n], ref_grads[n]) <= rtol, f"grad {n}: {_rel(grads[n], ref_grads[n]):.2e} off"
    # outside autocast the same model is back to fp32 (nothing leaked from the autocast region)
    loss32, _ = _step(model, ids, labels)
    ref32, _ = _step(ref, ids, labels)
    assert_close(loss32, ref32, F32, "fp32 loss after autocast")


def test_partitioned_lm_head_weight_is_a_clear_error(device, seed):
    """A wrapper that leaves lm_head.weight partitioned outside lm_head's own forward (as DeepSpeed ZeRO-3's
    empty placeholder, or a flat-parameter shard): the patched forward says so and names the remedies instead
    of failing inside the kernel (DeepSpeed ZeRO-3 itself gathers it on access: tests/distributed/)."""
    ids, labels = batch(seed, device, batch_size=1, seq=6)
    model = build("llama", seed, device)
    apply_liger_kernel(model)
    model.lm_head.weight = torch.nn.Parameter(torch.empty(0, device=device))
    with pytest.raises(RuntimeError, match=r"shape \(0,\), not the full \(331, 64\).*fused_linear_cross_entropy=False"):
        model.train()(input_ids=ids, labels=labels)


def test_fused_linear_cross_entropy_under_autocast(device, seed):
    """Called directly under autocast with an fp32 weight: works, matches F.linear + cross_entropy under the
    same autocast (bf16 logits), and the weight gradient is fp32 (accumulated in fp32 over the chunks)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(24, 64, generator=g).to(device).requires_grad_()
    w = (torch.randn(331, 64, generator=g) * 0.1).to(device).requires_grad_()
    t = torch.randint(0, 331, (24,), generator=g).to(device)
    with torch.autocast(device_type=x.device.type, dtype=BF16):
        ref = torch.nn.functional.cross_entropy(torch.nn.functional.linear(x, w).float(), t)
    ref_dx, ref_dw = torch.autograd.grad(ref, (x, w))
    with torch.autocast(device_type=x.device.type, dtype=BF16):
        loss = liger_torch.fused_linear_cross_entropy(x, w, t, chunk_size=8)  # 3 chunks
    dx, dw = torch.autograd.grad(loss, (x, w))
    assert dw.dtype == F32 and dx.dtype == F32
    assert_close(loss.float(), ref, BF16, "loss")
    _, rtol = tolerance(BF16)
    assert _rel(dw, ref_dw) <= rtol and _rel(dx, ref_dx) <= rtol

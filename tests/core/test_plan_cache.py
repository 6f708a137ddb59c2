"""Plans are cached by their (hashable) arguments: a training step's repeated shapes get the same ``Plan`` object
back, which is also what lets the torch executor launch a plan's compiled kernels directly (its fast-launch
cache is keyed by the launch object). On the GPU: repeated calls add no entries to that cache, and the fused
losses' fp32 weight-gradient matmul path is the one in use."""

import pytest
import torch

from liger_core import (cross_entropy, fused_add_rms_norm, fused_linear_cross_entropy, fused_linear_jsd, jsd,
                        kl_div, layer_norm, rms_norm, rope, swiglu)
from liger_core.launch import ArrayInfo


def bf16(*shape):
    return ArrayInfo.contiguous(shape, "bfloat16")


x, w = bf16(64, 256), bf16(256)
logits, target = bf16(64, 1000), ArrayInfo.contiguous((64,), "int64")
q, k, cos = bf16(1, 4, 16, 64), bf16(1, 2, 16, 64), bf16(1, 16, 64)
scalar = ArrayInfo.contiguous((), "float32")
BUILDERS = {
    "rms_norm forward": lambda: rms_norm.forward_plan(x, w, eps=1e-6),
    "rms_norm backward": lambda: rms_norm.backward_plan(x, x, w, num_sms=4),
    "layer_norm backward": lambda: layer_norm.backward_plan(x, x, w, w, num_sms=4),
    "fused_add_rms_norm forward": lambda: fused_add_rms_norm.forward_plan(x, x, w, eps=1e-6),
    "swiglu forward": lambda: swiglu.forward_plan(x, x, activation="silu"),
    "swiglu backward": lambda: swiglu.backward_plan(x, x, x, activation="silu", in_place=True),
    "rope forward": lambda: rope.forward_plan(q, k, cos, cos, head_axis=1),
    "cross_entropy forward": lambda: cross_entropy.forward_plan(logits, target, label_smoothing=0.1),
    "cross_entropy backward": lambda: cross_entropy.backward_plan(logits, scalar, reduction="mean"),
    "kl_div forward": lambda: kl_div.forward_plan(logits, logits, reduction="batchmean"),
    "jsd forward": lambda: jsd.forward_plan(logits, logits, beta=0.5),
    "flce chunk": lambda: fused_linear_cross_entropy.chunk_plan(64, 1000, "bfloat16", "int64", None,
                                                                  ignore_index=-100, reduction="mean",
                                                                  label_smoothing=0.0, lse_square_scale=0.0,
                                                                  softcap=None, return_z_loss=False,
                                                                  compute_grad=True),
    "fused_linear_jsd chunk": lambda: fused_linear_jsd.chunk_plan(64, 1000, "bfloat16", "float32", None, beta=0.5,
                                                                   ignore_index=-100, n_total_rows=64,
                                                                   temperature=1.0, compute_grad=True),
}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_a_plan_is_built_once_per_arguments(name):
    build = BUILDERS[name]
    assert build() is build()


@pytest.mark.gpu
def test_repeated_calls_reuse_the_fast_launch_cache():
    """After a first call, the same shapes launch through the cached compiled kernels: no new cache entries."""
    import liger_torch
    from liger_torch import _launch

    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(512, 1024, device="cuda", generator=gen).bfloat16().requires_grad_(True)
    b = torch.randn(512, 1024, device="cuda", generator=gen).bfloat16().requires_grad_(True)
    qq = torch.randn(2, 8, 128, 64, device="cuda", generator=gen).bfloat16()
    kk = torch.randn(2, 2, 128, 64, device="cuda", generator=gen).bfloat16()
    cc = torch.randn(1, 128, 64, device="cuda", generator=gen).bfloat16()
    t = torch.randint(0, 1024, (512,), device="cuda", generator=gen)

    def step():
        liger_torch.swiglu(a, b).sum().backward()
        liger_torch.rope(qq, kk, cc, cc)
        liger_torch.cross_entropy(a.detach().clone().requires_grad_(True), t).backward()
        liger_torch.rms_norm(a, b[0]).sum().backward()

    step()
    entries = len(_launch._FAST_LAUNCHES)
    for _ in range(3):
        step()
    assert len(_launch._FAST_LAUNCHES) == entries


@pytest.mark.gpu
def test_fused_losses_use_the_fp32_matmul_path():
    """The CUDA build adds bf16 products into the fp32 dW accumulator inside the matmul, and overwrites it on
    the first chunk (no zero fill); if either probe fails the fused losses are correct but slower."""
    import importlib

    flce = importlib.import_module("liger_torch.fused_linear_cross_entropy")
    device = torch.device("cuda", torch.cuda.current_device())
    assert flce._addmm_accumulates_in_fp32(device, torch.bfloat16)
    assert flce._addmm_overwrites_in_fp32(device, torch.bfloat16)

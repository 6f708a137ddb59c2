"""The torch frontend inside a captured CUDA graph (torch.cuda.graph, as torch.compile's "reduce-overhead" mode
uses): the losses' target check and RoPE's position check sync the host, which capture forbids, so they step
aside while capturing; replays then compute on whatever the static inputs hold, and a bad target or position
shows as NaN (the kernels' own mark) instead of an error."""

import pytest
import torch
import torch.nn.functional as F

import liger_torch
from helpers import assert_close

pytestmark = pytest.mark.gpu


def _capture(fn):
    """Warm up on a side stream (Triton compiles, the allocator settles), then capture ``fn`` into a graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def test_cross_entropy_and_fused_linear_cross_entropy_replay_on_new_inputs():
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(64, 1000, device="cuda", generator=gen)
    target = torch.randint(0, 1000, (64,), device="cuda", generator=gen)
    x = torch.randn(64, 32, device="cuda", generator=gen)
    weight = torch.randn(1000, 32, device="cuda", generator=gen) * 0.2
    with torch.no_grad():
        graph, (ce, flce) = _capture(lambda: (liger_torch.cross_entropy(logits, target),
                                              liger_torch.fused_linear_cross_entropy(x, weight, target)))
        for _ in range(2):  # new values in the static inputs, then a replay computes on them
            logits.normal_(generator=gen)
            x.normal_(generator=gen)
            target.random_(0, 1000, generator=gen)
            target[:5] = -100
            graph.replay()
            assert_close(ce, F.cross_entropy(logits.double(), target), torch.float32, "cross_entropy")
            assert_close(flce, F.cross_entropy(x.double() @ weight.double().t(), target), torch.float32, "flce")
        target[7] = 1000  # outside [0, V): eager, a ValueError; inside the graph, the kernel's NaN
        graph.replay()
        assert torch.isnan(ce) and torch.isnan(flce)
    with pytest.raises(ValueError, match="outside"):
        liger_torch.cross_entropy(logits, target)


def test_rope_with_position_ids_replays():
    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(1, 4, 16, 64, device="cuda", generator=gen)
    k = torch.randn(1, 2, 16, 64, device="cuda", generator=gen)
    cos = torch.randn(1, 32, 64, device="cuda", generator=gen)
    sin = torch.randn(1, 32, 64, device="cuda", generator=gen)
    pos = torch.arange(16, device="cuda")[None]
    graph, (q_out, k_out) = _capture(lambda: liger_torch.rope(q, k, cos, sin, position_ids=pos))
    pos.copy_(torch.randint(0, 32, (1, 16), device="cuda", generator=gen))
    graph.replay()
    want_q, want_k = liger_torch.rope(q, k, cos, sin, position_ids=pos)
    assert torch.equal(q_out, want_q) and torch.equal(k_out, want_k)

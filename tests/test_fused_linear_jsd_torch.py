"""liger_torch.fused_linear_jsd against matmul + log_softmax + the JSD formula in float64, forward and backward."""

import pytest
import torch

import liger_core
import liger_torch
from helpers import assert_close
from test_jsd_torch import reference as jsd_reference

N, HS, HT, V = 37, 24, 16, 259
CHUNK = 8  # 5 chunks, the last one partial


def reference(xs, ws, xt, wt, labels=None, beta=0.5, ignore_index=-100, temperature=1.0):
    """float64 from the same inputs, the logits rounded to the inputs' dtypes as an lm_head's output is."""
    zs = (xs.double() @ ws.double().t()).to(xs.dtype).double()
    zt = (xt.double() @ wt.double().t()).to(xt.dtype).double()
    s = torch.log_softmax(zs / temperature, -1)
    t = torch.log_softmax(zt / temperature, -1)
    return jsd_reference(s, t, beta, labels, ignore_index)


def draw(seed, dtype, n=N, ignore_fraction=0.3, device="cpu"):
    """Drawn on the CPU from a seeded generator (the same numbers on every device), then moved to ``device``."""
    gen = torch.Generator().manual_seed(seed)
    xs = torch.randn(n, HS, generator=gen).to(device, dtype)
    ws = (torch.randn(V, HS, generator=gen) * 0.4).to(device, dtype)
    xt = torch.randn(n, HT, generator=gen).to(device, dtype)
    wt = (torch.randn(V, HT, generator=gen) * 0.5).to(device, dtype)
    labels = torch.randint(0, V, (n,), generator=gen)
    labels[torch.rand(n, generator=gen) < ignore_fraction] = -100
    labels[0] = 1
    return xs, ws, xt, wt, labels.to(device)


def grads_of(fn, tensors, g):
    leaves = [a.detach().clone().requires_grad_(True) for a in tensors]
    loss = fn(*leaves)
    loss.backward(g)
    return loss, [a.grad for a in leaves]


@pytest.mark.parametrize("beta,with_labels,temperature", [
    (0.0, False, 1.0), (0.0, True, 2.0), (0.5, False, 0.7), (0.5, True, 2.0), (1.0, True, 0.7), (1.0, False, 2.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_backward(beta, with_labels, temperature, dtype, device, seed):
    xs, ws, xt, wt, labels = draw(seed, dtype, device=device)
    labels = labels if with_labels else None
    g = torch.tensor(0.7, device=device, dtype=dtype)
    loss, grads = grads_of(lambda a, b: liger_torch.fused_linear_jsd(
        a, b, xt, wt, labels, beta=beta, temperature=temperature, chunk_size=CHUNK), (xs, ws), g)
    loss_ref, grads_ref = grads_of(lambda a, b: reference(a, b, xt, wt, labels, beta, temperature=temperature),
                                   (xs, ws), g.double())
    assert loss.dtype == dtype and loss.shape == ()
    assert_close(loss, loss_ref, dtype, "loss", scale=4.0)
    count = N if labels is None else int((labels != -100).sum())  # the mean's gradients are ~1/count
    for name, got, want in zip(("dstudent_input", "dstudent_weight"), grads, grads_ref):
        assert got.dtype == dtype, name
        # dweight sums N rounded terms per element; bf16 dx is a bf16 matmul of bf16 dlogits.
        widen = 1.0 if name == "dstudent_input" else N ** 0.5
        assert_close(got * count, want * count, dtype, name, scale=widen if dtype == torch.float32 else 2 * widen)


def test_autocast_fp32_master_weight(device, seed):
    """fp32 heads under torch.autocast(bf16): bf16 logits, as F.linear's; the student head's gradient is
    accumulated in fp32 straight into its fp32 gradient (never rounded to bf16), the teacher is cast."""
    xs, ws, xt, wt, labels = draw(seed, torch.float32, device=device)

    def fused(a, b):
        with torch.autocast(device, dtype=torch.bfloat16):
            return liger_torch.fused_linear_jsd(a, b, xt, wt, labels, temperature=2.0, chunk_size=CHUNK)

    g = torch.tensor(0.7, device=device)
    loss, grads = grads_of(fused, (xs, ws), g)
    loss_ref, grads_ref = grads_of(lambda a, b: reference(a.bfloat16(), b.bfloat16(), xt.bfloat16(), wt.bfloat16(),
                                                          labels, temperature=2.0), (xs, ws), g.double())
    assert loss.dtype == torch.bfloat16  # the student's (autocast) dtype
    assert_close(loss, loss_ref, torch.bfloat16, "loss", scale=4.0)
    count = int((labels != -100).sum())
    for name, got, want in zip(("dstudent_input", "dstudent_weight"), grads, grads_ref):
        assert got.dtype == torch.float32, name
        widen = 1.0 if name == "dstudent_input" else N ** 0.5
        assert_close(got * count, want * count, torch.bfloat16, name, scale=2 * widen)
    assert (grads[1] != grads[1].bfloat16().float()).any(), "the master weight's gradient went through bf16"


def test_default_chunking_matches_explicit_chunks(device, seed):
    xs, ws, xt, wt, labels = draw(seed, torch.float32, device=device)
    outs = [grads_of(lambda a, b: liger_torch.fused_linear_jsd(a, b, xt, wt, labels, beta=0.3, temperature=1.5,
                                                               chunk_size=cs), (xs, ws),
                     torch.tensor(1.0, device=device)) for cs in (None, CHUNK, 1)]
    for loss, grads in outs[1:]:
        assert_close(loss, outs[0][0], torch.float32, "loss")
        for got, want in zip(grads, outs[0][1]):
            assert_close(got, want, torch.float32, "grad", scale=3.0)


def test_matches_jsd_on_full_log_probs(device, seed):
    xs, ws, xt, wt, labels = draw(seed, torch.float32, device=device)
    loss, grads = grads_of(lambda a, b: liger_torch.fused_linear_jsd(a, b, xt, wt, labels, temperature=2.0,
                                                                     chunk_size=CHUNK), (xs, ws),
                           torch.tensor(1.0, device=device))
    teacher = torch.log_softmax(xt @ wt.t() / 2.0, -1)
    loss_ref, grads_ref = grads_of(lambda a, b: liger_torch.jsd(torch.log_softmax(a @ b.t() / 2.0, -1), teacher,
                                                                labels), (xs, ws), torch.tensor(1.0, device=device))
    assert_close(loss, loss_ref, torch.float32, "loss")
    for got, want in zip(grads, grads_ref):
        assert_close(got * N, want * N, torch.float32, "grad", scale=3.0)


def test_three_dimensional_input_frozen_weight_and_module(device, seed):
    xs, ws, xt, wt, labels = draw(seed, torch.float32, n=3 * 5, device=device)
    xs3 = xs.reshape(3, 5, HS).clone().requires_grad_(True)
    module = liger_torch.FusedLinearJSD(beta=0.2, temperature=1.3, chunk_size=4)
    loss = module(xs3, ws, xt.reshape(3, 5, HT), wt, labels.reshape(3, 5))
    loss.backward()
    ref = xs3.detach().double().requires_grad_(True)
    loss_ref = reference(ref.reshape(15, HS), ws, xt, wt, labels, beta=0.2, temperature=1.3)
    loss_ref.backward()
    assert_close(loss, loss_ref, torch.float32, "loss")
    count = int((labels != -100).sum())
    assert_close(xs3.grad * count, ref.grad * count, torch.float32, "dx")


def test_bf16_without_fp32_accumulation(device, seed):
    xs, ws, xt, wt, labels = draw(seed, torch.bfloat16, device=device)
    _, grads = grads_of(lambda a, b: liger_torch.fused_linear_jsd(a, b, xt, wt, chunk_size=CHUNK,
                                                                  accum_dtype_fp32=False), (xs, ws),
                        torch.tensor(1.0, device=device))
    _, grads_ref = grads_of(lambda a, b: reference(a, b, xt, wt), (xs, ws), torch.tensor(1.0, device=device))
    assert grads[1].dtype == torch.bfloat16
    assert_close(grads[1] * N, grads_ref[1] * N, torch.bfloat16, "dweight", scale=2 * N ** 0.5)


def test_teacher_in_another_dtype(device, seed):
    """A bf16 student against an fp32 teacher: the kernel reads each head's logits in its own dtype."""
    xs, ws, _, _, labels = draw(seed, torch.bfloat16, device=device)
    _, _, xt, wt, _ = draw(seed + 1, torch.float32, device=device)
    loss, grads = grads_of(lambda a, b: liger_torch.fused_linear_jsd(a, b, xt, wt, labels, temperature=1.5,
                                                                     chunk_size=CHUNK), (xs, ws),
                           torch.tensor(1.0, device=device))
    loss_ref, grads_ref = grads_of(lambda a, b: reference(a, b, xt, wt, labels, temperature=1.5), (xs, ws),
                                   torch.tensor(1.0, device=device, dtype=torch.float64))
    assert_close(loss, loss_ref, torch.bfloat16, "loss", scale=4.0)
    count = int((labels != -100).sum())
    assert_close(grads[0] * count, grads_ref[0] * count, torch.bfloat16, "dstudent_input", scale=2.0)
    assert_close(grads[1] * count, grads_ref[1] * count, torch.bfloat16, "dstudent_weight", scale=2 * N ** 0.5)


def test_all_ignored_and_no_grad(device, seed):
    xs, ws, xt, wt, labels = draw(seed, torch.float32, device=device)
    labels = torch.full_like(labels, -100)
    loss, grads = grads_of(lambda a, b: liger_torch.fused_linear_jsd(a, b, xt, wt, labels, chunk_size=CHUNK),
                           (xs, ws), torch.tensor(1.0, device=device))
    assert float(loss) == 0.0
    for grad in grads:
        assert torch.equal(grad, torch.zeros_like(grad))
    with torch.no_grad():
        loss = liger_torch.fused_linear_jsd(xs.requires_grad_(True), ws, xt, wt, chunk_size=CHUNK, beta=1.0)
    assert_close(loss, reference(xs, ws, xt, wt, beta=1.0), torch.float32, "loss", scale=4.0)


def test_second_backward_is_refused(device, seed):
    xs, ws, xt, wt, _ = draw(seed, torch.float32, device=device)
    loss = liger_torch.fused_linear_jsd(xs.requires_grad_(True), ws, xt, wt)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        loss.backward()


def test_chunk_size_is_a_bounded_workspace():
    rows = liger_core.fused_linear_jsd.chunk_rows
    # the student's (rows, V) logits in liger_core.fused_linear_jsd.WORKSPACE_BYTES (the teacher's as many again)
    assert rows(8192, 128256, "bfloat16") == rows(10**6, 128256, "bfloat16") == 2048
    assert 2048 * 128256 * 2 <= liger_core.fused_linear_jsd.WORKSPACE_BYTES
    assert rows(10**6, 128256, "float32") == 1024
    assert rows(100, 128256, "bfloat16") == 100
    assert rows(50, 10, "float32", chunk_size=8) == 8


@pytest.mark.parametrize("n,teacher_dtype,chunk_size,accum,expect", [
    (4096, "bfloat16", None, True, (4096, False)),  # both heads' logits 2.1 GB <= the 2.1 GB accumulator
    (4097, "bfloat16", None, True, (2048, True)),
    (4096, "float32", None, True, (2048, True)),    # an fp32 teacher's logits are twice the bytes
    (2048, "float32", None, True, (2048, False)),
    (4096, "bfloat16", None, False, (2048, False)),
    (4096, "bfloat16", 1024, True, (1024, True)),
])
def test_one_chunk_when_both_heads_logits_fit_the_accumulator(n, teacher_dtype, chunk_size, accum, expect):
    chunking = liger_core.fused_linear_jsd.chunking
    assert chunking(n, 128256, 4096, "bfloat16", teacher_dtype, "bfloat16", chunk_size, accum) == expect


def _make(d, xs_shape=(4, 8), ws_shape=(10, 8), xt_shape=(4, 6), wt_shape=(10, 6), dtype=torch.float32,
          wt_dtype=None):
    return (torch.randn(xs_shape, device=d, dtype=dtype), torch.randn(ws_shape, device=d, dtype=dtype),
            torch.randn(xt_shape, device=d, dtype=dtype), torch.randn(wt_shape, device=d, dtype=wt_dtype or dtype))


# Everything is built on the test's device, so the device check (which runs first) passes and the check under
# test is the one that fires.
@pytest.mark.parametrize("make,kwargs,error,match", [
    (lambda d: _make(d, ws_shape=(10, 7)), lambda d: {}, ValueError, r"student_weight must have shape \(V, H\) with H=8"),
    (lambda d: _make(d, wt_shape=(10, 8)), lambda d: {}, ValueError, r"teacher_weight must have shape \(V, H\) with H=6"),
    (lambda d: _make(d, wt_shape=(11, 6)), lambda d: {}, ValueError, "teacher_weight must have the student's vocabulary"),
    (lambda d: _make(d, xt_shape=(5, 6)), lambda d: {}, ValueError, "teacher_input must have student_input's leading"),
    (lambda d: _make(d, wt_dtype=torch.bfloat16), lambda d: {}, TypeError, "teacher_weight must have teacher_input's dtype"),
    (lambda d: _make(d), lambda d: {"labels": torch.zeros(3, dtype=torch.long, device=d)}, ValueError,
     "labels must have shape"),
    (lambda d: _make(d), lambda d: {"temperature": 0.0}, ValueError, "temperature"),
    (lambda d: _make(d), lambda d: {"beta": 2.0}, ValueError, "beta"),
    (lambda d: _make(d), lambda d: {"chunk_size": 0}, ValueError, "chunk_size"),
])
def test_bad_input_raises_before_launch(make, kwargs, error, match, device):
    with pytest.raises(error, match=match):
        liger_torch.fused_linear_jsd(*make(device), **kwargs(device))


def test_teacher_requiring_grad_is_refused(device):
    xs, ws, xt, wt = _make(device)
    with pytest.raises(ValueError, match="teacher_weight requires grad"):
        liger_torch.fused_linear_jsd(xs, ws, xt, wt.requires_grad_(True))

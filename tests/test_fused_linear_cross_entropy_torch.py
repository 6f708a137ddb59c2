"""liger_torch.fused_linear_cross_entropy against matmul + F.cross_entropy in float64, forward and backward."""

import pytest
import torch
import torch.nn.functional as F

import liger_core
import liger_torch
from helpers import assert_close

N, H, V = 37, 24, 259
CHUNK = 8  # 5 chunks, the last one partial
OPTIONS = {
    "plain": {},
    "everything": {"ce_weight": True, "label_smoothing": 0.1, "lse_square_scale": 1e-3, "softcap": 5.0},
}


def reference(x, w, t, b=None, ce_weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
              lse_square_scale=0.0, softcap=None):
    """float64 from the same inputs, the logits rounded to x's dtype as an lm_head's output is; (loss, z)."""
    z = x.double() @ w.double().t()
    if b is not None:
        z = z + b.double()
    z = z.to(x.dtype).double()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    keep = t != ignore_index
    if reduction == "mean" and not keep.any():
        zero = (z * 0).sum()
        return zero, zero
    ce = F.cross_entropy(z.reshape(-1, z.shape[-1]), t.reshape(-1),
                         weight=None if ce_weight is None else ce_weight.double(), ignore_index=ignore_index,
                         reduction=reduction, label_smoothing=label_smoothing)
    zl = (lse_square_scale * torch.logsumexp(z, -1) ** 2 * keep).reshape(-1)
    if reduction == "mean":
        zl = zl.sum() / keep.sum()
    elif reduction == "sum":
        zl = zl.sum()
    return ce + zl, zl


def draw(seed, dtype, n=N, ignore_fraction=0.25, device="cpu"):
    """Drawn on the CPU from a seeded generator (the same numbers on every device), then moved to ``device``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, H, generator=gen).to(device, dtype)
    w = (torch.randn(V, H, generator=gen) * 0.4).to(device, dtype)
    b = torch.randn(V, generator=gen).to(device, dtype)
    t = torch.randint(0, V, (n,), generator=gen)
    t[torch.rand(n, generator=gen) < ignore_fraction] = -100
    cw = torch.rand(V, generator=gen) + 0.5
    return x, w, b, t.to(device), cw.to(device), gen


def grads_of(fn, tensors, g):
    leaves = [None if a is None else a.detach().clone().requires_grad_(True) for a in tensors]
    out = fn(*leaves)
    loss = out[0] if isinstance(out, tuple) else out
    loss.backward(g)
    return out, [None if a is None else a.grad for a in leaves]


# chunk None: one chunk, whose bf16 weight gradient is one matmul rounded once (no fp32 accumulator)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("option,with_bias", [("plain", False), ("plain", True), ("everything", True)])
@pytest.mark.parametrize("dtype,chunk", [(torch.float32, CHUNK), (torch.bfloat16, CHUNK), (torch.bfloat16, None)])
def test_forward_backward(reduction, option, with_bias, dtype, chunk, device, seed):
    x, w, b, t, cw, gen = draw(seed, dtype, device=device)
    opts = dict(OPTIONS[option])
    if opts.pop("ce_weight", False):
        opts["ce_weight"] = cw
    b = b if with_bias else None
    g = (torch.randn(N, generator=gen) if reduction == "none" else torch.tensor(0.7)).to(device, dtype)
    (loss, z), grads = grads_of(lambda a, c, d: liger_torch.fused_linear_cross_entropy(
        a, c, t, d, reduction=reduction, return_z_loss=True, chunk_size=chunk, **opts), (x, w, b), g)
    (loss_ref, z_ref), grads_ref = grads_of(lambda a, c, d: reference(a, c, t, d, reduction=reduction, **opts),
                                            (x, w, b), g.double())
    assert loss.dtype == torch.float32 and loss.shape == loss_ref.shape  # fp32 whatever the inputs
    assert_close(loss, loss_ref, dtype, "loss")
    assert_close(z, z_ref, dtype, "z_loss")
    scale = N if reduction == "mean" else 1.0  # the mean's gradients are ~1/N: compare them scaled up
    for name, got, want in zip(("dx", "dweight", "dbias"), grads, grads_ref):
        if want is None:
            assert got is None
            continue
        assert got.dtype == dtype, name
        # dweight / dbias sum N rounded terms per element; bf16 dx is a bf16 matmul of bf16 dlogits.
        widen = 1.0 if name == "dx" else N ** 0.5
        assert_close(got * scale, want * scale, dtype, name, scale=widen if dtype == torch.float32 else 2 * widen)


def test_default_chunking_matches_explicit_chunks(device, seed):
    x, w, b, t, cw, _ = draw(seed, torch.float32, device=device)
    outs = [grads_of(lambda a, c, d: liger_torch.fused_linear_cross_entropy(a, c, t, d, cw, chunk_size=cs,
                                                                             label_smoothing=0.1),
                     (x, w, b), torch.tensor(1.0, device=device)) for cs in (None, CHUNK, 1)]
    for loss, grads in outs[1:]:
        assert_close(loss, outs[0][0], torch.float32, "loss")
        for got, want in zip(grads, outs[0][1]):
            assert_close(got, want, torch.float32, "grad", scale=3.0)


def test_matches_cross_entropy_on_full_logits(device, seed):
    x, w, b, t, cw, _ = draw(seed, torch.float32, device=device)
    loss, grads = grads_of(lambda a, c: liger_torch.fused_linear_cross_entropy(a, c, t, chunk_size=CHUNK,
                                                                               softcap=3.0), (x, w),
                           torch.tensor(1.0, device=device))
    loss_ref, grads_ref = grads_of(lambda a, c: liger_torch.cross_entropy(a @ c.t(), t, softcap=3.0), (x, w),
                                   torch.tensor(1.0, device=device))
    assert_close(loss, loss_ref, torch.float32, "loss")
    for got, want in zip(grads, grads_ref):
        assert_close(got * N, want * N, torch.float32, "grad", scale=3.0)


def test_three_dimensional_input_and_frozen_weight(device, seed):
    x, w, _, t, _, _ = draw(seed, torch.float32, n=3 * 5, device=device)
    x3, t3 = x.reshape(3, 5, H), t.reshape(3, 5)
    x3 = x3.clone().requires_grad_(True)
    loss = liger_torch.fused_linear_cross_entropy(x3, w, t3, reduction="none", chunk_size=4)
    assert loss.shape == (3, 5)
    g = torch.randn(3, 5).to(device)  # torch's global generator, as before; drawn on the CPU
    loss.backward(g)
    ref = x3.detach().double().requires_grad_(True)
    reference(ref, w, t3, reduction="none")[0].reshape(3, 5).backward(g.double())
    assert_close(loss, reference(x3, w, t3, reduction="none")[0].reshape(3, 5), torch.float32, "loss")
    assert_close(x3.grad, ref.grad, torch.float32, "dx")


def test_bf16_without_fp32_accumulation(device, seed):
    x, w, _, t, _, _ = draw(seed, torch.bfloat16, device=device)
    loss, grads = grads_of(lambda a, c: liger_torch.fused_linear_cross_entropy(
        a, c, t, reduction="sum", chunk_size=CHUNK, accum_dtype_fp32=False), (x, w), torch.tensor(1.0, device=device))
    loss_ref, grads_ref = grads_of(lambda a, c: reference(a, c, t, reduction="sum"), (x, w),
                                   torch.tensor(1.0, device=device))
    assert grads[1].dtype == torch.bfloat16
    assert_close(grads[1], grads_ref[1], torch.bfloat16, "dweight", scale=2 * N ** 0.5)


def test_all_ignored_and_no_grad(device, seed):
    x, w, b, t, _, _ = draw(seed, torch.float32, ignore_fraction=1.0, device=device)
    loss, grads = grads_of(lambda a, c, d: liger_torch.fused_linear_cross_entropy(a, c, t, d, chunk_size=CHUNK,
                                                                                  label_smoothing=0.1),
                           (x, w, b), torch.tensor(1.0, device=device))
    assert float(loss) == 0.0
    for grad in grads:
        assert torch.equal(grad, torch.zeros_like(grad))
    x2, w2, _, t2, _, _ = draw(seed + 1, torch.float32, device=device)
    with torch.no_grad():
        loss = liger_torch.fused_linear_cross_entropy(x2.requires_grad_(True), w2, t2, chunk_size=CHUNK)
    assert_close(loss, reference(x2, w2, t2)[0], torch.float32, "loss")


def test_second_backward_is_refused(device, seed):
    x, w, _, t, _, _ = draw(seed, torch.float32, device=device)
    loss = liger_torch.fused_linear_cross_entropy(x.requires_grad_(True), w, t)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        loss.backward()


def test_module(device, seed):
    x, w, b, t, cw, _ = draw(seed, torch.float32, device=device)
    module = liger_torch.FusedLinearCrossEntropyLoss(ce_weight=cw, lse_square_scale=1e-3, return_z_loss=True,
                                                     chunk_size=CHUNK)
    loss, z = module(w, x, t, b)
    loss_ref, z_ref = reference(x, w, t, b, ce_weight=cw, lse_square_scale=1e-3)
    assert_close(loss, loss_ref, torch.float32, "loss")
    assert_close(z, z_ref, torch.float32, "z_loss")


def test_chunk_size_is_a_bounded_workspace():
    rows = liger_core.fused_linear_cross_entropy.chunk_rows
    assert rows(8192, 128256, "bfloat16") == rows(10**6, 128256, "bfloat16") == 2048
    assert rows(100, 128256, "bfloat16") == 100
    assert rows(50, 10, "float32", chunk_size=8) == 8
    assert rows(10**6, 10**7, "float32") >= 1


@pytest.mark.parametrize("n,hidden,weight_dtype,chunk_size,accum,expect", [
    (8192, 4096, "bfloat16", None, True, (8192, False)),   # logits 2.1 GB <= the 2.1 GB accumulator: one chunk
    # one row more: chunks and the fp32 accumulator, the chunks' logits half its bytes (H rows in bf16)
    (8193, 4096, "bfloat16", None, True, (4096, True)),
    (16384, 4096, "bfloat16", None, True, (4096, True)),
    (16384, 512, "bfloat16", None, True, (2048, True)),    # a small accumulator: the default workspace
    (8192, 4096, "bfloat16", None, False, (2048, False)),  # bf16 accumulation: no accumulator to save
    (8192, 4096, "float32", None, True, (2048, False)),    # an fp32 weight's gradient is its own accumulator
    (8192, 4096, "bfloat16", 1024, True, (1024, True)),    # chunk_size is obeyed
    (8192, 4096, "bfloat16", 8192, True, (8192, False)),
    (100, 4096, "bfloat16", None, True, (100, False)),
])
def test_one_chunk_when_its_logits_fit_the_accumulator(n, hidden, weight_dtype, chunk_size, accum, expect):
    chunking = liger_core.fused_linear_cross_entropy.chunking
    assert chunking(n, 128256, hidden, "bfloat16", weight_dtype, chunk_size, accum) == expect


# make(device) -> (x, weight, target); kwargs(device) -> keyword arguments. Everything is built on the test's
# device, so the device check (which runs first) passes and the check under test is the one that fires.
@pytest.mark.parametrize("make,kwargs,error,match", [
    (lambda d: (torch.randn(4, 8, device=d), torch.randn(10, 7, device=d), torch.zeros(4, dtype=torch.long, device=d)),
     lambda d: {}, ValueError, r"weight must have shape \(V, H\) with H=8"),
    (lambda d: (torch.randn(4, 8, device=d), torch.randn(10, 8, device=d).double(),
                torch.zeros(4, dtype=torch.long, device=d)), lambda d: {}, TypeError, "weight"),
    (lambda d: (torch.randn(4, 8, device=d), torch.randn(10, 8, device=d).bfloat16(),
                torch.zeros(4, dtype=torch.long, device=d)), lambda d: {}, TypeError, "weight must have x's dtype"),
    (lambda d: (torch.randn(4, 8, device=d), torch.randn(10, 8, device=d), torch.zeros(3, dtype=torch.long, device=d)),
     lambda d: {}, ValueError, "target must have shape"),
    (lambda d: (torch.randn(4, 8, device=d), torch.randn(10, 8, device=d), torch.zeros(4, dtype=torch.long, device=d)),
     lambda d: {"bias": torch.zeros(9, device=d)}, ValueError, r"bias must have shape \(10,\)"),
    (lambda d: (torch.randn(4, 8, device=d), torch.randn(10, 8, device=d), torch.tensor([0, 1, 10, 2], device=d)),
     lambda d: {}, ValueError, r"outside \[0, 10\)"),
    (lambda d: (torch.randn(4, 8, device=d), torch.randn(10, 8, device=d), torch.zeros(4, dtype=torch.long, device=d)),
     lambda d: {"chunk_size": 0}, ValueError, "chunk_size"),
    (lambda d: (torch.randn(4, 8, device=d), torch.randn(10, 8, device=d), torch.zeros(4, dtype=torch.long, device=d)),
     lambda d: {"reduction": "avg"}, ValueError, "reduction"),
])
def test_bad_input_raises_before_launch(make, kwargs, error, match, device):
    x, w, t = make(device)
    with pytest.raises(error, match=match):
        liger_torch.fused_linear_cross_entropy(x, w, t, **kwargs(device))


@pytest.mark.parametrize("weight_dtype,accum_fp32", [(torch.float32, True), (torch.bfloat16, True),
                                                     (torch.bfloat16, False)])
def test_weight_gradient_first_chunk_overwrites_unset_memory(weight_dtype, accum_fp32, device, seed):
    """The dW accumulator is allocated unset and the first chunk overwrites it: with it poisoned (NaN, as
    uninitialised memory may be), three chunks still sum exactly what one matmul over all rows gives."""
    from liger_torch.fused_linear_cross_entropy import accumulate_linear_grads, weight_grad_buffers

    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(37, 16, generator=gen).to(device, weight_dtype)
    x = torch.randn(23, 16, generator=gen).to(device, weight_dtype)
    dlogits = torch.randn(23, 37, generator=gen).to(device, weight_dtype)
    grad_w, grad_w_tmp = weight_grad_buffers(weight, weight_dtype, accum_fp32)
    assert grad_w.dtype == (torch.float32 if accum_fp32 else weight_dtype)
    grad_w.fill_(float("nan"))
    for i, (start, stop) in enumerate(((0, 8), (8, 16), (16, 23))):
        accumulate_linear_grads(dlogits[start:stop], x[start:stop], weight, None, grad_w, grad_w_tmp,
                                (False, True, False), first=i == 0)
    want = dlogits.double().t() @ x.double()
    assert torch.isfinite(grad_w).all()
    # bf16 products are rounded to bf16 once per chunk where the device adds them through the scratch
    assert_close(grad_w, want, weight_dtype, "grad_w", scale=3.0)


@pytest.mark.parametrize("overwrites", [True, False])
def test_weight_gradient_fp32_matmul_path_without_zero_fill(overwrites, monkeypatch, seed):
    """The GPU path that adds bf16 products into the fp32 accumulator inside the matmul (``addmm`` with
    ``out_dtype``; not on the CPU, so emulated here): the first chunk overwrites with ``beta=0`` where the device
    honours it, else zero-fills first. A poisoned (NaN) accumulator must not leak into either."""
    import importlib

    flce = importlib.import_module("liger_torch.fused_linear_cross_entropy")  # the module, not the function
    calls = []

    def addmm(acc, a, b, *, beta=1, out_dtype, out):  # CUDA's addmm.dtype_out semantics, on the CPU
        calls.append(beta)
        product = a.float() @ b.float()
        return out.copy_(product if beta == 0 else acc + product)

    monkeypatch.setattr(flce, "_addmm_accumulates_in_fp32", lambda device, dtype: True)
    monkeypatch.setattr(flce, "_addmm_overwrites_in_fp32", lambda device, dtype: overwrites)
    monkeypatch.setattr(flce.torch, "addmm", addmm)
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(37, 16, generator=gen).bfloat16()
    x = torch.randn(23, 16, generator=gen).bfloat16()
    dlogits = torch.randn(23, 37, generator=gen).bfloat16()
    grad_w, grad_w_tmp = flce.weight_grad_buffers(weight, weight.dtype, True)
    assert grad_w_tmp is None and grad_w.dtype == torch.float32
    grad_w.fill_(float("nan"))
    for i, (start, stop) in enumerate(((0, 8), (8, 16), (16, 23))):
        flce.accumulate_linear_grads(dlogits[start:stop], x[start:stop], weight, None, grad_w, grad_w_tmp,
                                     (False, True, False), first=i == 0)
    assert calls == [0 if overwrites else 1, 1, 1]
    assert_close(grad_w, dlogits.double().t() @ x.double(), torch.float32, "grad_w", scale=3.0)


@pytest.mark.gpu
@pytest.mark.parametrize("chunk_size", [None, 1024], ids=["one_chunk", "four_chunks"])
def test_peak_memory_holds_one_chunk_of_logits(chunk_size):
    """Peak memory of a forward+backward above the inputs: x's and W's gradients, and either all the logits
    (one chunk: the default here, 250 MiB of logits fit the workspace) or the fp32 dW accumulator with one chunk
    of logits at a time. Two chunks alive (the previous chunk's logits kept while the next one's matmul
    allocates) would add 62.5 MiB here."""
    n, h, v = 4096, 1024, 32000
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, h, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_(True)
    w = (torch.randn(v, h, device="cuda", generator=gen) * 0.05).to(torch.bfloat16).requires_grad_(True)
    t = torch.randint(0, v, (n,), device="cuda", generator=gen)

    def step():
        x.grad = w.grad = None
        liger_torch.fused_linear_cross_entropy(x, w, t, chunk_size=chunk_size).backward()

    step()  # warm-up: kernels compiled, cuBLAS workspace allocated
    x.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    grad_x, grad_w = n * h * 2, v * h * 2
    if chunk_size is None:  # the logits, overwritten by their gradient, and the bf16 dW written in the forward
        held = n * v * 2 + grad_w
    else:  # the accumulator with one chunk (forward), or with its rounded copy (the backward's end)
        held = v * h * 4 + max(chunk_size * v * 2, grad_w)
    assert extra <= grad_x + held + 16 * 2**20, f"peak {extra / 2**20:.1f} MiB above the inputs"


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("chunk", [CHUNK, None])
def test_autocast_fp32_master_weight(reduction, chunk, device, seed):
    """Mixed precision (fp32 parameters, torch.autocast to bf16): the logits are bf16 matmuls of bf16 copies, as
    F.linear's under autocast, but the weight's gradient is accumulated in fp32 straight into its fp32
    gradient: never rounded to bf16 (a bf16 gradient cast back would hold bf16 values only)."""
    x, w, b, t, _, gen = draw(seed, torch.float32, device=device)
    g = (torch.randn(N, generator=gen) if reduction == "none" else torch.tensor(0.7)).to(device)

    def fused(a, c, d):
        with torch.autocast(device, dtype=torch.bfloat16):
            return liger_torch.fused_linear_cross_entropy(a, c, t, d, reduction=reduction, chunk_size=chunk)

    loss, grads = grads_of(fused, (x, w, b), g)
    (loss_ref, _), grads_ref = grads_of(
        lambda a, c, d: reference(a.bfloat16(), c.bfloat16(), t, d.bfloat16(), reduction=reduction), (x, w, b),
        g.double())
    assert loss.dtype == torch.float32
    assert_close(loss, loss_ref, torch.bfloat16, "loss")
    scale = N if reduction == "mean" else 1.0
    for name, got, want in zip(("dx", "dweight", "dbias"), grads, grads_ref):
        assert got.dtype == torch.float32, name
        widen = 1.0 if name == "dx" else N ** 0.5
        assert_close(got * scale, want * scale, torch.bfloat16, name, scale=2 * widen)
    dw = grads[1]
    if chunk is not None:  # chunks summed in fp32 (one chunk's matmul is rounded to bf16 where the device,
        # like the CPU, has no bf16 matmul with an fp32 output: weight_grad_buffers' scratch)
        assert (dw != dw.bfloat16().float()).any(), "the master weight's gradient went through bf16"


@pytest.mark.gpu
def test_peak_memory_of_a_master_weight():
    """Under autocast with an fp32 weight: its bf16 copy, its fp32 gradient (the accumulator itself) and one
    chunk of logits, and nothing W-sized more (a bf16 gradient cast back, or an accumulator beside the
    gradient, would add 62.5-125 MiB here)."""
    n, h, v, chunk = 4096, 1024, 32000, 1024
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, h, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_(True)
    w = (torch.randn(v, h, device="cuda", generator=gen) * 0.05).requires_grad_(True)
    t = torch.randint(0, v, (n,), device="cuda", generator=gen)

    def step():
        x.grad = w.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = liger_torch.fused_linear_cross_entropy(x, w, t, chunk_size=chunk)
        loss.backward()

    step()
    x.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert w.grad.dtype == torch.float32
    held = n * h * 2 + v * h * 4 + v * h * 2 + chunk * v * 2  # dx, fp32 dW, W's bf16 copy, one chunk
    assert extra <= held + 16 * 2**20, f"peak {extra / 2**20:.1f} MiB above the inputs"


def test_vocab_not_a_power_of_two(device, seed):
    """V = 32003: the chunk's kernel sweeps several column blocks, the last one ragged (bf16, one chunk)."""
    gen = torch.Generator().manual_seed(seed)
    n, h, v = 5, 16, 32003
    x = torch.randn(n, h, generator=gen).to(device, torch.bfloat16)
    w = (torch.randn(v, h, generator=gen) * 0.4).to(device, torch.bfloat16)
    t = torch.randint(0, v, (n,), generator=gen)
    t[1] = -100
    t = t.to(device)
    # g = 1: the backward's scale moves nothing (g != 1 is test_forward_backward's; here, on 32003 rows of dW
    # 16 wide, the interpreter would take minutes over the scale kernel's 32003 tiles)
    g = torch.tensor(1.0, device=device)
    loss, grads = grads_of(lambda a, c: liger_torch.fused_linear_cross_entropy(a, c, t, label_smoothing=0.1),
                           (x, w), g)
    (loss_ref, _), grads_ref = grads_of(lambda a, c: reference(a, c, t, label_smoothing=0.1), (x, w), g.double())
    assert_close(loss, loss_ref, torch.bfloat16, "loss")
    kept = 4  # the mean's gradients are ~1/kept: compare them scaled up
    assert_close(grads[0] * kept, grads_ref[0] * kept, torch.bfloat16, "dx")
    assert_close(grads[1] * kept, grads_ref[1] * kept, torch.bfloat16, "dweight", scale=2 * n ** 0.5)

"""Bitwise determinism on the GPU: every kernel family, both frontends, forward outputs and every gradient,
three runs on fresh, identical inputs (regenerated from the same seed each run), at sizes where the persistent
backward with per-program partial sums (the norms' dW), the multi-block vocabulary sweeps (the losses) and the
chunk loops (the fused losses, several chunks accumulating dW) all run.

Every reduction of the kernels has a fixed order (no atomics; partials summed by liger_core.reduce in program
order), and the matmuls of the fused losses are cuBLAS / XLA GEMMs of fixed shapes on one stream, so the bits
must not change between runs. A failure names the output and how many elements differ.
"""

import numpy as np
import pytest
import torch

import liger_torch

pytestmark = pytest.mark.gpu

RUNS = 3
R, H = 4096, 4096          # norms, gated activations: 16M elements, a persistent backward over 4096 rows
V = 32768                  # losses: a vocabulary of several blocks
HF, HT = 1024, 512         # fused losses: student / teacher hidden sizes
CHUNK = 1024               # fused losses: 4 chunks of rows
B, T, HQ, HK, D = 4, 2048, 32, 8, 128   # rope
BF16 = torch.bfloat16


# ------------------------------------------------------------------------------------------------- torch
def _torch_inputs(family, gen):
    def randn(*shape, scale=1.0, dtype=BF16, grad=True):
        t = (torch.randn(shape, generator=gen, device="cuda") * scale).to(dtype)
        return t.requires_grad_(True) if grad else t

    def logp(*shape, grad=True):
        t = torch.log_softmax(torch.randn(shape, generator=gen, device="cuda") * 2, -1).to(BF16)
        return t.requires_grad_(True) if grad else t

    def labels(n, ignore=0.25):
        t = torch.randint(0, V, (n,), generator=gen, device="cuda")
        t[torch.rand(n, generator=gen, device="cuda") < ignore] = -100
        return t

    if family == "rms_norm":
        return dict(x=randn(R, H), weight=randn(H, scale=0.5))
    if family == "layer_norm":
        return dict(x=randn(R, H), weight=randn(H), bias=randn(H))
    if family == "fused_add_rms_norm":
        return dict(x=randn(R, H), residual=randn(R, H), weight=randn(H))
    if family == "rope":
        return dict(q=randn(B, HQ, T, D), k=randn(B, HK, T, D), cos=randn(T, D, grad=False),
                    sin=randn(T, D, grad=False))
    if family in ("swiglu", "geglu"):
        return dict(a=randn(R, 2 * H, scale=2.0), b=randn(R, 2 * H))
    if family == "cross_entropy":
        return dict(logits=randn(R, V, scale=3.0), target=labels(R), label_smoothing=0.1, lse_square_scale=1e-4)
    if family == "fused_linear_cross_entropy":
        return dict(x=randn(R, HF), weight=randn(V, HF, scale=0.05), target=labels(R), chunk_size=CHUNK)
    if family == "kl_div":
        return dict(input=logp(R, V), target=logp(R, V, grad=False).exp(), reduction="batchmean")
    if family == "jsd":
        return dict(student_logprobs=logp(R, V), teacher_logprobs=logp(R, V, grad=False), labels=labels(R))
    assert family == "fused_linear_jsd"
    return dict(student_input=randn(R, HF), student_weight=randn(V, HF, scale=0.05),
                teacher_input=randn(R, HT, grad=False), teacher_weight=randn(V, HT, scale=0.05, grad=False),
                labels=labels(R), chunk_size=CHUNK)


FAMILIES = ["rms_norm", "layer_norm", "fused_add_rms_norm", "rope", "swiglu", "geglu", "cross_entropy",
            "fused_linear_cross_entropy", "kl_div", "jsd", "fused_linear_jsd"]


def _torch_run(family):
    """(names, tensors): the forward outputs and the gradient of every input that requires grad."""
    gen = torch.Generator(device="cuda").manual_seed(1234)
    inputs = _torch_inputs(family, gen)
    outs = getattr(liger_torch, family)(**inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    cotangents = [torch.ones_like(o) if o.ndim == 0 else torch.randn(o.shape, generator=gen, device="cuda").to(o.dtype)
                  for o in outs]
    torch.autograd.backward(outs, cotangents)
    leaves = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.requires_grad}
    names = [f"output {i}" for i in range(len(outs))] + [f"d{k}" for k in leaves]
    tensors = [o.detach() for o in outs] + [v.grad for v in leaves.values()]
    torch.cuda.synchronize()
    return names, tensors


def _bits(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("family", FAMILIES)
def test_torch_bitwise_deterministic(family):
    names, first = _torch_run(family)
    assert all(t is not None for t in first), names
    for run in range(1, RUNS):
        _, again = _torch_run(family)
        for name, a, b in zip(names, first, again):
            assert a.shape == b.shape and a.dtype == b.dtype, name
            if not torch.equal(_bits(a), _bits(b)):
                differ = int((a.reshape(-1) != b.reshape(-1)).sum())
                pytest.fail(f"{family} {name}: run {run} differs from run 0 in {differ} of {a.numel()} elements")
    del first, again
    torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------------- jax
def _jax_case(family):
    """(function of the differentiable arrays, their count, a builder of all the arrays from a PRNG key)."""
    import jax
    import jax.numpy as jnp

    import liger_jax

    bf = jnp.bfloat16

    def build(key):
        keys = iter(jax.random.split(key, 8))

        def randn(*shape, scale=1.0):
            return (jax.random.normal(next(keys), shape, jnp.float32) * scale).astype(bf)

        def logp(*shape):
            return jax.nn.log_softmax(jax.random.normal(next(keys), shape, jnp.float32) * 2, -1).astype(bf)

        def labels(n):
            k1, k2 = jax.random.split(next(keys))
            t = jax.random.randint(k1, (n,), 0, V)
            return jnp.where(jax.random.uniform(k2, (n,)) < 0.25, -100, t)

        if family == "rms_norm":
            return (randn(R, H), randn(H, scale=0.5)), ()
        if family == "layer_norm":
            return (randn(R, H), randn(H), randn(H)), ()
        if family == "fused_add_rms_norm":
            return (randn(R, H), randn(R, H), randn(H)), ()
        if family == "rope":
            return (randn(B, T, HQ, D), randn(B, T, HK, D)), (randn(T, D), randn(T, D))
        if family in ("swiglu", "geglu"):
            return (randn(R, 2 * H, scale=2.0), randn(R, 2 * H)), ()
        if family == "cross_entropy":
            return (randn(R, V, scale=3.0),), (labels(R),)
        if family == "fused_linear_cross_entropy":
            return (randn(R, HF), randn(HF, V, scale=0.05)), (labels(R),)
        if family == "kl_div":
            return (logp(R, V),), (jnp.exp(logp(R, V).astype(jnp.float32)).astype(bf),)
        if family == "jsd":
            return (logp(R, V),), (logp(R, V), labels(R))
        assert family == "fused_linear_jsd"
        return (randn(R, HF), randn(HF, V, scale=0.05)), (randn(R, HT), randn(HT, V, scale=0.05), labels(R))

    calls = {
        "rms_norm": lambda x, s: liger_jax.rms_norm(x, s),
        "layer_norm": lambda x, s, b: liger_jax.layer_norm(x, s, b),
        "fused_add_rms_norm": lambda x, r, s: liger_jax.fused_add_rms_norm(x, r, s),
        "rope": lambda q, k, cos, sin: liger_jax.rope(q, k, cos, sin),
        "swiglu": liger_jax.swiglu,
        "geglu": liger_jax.geglu,
        "cross_entropy": lambda z, t: liger_jax.cross_entropy(z, t, label_smoothing=0.1, lse_square_scale=1e-4),
        "fused_linear_cross_entropy": lambda x, k, t: liger_jax.fused_linear_cross_entropy(x, k, t,
                                                                                          chunk_size=CHUNK),
        "kl_div": lambda x, y: liger_jax.kl_div(x, y, reduction="batchmean"),
        "jsd": lambda s, t, lab: liger_jax.jsd(s, t, lab),
        "fused_linear_jsd": lambda xs, ks, xt, kt, lab: liger_jax.fused_linear_jsd(xs, ks, xt, kt, lab,
                                                                                  chunk_size=CHUNK),
    }
    return calls[family], build


@pytest.mark.parametrize("family", FAMILIES)
def test_jax_bitwise_deterministic(family):
    import jax
    import jax.numpy as jnp

    fn, build = _jax_case(family)

    def outputs(diff, const):
        out = fn(*diff, *const)
        return out if isinstance(out, tuple) else (out,)

    def step(diff, const, cots):
        def scalar(*d):  # the outputs against fixed cotangents: its gradient is the vjp with them
            return sum(jnp.sum(o.astype(jnp.float32) * c) for o, c in zip(outputs(d, const), cots))
        return outputs(diff, const), jax.grad(scalar, argnums=tuple(range(len(diff))))(*diff)

    step = jax.jit(step)

    def run():
        diff, const = build(jax.random.PRNGKey(1234))
        shapes = jax.eval_shape(lambda: outputs(diff, const))
        keys = jax.random.split(jax.random.PRNGKey(99), len(shapes))
        cots = tuple(jax.random.normal(k, s.shape, jnp.float32) for k, s in zip(keys, shapes))
        outs, grads = step(diff, const, cots)
        arrays = [np.asarray(a) for a in (*outs, *grads)]
        names = [f"output {i}" for i in range(len(outs))] + [f"grad {i}" for i in range(len(grads))]
        return names, arrays

    names, first = run()
    for r in range(1, RUNS):
        _, again = run()
        for name, a, b in zip(names, first, again):
            assert a.shape == b.shape and a.dtype == b.dtype, name
            if not np.array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)):
                differ = int((a.reshape(-1) != b.reshape(-1)).sum())
                pytest.fail(f"{family} {name}: run {r} differs from run 0 in {differ} of {a.size} elements")


# ------------------------------------------------------------------------------ lagged norm backward (wide rows)
@pytest.mark.parametrize("family", ["rms_norm", "fused_add_rms_norm"])
@pytest.mark.parametrize("chain_dw", [False, True])
def test_lagged_norm_backward_bitwise_deterministic(family, chain_dw, norm_lagged):
    """The lagged norm backward on 1024 x 65536 bf16 rows (its jobs in ticket order, spin-waiting on each other
    with real concurrency; the weight gradient from partial rows or chained through the blocks): three runs
    bitwise equal, and within a rounding of the column split's gradients."""
    from liger_core import fused_add_rms_norm, rms_norm
    from liger_torch._launch import info, run_plan

    norm_lagged(chain_dw=chain_dw)
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, m = 1024, 65536
    x, dy0, dh = ((torch.randn(n, m, generator=gen, device="cuda")).to(BF16) for _ in range(3))
    w = (1 + 0.1 * torch.randn(m, generator=gen, device="cuda")).to(BF16)
    _, rstd = run_plan(rms_norm.forward_plan(info(x), info(w), eps=1e-6), x=x, weight=w)
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def plan(lagged):
        if family == "rms_norm":
            return rms_norm.backward_plan(info(dy0), info(x), info(w), num_sms=sms, in_place=False, lagged=lagged)
        return fused_add_rms_norm.backward_plan(info(dy0), info(dh), info(x), info(w), x_dtype="bfloat16",
                                                residual_dtype="bfloat16", num_sms=sms, in_place=False,
                                                lagged=lagged)

    inputs = dict(dy=dy0, x=x, weight=w, rstd=rstd) if family == "rms_norm" else dict(dy=dy0, dh=dh, h=x, weight=w,
                                                                                        rstd=rstd)
    lagged = plan(True)
    assert lagged.launches[0].kernel.fn.__name__ == "_rms_norm_lagged_backward_kernel"
    first = run_plan(lagged, **inputs)
    for _ in range(RUNS - 1):
        again = run_plan(lagged, **inputs)
        for name, a, b in zip(lagged.outputs, first, again):
            assert torch.equal(_bits(a), _bits(b)), f"{family} {name}: {int((a != b).sum())} elements differ"
    split = run_plan(plan(False), **inputs)
    for name, a, b in zip(lagged.outputs, first, split):
        scale = b.float().abs().max().item()
        assert (a.float() - b.float()).abs().max().item() <= 2 ** -7 * scale, name

"""Host time per call of the torch frontend's ops with the kernel launches stubbed out: the Python, autograd and
plan work a training step pays on the CPU for every op, whatever the GPU does. Runs anywhere (small CPU
tensors; nothing is computed, so the outputs are garbage and never read).

    python3 scripts/host_overhead.py [--iters 2000]
    python3 scripts/host_overhead.py --e2e     # a whole training step of a 16-layer toy Llama, HF vs patched

Compare with the eager formula's host time on the same tensors (printed alongside) and with Triton's own launch
cost on a GPU (``scripts/tune_rms_norm.py --host``).
"""

import argparse
import os
import time

os.environ.setdefault("LIGER_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import liger_torch  # noqa: E402
import liger_torch._launch as launch_module  # noqa: E402


def per_call_us(fn, iters):
    for _ in range(max(20, iters // 20)):
        fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e6


def cases():
    gen = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, generator=gen).requires_grad_(True)

    a, b, x = leaf(64, 256), leaf(64, 256), leaf(64, 256)
    w, bias = leaf(256), leaf(256)
    g = torch.randn(64, 256, generator=gen)
    q, k = leaf(1, 4, 16, 64), leaf(1, 2, 16, 64)
    cos, sin = torch.randn(1, 16, 64, generator=gen), torch.randn(1, 16, 64, generator=gen)
    logits, target = leaf(64, 1000), torch.randint(0, 1000, (64,), generator=gen)

    def fwd_bwd(op, *leaves):
        def run():
            for t in leaves:
                t.grad = None
            out = op()
            out = out if isinstance(out, tuple) else (out,)
            torch.autograd.backward(out, [torch.ones_like(o) for o in out])
        return run

    return {
        "swiglu fwd+bwd": (fwd_bwd(lambda: liger_torch.swiglu(a, b), a, b),
                           fwd_bwd(lambda: F.silu(a) * b, a, b)),
        "rms_norm fwd+bwd": (fwd_bwd(lambda: liger_torch.rms_norm(x, w), x, w),
                             fwd_bwd(lambda: F.rms_norm(x, (256,), w), x, w)),
        "layer_norm fwd+bwd": (fwd_bwd(lambda: liger_torch.layer_norm(x, w, bias), x, w, bias),
                               fwd_bwd(lambda: F.layer_norm(x, (256,), w, bias), x, w, bias)),
        "rope fwd+bwd": (fwd_bwd(lambda: liger_torch.rope(q, k, cos, sin), q, k),
                         fwd_bwd(lambda: (q * cos[:, None] + q.flip(-1) * sin[:, None],
                                          k * cos[:, None] + k.flip(-1) * sin[:, None]), q, k)),
        "cross_entropy fwd+bwd": (fwd_bwd(lambda: liger_torch.cross_entropy(logits, target), logits),
                                  fwd_bwd(lambda: F.cross_entropy(logits, target), logits)),
    }


def stub_launch(launch, args, outputs, device):
    """No kernel runs (host path only), except that the targets check must read a count: zero invalid targets."""
    if launch.kernel.__name__ == "_denominators_kernel":
        for out in outputs:
            out.zero_()


def e2e_step_ms(patched: bool, steps: int = 20) -> float:
    """Host ms per training step (forward, backward, AdamW) of a toy 16-layer Llama (hidden 64, 1 x 32 tokens):
    HF's Python and autograd, plus ours when ``patched``; the CPU math of HF's own ops is tiny at this size."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=16,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                      max_position_embeddings=256, use_cache=False)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    if patched:
        liger_torch.apply_liger_kernel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 256, (1, 32))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return per_call_us(step, steps) / 1e3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--e2e", action="store_true", help="a whole training step instead of single ops")
    args = parser.parse_args()
    launch_module._launch = stub_launch
    if args.e2e:
        print(f"host ms per training step, toy 16-layer Llama: HF {e2e_step_ms(False):.1f}, "
              f"HF + liger_torch {e2e_step_ms(True):.1f}")
        return
    print(f"{'op':<26}{'ours us':>10}{'eager us':>10}")
    for name, (ours, eager) in cases().items():
        print(f"{name:<26}{per_call_us(ours, args.iters):>10.1f}{per_call_us(eager, args.iters):>10.1f}")


if __name__ == "__main__":
    main()

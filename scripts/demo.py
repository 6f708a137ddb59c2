"""The main job: a Llama-family model trained with and without the kernels, same seed and data, with a table.

Unpatched transformers first, then the same model built after ``liger_torch.transformers`` patched the Llama
modeling module (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy: the (tokens x vocab) logits are never
materialised in training). Prints tokens/s, peak memory and final loss of both, and the largest difference of
the per-step losses.

- CPU (kernels in Triton's interpreter): a tiny Llama (2 layers, hidden 64), fp32, a few AdamW steps.
- GPU: a Llama-3.2-1B-shaped model (16 layers, hidden 2048, 32/8 heads, vocab 128256, tied embeddings),
  random init, bf16, 4096 tokens per sequence, AdamW.

    python3 scripts/demo.py [--steps N --batch B --seq T]
"""

from __future__ import annotations

import argparse
import gc
import resource
import time
import warnings

warnings.filterwarnings("ignore", message="liger_core: no NVIDIA GPU found")  # the demo says so itself
warnings.filterwarnings("ignore", category=DeprecationWarning)
import liger_core  # noqa: E402  (decides interpreter vs GPU before any kernel exists)

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from liger_torch.transformers import liger_kernel_patched  # noqa: E402

hf_logging.set_verbosity_error()
ON_GPU = not liger_core.INTERPRET


def model_config() -> LlamaConfig:
    if ON_GPU:  # Llama-3.2-1B's shape
        return LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                           num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=8192,
                           rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, use_cache=False)
    return LlamaConfig(vocab_size=1031, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                       tie_word_embeddings=False, use_cache=False)


def data(args, vocab, device):
    """A fixed cycle of synthetic batches (a stream the model can learn), the same for both runs."""
    g = torch.Generator().manual_seed(1234)
    batches = []
    for _ in range(4):
        ids = torch.randint(0, vocab, (args.batch, args.seq), generator=g)
        batches.append(ids.to(device))
    return batches


def peak_memory_start(device):
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def peak_memory_mb(device, start):
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    # CPU: the growth of the process's peak RSS during the run (a lower bound when an earlier run peaked higher)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - start) / 1024


def train(args, device, dtype, batches):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config(), dtype=dtype).to(device)
    n_liger = sum("_liger_base" in type(m).__dict__ for m in model.modules())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    model.train()
    losses = []
    start = peak_memory_start(device)
    timed_tokens, t0 = 0, None
    for step in range(args.steps):
        if step == args.warmup:
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        ids = batches[step % len(batches)]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().float())
        if step >= args.warmup:
            timed_tokens += ids.numel()
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    mem = peak_memory_mb(device, start)
    losses = torch.stack(losses).cpu()
    del model, opt
    gc.collect()
    return {"tokens/s": timed_tokens / elapsed, "peak_mb": mem, "losses": losses, "modules": n_liger}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20 if ON_GPU else 8)
    parser.add_argument("--warmup", type=int, default=3 if ON_GPU else 1)
    parser.add_argument("--batch", type=int, default=4 if ON_GPU else 2)
    parser.add_argument("--seq", type=int, default=4096 if ON_GPU else 32)
    parser.add_argument("--lr", type=float, default=3e-4 if ON_GPU else 3e-3)
    args = parser.parse_args()
    args.warmup = min(args.warmup, args.steps - 1)
    device = "cuda" if ON_GPU else "cpu"
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    cfg = model_config()
    batches = data(args, cfg.vocab_size, device)
    mode = "GPU (compiled Triton)" if ON_GPU else "CPU (Triton interpreter)"
    if ON_GPU:
        torch.backends.cuda.matmul.allow_tf32 = True
    print(f"liger demo: Llama training, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, vocab "
          f"{cfg.vocab_size}, batch {args.batch} x {args.seq} tokens, {str(dtype)[6:]}, AdamW, {args.steps} steps "
          f"({args.warmup} warm-up steps not timed), {mode}\n")

    results = {"HF transformers": train(args, device, dtype, batches)}
    with liger_kernel_patched("llama"):  # module-level patch, undone on exit
        results["liger_torch (patched)"] = train(args, device, dtype, batches)

    mem_label = "peak mem (MiB)" if ON_GPU else "peak RSS +(MiB)"
    print(f"{'model':<24}{'kernel modules':>16}{'tokens/s':>14}{mem_label:>17}{'first loss':>12}{'final loss':>12}")
    for name, r in results.items():
        print(f"{name:<24}{r['modules']:>16}{r['tokens/s']:>14.1f}{r['peak_mb']:>17.1f}"
              f"{r['losses'][0].item():>12.5f}{r['losses'][-1].item():>12.5f}")
    ref, lig = results["HF transformers"]["losses"], results["liger_torch (patched)"]["losses"]
    diff = (ref - lig).abs()
    print(f"\nper-step losses, max |HF - liger|: {diff.max().item():.3e} (step {int(diff.argmax())}; "
          f"relative {(diff / ref.abs()).max().item():.3e})")
    if ON_GPU:
        print("(bf16: both losses are fp32, but the runs' bf16 values differ in their last bits where the order of "
              "operations differs (the fused loss's chunked matmuls, its fp32 head-gradient accumulation), and "
              "training amplifies that, so the curves agree to bf16 precision, not bitwise)")
    speed = results["liger_torch (patched)"]["tokens/s"] / results["HF transformers"]["tokens/s"]
    print(f"speed ratio liger / HF: {speed:.2f}x" + ("" if ON_GPU else
          "  (CPU: the kernels run in Triton's interpreter, so this measures the interpreter, not the kernels)"))


if __name__ == "__main__":
    main()

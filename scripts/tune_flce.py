"""GPU sweep of the fused linear cross-entropy (torch frontend) against its matmul floor, at one shape.

Times, with the benchmark harness (CUDA events, L2 flushed, host running ahead):
- the three matmuls of the loss at full size in bf16 (x @ W^T, dlogits @ W, dlogits^T @ x): the floor;
- the weight-gradient accumulation ``addmm(acc_fp32, dlogits_c^T, x_c)`` per chunk size (its share of the loop);
- forward+backward of ``liger_torch.fused_linear_cross_entropy`` for several chunk sizes and the default
  (one chunk when N <= 2H), with its peak memory above the inputs;
- the error of dx and dW against float64 for an incoming gradient g != 1 (gradient accumulation's 1/steps), for
  the default and a chunked run: one chunk rounds dW to bf16 and then scales it, the chunks scale the fp32 sum.

    python3 scripts/tune_flce.py [--tokens 8192 --hidden 4096 --vocab 128256] [--json out.json]
"""

import argparse
import json
import statistics

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: benchmarks

import liger_torch  # noqa: E402
from benchmarks.harness import time_torch, torch_peak_extra_mb  # noqa: E402
from liger_torch.fused_linear_cross_entropy import _addmm_accumulates_in_fp32  # noqa: E402


def median_ms(fn):
    return statistics.median(time_torch(fn))


def reference_grads(x, w, target, g):
    """float64 dx, dW of ``g * mean CE(x @ W^T)`` (logits rounded to bf16 first, as the lm_head's output is)."""
    z = (x.double() @ w.double().t()).to(torch.bfloat16).double()
    keep = target != -100
    p = torch.softmax(z, dim=1)
    p[keep, target[keep]] -= 1.0
    p[~keep] = 0.0
    p *= g / keep.sum()
    return p @ w.double(), p.t() @ x.double()


def gradient_errors(x, w, target, g, chunks):
    """Max-abs and relative-Frobenius errors of dx and dW against float64, per chunk setting."""
    want = reference_grads(x, w, target, g)
    torch.cuda.empty_cache()
    out = []
    for c in chunks:
        xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        liger_torch.fused_linear_cross_entropy(xg, wg, target, chunk_size=c).backward(torch.tensor(g, device=x.device))
        row = {"chunk": c or "default", "g": g}
        for name, got, ref in (("dx", xg.grad, want[0]), ("dW", wg.grad, want[1])):
            err = got.double() - ref
            row[f"{name}_max_abs"] = float(err.abs().max())
            row[f"{name}_rel_fro"] = float(err.norm() / ref.norm())
            row[f"{name}_ref_max_abs"] = float(ref.abs().max())
        out.append(row)
        print(row, flush=True)
        del xg, wg
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--chunks", type=int, nargs="*", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--grad-scale", type=float, default=0.37, help="the incoming gradient of the error check")
    parser.add_argument("--json")
    args = parser.parse_args()
    n, h, v = args.tokens, args.hidden, args.vocab
    bf16 = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(n, h, device="cuda", generator=gen) * 0.5).to(bf16)
    w = (torch.randn(v, h, device="cuda", generator=gen) * h ** -0.5).to(bf16)
    target = torch.randint(0, v, (n,), device="cuda", generator=gen)
    target[::10] = -100
    rows = []

    def record(what, ms, flops=None, extra_mb=None):
        rows.append({"what": what, "ms": round(ms, 3), "TFLOPs": None if flops is None else round(flops / ms / 1e9, 1),
                     "peak_extra_MB": None if extra_mb is None else round(extra_mb, 1)})
        print(rows[-1], flush=True)

    print(f"addmm accumulates bf16 products into fp32 in place: {_addmm_accumulates_in_fp32(x.device, bf16)}")
    dlogits = torch.randn(n, v, device="cuda", generator=gen).to(bf16)
    mm = 2 * n * h * v
    t1 = median_ms(lambda: torch.mm(x, w.t()))
    record("mm x @ W^T (N x V)", t1, mm)
    t2 = median_ms(lambda: torch.mm(dlogits, w))
    record("mm dlogits @ W (N x H)", t2, mm)
    t3 = median_ms(lambda: torch.mm(dlogits.t(), x))
    record("mm dlogits^T @ x (V x H), K=N", t3, mm)
    record("floor: the three matmuls", t1 + t2 + t3, 3 * mm)
    acc = torch.zeros(v, h, device="cuda", dtype=torch.float32)
    for c in args.chunks:
        if c > n:
            continue
        t = median_ms(lambda: torch.addmm(acc, dlogits[:c].t(), x[:c], out_dtype=torch.float32, out=acc))
        record(f"addmm fp32 acc += dlogits_c^T @ x_c, K={c}, x{n // c} chunks", t * (n // c), mm)
    del dlogits, acc
    torch.cuda.empty_cache()

    xg = x.clone().requires_grad_(True)
    wg = w.clone().requires_grad_(True)
    for c in [None] + args.chunks:
        if c is not None and c > n:
            continue

        def step(c=c):
            xg.grad = None
            wg.grad = None
            liger_torch.fused_linear_cross_entropy(xg, wg, target, chunk_size=c).backward()

        t = median_ms(step)
        step()
        xg.grad = wg.grad = None
        torch.cuda.empty_cache()
        record(f"liger_torch FLCE fwd+bwd, chunk {c or 'default'}", t, 3 * mm, torch_peak_extra_mb(step))
    errors = gradient_errors(x, w, target, args.grad_scale, [None, min(2048, n)])
    print()
    print(f"{'what':<58}{'ms':>9}{'TFLOP/s':>9}{'extra MB':>10}")
    for r in rows:
        print(f"{r['what']:<58}{r['ms']:>9.3f}{r['TFLOPs'] or '':>9}{r['peak_extra_MB'] or '':>10}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": [n, h, v], "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": rows, "gradient_errors": errors}, f, indent=1)


if __name__ == "__main__":
    main()

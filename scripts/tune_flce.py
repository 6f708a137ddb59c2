"""GPU sweep of the fused linear cross-entropy (torch frontend) against its matmul floor, at one shape.

Times, with the benchmark harness (CUDA events, L2 flushed, host running ahead):
- the three matmuls of the loss at full size in bf16 (x @ W^T, dlogits @ W, dlogits^T @ x): the floor;
- the weight-gradient accumulation ``addmm(acc_fp32, dlogits_c^T, x_c)`` per chunk size (its share of the loop);
- forward+backward of ``liger_torch.fused_linear_cross_entropy`` for several chunk sizes, with its peak memory
  above the inputs.

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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--chunks", type=int, nargs="*", default=[512, 1024, 2048, 4096, 8192])
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
    for c in args.chunks:
        if c > n:
            continue

        def step(c=c):
            xg.grad = None
            wg.grad = None
            liger_torch.fused_linear_cross_entropy(xg, wg, target, chunk_size=c).backward()

        t = median_ms(step)
        step()
        xg.grad = wg.grad = None
        torch.cuda.empty_cache()
        record(f"liger_torch FLCE fwd+bwd, chunk {c}", t, 3 * mm, torch_peak_extra_mb(step))
    print()
    print(f"{'what':<58}{'ms':>9}{'TFLOP/s':>9}{'extra MB':>10}")
    for r in rows:
        print(f"{r['what']:<58}{r['ms']:>9.3f}{r['TFLOPs'] or '':>9}{r['peak_extra_MB'] or '':>10}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": [n, h, v], "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

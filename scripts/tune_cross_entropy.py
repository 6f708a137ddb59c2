"""GPU sweep of the cross-entropy kernel's launch (one program per row) by block size and warps, at bf16
(tokens, vocab) shapes, loss and gradient in one pass (as training runs it) and the loss alone, through
liger_torch's executor; CUDA-event median with L2 flushed (triton.testing.do_bench). Prints one table per shape.
(A persistent grid of 1-3 programs per SM with the gradient sweep run backwards was swept here and lost at every
point: benchmarks/results/h200-2026-12-03-tune_ce-persistent.txt.)

    python3 scripts/tune_cross_entropy.py [--shapes 8192x128256 2048x128256 8192x32000] [--out FILE]
"""

import argparse
import dataclasses
import sys

import torch
import triton.testing

from liger_core import cross_entropy as core
from liger_torch._launch import info, run_plan

COPY_GBPS = 4277.0  # the H200's measured copy bandwidth (benchmarks/results), for the floor column
VARIANTS = [(2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16)]


def sweep(n, v, out):
    logits = torch.randn(n, v, device="cuda", dtype=torch.bfloat16) * 4
    target = torch.randint(0, v, (n,), device="cuda")
    unit_ms = n * v * 2 / (COPY_GBPS * 1e9) * 1e3
    out(f"{n}x{v}: floor {2 * unit_ms:.3f} ms with the gradient (read + write once), {unit_ms:.3f} loss only")
    out(f"{'pass':<10}{'block':>7}{'warps':>6}{'ms':>8}{'of floor':>10}")
    for compute_grad in (True, False):
        for block, warps in VARIANTS:
            plan = core.forward_plan(info(logits), info(target), reduction="mean", compute_grad=compute_grad)
            plan = dataclasses.replace(plan, launches=tuple(
                dataclasses.replace(l, num_warps=warps, constexprs={**l.constexprs, "BLOCK_V": block})
                if l.kernel is core._cross_entropy_kernel else l for l in plan.launches))
            ms = triton.testing.do_bench(lambda: run_plan(plan, logits=logits, target=target), return_mode="median")
            floor = (2 if compute_grad else 1) * unit_ms
            name = "loss+grad" if compute_grad else "loss"
            out(f"{name:<10}{block:>7}{warps:>6}{ms:>8.3f}{floor / ms:>10.2f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["8192x128256", "2048x128256", "8192x32000"])
    parser.add_argument("--out", help="also write the tables to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_cross_entropy needs a CUDA GPU", file=sys.stderr)
        return 1
    lines = []

    def out(line):
        print(line, flush=True)
        lines.append(line)

    out(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for shape in args.shapes:
        n, v = (int(x) for x in shape.split("x"))
        sweep(n, v, out)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

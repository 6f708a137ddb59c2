"""GPU sweep of the row-wise loss kernels' launch: block size (vocabulary elements per step of a program's sweep
over its row) and warps, one program per row, at bf16 (tokens, vocab) shapes, through liger_torch's executor;
CUDA-event median with L2 flushed (triton.testing.do_bench). Prints one table per kernel and shape.

- cross_entropy: loss and gradient in one pass (as training runs it), and the loss alone;
- jsd (beta 0.5): loss and gradient in one pass, and the loss alone;
- kl_div: the forward (the loss) and the backward (the gradient from the target).

    python3 scripts/tune_row_kernels.py [--kernels cross_entropy jsd kl_div] [--shapes 8192x128256 ...]
                                        [--out FILE]

(A cross-entropy persistent grid of 1-3 programs per SM, its gradient sweep run backwards, was swept before
and lost at every point: benchmarks/results/h200-2026-12-03-tune_ce-persistent.txt.)
"""

import argparse
import dataclasses
import sys

import torch
import triton.testing

from liger_core import cross_entropy, jsd, kl_div
from liger_torch._launch import info, run_plan

import _gpu_tables as gpu_tables  # scripts/, the directory Python puts first on the path

COPY_GBPS = 4277.0  # the H200's measured copy bandwidth (benchmarks/results), for the floor column
VARIANTS = [(2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16)]


def _passes(name, n, v):
    """(pass name, units of N x V bf16 traffic at the floor, plan, inputs, the kernel swept, its block
    constexpr) for each pass of kernel ``name``."""
    x = torch.randn(n, v, device="cuda", dtype=torch.bfloat16) * 4
    if name == "cross_entropy":
        target = torch.randint(0, v, (n,), device="cuda")
        for grad, units in ((True, 2), (False, 1)):
            plan = cross_entropy.forward_plan(info(x), info(target), reduction="mean", compute_grad=grad)
            yield ("loss+grad" if grad else "loss", units, plan, dict(logits=x, target=target),
                   cross_entropy._cross_entropy_kernel, "BLOCK_V")
    elif name == "jsd":
        student, teacher = torch.log_softmax(x.float(), -1).bfloat16(), torch.log_softmax(
            torch.randn_like(x, dtype=torch.float32) * 4, -1).bfloat16()
        for grad, units in ((True, 3), (False, 2)):
            plan = jsd.forward_plan(info(student), info(teacher), beta=0.5, compute_grad=grad)
            yield ("loss+grad" if grad else "loss", units, plan, dict(student=student, teacher=teacher),
                   jsd._jsd_kernel, "BLOCK")
    elif name == "kl_div":
        x = torch.log_softmax(x.float(), -1).bfloat16()
        target = torch.softmax(torch.randn_like(x, dtype=torch.float32) * 4, -1).bfloat16()
        plan = kl_div.forward_plan(info(x), info(target), reduction="batchmean")
        yield "forward", 2, plan, {"input": x, "target": target}, kl_div._kl_div_forward_kernel, "BLOCK"
        g = torch.ones((), device="cuda", dtype=torch.bfloat16)
        plan = kl_div.backward_plan(info(g), info(x), info(target), reduction="batchmean")
        yield ("backward", 2, plan, {"grad_output": g, "target": target}, kl_div._kl_div_backward_kernel,
               "BLOCK")
    else:
        raise ValueError(f"unknown kernel {name!r}")


def sweep(name, n, v, out):
    unit_ms = n * v * 2 / (COPY_GBPS * 1e9) * 1e3
    out(f"{name} {n}x{v}: one N x V bf16 read or write at the copy bandwidth: {unit_ms:.3f} ms")
    out(f"{'pass':<10}{'block':>7}{'warps':>6}{'ms':>8}{'of floor':>10}")
    for pass_name, units, plan, inputs, kernel, block_name in _passes(name, n, v):
        for block, warps in VARIANTS:
            if block > 2 ** (v - 1).bit_length():
                continue
            tuned = dataclasses.replace(plan, launches=tuple(
                dataclasses.replace(l, num_warps=warps, constexprs={**l.constexprs, block_name: block},
                                    # a grid over column blocks (the KL backward) follows the block
                                    grid=l.grid if len(l.grid) == 1 else (l.grid[0], -(-v // block)))
                if l.kernel is kernel else l for l in plan.launches))
            ms = triton.testing.do_bench(lambda: run_plan(tuned, **inputs), return_mode="median")
            out(f"{pass_name:<10}{block:>7}{warps:>6}{ms:>8.3f}{units * unit_ms / ms:>10.2f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", nargs="+", default=["cross_entropy", "jsd", "kl_div"])
    parser.add_argument("--shapes", nargs="+", default=["8192x128256", "8192x32000"])
    parser.add_argument("--out", help="also write the tables to this file")
    args = parser.parse_args(argv)

    def tables(out):
        out(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
        for name in args.kernels:
            for shape in args.shapes:
                n, v = (int(x) for x in shape.split("x"))
                sweep(name, n, v, out)
                torch.cuda.empty_cache()

    return gpu_tables.run("tune_row_kernels", args.out, tables)


if __name__ == "__main__":
    sys.exit(main())

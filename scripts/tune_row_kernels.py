"""GPU sweep of the row-wise loss kernels' launch: block size and warps at bf16 (tokens, vocab) shapes, through
liger_torch's executor; CUDA-event median with L2 flushed (triton.testing.do_bench). Prints one table per kernel
and shape. The block is the vocabulary elements per step of a program's sweep over its row (cross_entropy, jsd:
one program per row), per program of a grid of rows x column blocks (the kl_div backward), or the chunk of a
row per program of a grid of rows x chunks (the kl_div forward, in steps of 2048; a chunk at least the row's
length is the one-program-per-row sweep).

- cross_entropy: loss and gradient in one pass (as training runs it), and the loss alone;
- jsd (beta 0.5): loss and gradient in one pass, and the loss alone;
- kl_div: the forward with the gradient (as training runs it), the forward alone (the loss), and the backward
  (the gradient from the target).

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
CHUNK_VARIANTS = [(2048, 8), (4096, 8), (8192, 8), (16384, 4), (16384, 8), (32768, 8), (131072, 8)]


def _passes(name, n, v):
    """(pass name, units of N x V bf16 traffic at the floor, inputs, the kernel swept, a function of the block
    giving the plan, the (block, warps) variants) for each pass of kernel ``name``."""
    x = torch.randn(n, v, device="cuda", dtype=torch.bfloat16) * 4
    if name == "cross_entropy":
        target = torch.randint(0, v, (n,), device="cuda")
        for grad, units in ((True, 2), (False, 1)):
            # the two-pass kernel, the one swept here (wide rows take the lagged kernel by default)
            plan = cross_entropy.forward_plan(info(x), info(target), reduction="mean", compute_grad=grad,
                                              lagged=False)
            yield ("loss+grad" if grad else "loss", units, dict(logits=x, target=target),
                   cross_entropy._cross_entropy_kernel, _with_block(plan, cross_entropy._cross_entropy_kernel,
                                                                    "BLOCK_V", v), VARIANTS)
    elif name == "jsd":
        student, teacher = torch.log_softmax(x.float(), -1).bfloat16(), torch.log_softmax(
            torch.randn_like(x, dtype=torch.float32) * 4, -1).bfloat16()
        for grad, units in ((True, 3), (False, 2)):
            plan = jsd.forward_plan(info(student), info(teacher), beta=0.5, compute_grad=grad)
            yield ("loss+grad" if grad else "loss", units, dict(student=student, teacher=teacher), jsd._jsd_kernel,
                   _with_block(plan, jsd._jsd_kernel, "BLOCK", v), VARIANTS)
    elif name == "kl_div":
        x = torch.log_softmax(x.float(), -1).bfloat16()
        target = torch.softmax(torch.randn_like(x, dtype=torch.float32) * 4, -1).bfloat16()
        inputs = {"input": x, "target": target}
        for grad, units in ((True, 3), (False, 2)):
            # the chunk sets the grid and the partial sums' shape: the plan is built for it
            yield ("fwd+grad" if grad else "forward", units, inputs, kl_div._kl_div_forward_kernel,
                   lambda chunk, grad=grad: kl_div.forward_plan(info(x), info(target), reduction="batchmean",
                                                                compute_grad=grad, chunk=chunk), CHUNK_VARIANTS)
        g = torch.ones((), device="cuda", dtype=torch.bfloat16)
        plan = kl_div.backward_plan(info(g), info(x), info(target), reduction="batchmean")
        yield ("backward", 2, {"grad_output": g, "target": target}, kl_div._kl_div_backward_kernel,
               _with_block(plan, kl_div._kl_div_backward_kernel, "BLOCK", v), VARIANTS)
    else:
        raise ValueError(f"unknown kernel {name!r}")


def _with_block(plan, kernel, block_name, v):
    """A function of the block: ``plan`` with ``kernel``'s block constexpr set to it, and a grid over column
    blocks (the KL backward's second axis, ``v`` columns) following it."""
    def build(block):
        return dataclasses.replace(plan, launches=tuple(
            dataclasses.replace(l, constexprs={**l.constexprs, block_name: block},
                                grid=l.grid if len(l.grid) == 1 else (l.grid[0], -(-v // block)))
            if l.kernel is kernel else l for l in plan.launches))
    return build


def _with_warps(plan, kernel, warps):
    return dataclasses.replace(plan, launches=tuple(
        dataclasses.replace(l, num_warps=warps) if l.kernel is kernel else l for l in plan.launches))


def sweep(name, n, v, out):
    unit_ms = n * v * 2 / (COPY_GBPS * 1e9) * 1e3
    out(f"{name} {n}x{v}: one N x V bf16 read or write at the copy bandwidth: {unit_ms:.3f} ms")
    out(f"{'pass':<10}{'block':>7}{'warps':>6}{'ms':>8}{'of floor':>10}")
    for pass_name, units, inputs, kernel, plan_for, variants in _passes(name, n, v):
        for block, warps in variants:
            if block > 2 ** (v - 1).bit_length():
                continue
            tuned = _with_warps(plan_for(block), kernel, warps)
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

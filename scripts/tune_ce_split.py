"""GPU sweep of the cross-entropy split-row kernel (a row over several programs, the logits read once) against
the two-pass kernel (one program a row, the row read twice): loss and gradient in place, bf16, reduction mean,
CUDA-event median with L2 flushed (triton.testing.do_bench). The floor column counts one read and one write of
the logits at the copy bandwidth.

    python3 scripts/tune_ce_split.py [--shapes 8192x128256 ...] [--out FILE]
"""

import argparse
import dataclasses
import sys

import torch
import triton.testing

from liger_core import cross_entropy
from liger_torch._launch import info, run_plan

import _gpu_tables as gpu_tables  # scripts/, the directory Python puts first on the path

COPY_GBPS = 4277.0  # the H200's measured copy bandwidth (benchmarks/results)
# (columns a program, warps, read the segment again after the wait); segment None: the two-pass kernel at its
# default launch
VARIANTS = [(None, None, False)] + [(seg, warps, reload) for reload in (False, True)
                                    for seg, warps in ((4096, 4), (4096, 8), (8192, 4), (8192, 8), (16384, 16))]


def _plan(x, t, segment, warps, reload):
    plan = cross_entropy.forward_plan(info(x), info(t), reduction="mean", in_place=True,
                                      row_split=0 if segment is None else segment)
    if warps is None:
        return plan
    return dataclasses.replace(plan, launches=tuple(
        dataclasses.replace(l, num_warps=warps, constexprs={**l.constexprs, "RELOAD": reload})
        if "split" in l.kernel.fn.__name__ else l for l in plan.launches))


def sweep(n, v, out):
    floor_ms = 2 * n * v * 2 / (COPY_GBPS * 1e9) * 1e3
    out(f"cross_entropy {n}x{v}: floor (one read, one write) {floor_ms:.3f} ms")
    out(f"{'kernel':<14}{'segment':>8}{'warps':>6}{'ms':>8}{'of floor':>10}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(n, v, generator=gen, device="cuda") * 4).to(torch.bfloat16)
    t = torch.randint(0, v, (n,), generator=gen, device="cuda")
    for segment, warps, reload in VARIANTS:
        if segment is not None and -(-v // segment) > 32:
            continue
        plan = _plan(x, t, segment, warps, reload)
        work = x.clone()
        ms = triton.testing.do_bench(lambda: run_plan(plan, logits=work, target=t), return_mode="median")
        name = "two-pass" if segment is None else ("split reload" if reload else "split hold")
        out(f"{name:<14}{segment or '-':>8}{warps or plan.launches[-1].num_warps:>6}{ms:>8.3f}"
            f"{floor_ms / ms:>10.2f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["8192x128256", "8192x32000", "4096x256000"])
    parser.add_argument("--out", help="also write the tables to this file")
    args = parser.parse_args(argv)

    def tables(out):
        out(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
        for shape in args.shapes:
            n, v = (int(x) for x in shape.split("x"))
            sweep(n, v, out)
            torch.cuda.empty_cache()

    return gpu_tables.run("tune_ce_split", args.out, tables)


if __name__ == "__main__":
    sys.exit(main())

"""Does a benchmark point depend on what ran before it in the same process? (GPU)

At 4096 x 4096 bf16 the norm forwards' benchmark gave whichever provider ran right after ``torch_compile`` ~10%
less time (0.0255 against 0.0282 ms on an H100, either provider; `benchmarks/results/*-ord_*`). This runs the
benchmark's own cases (``benchmarks.harness.run_case``) of one kernel's 4096 x 4096 forward in a fixed sequence in
one process, then each provider again after a spacer allocation of various sizes held while it runs (where its
inputs and outputs land in memory), and prints every point's median:

    [LIGER_BENCH_FLUSH=write] python3 scripts/order_probe.py [--kernel rms_norm] [--out FILE]
"""

import argparse
import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: benchmarks

import torch  # noqa: E402

from benchmarks import harness  # noqa: E402

SEQUENCE = ("liger_torch", "liger_kernel", "liger_torch", "liger_kernel", "torch_compile", "liger_kernel",
            "liger_torch", "torch_compile", "liger_torch", "liger_kernel", "liger_torch")
SPACERS_MB = (0, 1, 2, 4, 8, 16, 32, 64, 128)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", default="rms_norm")
    parser.add_argument("--shape", default="4096x4096")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    lines = []

    def out(line):
        print(line, flush=True)
        lines.append(line)

    module = importlib.import_module(f"benchmarks.bench_{args.kernel}")
    cases = {c.provider: c for c in module.cases(quick=True)
             if c.pass_ == "fwd" and c.shape == args.shape and c.framework == "torch"}
    ceilings = harness.measure_ceilings()
    out(f"{torch.cuda.get_device_name()}  {args.kernel} fwd {args.shape}  copy {ceilings.get('copy_GBps')} GB/s  "
        f"L2 flush: {os.environ.get('LIGER_BENCH_FLUSH', 'read')}")
    out("-- sequence (one process, the benchmark's run_case each time)")
    for i, name in enumerate(SEQUENCE):
        p = harness.run_case(cases[name], ceilings)
        out(f"{i:>3} {name:<16}{p.get('median_ms', p.get('status')):>10}")
    out("-- after a spacer allocation held during the point (MB): " + " ".join(map(str, SPACERS_MB)))
    for name in ("liger_torch", "liger_kernel"):
        row = []
        for mb in SPACERS_MB:
            spacer = torch.empty(mb * 2**20 + 1, dtype=torch.uint8, device="cuda") if mb else None
            p = harness.run_case(cases[name], ceilings)
            row.append(f"{p.get('median_ms', p.get('status'))}")
            del spacer
            harness.free_memory()
        out(f"    {name:<16}" + " ".join(f"{v:>8}" for v in row))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

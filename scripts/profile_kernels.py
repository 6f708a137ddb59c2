"""Where a benchmark point's GPU time goes, kernel by kernel: the same runners the benchmark times, a few
steps under ``torch.profiler`` (its CUPTI tracing records every kernel of the process, XLA's included), and a
table per provider of each kernel's calls and device microseconds per step. For jax runners the compiled
program's copies and custom calls are listed too (the copies XLA adds around an aliased kernel are the usual
suspects of a jax-vs-torch gap).

    python3 scripts/profile_kernels.py --kernel cross_entropy --match "fwd\\+bwd 8192x128256 liger_(torch|jax)$"
    ncu --kernel-name _cross_entropy_kernel --launch-skip 2 --launch-count 1 python3 scripts/profile_kernels.py \\
        --plain --steps 3 --kernel cross_entropy --match "fwd\\+bwd 8192x128256 liger_jax$"
"""

import argparse
import collections
import importlib
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: benchmarks


def kernel_times(run, steps):
    """``{kernel name: (calls, total us)}`` per step, over ``steps`` runs after a warm-up."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        prepare(run, 1)
        sync(run())
    prepare(run, steps)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            sync(run())
        torch.cuda.synchronize()
    totals = collections.defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type.name == "CUDA":
            totals[event.name][0] += 1
            totals[event.name][1] += event.device_time
    return {name: (calls / steps, us / steps) for name, (calls, us) in totals.items()}


def prepare(run, steps):
    """Inputs ready for ``steps`` runs: jax runners' ``prepare(n)`` makes n donated copies ahead; torch runners'
    ``prepare()`` restores overwritten inputs, once (a step on overwritten inputs moves the same bytes), so no
    restore copy is profiled."""
    fn = getattr(run, "prepare", None)
    if fn is None:
        return
    if fn.__code__.co_argcount > 0:
        fn(steps)
    else:
        fn()


def sync(out):
    try:
        import jax

        jax.block_until_ready(out)
    except ImportError:
        pass
    import torch

    torch.cuda.synchronize()


def print_table(label, times):
    total = sum(us for _, us in times.values())
    print(f"\n== {label}: {total:.1f} us of kernels per step")
    for name, (calls, us) in sorted(times.items(), key=lambda kv: -kv[1][1]):
        print(f"{us:10.1f} us {calls:6.1f}x  {name[:110]}")


def hlo_summary(run, fusions=False):
    """The optimized HLO's copies and custom calls of a jax runner's program; with ``fusions`` also the entry
    computation's fusions (their output shapes and operands: which tensors each XLA kernel reads and writes)."""
    compiled = getattr(run, "compiled", None)
    if compiled is None:
        return
    text = compiled.as_text()
    for line in text.splitlines():
        if re.search(r"\b(copy|custom-call|copy-start|dynamic-update-slice)\(", line):
            print("   ", line.strip()[:200])
    if fusions:
        entry = text[text.find("\nENTRY"):]
        for line in entry.splitlines()[1:]:
            if line.startswith("}"):
                break
            if re.search(r"\bfusion\(", line):
                print("   ", re.sub(r", metadata=.*", "", line.strip())[:300])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--kernel", required=True, help="a benchmarks/bench_<kernel>.py module")
    parser.add_argument("--match", required=True, help="regex over the case label 'kernel pass shape provider'")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--fusions", action="store_true", help="list a jax program's fusions too")
    parser.add_argument("--plain", action="store_true",
                        help="only run the steps, without torch.profiler (to run under ncu, which needs CUPTI)")
    args = parser.parse_args()
    module = importlib.import_module(f"benchmarks.bench_{args.kernel}")
    chosen = [c for c in module.cases() if re.search(args.match, c.label)]
    if not chosen:
        sys.exit(f"no case of {args.kernel} matches {args.match!r}")
    for case in chosen:
        run = case.make()
        if args.plain:
            for _ in range(args.steps):
                prepare(run, 1)
                sync(run())
            continue
        print_table(case.label, kernel_times(run, args.steps))
        for attr in ("donated", "copy_bytes", "calls_per_run"):
            if hasattr(run, attr):
                print(f"   {attr}: {getattr(run, attr)}")
        hlo_summary(run, args.fusions)
        del run


if __name__ == "__main__":
    main()

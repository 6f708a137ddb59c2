"""Where an end-to-end training step spends its GPU time: torch.profiler over a few steps of the HF Llama model
of benchmarks/bench_e2e.py, one provider at a time, as a table of the kernels with the most device time, then
where the GPU sat idle between them (the step's span minus its busy time, largest gaps by the kernels around
them: host-bound stretches show up as many gaps before the same kernels).

    python3 scripts/profile_e2e.py [--model llama-3.2-1b] [--batch 4] [--seq 4096]
                                   [--providers hf+liger_torch hf_eager] [--top 30] [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

_SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_SCRIPTS), _SCRIPTS]  # the repo's benchmarks package; _gpu_tables (when imported)
from benchmarks import bench_e2e  # noqa: E402

import _gpu_tables as gpu_tables  # noqa: E402


def profile_provider(model_name: str, provider: str, batch: int, seq: int, steps: int, top: int) -> str:
    spec = bench_e2e.MODELS[model_name]
    model, opt = bench_e2e.build_hf(spec, provider)
    batches = [torch.randint(0, spec["vocab_size"], (batch, seq), device="cuda") for _ in range(2)]
    for i in range(2):  # warm-up: Triton compilation, allocator growth
        bench_e2e._hf_step(model, opt, batches[i % 2])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            bench_e2e._hf_step(model, opt, batches[i % 2])
        torch.cuda.synchronize()
    events = prof.key_averages()
    total_us = sum(e.self_device_time_total for e in events) / steps
    lines = [f"## {model_name} {provider} {batch}x{seq}: {total_us / 1e3:.1f} ms of kernels per step"]
    lines.append(f"{'ms/step':>8} {'share':>6} {'calls':>6}  kernel")
    ranked = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:top]
    for e in ranked:
        us = e.self_device_time_total / steps
        lines.append(f"{us / 1e3:8.2f} {100 * us / total_us:5.1f}% {e.count // steps:6d}  {e.key[:110]}")
    device_events = [(ev.name(), ev.start_ns(), ev.end_ns()) for ev in prof.profiler.kineto_results.events()
                      if ev.device_type() == torch.autograd.DeviceType.CUDA]
    lines += idle_report(device_events, steps)
    del model, opt
    bench_e2e.free_memory()
    return "\n".join(lines)


def idle_report(events, steps: int, top: int = 12, min_gap_ns: int = 2000) -> list[str]:
    """Lines on the GPU's idle time. ``events``: (name, start_ns, end_ns) of every device activity (kernels,
    copies, memsets), any order; overlapping activities count as busy. Gaps of at least ``min_gap_ns`` are
    grouped by (the activity that ended last before the gap, the one after it)."""
    events = sorted(events, key=lambda e: e[1])
    if not events:
        return ["(no device activity recorded)"]
    busy_until, before = events[0][2], events[0][0]
    busy = events[0][2] - events[0][1]
    idle = 0
    groups = collections.defaultdict(lambda: [0, 0])
    for name, start, end in events[1:]:
        if start > busy_until:
            gap = start - busy_until
            idle += gap
            if gap >= min_gap_ns:
                group = groups[(before[:50], name[:50])]
                group[0] += gap
                group[1] += 1
        busy += max(0, end - max(start, busy_until))
        if end > busy_until:
            busy_until, before = end, name
    span = busy_until - events[0][1]
    lines = [f"GPU span {span / steps / 1e6:.1f} ms/step: busy {busy / steps / 1e6:.1f}, idle {idle / steps / 1e6:.1f} "
             f"({100 * idle / max(span, 1):.1f}%); gaps >= {min_gap_ns / 1e3:.0f} us by the activities around them:",
             f"{'ms/step':>8} {'gaps':>6}  after -> before"]
    for (after, following), (ns, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{ns / steps / 1e6:8.2f} {count // steps:6d}  {after} -> {following}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.2-1b", choices=sorted(bench_e2e.MODELS))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--providers", nargs="+", default=["hf+liger_torch", "hf_eager"])
    p.add_argument("--out", help="also write the tables to this file")
    args = p.parse_args(argv)

    def tables(out):
        import datetime

        import transformers
        import triton

        out(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
            f"transformers {transformers.__version__}, {datetime.date.today()}")
        out(f"command: python3 scripts/profile_e2e.py {' '.join(sys.argv[1:])}")
        for provider in args.providers:
            out("\n" + profile_provider(args.model, provider, args.batch, args.seq, args.steps, args.top))

    return gpu_tables.run("profile_e2e", args.out, tables)


if __name__ == "__main__":
    sys.exit(main())

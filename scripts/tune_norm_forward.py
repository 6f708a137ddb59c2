"""GPU sweep of the norm forwards' launch (rows per program x warps) for RMSNorm, LayerNorm and fused
add+RMSNorm, bf16, timed with CUDA graphs (no Python launch overhead) against the copy floor; the default
configuration is marked with *. At 4096 x 4096 (32 MB, ~16 us at the floor) our LayerNorm forward measured
0.0243 ms against Liger-Kernel's 0.0224 (one row per program at 8 warps), at 65536 rows 0.264 against 0.281:
the sweep says whether small inputs want another configuration.

    python3 scripts/tune_norm_forward.py [--shapes 4096x4096 16384x4096 65536x4096] [--timer graph|bench]
        [--families rms_norm ...] [--match REGEX] [--out FILE]

Past their held_up_to (2-byte rows: 32768 columns; LayerNorm holds them only from 28672; 16384 otherwise) the
forwards sweep each row in chunks (``liger_core.rowwise.forward_chunk``); from 8192 columns the sweep tries
chunk widths x warps beside the held rows (e.g. ``--shapes 16384x16384 4096x32768 4096x65536``).

``--timer bench`` times each configuration as the benchmark suite does (CUDA events, L2 flushed before each
repetition, the host kept ahead) instead of CUDA-graph replays, and adds Liger-Kernel's forward (when installed)
as a reference row: at 4096 x 4096 the two timers disagree (a graph replay finds the 32 MB input in L2).

``--ops`` times whole ops instead (``liger_torch.rms_norm`` and Liger-Kernel's ``LigerRMSNormFunction``, with the
benchmark's timer), three rounds in alternating order, first on one shared pair of inputs, then each op on its
own freshly allocated inputs as the benchmark makes them: at 4096 x 4096 the benchmark gave Liger-Kernel's op
~9% less time than its kernel takes here, so this tells the op's cost from where its inputs happen to sit.
"""

import argparse
import itertools
import os
import re
import statistics
import sys

import torch
import triton.testing

from liger_core import fused_add_rms_norm, layer_norm, rms_norm
from liger_core.rowwise import MAX_HELD_COLUMNS
from liger_torch._launch import info, run_plan

import _gpu_tables as gpu_tables  # scripts/, the directory Python puts first on the path

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: benchmarks

COPY_BYTES_PER_S = 4.25e12  # the H200's measured copy bandwidth (benchmarks/results, ceilings)
ROWS_PER_PROGRAM = (1, 2, 4)
WARPS = (4, 8, 16)
CHUNKS = (2048, 4096, 8192, 16384)  # columns a step of the chunked sweep (rows over MAX_HELD_COLUMNS)
FAMILIES = ["rms_norm", "layer_norm", "fused_add_rms_norm"]


def _cases(n, h):
    """(kernel name, plan builder taking block_m / num_warps overrides, inputs, bytes the forward moves,
    Liger-Kernel's forward on the same inputs or None)."""
    x, r = (torch.randn(n, h, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w = torch.rand(h, device="cuda", dtype=torch.bfloat16) + 0.5
    b = torch.randn(h, device="cuda", dtype=torch.bfloat16)
    tensor = n * h * 2
    yield ("rms_norm", lambda **o: rms_norm.forward_plan(info(x), info(w), eps=1e-6, **o),
           dict(x=x, weight=w), 2 * tensor, _liger_kernel("rms_norm", x, w, b))  # reads x, writes y
    yield ("layer_norm", lambda **o: layer_norm.forward_plan(info(x), info(w), info(b), eps=1e-5, **o),
           dict(x=x, weight=w, bias=b), 2 * tensor, _liger_kernel("layer_norm", x, w, b))
    yield ("fused_add_rms_norm", lambda **o: fused_add_rms_norm.forward_plan(info(x), info(r), info(w), eps=1e-6,
                                                                             **o),
           dict(x=x, residual=r, weight=w), 4 * tensor, None)  # reads x and residual, writes y and h


SHORT = {"block_m": "rows", "num_warps": "warps", "full_chunks": "full"}  # table labels


def _configs(h):
    """Launch overrides to try at hidden size ``h``: rows a program x warps for held rows (forced with chunk=0
    past MAX_HELD_COLUMNS, one row at 16 and 32 warps: the old default spilled there), and from 8192 columns
    chunk widths x warps, the first sweep's prefetch on and off at 16 warps, 2 or 4 rows a program, the default
    with the column masks it drops where every chunk is whole (``full_chunks=False``, also at 2 rows) (the
    chunked sweep is the default only past MAX_HELD_COLUMNS; at 16384 LayerNorm's held row takes 174 registers a
    thread, one 8-warp program an SM, so the sweep may serve it better)."""
    warps = WARPS + ((32,) if h >= 16384 else ())  # wide rows: 32 warps keep LayerNorm at ~51 registers
    if h <= MAX_HELD_COLUMNS:
        held = [dict(block_m=bm, num_warps=w) for bm, w in itertools.product(ROWS_PER_PROGRAM, warps)]
    else:
        held = [dict(chunk=0, block_m=1, num_warps=w) for w in (16, 32)]
    chunked = [dict(chunk=c, num_warps=w) for c, w in itertools.product(CHUNKS, (8, 16, 32)) if c <= h]
    chunked += [dict(chunk=c, num_warps=16, prefetch=p) for c, p in itertools.product(CHUNKS, (False, True))
                if c <= h]  # the family's default prefetch appears twice: the repeat shows the timer's noise
    chunked += [dict(chunk=c, block_m=m, num_warps=w) for c, m, w in itertools.product(CHUNKS[:3], (2, 4), (8, 16))
                if c <= h and c * m <= 64 * 32 * w]  # several rows a program: the parameters read once for them
    # (from L2, once a row), at most 64 values a thread
    if h > MAX_HELD_COLUMNS:  # the default launch with its column masks kept (where its chunks are whole)
        chunked += [dict(full_chunks=False), dict(block_m=2, full_chunks=False)]
    return held + (chunked if h >= 8192 else [])


def _liger_kernel(name, x, w, b):
    """Liger-Kernel's forward of ``name`` on these inputs (no autograd), or None where it is not installed."""
    try:
        if name == "rms_norm":
            from liger_kernel.ops.rms_norm import rms_norm_forward

            return lambda: rms_norm_forward(x, w, 1e-6, 0.0, 0, False)
        from liger_kernel.ops.layer_norm import layer_norm_forward

        return lambda: layer_norm_forward(x, w, b, 1e-5)
    except Exception:  # not installed, or its internal API moved: the sweep goes on without the reference
        return None


def _timer(kind):
    if kind == "graph":
        return lambda fn: triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
    from benchmarks.harness import time_torch

    return lambda fn: statistics.median(time_torch(fn))


def _label(overrides):
    return "*default" if not overrides else " ".join(f"{SHORT.get(k, k)}={v}" for k, v in overrides.items())


def sweep(n, h, out, timer, families=None, match=None):
    for name, plan, inputs, nbytes, reference in _cases(n, h):
        if families is not None and name not in families:
            continue
        floor = nbytes / COPY_BYTES_PER_S * 1e3
        configs = [{}] + [o for o in _configs(h) if match is None or re.search(match, _label(o))]
        for overrides in configs:
            label = _label(overrides)
            try:
                p = plan(**overrides)
                ms = timer(lambda: run_plan(p, **inputs))
            except Exception as err:  # a configuration that does not compile or fit is reported, not fatal
                out(f"{name:<20}{n}x{h:<8}{label:<22}{type(err).__name__}")
            else:
                out(f"{name:<20}{n}x{h:<8}{label:<22}{ms:>8.4f}{floor / ms:>10.2f}")
        if reference is not None:
            try:
                ms = timer(reference)
            except Exception as err:
                out(f"{name:<20}{n}x{h:<8}{'liger_kernel':<22}{type(err).__name__}: {err}"[:150])
            else:
                out(f"{name:<20}{n}x{h:<8}{'liger_kernel':<22}{ms:>8.4f}{floor / ms:>10.2f}")
    torch.cuda.empty_cache()


def sweep_ops(n, h, out, timer):
    import liger_torch
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    ops = {"liger_torch": lambda x, w: liger_torch.rms_norm(x, w, 1e-6),
           "liger_kernel": lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-6)}
    floor = 2 * n * h * 2 / COPY_BYTES_PER_S * 1e3

    def inputs():
        return (torch.randn(n, h, device="cuda", dtype=torch.bfloat16),
                torch.rand(h, device="cuda", dtype=torch.bfloat16) + 0.5)

    shared = inputs()
    placements = {"shared": {name: shared for name in ops}, "own": {name: inputs() for name in ops}}
    for round_ in range(3):
        order = list(ops) if round_ % 2 == 0 else list(ops)[::-1]
        for placement, args in placements.items():
            for name in order:
                x, w = args[name]
                ms = timer(lambda: ops[name](x, w))
                out(f"{'rms_norm op':<20}{n}x{h:<8}{name + ' ' + placement + ' r' + str(round_):<22}{ms:>8.4f}"
                    f"{floor / ms:>10.2f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["4096x4096", "16384x4096", "65536x4096"])
    parser.add_argument("--timer", choices=("graph", "bench"), default="graph",
                        help="CUDA-graph replays (default) or the benchmark suite's timer")
    parser.add_argument("--ops", action="store_true", help="time whole RMSNorm ops (ours, Liger-Kernel's) instead")
    parser.add_argument("--out", help="also write the table to this file")
    parser.add_argument("--families", nargs="+", default=FAMILIES, choices=FAMILIES, help="norms to sweep")
    parser.add_argument("--match", help="only the launches whose label matches this regex (and the default)")
    args = parser.parse_args(argv)
    timer = _timer(args.timer)

    def tables(out):
        out(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
            f"timer {args.timer}")
        out(f"{'kernel':<20}{'shape':<13}{'config':<22}{'ms':>8}{'of floor':>10}")
        for shape in args.shapes:
            n, h = (int(v) for v in shape.split("x"))
            if args.ops:
                sweep_ops(n, h, out, timer)
            else:
                sweep(n, h, out, timer, args.families, args.match)

    return gpu_tables.run("tune_norm_forward", args.out, tables)


if __name__ == "__main__":
    sys.exit(main())

"""GPU sweep of the RMSNorm, LayerNorm and fused add+RMSNorm backward launch configurations (prefetch, programs
per SM, tile height, warps; at rows over 8192 columns also reloading the tile after the row's reduction or holding
it, and 32 warps for a 16384-value tile (16 values a thread);
past rowwise.MAX_HELD_COLUMNS the column-split backward's block width x tile height x prefetch, beside whole
rows), timed with CUDA graphs, against the copy floor. Prints one table; the default configuration is marked
with *.

    python3 scripts/tune_norm_backward.py [--shapes 16384x4096 65536x4096 4096x16384 4096x65536] [--out FILE]
                                          [--families rms_norm layer_norm fused_add_rms_norm]
"""

import argparse
import itertools

import torch
import triton.testing

from liger_core import fused_add_rms_norm, layer_norm, rms_norm
from liger_core.rowwise import MAX_HELD_COLUMNS
from liger_torch._launch import info, num_sms, run_plan

SHAPES = [(16384, 4096), (65536, 4096), (4096, 16384)]
SHORT = {"prefetch": "pf", "programs_per_sm": "per_sm", "block_m": "bm", "num_warps": "warps", "reload": "rl",
         "column_block": "cb"}
COPY_BYTES_PER_S = 4.25e12  # the H200's measured copy bandwidth (benchmarks/results, ceilings)


def graph_ms(fn):
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")


def rms_norm_case(n, h):
    """(plan builder, inputs, bytes the backward must move): reads dy and x, writes dx."""
    x, dy = (torch.randn(n, h, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w = torch.rand(h, device="cuda", dtype=torch.bfloat16) + 0.5
    _, rstd = run_plan(rms_norm.forward_plan(info(x), info(w), eps=1e-6), x=x, weight=w)

    def plan(**overrides):
        return rms_norm.backward_plan(info(dy), info(x), info(w), num_sms=num_sms(x.device), in_place=False,
                                      **overrides)

    return plan, dict(dy=dy, x=x, weight=w, rstd=rstd), 3 * n * h * 2


def layer_norm_case(n, h):
    """(plan builder, inputs, bytes the backward must move): reads dy and x, writes dx."""
    x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(h, device="cuda", dtype=torch.bfloat16) + 0.5
    b = torch.randn(h, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
    _, mean, rstd = run_plan(layer_norm.forward_plan(info(x), info(w), info(b), eps=1e-5), x=x, weight=w, bias=b)

    def plan(**overrides):
        return layer_norm.backward_plan(info(dy), info(x), info(w), info(b), num_sms=num_sms(x.device),
                                        in_place=False, **overrides)

    return plan, dict(dy=dy, x=x, weight=w, mean=mean, rstd=rstd), 3 * n * h * 2


def fused_add_case(n, h):
    """Reads dy, dh and h, writes dx and dresidual."""
    x, r, dy, dh = (torch.randn(n, h, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    w = torch.rand(h, device="cuda", dtype=torch.bfloat16) + 0.5
    _, hsum, rstd = run_plan(fused_add_rms_norm.forward_plan(info(x), info(r), info(w), eps=1e-6),
                             x=x, residual=r, weight=w)

    def plan(**overrides):
        return fused_add_rms_norm.backward_plan(info(dy), info(dh), info(hsum), info(w), x_dtype="bfloat16",
                                                residual_dtype="bfloat16", num_sms=num_sms(x.device),
                                                in_place=False, **overrides)

    return plan, dict(dy=dy, dh=dh, h=hsum, weight=w, rstd=rstd), 5 * n * h * 2


def row_tile_configs(h):
    """Whole-row tiles. At rows over 8192 columns: reload or hold, and no prefetch (at 16384 columns every
    prefetching tile lost 1.6-12x, h200-2026-12-06-tune_wide_bwd.txt); a 16384-value tile also at 32 warps, 16
    values a thread (Liger-Kernel's launch there), one program an SM."""
    wide = h > 8192
    configs = []
    for p, s, bm, w, rl in itertools.product((False,) if wide else (False, True), (1, 2),
                                             sorted({max(1, 4096 // h), max(1, 8192 // h)}), (8, 16, 32),
                                             (False, True) if wide else (False,)):
        if w == 32 and (bm * h < 16384 or s > 1):
            continue
        configs.append(dict(prefetch=p, programs_per_sm=s, block_m=bm, num_warps=w, reload=rl))
    return configs


def split_configs():
    """Column blocks (the row sums then swept in chunks of the block's width) x tile height x prefetch, and the
    whole-row tile it replaced."""
    return [dict(column_block=0)] + [dict(column_block=cb, block_m=bm, prefetch=p)
                                     for cb, bm, p in itertools.product((2048, 4096, 8192), (1, 2, 4), (False, True))
                                     if cb * bm <= 16384]


CASES = {"rms_norm": rms_norm_case, "layer_norm": layer_norm_case, "fused_add_rms_norm": fused_add_case}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", help="also write the table to this file")
    parser.add_argument("--shapes", nargs="+", default=[f"{n}x{h}" for n, h in SHAPES])
    parser.add_argument("--families", nargs="+", default=list(CASES), choices=list(CASES), help="norms to sweep")
    args = parser.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    lines = [f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}", "",
             f"{'kernel':<20}{'shape':<12}{'config':<34}{'ms':>8}{'of floor':>10}"]
    print("\n".join(lines), flush=True)
    for name, (n, h) in itertools.product(args.families, shapes):
        make = CASES[name]
        plan, inputs, nbytes = make(n, h)
        floor = nbytes / COPY_BYTES_PER_S * 1e3
        configs = [{}] + (split_configs() if h > MAX_HELD_COLUMNS else row_tile_configs(h))
        for overrides in configs:
            label = "*default" if not overrides else " ".join(f"{SHORT[k]}={int(v)}" for k, v in overrides.items())
            try:
                p = plan(**overrides)
                t = graph_ms(lambda: run_plan(p, **inputs))
            except Exception as err:  # a configuration that does not compile or fit is reported, not fatal
                line = f"{name:<20}{n}x{h:<7}{label:<34}{type(err).__name__}"
            else:
                line = f"{name:<20}{n}x{h:<7}{label:<34}{t:>8.4f}{floor / t:>10.2f}"
            lines.append(line)
            print(line, flush=True)
        del inputs
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

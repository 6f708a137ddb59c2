"""GPU sweep of RoPE's tile (heads per block x tile elements x head blocks per program, which share one cos/sin
tile) at B1 T 32/8 D128 bf16 (T = 65536 by default),
HF and Flax layouts, forward through liger_torch.rope, CUDA-event median (triton.testing.do_bench). Prints one
table per sequence length.

    python3 scripts/tune_rope.py [--tokens 65536 16384 4096]
"""

import dataclasses
import itertools

import torch
import triton.testing

from liger_core import rope as core
from liger_torch._launch import info, run_plan


def main():
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[65536])
    for T in parser.parse_args().tokens:
        sweep(T)


def sweep(T):
    Hq, Hk, D = 32, 8, 128
    floor_ms = 2 * (Hq + Hk) * T * D * 2 / 4.277e12 * 1e3
    print(f"T={T}: floor (read + write q, k) {floor_ms:.3f} ms")
    print(f"{'layout':<8}{'max_h':>6}{'tile':>7}{'groups':>7}{'warps':>6}{'ms':>8}{'of floor':>10}")
    for layout in ("bhtd", "bthd"):
        shape = (lambda h: (1, h, T, D)) if layout == "bhtd" else (lambda h: (1, T, h, D))
        q = torch.randn(shape(Hq), device="cuda", dtype=torch.bfloat16)
        k = torch.randn(shape(Hk), device="cuda", dtype=torch.bfloat16)
        cos = torch.randn(1, T, D, device="cuda", dtype=torch.bfloat16)
        sin = torch.randn(1, T, D, device="cuda", dtype=torch.bfloat16)
        for max_h, tile, groups, warps in itertools.product((1, 2), (1024, 2048, 4096), (1, 4, 40), (4, 8)):
            core._MAX_BLOCK_H, core._TILE_ELEMENTS, core._GROUPS_PER_PROGRAM = max_h, tile, groups
            core._plan.cache_clear()  # plans are cached by their arguments, not by these module settings
            plan = core.forward_plan(info(q), info(k), info(cos), info(sin), None,
                                     head_axis=1 if layout == "bhtd" else 2)
            plan = dataclasses.replace(plan, launches=tuple(dataclasses.replace(l, num_warps=warps)
                                                            for l in plan.launches))
            ms = triton.testing.do_bench(lambda: run_plan(plan, q=q, k=k, cos=cos, sin=sin), return_mode="median")
            print(f"{layout:<8}{max_h:>6}{tile:>7}{groups:>7}{warps:>6}{ms:>8.3f}{floor_ms / ms:>10.2f}", flush=True)


if __name__ == "__main__":
    main()

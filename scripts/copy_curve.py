"""What "90% of the copy bandwidth" can mean at a small size: torch's own device-to-device copy (``dst.copy_(src)``,
bf16) timed exactly as the benchmark times a kernel (CUDA events, L2 flushed, host kept ahead), from a few MB
to the 4 GB the benchmark's copy ceiling moves, with each size's rate as a fraction of that ceiling.

    python3 scripts/copy_curve.py [--out FILE]

A kernel at size S that reaches the copy's own fraction at S has no overhead beyond what moving S bytes costs
(launch, ramp-up, the last wave); the benchmark's floor (bytes / ceiling) does not allow for that.
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: benchmarks

# bytes moved (read + written), MB: the RoPE, norm and loss points of the quick benchmarks lie in this range
SIZES_MB = [8, 16, 32, 48, 64, 80, 128, 160, 256, 320, 512, 1024, 2048, 4096]


def copy_ms(moved_bytes: int) -> float:
    import torch

    from benchmarks.harness import _reps, _time_cuda

    n = moved_bytes // 2 // 2  # bf16 elements of the source
    src = torch.randn(n, device="cuda").to(torch.bfloat16)
    dst = torch.empty_like(src)
    ms = statistics.median(_time_cuda(lambda: dst.copy_(src), **_reps()))
    del src, dst
    torch.cuda.empty_cache()
    return ms


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="also write the table here")
    args = parser.parse_args()
    import torch

    rows = [(mb, copy_ms(mb * 2**20)) for mb in SIZES_MB]
    ceiling = rows[-1][0] * 2**20 / rows[-1][1] / 1e6
    lines = [f"# torch bf16 copy, {torch.cuda.get_device_name()}, torch {torch.__version__}",
             f"# ceiling (the largest size): {ceiling:.1f} GB/s",
             "| moved MB | ms | GB/s | of ceiling |", "|---|---|---|---|"]
    for mb, ms in rows:
        gbps = mb * 2**20 / ms / 1e6
        lines.append(f"| {mb} | {ms:.4f} | {gbps:.1f} | {gbps / ceiling:.3f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()

"""The main job: the same input through both frontends and the eager baselines, with a printed table.

On the CPU (kernels in Triton's interpreter) a small shape; on a GPU an LLM shape with timings against
HF eager, torch.compile, Liger-Kernel (when installed) and XLA.

    python3 scripts/demo.py [--rows N --hidden H]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import warnings  # noqa: E402

import numpy as np  # noqa: E402

warnings.filterwarnings("ignore", message="liger_core: no NVIDIA GPU found")  # the demo says so itself
import liger_core  # noqa: E402  (decides interpreter vs GPU before any kernel exists)

if liger_core.INTERPRET:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

import liger_jax  # noqa: E402
import liger_torch  # noqa: E402

EPS = 1e-6


def hf_rms_norm(x, w):
    h = x.to(torch.float32)
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def torch_grads(fn, x, w, g):
    x = x.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    y = fn(x, w)
    y.backward(g.clone())
    return [t.detach().double().cpu() for t in (y, x.grad, w.grad)]


def jax_grads(fn, x, w, g):
    y, vjp = jax.vjp(jax.jit(fn), x, w)
    return [torch.from_numpy(np.array(t.astype(jnp.float32))).double() for t in (y, *vjp(g))]


def to_jax(t):
    return jnp.asarray(t.float().cpu().numpy()).astype(jnp.bfloat16 if t.dtype == torch.bfloat16 else jnp.float32)


def main():
    parser = argparse.ArgumentParser()
    on_gpu = not liger_core.INTERPRET
    parser.add_argument("--rows", type=int, default=16384 if on_gpu else 123)
    parser.add_argument("--hidden", type=int, default=4096 if on_gpu else 257)
    args = parser.parse_args()
    device = "cuda" if on_gpu else "cpu"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    gen = torch.Generator().manual_seed(int(time.time()))
    x = torch.randn(args.rows, args.hidden, generator=gen).to(device, dtype)
    w = (torch.rand(args.hidden, generator=gen) + 0.5).to(device, dtype)
    g = torch.randn(args.rows, args.hidden, generator=gen).to(device, dtype)

    mode = "GPU (compiled Triton)" if on_gpu else "CPU (Triton interpreter)"
    print(f"liger demo: RMSNorm forward+backward, {args.rows} x {args.hidden} {str(dtype)[6:]}, {mode}\n")
    reference = torch_grads(hf_rms_norm, x.double(), w.double(), g.double())
    results = {
        "HF eager (torch)": torch_grads(hf_rms_norm, x, w, g),
        "liger_torch": torch_grads(lambda a, b: liger_torch.rms_norm(a, b, EPS), x, w, g),
        "liger_jax": jax_grads(lambda a, b: liger_jax.rms_norm(a, b, epsilon=EPS), to_jax(x), to_jax(w), to_jax(g)),
    }
    print(f"{'provider':<20}{'max|y-ref|':>14}{'max|dx-ref|':>14}{'max|dw-ref|/max|dw|':>22}")
    for name, (y, dx, dw) in results.items():
        ry, rdx, rdw = reference
        print(f"{name:<20}{(y - ry).abs().max():>14.3e}{(dx - rdx).abs().max():>14.3e}"
              f"{((dw - rdw).abs().max() / rdw.abs().max()):>22.3e}")
    same = all(torch.equal(a, b) for a, b in zip(results["liger_torch"], results["liger_jax"]))
    print(f"\nliger_torch and liger_jax bitwise identical: {same}")

    if on_gpu:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
        from benchmarks import bench_rms_norm
        from benchmarks.harness import measure_ceilings, run_case, short_table

        ceilings = measure_ceilings()
        cases = [c for c in bench_rms_norm.cases(quick=True) if c.shape == f"{args.rows}x{args.hidden}"] or \
            bench_rms_norm.cases(quick=True)[:12]
        print(f"\nceilings: {ceilings}")
        print(short_table([run_case(c, ceilings) for c in cases]))


if __name__ == "__main__":
    main()

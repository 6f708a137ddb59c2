"""Instructions in each loop of a norm forward's sm_90 SASS (no GPU needed: Triton compiles for the named
target, the launch specialised as jax_triton specialises it; tests/core/ptx_worker.py), by opcode.

    python3 scripts/sass_loops.py layer_norm [--shape 4096x65536] [--override "block_m=2"] [--override ...]

Each ``--override`` is one launch configuration (``key=value`` pairs, comma-separated, passed to the family's
forward_plan); none gives the default. A chunked forward prints its two sweeps' loops: instructions a loop
body and the common opcodes; divide by the values a thread holds (chunk x rows / (32 x warps)) for a count an
element.
"""

import argparse
import ast
import collections
import os
import re
import subprocess
import sys
import tempfile

os.environ["LIGER_INTERPRET"] = "0"  # compiled kernels (no launch happens: compile only)
os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "core"))

import ptx_worker  # noqa: E402
import triton  # noqa: E402

from liger_core.launch import ArrayInfo  # noqa: E402
from norm_plans import NORM_FAMILIES, norm_forward_plan  # noqa: E402  (tests/, put on the path by ptx_worker)

OPCODE = re.compile(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")
ADDRESS = re.compile(r"/\*[0-9a-f]{4,}\*/")


def sass(launch):
    dtypes = collections.defaultdict(lambda: "bfloat16", mean="float32", rstd="float32")
    cubin = ptx_worker.compile_launch(launch, dtypes, False).asm["cubin"]
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([nvdisasm, "-c", "-g", f.name], capture_output=True, text=True, check=True).stdout


def loops(text):
    """(instructions, opcode counts) of each loop: a label reached by a later branch back to it."""
    lines = text.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"\.(L_x_\d+):", line.strip()))}
    for i, line in enumerate(lines):
        m = re.search(r"BRA\s+`\(\.(L_x_\d+)\)", line)
        if m and labels.get(m.group(1), len(lines)) < i:
            body = [b for b in lines[labels[m.group(1)]:i + 1] if ADDRESS.search(b)]
            yield len(body), collections.Counter(m.group(1) for b in body if (m := OPCODE.search(b)))


def parse_override(text):
    return {k: ast.literal_eval(v) for k, v in (item.split("=") for item in text.split(",") if item)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("family", choices=NORM_FAMILIES)
    parser.add_argument("--shape", default="4096x65536")
    parser.add_argument("--override", action="append", default=None)
    args = parser.parse_args(argv)
    n, h = (int(v) for v in args.shape.split("x"))
    for text in args.override or [""]:
        x, w = ArrayInfo.contiguous((n, h), "bfloat16"), ArrayInfo.contiguous((h,), "bfloat16")
        launch = norm_forward_plan(args.family, x, w, **parse_override(text)).launches[0]
        held = {k: launch.constexprs[k] for k in ("CHUNK", "ROWS", "BLOCK_M", "BLOCK_N") if k in launch.constexprs}
        print(f"{args.family} {args.shape} {text or 'default'}: {launch.kernel.fn.__name__} {held} "
              f"{launch.num_warps} warps")
        text = sass(launch)
        total = sum(1 for line in text.splitlines() if ADDRESS.search(line))
        print(f"  kernel: {total} instructions (once a program: outside the loops, e.g. the row reductions)")
        for count, ops in loops(text):
            if count > 1:
                print(f"  loop of {count}: " + ", ".join(f"{op} {c}" for op, c in ops.most_common(10)))


if __name__ == "__main__":
    main()

"""What the GPU scripts share: they need a CUDA device, print each line of their tables as it comes (a run cut
short by the device's time limit still shows what it measured), and write them all to ``--out`` at the end."""

from __future__ import annotations

import sys
from typing import Callable

import torch


def run(script: str, out_path: str | None, body: Callable[[Callable[[str], None]], None]) -> int:
    """Call ``body(out)``, ``out`` printing a line and keeping it for ``out_path``; 1 without a CUDA device."""
    if not torch.cuda.is_available():
        print(f"{script} needs a CUDA GPU", file=sys.stderr)
        return 1
    lines = []

    def out(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    body(out)
    if out_path:
        with open(out_path, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


def sweep_shapes_main(script: str, doc: str, default_shapes: list[str], sweep, argv=None) -> int:
    """A script sweeping ``sweep(rows, columns, out)`` over ``--shapes ROWSxCOLUMNS ...`` (``default_shapes``), the
    GPU and versions first, its lines also written to ``--out``."""
    import argparse

    import triton

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=default_shapes)
    parser.add_argument("--out", help="also write the tables to this file")
    args = parser.parse_args(argv)

    def tables(out):
        out(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
        for shape in args.shapes:
            n, v = (int(s) for s in shape.split("x"))
            sweep(n, v, out)
            torch.cuda.empty_cache()

    return run(script, args.out, tables)

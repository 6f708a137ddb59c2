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

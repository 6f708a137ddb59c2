"""scripts/sass_loops.py, which perf-log quotes for instruction counts: it compiles a norm forward for sm_90
(in a subprocess, no GPU needed) and finds both sweeps of a chunked forward as loops in the SASS."""

import os
import re
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts",
                      "sass_loops.py")


def test_chunked_forward_has_two_sweep_loops(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LIGER_INTERPRET")}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    out = subprocess.run([sys.executable, SCRIPT, "layer_norm", "--shape", "3x20000", "--override",
                          "block_m=2,chunk=4096,num_warps=8,prefetch=False"],
                         capture_output=True, text=True, env=env, timeout=600)
    if out.returncode != 0 and ("not found" in out.stderr or "No such file" in out.stderr):
        pytest.skip("this Triton build has no ptxas / nvdisasm to compile for sm_90")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "_layer_norm_chunked_forward_kernel {'CHUNK': 4096, 'ROWS': 2} 8 warps" in out.stdout
    loops = [int(n) for n in re.findall(r"loop of (\d+):", out.stdout)]
    assert len(loops) == 2 and all(n > 50 for n in loops), out.stdout  # the first sweep, then the second
    assert "FFMA" in out.stdout and "LDG" in out.stdout

#!/usr/bin/env bash
# The open tuning sweeps in one device call, most telling first (docs/perf-notes.md, "Open predictions"). Each
# step has its own time limit and tees its lines into $OUT as they come, so a call cut short by the device's
# limit still brings back what it measured. Defaults change only after these tables are read.
#   scripts/gpu_sweeps.sh            (about 8 minutes with installation)
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/liger-out}
bash scripts/gpu_check.sh script -c "print('installed')" || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
step() { local t=$1 name=$2; shift 2; echo "== $name"; timeout "$t" "$@" 2>&1 | tee "$OUT/$name.log" | grep -v "^\s*$" | tail -60; }
# s21 ran the s20 set (CE L2 probe, split backwards, 4096x65536 forwards, 16384x16384) on an H100; next: the
# launches s21 chose, on whichever card comes, then the widths where RMSNorm trails torch.compile (4096x32768).
step 150 bench bash scripts/gpu_check.sh bench --tag sweeps --kernels cross_entropy layer_norm rms_norm \
  --match "(fwd\+bwd 8192x(32000|128256) |fwd .*4096x(32768|65536) )(liger_torch|liger_kernel|torch_compile)$"
step 100 tune_ce_rows python3 scripts/tune_row_kernels.py --kernels cross_entropy --shapes 8192x128256 16384x32000 \
  --out "$OUT/tune_ce_rows.txt"
step 120 tune_rms_fwd python3 scripts/tune_norm_forward.py --shapes 4096x32768 4096x20496 \
  --families rms_norm fused_add_rms_norm --out "$OUT/tune_rms_fwd.txt"
# The CE probe ran on an H100 only; on an H200 it says whether longer steps and streamed stores win there too.
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  step 100 tune_ce_l2 python3 scripts/tune_ce_l2.py --out "$OUT/tune_ce_l2.txt"
fi
# s22's changes, compiled for the first time (CPU-only session): KL's one-axis grid past 65535 column blocks,
# the fused linear JSD's normalised gradient sweep, the second-derivative and constant-argument errors.
step 150 s22_tests python3 -m pytest -q -p no:cacheprovider \
  tests/gpu/test_huge_inputs.py::test_kl_div_of_a_flattened_array_past_grid_axis_1 \
  tests/test_fused_linear_jsd_torch.py tests/test_fused_linear_jsd_jax.py tests/test_errors.py

#!/usr/bin/env bash
# The open tuning sweeps in one device call, most telling first (docs/perf-notes.md, "Open predictions"). Each
# step has its own time limit and tees its lines into $OUT as they come, so a call cut short by the device's
# limit still brings back what it measured. Defaults change only after these tables are read.
#   scripts/gpu_sweeps.sh            (about 6 minutes with installation; 8 on an H200)
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/liger-out}
bash scripts/gpu_check.sh script -c "print('installed')" || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
step() { local t=$1 name=$2; shift 2; echo "== $name"; timeout "$t" "$@" 2>&1 | tee "$OUT/$name.log" | grep -v "^\s*$" | tail -60; }
# s23: the RMSNorms hold rows up to 32768 columns (16 warps), chosen from s23's first sweep on an H100; LayerNorm's
# held row loads w and b after its reductions past 16384 columns (no spills now) and, since s24, is LayerNorm's
# default up to 32768 columns too (bf16): does it beat its chunked sweep? (If not, s24's commit is reverted.)
step 100 tune_wide_fwd python3 scripts/tune_norm_forward.py --shapes 4096x32768 4096x20496 \
  --families layer_norm --match "^chunk=0|^chunk=(4096|8192) warps=(8|16)$" --out "$OUT/tune_wide_fwd.txt"
step 150 bench bash scripts/gpu_check.sh bench --tag wide_fwd --kernels rms_norm fused_add_rms_norm layer_norm \
  --match "fwd 4096x32768 (liger_torch|liger_kernel|torch_compile)$"
step 200 wide_tests python3 -m pytest -q -p no:cacheprovider tests/test_rms_norm_torch.py \
  tests/test_fused_add_rms_norm_torch.py tests/test_layer_norm_torch.py tests/parity/test_rms_norm_parity.py \
  tests/parity/test_fused_add_rms_norm_parity.py tests/parity/test_layer_norm_parity.py \
  tests/gpu/test_huge_inputs.py::test_wide_norm_forwards_past_2_31_elements \
  -k "16384_columns or 16400 or held or chunked or wide_norm"
# On an H200 (none came in s21-s23): the open predictions, CE 8192x128256 fwd+bwd ~1.20-1.25 ms and LayerNorm
# 4096x65536 fwd ~0.33.
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  step 120 h200_open bash scripts/gpu_check.sh bench --tag h200_open --kernels cross_entropy layer_norm \
    --match "(fwd\+bwd 8192x128256 |fwd 4096x65536 )(liger_torch|liger_kernel|torch_compile)$"
fi

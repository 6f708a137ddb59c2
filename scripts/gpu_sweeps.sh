#!/usr/bin/env bash
# The open tuning sweeps in one device call, most telling first (docs/perf-notes.md, "Open predictions"). Each
# step has its own time limit and tees its lines into $OUT as they come, so a call cut short by the device's
# limit still brings back what it measured. Defaults change only after these tables are read.
#   scripts/gpu_sweeps.sh            (about 5 minutes with installation; 9 on an H200)
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/liger-out}
bash scripts/gpu_check.sh script -c "print('installed')" || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
step() { local t=$1 name=$2; shift 2; echo "== $name"; timeout "$t" "$@" 2>&1 | tee "$OUT/$name.log" | grep -v "^\s*$" | tail -60; }
h200=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -c H200)
# On an H200 (none came in s21-s24), first: the open predictions, CE 8192x128256 fwd+bwd ~1.20-1.25 ms and
# LayerNorm 4096x65536 fwd ~0.33.
if [ "$h200" -gt 0 ]; then
  step 120 h200_open bash scripts/gpu_check.sh bench --tag h200_open --kernels cross_entropy layer_norm \
    --match "(fwd\+bwd 8192x128256 |fwd 4096x65536 )(liger_torch|liger_kernel|torch_compile)$"
fi
# s24: LayerNorm's forward launch by width (held 28672-32768 columns, 8192 x 16 from 24576, 4096 x 16 below),
# from the tuner's graph timer: the same points in the benchmark's timer against torch.compile and Liger-Kernel.
step 150 ln_width bash scripts/gpu_check.sh bench --tag ln_width_s24 --kernels layer_norm \
  --match "fwd 4096x(20496|32768) (liger_torch|liger_kernel|torch_compile)$"
step 120 ln_tests python3 -m pytest -q -p no:cacheprovider tests/test_layer_norm_torch.py \
  tests/parity/test_chunked_forward_parity.py \
  tests/gpu/test_huge_inputs.py::test_wide_norm_forwards_past_2_31_elements \
  -k "by_width or 16384_columns or held or wide_norm"
# With what is left of the call, on either card: one fwd+bwd point per memory-bound kernel against the peers.
BENCH_TIME_LIMIT=150 step 200 refresh bash scripts/h200_refresh.sh

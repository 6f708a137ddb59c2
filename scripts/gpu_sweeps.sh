#!/usr/bin/env bash
# The open tuning sweeps in one device call, most telling first (docs/perf-notes.md, "Open predictions"). Each
# step has its own time limit and tees its lines into $OUT as they come, so a call cut short by the device's
# limit still brings back what it measured. Defaults change only after these tables are read.
#   scripts/gpu_sweeps.sh            (on an H200 about 5 minutes with installation)
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/liger-out}
# s25 measured what an H100 can tell (LayerNorm's launches by width, the peers' refresh, XLA's RMSNorm kernels):
# what is left needs an H200, and on another card the call ends before installing anything.
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 \
  || { echo "not an H200: nothing left to measure here"; exit 0; }
bash scripts/gpu_check.sh script -c "print('installed')" || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
step() { local t=$1 name=$2; shift 2; echo "== $name"; timeout "$t" "$@" 2>&1 | tee "$OUT/$name.log" | grep -v "^\s*$" | tail -60; }
# The open predictions (no H200 came in s21-s25): CE 8192x128256 fwd+bwd ~1.20-1.25 ms, LayerNorm 4096x65536
# fwd ~0.33.
step 120 h200_open bash scripts/gpu_check.sh bench --tag h200_open --kernels cross_entropy layer_norm \
  --match "(fwd\+bwd 8192x128256 |fwd 4096x65536 )(liger_torch|liger_kernel|torch_compile)$"
# With what is left of the call: one fwd+bwd point per memory-bound kernel against the peers (s25 ran it on an
# H100).
BENCH_TIME_LIMIT=150 step 200 refresh bash scripts/h200_refresh.sh

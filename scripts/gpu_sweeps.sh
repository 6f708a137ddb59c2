#!/usr/bin/env bash
# The open tuning sweeps in one device call, most telling first (docs/perf-notes.md, "Open predictions"). Each
# step has its own time limit and tees its lines into $OUT as they come, so a call cut short by the device's
# limit still brings back what it measured. Defaults change only after these tables are read.
#   scripts/gpu_sweeps.sh            (on an H200 about 5 minutes with installation)
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/liger-out}
bash scripts/gpu_check.sh script -c "print('installed')" || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
step() { local t=$1 name=$2; shift 2; echo "== $name"; timeout "$t" "$@" 2>&1 | tee "$OUT/$name.log" | grep -v "^\s*$" | tail -60; }
# s27, on either card: cross-entropy's lagged kernel, its lag now in bytes of rows (12 MiB) and on by default
# from 98304 up to 196607 columns (it lost at 65536 and 256000 with a lag of 64 rows; its GPU tests passed on an
# H100): the huge tests (2 workers: 12 ran the huge norm tests out of an H100's memory; FLCE's past 2**31 logits
# take it too), its sweep against the two-pass kernel at the three widths, then the benchmark points.
step 150 ce_huge env TEST_WORKERS=2 TEST_TIME_LIMIT=140 PYTEST_K="cross_entropy_past" \
  LIGER_TESTS=tests/gpu/test_huge_inputs.py bash scripts/gpu_check.sh tests
step 120 tune_ce_lagged python3 scripts/tune_ce_lagged.py --shapes 8192x128256 8192x65536 8192x256000 \
  --out "$OUT/tune_ce_lagged.txt"
BENCH_TIME_LIMIT=100 step 130 ce_bench bash scripts/gpu_check.sh bench --tag ce_lagged2 --kernels cross_entropy \
  --match "fwd\+bwd 8192x(65536|128256|256000) (liger_torch|liger_jax)$"
# What is left of s21-s25's list needs an H200.
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || exit 0
# The open predictions (no H200 came in s21-s25): CE 8192x128256 fwd+bwd ~1.20-1.25 ms, LayerNorm 4096x65536
# fwd ~0.33.
step 120 h200_open bash scripts/gpu_check.sh bench --tag h200_open --kernels cross_entropy layer_norm \
  --match "(fwd\+bwd 8192x128256 |fwd 4096x65536 )(liger_torch|liger_kernel|torch_compile)$"
# With what is left of the call: one fwd+bwd point per memory-bound kernel against the peers (s25 ran it on an
# H100).
BENCH_TIME_LIMIT=150 step 200 refresh bash scripts/h200_refresh.sh

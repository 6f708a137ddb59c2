#!/usr/bin/env bash
# The open tuning sweeps in one device call, most telling first (docs/perf-notes.md, "Open predictions"). Each
# step has its own time limit and tees its lines into $OUT as they come, so a call cut short by the device's
# limit still brings back what it measured. Defaults change only after these tables are read.
#   scripts/gpu_sweeps.sh            (about 5 minutes with installation; on an H200 about 9)
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/liger-out}
bash scripts/gpu_check.sh script -c "print('installed')" || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
step() { local t=$1 name=$2; shift 2; echo "== $name"; timeout "$t" "$@" 2>&1 | tee "$OUT/$name.log" | grep -v "^\s*$" | tail -60; }
# s28, on any card: the lagged norm backward's small jobs (16-32 KB, dW chained through the blocks) against the
# column split at 4096x65536 and 4096x32768 (the first sweep's 512 KB jobs lost). On an H200 it runs last.
norm_tune() {
  step "$1" tune_norm_lagged python3 scripts/tune_norm_lagged.py --out "$OUT/tune_norm_lagged.txt"
  step 90 lagged_norm_tests python3 -m pytest -q -n 2 -p no:cacheprovider -k lagged tests/gpu/test_determinism.py \
    tests/parity/test_chunked_forward_parity.py tests/test_rms_norm_torch.py tests/test_fused_add_rms_norm_torch.py
}
# The rest needs an H200 (s21-s28 got none).
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || { norm_tune 220; exit 0; }
# s27: cross-entropy's lagged kernel (the default from 98304 columns, its lag 12 MiB of rows, tuned on an H100)
# against the two-pass kernel on the H200's L2.
step 120 tune_ce_lagged python3 scripts/tune_ce_lagged.py --shapes 8192x128256 8192x65536 8192x256000 \
  --out "$OUT/tune_ce_lagged.txt"
# The open predictions: CE 8192x128256 fwd+bwd ~1.15-1.20 ms (lagged; 1.20-1.25 two-pass), LayerNorm
# 4096x65536 fwd ~0.33.
step 120 h200_open bash scripts/gpu_check.sh bench --tag h200_open --kernels cross_entropy layer_norm \
  --match "(fwd\+bwd 8192x128256 |fwd 4096x65536 )(liger_torch|liger_kernel|torch_compile)$"
# With what is left of the call: one fwd+bwd point per memory-bound kernel against the peers (s25 ran it on an
# H100).
BENCH_TIME_LIMIT=120 step 160 refresh bash scripts/h200_refresh.sh
norm_tune 110

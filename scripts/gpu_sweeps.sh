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
# s27, on either card: cross-entropy's lagged kernel (s26; its GPU tests passed on an H100 in s27, but it ran at
# 1.93 ms with 79 registers, now 62) by default from 65536 columns: its tests again (the huge ones on 2 workers:
# 12 ran the huge norm tests out of an H100's memory; FLCE's past 2**31 logits take it too), its launch sweep
# against the two-pass kernel, then the CE benchmark points at the lagged widths (and FLCE's, whose chunks take
# it) against the peers.
step 120 ce_tests env TEST_WORKERS=8 TEST_TIME_LIMIT=110 PYTEST_K="lagged or wide_vocab" \
  LIGER_TESTS="tests/test_cross_entropy_torch.py tests/test_cross_entropy_jax.py \
tests/parity/test_cross_entropy_parity.py" bash scripts/gpu_check.sh tests
step 150 ce_huge env TEST_WORKERS=2 TEST_TIME_LIMIT=140 PYTEST_K="cross_entropy_past" \
  LIGER_TESTS=tests/gpu/test_huge_inputs.py bash scripts/gpu_check.sh tests
step 120 tune_ce_lagged python3 scripts/tune_ce_lagged.py --shapes 8192x128256 8192x65536 8192x256000 \
  --out "$OUT/tune_ce_lagged.txt"
BENCH_TIME_LIMIT=140 step 170 ce_bench bash scripts/gpu_check.sh bench --tag ce_lagged \
  --kernels cross_entropy fused_linear_cross_entropy --match \
  "(cross_entropy fwd\+bwd 8192x(65536|128256|256000)|fused_linear_cross_entropy fwd\+bwd 8192x4096x128256) \
(liger_torch|liger_jax|liger_kernel|torch_compile)$"
# What is left of s21-s25's list needs an H200.
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || exit 0
# The open predictions (no H200 came in s21-s25): CE 8192x128256 fwd+bwd ~1.20-1.25 ms, LayerNorm 4096x65536
# fwd ~0.33.
step 120 h200_open bash scripts/gpu_check.sh bench --tag h200_open --kernels cross_entropy layer_norm \
  --match "(fwd\+bwd 8192x128256 |fwd 4096x65536 )(liger_torch|liger_kernel|torch_compile)$"
# With what is left of the call: one fwd+bwd point per memory-bound kernel against the peers (s25 ran it on an
# H100).
BENCH_TIME_LIMIT=150 step 200 refresh bash scripts/h200_refresh.sh

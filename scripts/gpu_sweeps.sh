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
step 100 tune_ce_l2 python3 scripts/tune_ce_l2.py --out "$OUT/tune_ce_l2.txt"
step 130 tune_split_bwd python3 scripts/tune_norm_backward.py --shapes 4096x65536 --out "$OUT/tune_split_bwd.txt"
step 100 tune_rows_fwd python3 scripts/tune_norm_forward.py --shapes 4096x65536 --out "$OUT/tune_rows_fwd.txt"
step 80 tune_bwd_16384 python3 scripts/tune_norm_backward.py --shapes 16384x16384 --out "$OUT/tune_bwd_16384.txt"
step 50 tune_ln_16384 python3 scripts/tune_norm_forward.py --shapes 16384x16384 --families layer_norm \
  --out "$OUT/tune_ln_16384.txt"

#!/usr/bin/env bash
# Before/after on one warm GPU: run `python -m benchmarks run ARGS --tag TAG_new`, then swap in the kernel files
# kept in OLD_DIR (e.g. made here by `git show REV:liger_core/jsd.py > ab/old/jsd.py`; the device copy of the
# tree has no git history), run `... --tag TAG_old`, and put the current files back.
#   scripts/ab_bench.sh OLD_DIR TAG [ARGS for `python -m benchmarks run`]
# Run after scripts/gpu_check.sh has installed the wheels (PYTHONPATH=/tmp/site); results are mirrored to
# $OUT/results without plots.
set -uo pipefail
cd "$(dirname "$0")/.."
old_dir=$1 tag=$2; shift 2
OUT=${OUT:-/tmp/liger-out}; mkdir -p "$OUT/results"
export PYTHONPATH=${PYTHONPATH:-/tmp/site} LIGER_BENCH_MIRROR="$OUT/results"
saved=$(mktemp -d)
for f in "$old_dir"/*.py; do cp "liger_core/$(basename "$f")" "$saved/"; done
run() { python3 -m benchmarks run "$@" 2>&1 | tee -a "$OUT/bench.log" | grep -v "^\[" | tail -40; }
run "$@" --tag "${tag}_new"
cp "$old_dir"/*.py liger_core/
run "$@" --tag "${tag}_old"
cp "$saved"/*.py liger_core/
rm -rf "$OUT"/results/*-plots

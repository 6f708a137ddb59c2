#!/usr/bin/env bash
# One call on the GPU machine: install the carried wheels (.whl/, from ../shared/device-wheels.sh) and this
# repo, run the whole test suite on the GPU, then the benchmarks, and print a short table.
#   scripts/gpu_check.sh [all|tests|bench|demo|profile|script] [extra args for `python -m benchmarks run`, or
#   for scripts/profile_e2e.py with profile; with script: a script and its args, e.g.
#   script scripts/tune_norm_backward.py --out "$OUT/tune_norm_backward.txt"]
# Logs and results land in $OUT (the device tool brings them back) and benchmarks/results/.
# tests: LIGER_TESTS (paths, default tests), PYTEST_K (a -k expression, spaces allowed), PYTEST_ARGS (plain
# words only: it is split on spaces), TEST_WORKERS, TEST_TIME_LIMIT.
#   e.g. scripts/gpu_check.sh bench --quick --kernels rms_norm layer_norm fused_add_rms_norm rope swiglu
#        scripts/gpu_check.sh bench --quick --kernels e2e --match "e2e hf"     (then --match "e2e flax")
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}; shift || true
OUT=${OUT:-/tmp/liger-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false NCCL_NVLS_ENABLE=0
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
  || python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton, jax; print('torch', torch.__version__, 'triton', triton.__version__, 'jax', jax.__version__, jax.devices())"
status=0
if [ "$what" = all ] || [ "$what" = tests ]; then
  timeout "${TEST_TIME_LIMIT:-540}" python3 -m pytest -q -n "${TEST_WORKERS:-4}" -p no:cacheprovider --durations=25 \
    ${PYTEST_ARGS:-} ${PYTEST_K:+-k "$PYTEST_K"} ${LIGER_TESTS:-tests} 2>&1 | tee "$OUT/tests.log" | grep -E "passed|failed|error|FAILED|ERROR" | tail -60
  status=${PIPESTATUS[0]}
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
  # The results file, report and plots are copied to $OUT/results after every module (a run cut short still
  # brings back what it measured); tasks not started within BENCH_TIME_LIMIT seconds are recorded as skipped.
  export LIGER_BENCH_MIRROR="$OUT/results"
  python3 -m benchmarks run --time-limit "${BENCH_TIME_LIMIT:-420}" "$@" 2>&1 | tee "$OUT/bench.log" \
    | grep -v "^\[" | tail -80
  # The plots stay behind: the device tool brings back a limited number of files (a run of several tags lost
  # its JSON that way); `python -m benchmarks render RESULTS.json` draws them again here.
  rm -rf "$OUT"/results/*-plots
fi
if [ "$what" = demo ]; then  # the README's main job at its GPU size
  bash scripts/demo.sh 2>&1 | tee "$OUT/demo.log" | tail -30
  status=${PIPESTATUS[0]}
fi
if [ "$what" = profile ]; then  # where an e2e training step's GPU time goes, per kernel
  python3 scripts/profile_e2e.py --out "$OUT/profile_e2e.txt" "$@" 2>&1 | tail -80
  status=${PIPESTATUS[0]}
fi
if [ "$what" = script ]; then  # a tuning or probe script, after the same installation
  python3 "$@" 2>&1 | tail -150
  status=${PIPESTATUS[0]}
fi
exit $status

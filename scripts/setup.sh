#!/usr/bin/env bash
# Installs everything the CPU test suite and the demo need, into the current python3 (idempotent).
# torch is pinned to the CPU build on disk (an unpinned torch pulls a multi-GB CUDA build); triton to the GPU
# image's 3.6.0; numpy below 2.4, whose stricter array-to-int conversion breaks Triton 3.6's interpreter
# (loops with runtime bounds).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# Fail fast without a network (the GPU machine has none: pip's default retries cost minutes there).
PIP_NET="--retries 1 --timeout 20"
if ! $PY -c "import torch, triton, jax, flax, jax_triton, pytest, xdist, transformers, liger_torch" >/dev/null 2>&1; then
  $PY -m pip install -q --disable-pip-version-check $PIP_NET "torch==2.13.0" "triton==3.6.0" "numpy<2.4" \
    "jax==0.10.2" "jaxlib==0.10.2" "jax-triton==0.3.1" "flax>=0.12,<0.13" 2>&1 | grep -v -E "^WARNING: (Running pip|Location)" || true
  $PY -m pip install -q --disable-pip-version-check $PIP_NET -e ".[dev]" "torch==2.13.0" "numpy<2.4" 2>&1 \
    | grep -v -E "^WARNING: (Running pip|Location)" || true
fi
# Optional: DeepSpeed for the ZeRO-3 test in tests/distributed (skipped without it). Its ops are JIT-built on use,
# so DS_BUILD_OPS=0 makes this a pure-Python install; a failure here is not fatal.
if ! $PY -c "import deepspeed" >/dev/null 2>&1; then
  DS_BUILD_OPS=0 $PY -m pip install -q --disable-pip-version-check $PIP_NET "deepspeed==0.19.8" 2>&1 \
    | grep -v -E "^WARNING: (Running pip|Location)" || true
fi
# The packages must come from this checkout (an editable install of another clone would shadow it).
here=$(pwd -P)
installed=$($PY -c "import os, liger_core; print(os.path.dirname(os.path.dirname(os.path.realpath(liger_core.__file__))))" 2>/dev/null || true)
if [ "$installed" != "$here" ]; then
  $PY -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e . 2>&1 \
    | grep -v -E "^WARNING: (Running pip|Location)" || true
fi
$PY -W ignore -c "import torch, triton, jax, flax, liger_torch, liger_jax; print('torch', torch.__version__, '| triton', triton.__version__, '| jax', jax.__version__, '| flax', flax.__version__)" 2>&1 | grep -v Warning

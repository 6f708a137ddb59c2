#!/usr/bin/env bash
# The main job: install what is missing, then run the demo (scripts/demo.py).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
python3 scripts/demo.py "$@"

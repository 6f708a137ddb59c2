#!/usr/bin/env bash
# The test command: install what is missing, then the whole CPU suite (kernels in Triton's interpreter).
# On a GPU machine the same suite runs compiled kernels and the `gpu`-marked tests too.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
export LIGER_INTERPRET=${LIGER_INTERPRET:-auto}
python3 -m pytest -n 2 -q -p no:cacheprovider tests "$@"
rc=$?
[ $rc -eq 5 ] && { echo "no tests were collected"; exit 1; }
exit $rc

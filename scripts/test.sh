#!/usr/bin/env bash
# The test command of the README: installs what is missing, then runs the whole suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "${PYTHON:-python3}" -m pytest -q "$@"

#!/usr/bin/env bash
# The test command of the README: installs what is missing, then runs the suite on CPU.
#   bash scripts/test.sh [pytest args]        every test module, the quick tier (~10 min)
#   bash scripts/test.sh --all [pytest args]  adds the long tier: tests marked 'long'
#                                             (long trainings, batteries, torchtitan runs)
# tests/conftest.py defines the tiers; FSDP_QCOMM_TEST_ALL=1 is --all, and reaches the child
# pytest runs some tests start (the Triton interpreter's, the GPU check's dry run).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "--all" ]]; then
    shift
    export FSDP_QCOMM_TEST_ALL=1
fi
bash scripts/install.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "${PYTHON:-python3}" -m pytest -q "$@"

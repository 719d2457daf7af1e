#!/usr/bin/env bash
# The test command of the README: installs what is missing, then runs the suite on CPU.
#   bash scripts/test.sh [pytest args]        every test module, the quick tier (~6 min on 2 cores)
#   bash scripts/test.sh --all [pytest args]  adds the long tier: tests marked 'long'
#                                             (long trainings, batteries, torchtitan runs)
# tests/conftest.py defines the tiers; FSDP_QCOMM_TEST_ALL=1 is --all, and reaches the child
# pytest runs some tests start (the Triton interpreter's, the GPU check's dry run).
# Test files run side by side in FSDP_QCOMM_TEST_WORKERS pytest-xdist workers, each file whole
# in one worker (--dist loadfile: a module's fixtures run once); 1 runs them in this process.
# Default: one per core, at most 4, for the quick tier, where many tests keep one core busy (the
# Triton interpreter, a child pytest, one process training) and a second worker fills the
# other; one per two cores with --all, whose torchrun jobs of 4 ranks slow down beside another
# multi-rank test about as much as the second worker gains (measured on 2 cores: the quick tier
# ~25% faster with 2 workers, both tiers no faster).
# FSDP_QCOMM_TEST_INSTALL=0 skips the install and tests ${PYTHON:-python3} as it is (.ci/run's
# torch 2.11 and 2.15 environments).
set -euo pipefail
cd "$(dirname "$0")/.."
per_worker=1  # cores per default worker
if [[ "${1:-}" == "--all" ]]; then
    shift
    export FSDP_QCOMM_TEST_ALL=1
    per_worker=2
fi
PY=${PYTHON:-python3}
[[ "${FSDP_QCOMM_TEST_INSTALL:-1}" == 0 ]] || bash scripts/install.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
workers=${FSDP_QCOMM_TEST_WORKERS:-$("$PY" -c \
    "import os; print(max(1, min(len(os.sched_getaffinity(0)) // $per_worker, 4)))")}
xdist=()
if (( workers > 1 )); then xdist=(-n "$workers" --dist loadfile); fi
exec "$PY" -m pytest -q "${xdist[@]}" "$@"

#!/usr/bin/env bash
# Installs fsdp-qcomm and what it needs into the current Python, idempotently.
# torch is pinned first: an unpinned torch would pull a multi-GB CUDA build on CPU machines.
# FSDP_QCOMM_TORCH overrides the pin (for example on a GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install --quiet --disable-pip-version-check "torch==${FSDP_QCOMM_TORCH:-2.13.0}"
"$PY" -m pip install --quiet --disable-pip-version-check triton
"$PY" -m pip install --quiet --disable-pip-version-check -e ".[test,titan,bench,ft]"

#!/usr/bin/env bash
# The GPU path in one run on a single-GPU machine, under 8 minutes: the kernel tests on CUDA,
# bit-exactness of every kernel against the torch codec, the bandwidth table against
# torch.clone and the device's peak, and FSDP2 runs with enable() for each preset
# (scripts/gpu_check.py says what each step checks). Writes one JSON results file and prints a
# summary table; exit status 1 if a step failed.
#   bash scripts/gpu_check.sh [--dry-run] [--out FILE] [--only STEP,...]
# --dry-run (or GPU_CHECK_DRY_RUN=1): everything that runs without CUDA, on the CPU with small
# sizes (Triton interpreter, gloo). Installs what is missing first (scripts/install.sh; set
# FSDP_QCOMM_TORCH to the torch version of a CUDA build); the package itself is used from this
# checkout, which needs no install.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
PY=${PYTHON:-python3}
dry=${GPU_CHECK_DRY_RUN:-0}
for a in "$@"; do
    if [[ "$a" == --dry-run ]]; then dry=1; fi
done
if ! DRY="$dry" "$PY" - <<'PYEOF'
import os
import numpy, pytest, torch, triton  # noqa: F401
assert os.environ["DRY"] == "1" or torch.cuda.is_available(), "no CUDA device visible to torch"
PYEOF
then
    echo "gpu_check.sh: installing the requirements (scripts/install.sh)" >&2
    PYTHON="$PY" bash scripts/install.sh
fi
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
if [[ "$dry" == 1 ]]; then
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
fi
exec "$PY" scripts/gpu_check.py "$@"

#!/usr/bin/env bash
# The GPU path in one run on a single-GPU machine, within --budget seconds (default 480): the
# codec's cost inside a training step, kernel exactness and bandwidth, and FSDP2 runs with
# enable() for each preset (scripts/gpu_check.py says what each step checks). Each step's
# result is written as it ends, to $OUT when set, else results/gpu_check/ (or --out DIR):
# gpu_check.json, summary.md, log.txt. Exit status 1 if a step failed.
#   bash scripts/gpu_check.sh [--dry-run] [--budget SECONDS] [--out DIR] [--only STEP,...]
# Installs nothing: it uses the machine's torch, triton, numpy, pytest and hypothesis, and
# runs the package from this checkout. --dry-run (or GPU_CHECK_DRY_RUN=1): every step on the
# CPU with small sizes (Triton interpreter, gloo, the fake backend).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
PY=${PYTHON:-python3}
dry=${GPU_CHECK_DRY_RUN:-0}
for a in "$@"; do
    if [[ "$a" == --dry-run ]]; then dry=1; fi
done
DRY="$dry" "$PY" - <<'PYEOF'
import importlib.util, os, sys
missing = [m for m in ("numpy", "pytest", "hypothesis", "torch", "triton")
           if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_check.sh: {', '.join(missing)} not importable by {sys.executable}; install "
             "them (or set PYTHON to an interpreter that has them): this script installs nothing")
import torch
if os.environ["DRY"] != "1" and not torch.cuda.is_available():
    sys.exit("gpu_check.sh: no CUDA device visible to torch; run with --dry-run for the CPU check")
PYEOF
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
if [[ "$dry" == 1 ]]; then
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
fi
exec "$PY" scripts/gpu_check.py "$@"

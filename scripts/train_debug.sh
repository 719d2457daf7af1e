#!/usr/bin/env bash
# The main job: 4 torchtitan processes train the debug GPT on the CPU (gloo) on the built-in
# offline corpus, printing the loss, then a summary of the bytes sent per step against what
# unquantized FSDP2 collectives would have sent (from the fsdp_qcomm handles' counters).
#   bash scripts/train_debug.sh [scheme] [extra args for fsdp_qcomm.titan.main ...]
# scheme: baseline | sdp4bit (default) | qsdp | zeropp | qw4
# Runs scripts/install.sh first when torch/triton/torchtitan/tokenizers are missing (a fresh
# machine); FSDP_QCOMM_INSTALL=1 forces it. This checkout is put first on PYTHONPATH, so the
# ranks import this copy of fsdp_qcomm whatever else is installed.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
scheme="${1:-sdp4bit}"
shift || true
cd "$repo"
PY=${PYTHON:-python3}
if [[ "${FSDP_QCOMM_INSTALL:-0}" == 1 ]] || ! "$PY" - <<'PYEOF' 2>/dev/null
import importlib.metadata as md
import torch, triton, tokenizers, torchtitan  # noqa: F401
assert md.version("torchtitan") == "0.2.2"
PYEOF
then
    echo "train_debug.sh: installing the requirements (scripts/install.sh)" >&2
    PYTHON="$PY" bash scripts/install.sh
fi
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$PY" -m fsdp_qcomm.titan.main --scheme "$scheme" "$@"

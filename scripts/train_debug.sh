#!/usr/bin/env bash
# CPU debug job: 4 torchtitan processes train the debug GPT for 300 steps on the built-in
# offline corpus, then print bytes sent per step against unquantized FSDP2.
#   scripts/train_debug.sh [scheme] [extra args for fsdp_qcomm.titan.main ...]
# scheme: baseline | sdp4bit (default) | qsdp | zeropp | qw4
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
scheme="${1:-sdp4bit}"
shift || true
cd "$repo"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec python -m fsdp_qcomm.titan.main --scheme "$scheme" "$@"

#!/usr/bin/env bash
# Run one test module N times in a row in a given Python, stopping at nothing; one line per run
# (pass/fail and pytest's summary), and every failing run's output kept next to the log.
#   bash scripts/repeat_module.sh PYTHON MODULE N OUTDIR [env assignments...]
# e.g. bash scripts/repeat_module.sh .ci/venv-torch215/bin/python tests/test_weight_writes.py \
#      30 results/segfault_hunt FSDP_QCOMM_NATIVE=1
set -uo pipefail
py=$1; module=$2; n=$3; out=$4; shift 4
mkdir -p "$out"
tag=$(basename "$module" .py)$(printf '_%s' "${@##*/}" | tr '=' '-')
log="$out/$tag.log"
: > "$log"
pass=0
for i in $(seq 1 "$n"); do
    t0=$SECONDS
    env "$@" PYTHONFAULTHANDLER=1 OMP_NUM_THREADS=1 "$py" -m pytest -q -p no:cacheprovider \
        "$module" > "$out/.run.txt" 2>&1
    rc=$?
    summary=$(grep -E '(passed|failed|error)' "$out/.run.txt" | tail -1)
    if [[ $rc -eq 0 ]]; then pass=$((pass + 1)); else cp "$out/.run.txt" "$out/${tag}_run$i.txt"; fi
    echo "run $i: exit $rc in $((SECONDS - t0)) s: $summary" | tee -a "$log"
done
rm -f "$out/.run.txt"
echo "$pass of $n runs passed" | tee -a "$log"

#!/usr/bin/env bash
# Run one test module N times in a row in a given Python, stopping at nothing; one line per run
# (pass/fail and pytest's summary), and every failing run's output kept next to the log.
#   bash scripts/repeat_module.sh PYTHON MODULE N OUTDIR [env assignments...]
# e.g. bash scripts/repeat_module.sh .ci/venv-torch215/bin/python tests/test_weight_writes.py \
#      30 results/segfault_hunt FSDP_QCOMM_NATIVE=1
# REPEAT_CORES=DIR (as root): every process of a run may dump core into DIR (the kernel's
# core_pattern is pointed there for the loop and restored after); a failing run's cores become
# gdb backtraces of every thread beside its output, <tag>_run<i>_core.<pid>.txt (the native
# frame a crash died in; scripts/native_cores.sh) and its cores are kept in DIR/run<i>/ (for gdb
# by hand: the heap around a corrupted chunk); a passing run's cores are deleted (tests that
# abort on purpose). Loops that collect cores may run at the same time (scripts/core_route.sh).
# Resumable: the same command again continues where OUTDIR's log stopped (its runs are kept and
# counted), up to N runs in all.
set -uo pipefail
py=$1; module=$2; n=$3; out=$4; shift 4
mkdir -p "$out"
source "$(dirname "$0")/native_cores.sh"
finish() {
    rm -f "$out/.run.txt"
    cores_stop
}
trap finish EXIT
if [[ -n "${REPEAT_CORES:-}" ]]; then
    cores_start "$REPEAT_CORES" >&2 || exit 2
fi
tag=$(basename "$module" .py)
[[ $# -eq 0 ]] || tag=$tag$(printf '_%s' "${@##*/}" | tr '=' '-')
log="$out/$tag.log"
touch "$log"
first=$(($(grep -c '^run ' "$log") + 1))
pass=$(grep -c '^run [0-9]*: exit 0 ' "$log")
[[ $first -eq 1 ]] || echo "resuming at run $first of $n ($pass of $((first - 1)) passed)" \
    | tee -a "$log"
for i in $(seq "$first" "$n"); do
    t0=$SECONDS
    # no reruns of a crashed multi-rank run (CI's setting): here every crash is the finding
    env FSDP_QCOMM_NATIVE_CRASH_RERUNS=0 "$@" PYTHONFAULTHANDLER=1 OMP_NUM_THREADS=1 "$py" -m \
        pytest -q -p no:cacheprovider \
        "$module" > "$out/.run.txt" 2>&1
    rc=$?
    summary=$(grep -E '(passed|failed|error)' "$out/.run.txt" | tail -1)
    if [[ $rc -eq 0 ]]; then
        pass=$((pass + 1))
    else
        cp "$out/.run.txt" "$out/${tag}_run$i.txt"
        cores_report "$out/${tag}_run${i}_"
        if [[ -n "$cores_reported" ]]; then
            summary="$summary; backtraces of $cores_reported, cores kept in $cores_dir/run$i"
            mkdir -p "$cores_dir/run$i" && mv "$cores_dir"/core.* "$cores_dir/run$i/"
        fi
    fi
    cores_clear
    echo "run $i: exit $rc in $((SECONDS - t0)) s: $summary" | tee -a "$log"
done
echo "$pass of $(grep -c '^run ' "$log") runs passed" | tee -a "$log"

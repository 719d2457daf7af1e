# Sourced by .ci/run and scripts/repeat_module.sh: every process started after cores_start may
# dump core into one folder, and cores_report turns each core into a gdb backtrace, the native
# frame a crash died in (run_ranks reports a crashed rank's signal and Python stacks, not the C
# frames under them). Needs root (the kernel's core_pattern, restored by cores_stop) and gdb.
#   cores_start [DIR]    DIR (created if missing), or a fresh temporary folder; returns 1 (and
#                        says why) when it cannot, leaving core_pattern as it was
#   cores_report [PREFIX] each core's backtrace: to stdout (bt 50 and the thread list), or with
#                        PREFIX to PREFIXcore.<pid>.txt (also every thread's bt 30); sets
#                        cores_reported to the cores it read (core.<pid> ...)
#   cores_clear          drop the cores so far (runs that passed: tests crash ranks on purpose)
#   cores_stop           restore core_pattern; remove the folder if cores_start made it

cores_dir=""
cores_made=""
cores_saved=""
cores_reported=""
cores_pattern=/proc/sys/kernel/core_pattern

cores_start() {
    local dir=${1:-}
    if ! command -v gdb > /dev/null; then
        echo "native cores: no gdb here: a native crash will show its Python stacks only"
        return 1
    fi
    cores_saved=$(cat "$cores_pattern" 2> /dev/null || true)
    if [[ -n "$dir" ]]; then
        mkdir -p "$dir" || return 1
        dir=$(cd "$dir" && pwd)
    else
        dir=$(mktemp -d "${TMPDIR:-/tmp}/fsdp_qcomm_cores.XXXXXX") && cores_made=$dir
    fi
    # %E: the executable's path with '/' written as '!', so gdb opens the core with the program
    # that wrote it (a venv's python, a subprocess's binary)
    if [[ -z "$cores_saved" ]] || ! { echo "$dir/core.%p.%E" > "$cores_pattern"; } \
        2> /dev/null; then
        echo "native cores: cannot set the kernel's core_pattern (not root): a native crash" \
            "will show its Python stacks only"
        [[ -z "$cores_made" ]] || rmdir "$cores_made"
        cores_made=""
        return 1
    fi
    ulimit -c unlimited 2> /dev/null || ulimit -c "$(ulimit -H -c)"
    cores_dir=$dir
}

cores_report() {
    local prefix=${1:-} core name exe pid
    cores_reported=""
    [[ -n "$cores_dir" ]] || return 0
    for core in "$cores_dir"/core.*; do
        [[ -e "$core" ]] || continue
        name=${core##*/}
        exe=${name#core.*.}
        exe=${exe//\!//}
        pid=${name#core.}
        pid=${pid%%.*}
        cores_reported="$cores_reported core.$pid"
        if [[ -z "$prefix" ]]; then
            echo "native backtrace of core.$pid ($exe):"
            gdb -batch -ex "bt 50" -ex "info threads" "$exe" "$core" 2>&1 \
                | grep -v -E '^\[(New LWP|Thread debugging|Using host)' || true
        else
            gdb -batch -ex "bt 50" -ex "thread apply all bt 30" "$exe" "$core" \
                > "${prefix}core.$pid.txt" 2>&1 || true
        fi
    done
    cores_reported=${cores_reported# }
}

cores_clear() {
    [[ -z "$cores_dir" ]] || rm -f "$cores_dir"/core.*
}

cores_stop() {
    [[ -n "$cores_dir" ]] || return 0
    cores_clear
    [[ -z "$cores_made" ]] || rm -rf "$cores_made"
    echo "$cores_saved" > "$cores_pattern" || true
    cores_dir=""
    cores_made=""
}

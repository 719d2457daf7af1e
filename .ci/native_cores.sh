# Sourced by .ci/run. Every process CI starts may dump core into one folder, and a failing run
# prints a gdb backtrace of each core: the native frame a crash died in (run_ranks reports a
# crashed rank's signal and Python stacks, not the C frames under them). Needs root (the
# kernel's core_pattern, restored at exit) and gdb; without them it says so and does nothing.
# Tests that crash a rank on purpose (tests/test_run_ranks.py) leave cores too: ci_cores_clear
# drops them after each part that passed, so only a failing part's cores are reported.

ci_cores_dir=""
ci_cores_saved=""
ci_cores_pattern=/proc/sys/kernel/core_pattern

ci_cores_start() {
    if ! command -v gdb > /dev/null; then
        echo "ci: no gdb here: a native crash will show its Python stacks only"
        return 0
    fi
    local dir
    dir=$(mktemp -d "${TMPDIR:-/tmp}/fsdp_qcomm_ci_cores.XXXXXX")
    ci_cores_saved=$(cat "$ci_cores_pattern" 2> /dev/null || true)
    # %E: the executable's path with '/' written as '!', so gdb gets the right interpreter
    if [[ -z "$ci_cores_saved" ]] || ! { echo "$dir/core.%p.%E" > "$ci_cores_pattern"; } \
        2> /dev/null; then
        echo "ci: cannot set the kernel's core_pattern (not root): a native crash will show" \
            "its Python stacks only"
        rmdir "$dir"
        return 0
    fi
    ulimit -c unlimited 2> /dev/null || ulimit -c "$(ulimit -H -c)"
    ci_cores_dir=$dir
}

ci_cores_clear() {
    [[ -z "$ci_cores_dir" ]] || rm -f "$ci_cores_dir"/core.*
}

ci_cores_finish() {
    local rc=$? core exe
    if [[ -n "$ci_cores_dir" ]]; then
        if [[ $rc -ne 0 ]]; then
            for core in "$ci_cores_dir"/core.*; do
                [[ -e "$core" ]] || continue
                exe=${core#*/core.*.}
                exe=${exe//\!//}
                echo "ci: native backtrace of ${core##*/} ($exe):"
                gdb -batch -ex "bt 50" -ex "info threads" "$exe" "$core" 2>&1 \
                    | grep -v -E '^\[(New LWP|Thread debugging|Using host)' || true
            done
        fi
        rm -rf "$ci_cores_dir"
        echo "$ci_cores_saved" > "$ci_cores_pattern" || true
    fi
    exit "$rc"
}

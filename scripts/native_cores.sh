# Sourced by .ci/run and scripts/repeat_module.sh: every process started after cores_start may
# dump core into one folder, and cores_report turns each core into a gdb backtrace, the native
# frame a crash died in (run_ranks reports a crashed rank's signal and Python stacks, not the C
# frames under them). Needs root (the kernel's core_pattern, restored by the last cores_stop)
# and gdb. The kernel pipes each core to scripts/core_route.sh, which writes it to the folder
# named by the crashing process's FSDP_QCOMM_CORES_DIR (exported by cores_start): loops that
# collect cores at the same time (two repeat loops, a loop beside CI) each get their own.
#   cores_start [DIR]    DIR (created if missing), or a fresh temporary folder; returns 1 (and
#                        says why) when it cannot, leaving core_pattern as it was
#   cores_report [PREFIX] each core's backtrace: to stdout (bt 50 and the thread list), or with
#                        PREFIX to PREFIXcore.<pid>.txt (also every thread's bt 30 and the
#                        crashed thread's glibc tcache free lists); sets
#                        cores_reported to the cores it read (core.<pid> ...)
#   cores_clear          drop the cores so far (runs that passed: tests crash ranks on purpose)
#   cores_stop           leave; the last collector to leave restores core_pattern; remove the
#                        folder if cores_start made it

cores_dir=""
cores_made=""
cores_reported=""
cores_pattern=/proc/sys/kernel/core_pattern
cores_pipe_limit=/proc/sys/kernel/core_pipe_limit
# shared by every collector on this machine: who collects now, what to restore after the last
cores_state=/run/fsdp_qcomm_cores

# Drop collectors that are gone (a loop killed with SIGKILL); prints how many remain.
_cores_live() {
    local f n=0
    for f in "$cores_state"/users/*; do
        [[ -e "$f" ]] || continue
        if kill -0 "${f##*/}" 2> /dev/null; then n=$((n + 1)); else rm -f "$f"; fi
    done
    echo "$n"
}

cores_start() {
    local dir=${1:-} handler want
    if ! command -v gdb > /dev/null; then
        echo "native cores: no gdb here: a native crash will show its Python stacks only"
        return 1
    fi
    if [[ ! -w "$cores_pattern" ]] || ! mkdir -p "$cores_state/users" 2> /dev/null; then
        echo "native cores: cannot set the kernel's core_pattern (not root): a native crash" \
            "will show its Python stacks only"
        return 1
    fi
    if [[ -n "$dir" ]]; then
        mkdir -p "$dir" || return 1
        dir=$(cd "$dir" && pwd)
    else
        dir=$(mktemp -d "${TMPDIR:-/tmp}/fsdp_qcomm_cores.XXXXXX") && cores_made=$dir
    fi
    handler="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/core_route.sh"
    # %P: the pid whose environment names the folder; %p: the pid in its own namespace (the
    # file name); %E: the executable's path with '/' as '!', so gdb opens the core with the
    # program that wrote it (a venv's python, a subprocess's binary)
    want="|$handler %P %p %E"
    if ! (
        flock 9
        now=$(cat "$cores_pattern")
        live=$(_cores_live)
        # Another checkout's handler with collectors still live stays: it routes by the same
        # variable, and replacing it would leave ours behind when we leave (the last collector
        # restores only when none is live) and lose its cores if that checkout goes first.
        other=${now#|}
        other=${other%% *}
        if [[ "$live" != 0 && "$now" == "|"*/core_route.sh" "* && -x "$other" ]]; then
            :
        elif [[ "$now" != "$want" || "$live" == 0 ]]; then
            # the first collector: remember what to restore (a stale handler line is not)
            if [[ "$now" != "|"*core_route.sh* ]]; then
                cat "$cores_pattern" > "$cores_state/pattern"
                cat "$cores_pipe_limit" > "$cores_state/pipe_limit"
            fi
            echo "$want" > "$cores_pattern" || exit 1
            # a non-zero limit makes the kernel keep /proc/<pid> (the environment) for the handler
            echo 16 > "$cores_pipe_limit" || exit 1
        fi
        : > "$cores_state/users/$$"
    ) 9> "$cores_state/lock"; then
        echo "native cores: cannot set the kernel's core_pattern: a native crash will show" \
            "its Python stacks only"
        [[ -z "$cores_made" ]] || rmdir "$cores_made"
        cores_made=""
        return 1
    fi
    ulimit -c unlimited 2> /dev/null || ulimit -c "$(ulimit -H -c)"
    export FSDP_QCOMM_CORES_DIR=$dir
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
            # *tcache: the crashed thread's glibc free lists (a crash in malloc follows a
            # corrupted entry: the garbage pointer there is what a write after free left)
            gdb -batch -ex "bt 50" -ex "thread apply all bt 30" -ex "p *tcache" "$exe" "$core" \
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
    (
        flock 9
        rm -f "$cores_state/users/$$"
        if [[ "$(_cores_live)" == 0 && -e "$cores_state/pattern" ]]; then
            cat "$cores_state/pattern" > "$cores_pattern"
            cat "$cores_state/pipe_limit" > "$cores_pipe_limit"
            rm -f "$cores_state/pattern" "$cores_state/pipe_limit"
        fi
    ) 9> "$cores_state/lock" || true
    unset FSDP_QCOMM_CORES_DIR
    cores_dir=""
    cores_made=""
}

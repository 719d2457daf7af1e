#!/bin/sh
# The kernel's core_pattern pipe handler while scripts/native_cores.sh collects cores:
#   |/path/to/core_route.sh %P %p %E
# It writes the core arriving on stdin to the folder named by the crashing process's own
# FSDP_QCOMM_CORES_DIR (its environment at exec, which cores_start exports to everything the
# loop or CI starts), as core.<pid>.<executable with '/' as '!'>. So two loops that collect
# cores at once each get their own; a process outside them (no such variable) leaves no core.
# The kernel runs this as root with an empty environment: absolute paths only.
pid=$1
vpid=$2
exe=$3
dir=$(/usr/bin/tr '\0' '\n' < "/proc/$pid/environ" 2> /dev/null \
    | /bin/sed -n 's/^FSDP_QCOMM_CORES_DIR=//p' | /usr/bin/head -n 1)
[ -n "$dir" ] && [ -d "$dir" ] || exit 0
# A piped core carries every hole (unmapped or never-touched pages) as zeros: write it sparse,
# and stop at 16 GiB (the notes with every thread's registers come first) so that no core can
# fill the disk under a test run.
/usr/bin/head -c 17179869184 | /bin/cp --sparse=always /dev/stdin "$dir/core.$vpid.$exe"

#!/usr/bin/env bash
# Step time of this checkout against another commit's code on the emulated 2-node cluster, in
# alternating runs on the same machine (so a drift of the machine's load hits both alike).
#
#   sudo bash benchmarks/speed_vs_commit.sh COMMIT OUT [RUNS] [RATE] [SCHEMES] [THEIR_SCHEMES]
#
# COMMIT is checked out as a git worktree under /tmp (kept for the next call); each run writes
# OUT/main_run<k>/ (benchmarks/cluster_speed.py, its own provenance) and OUT/<COMMIT>_run<k>/
# (the other code's cluster_speed.py, recorded through benchmarks/_provenance.py). Defaults:
# 2 runs each, 100mbit, HSDP sdp4bit as shipped and with the node's hops quantized here, HSDP
# sdp4bit there. Needs root (network namespaces) and an idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
commit=${1:?usage: speed_vs_commit.sh COMMIT OUT [RUNS] [RATE] [SCHEMES] [THEIR_SCHEMES]}
out=${2:?usage: speed_vs_commit.sh COMMIT OUT [RUNS] [RATE] [SCHEMES] [THEIR_SCHEMES]}
runs=${3:-2}
rate=${4:-100mbit}
ours=${5:-hsdp_sdp4bit,hsdp_sdp4bit_intra}
theirs=${6:-hsdp_sdp4bit}
short=$(git rev-parse --short "$commit")
tree=/tmp/fsdp_qcomm_at_$short
[[ -d $tree ]] || git worktree add --detach "$tree" "$commit" >/dev/null
here=$(pwd)
for k in $(seq 1 "$runs"); do
  OMP_NUM_THREADS=1 python benchmarks/cluster_speed.py --rates "$rate" --schemes "$ours" \
      --steps 8 --out "$out/main_run$k"
  OMP_NUM_THREADS=1 python benchmarks/_provenance.py --out "$out/${short}_run$k" -- bash -c \
      "cd $tree && OMP_NUM_THREADS=1 python3 benchmarks/cluster_speed.py --rates $rate --schemes $theirs --steps 8 --out $here/$out/${short}_run$k"
done

set -u
for mode in local local_atexit_gc; do
  n=0
  for i in $(seq 12); do
    OMP_NUM_THREADS=1 python3 -m torch.distributed.run --standalone --nproc-per-node 4 tools/gloo_exit/reproducer.py $mode > /tmp/ge/r.txt 2>&1 || { n=$((n+1)); grep -q "terminate called without an active exception" /tmp/ge/r.txt && echo "  $mode run $i: terminate called without an active exception (SIGABRT)"; }
  done
  echo "reproducer $mode: $n of 12 launches aborted"
done
for tree in /tmp/ge/before /work/main; do
  n=0; a=0
  for i in $(seq 12); do
    (cd $tree && OMP_NUM_THREADS=1 python3 -m fsdp_qcomm.titan.main --steps 10 --out /tmp/ge/dbg) > /tmp/ge/t.txt 2>&1 || { n=$((n+1)); echo "  $(git -C $tree rev-parse --short HEAD) run $i: exit status non-zero"; }
    grep -q "terminate called without an active exception" /tmp/ge/t.txt && a=$((a+1))
  done
  echo "debug job (10 steps) at $(git -C $tree rev-parse --short HEAD): $n of 12 runs failed, $a of 12 logged the gloo abort"
done

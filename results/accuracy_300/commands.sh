# char GPT (0.82M params, tinyshakespeare), 300 steps, 4 gloo ranks as 2 nodes x 2; the whole
# held-out split (1,742 windows of 64) evaluated at steps 250, 275, 300; score = the mean of
# those three (--tail 3). Invocations in order (provenance.json: commit, dirty flag, load):
# 1. stopped (kill of its process group) once the first three runs (seed 1234) were stored, to
#    leave qW out of this store's first pass:
OMP_NUM_THREADS=1 PYTHONPATH=. python3 benchmarks/frontier.py --rows "baseline,SDP4Bit,W2-learned G3,qW" --steps 300 --eval-every 25 --eval-full --full-last 3 --tail 3 --seeds 3 --out results/accuracy_300
# 2. seeds 1235-1236 of the three rows:
OMP_NUM_THREADS=1 PYTHONPATH=. python3 benchmarks/frontier.py --rows "baseline,SDP4Bit,W2-learned G3" --steps 300 --eval-every 25 --eval-full --full-last 3 --tail 3 --seeds 3 --out results/accuracy_300
# 3. two more seeds (1237-1238) for the rows that decide the claims:
OMP_NUM_THREADS=1 PYTHONPATH=. python3 benchmarks/frontier.py --rows "baseline,SDP4Bit,W2-learned G3" --steps 300 --eval-every 25 --eval-full --full-last 3 --tail 3 --seed 1237 --seeds 2 --out results/accuracy_300
# 4. qW (direct 4-bit weights), seeds 1234-1236: stopped (its processes killed) at step ~100 of
#    its first run, for want of time in the session (load 23 made it 2.5 s per step); no qW
#    run is stored, and its provenance.json entry has no end:
OMP_NUM_THREADS=1 PYTHONPATH=. python3 benchmarks/frontier.py --rows "qW" --steps 300 --eval-every 25 --eval-full --full-last 3 --tail 3 --seeds 3 --out results/accuracy_300
# table.md / results.json / frontier.png were written by invocation 3 (they cover
# every run in runs/). W2-learned G3 is the lowbit preset (benchmarks/frontier.py LOWBIT_ROW).

# Timing probe of the larger (BPE) workload before choosing its size: 20 steps of the baseline,
# 4 gloo ranks as 2 nodes x 2, while results/accuracy_300's sweep ran (load in provenance.json).
OMP_NUM_THREADS=1 PYTHONPATH=. python3 benchmarks/accuracy.py --bpe 8192 --dim 256 --layers 4 --heads 4 --seq 128 --batch 8 --steps 20 --eval-every 20 --eval-batches 2 --schemes baseline --out results/accuracy_bpe_probe

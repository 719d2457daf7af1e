# Where the seed-to-seed spread of the paired gap comes from (docs/accuracy_method.md).
# 1. quantizer randomness only: initial weights and batches held at seed 1234, quantizer seeds
#    1234-1236; seed 1234's runs and the baseline are the same computations as in
#    results/accuracy_300 and are copied from there (--reuse; the baseline does not depend on a
#    quantizer seed and is stored once per seed):
OMP_NUM_THREADS=1 PYTHONPATH=. python3 benchmarks/frontier.py --rows "baseline,SDP4Bit,W2-learned G3" --steps 300 --eval-every 25 --eval-full --full-last 3 --tail 3 --fix init,data --seed 1234 --seeds 3 --reuse results/accuracy_300 --out results/accuracy_variance/quant_only
# 2. the report over the stores (trains nothing):
python3 benchmarks/accuracy_variance.py --store all=results/accuracy_300 --store quant_only=results/accuracy_variance/quant_only --store old_1000=results/accuracy_1000_seeds --out results/accuracy_variance
# 3. quant_only's table rebuilt from its stored runs (trains nothing), after accuracy.py's report
#    learned to say that verdicts under --fix hold for one realization only:
OMP_NUM_THREADS=1 PYTHONPATH=. python3 benchmarks/frontier.py --rows "baseline,SDP4Bit,W2-learned G3" --steps 300 --eval-every 25 --eval-full --full-last 3 --tail 3 --fix init,data --seed 1234 --seeds 3 --out results/accuracy_variance/quant_only --report-only

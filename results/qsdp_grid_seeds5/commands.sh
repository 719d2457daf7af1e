# QSDP grid, learned vs uniform levels with 5 seeds on the cells whose ordering docs/qsdp.md
# discusses (4-bit weights and gradients, 2-bit weights) and the unquantized reference; the grid's
# own small setting (GPT d=64, 2 layers, 2 gloo ranks, 60 steps):
OMP_NUM_THREADS=1 PYTHONPATH=. python3 benchmarks/qsdp_grid.py --d 64 --steps 60 --refresh 20 --cells W32G32,W4G4,W2G32 --seeds 5 --out results/qsdp_grid_seeds5

"""torch's gloo backend aborts a process at exit ("terminate called without an active
exception", SIGABRT) when an FSDP2 module is still alive at destroy_process_group (or when no
group is destroyed at all); dropping the module first avoids it. Torch only:

    for i in $(seq 12); do OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone \\
        --nproc-per-node 4 tools/gloo_exit/reproducer.py MODE || echo aborted; done

MODE: ``alive`` (the module alive at destroy_process_group), ``barrier`` (a barrier first),
``dropped`` (the module deleted and collected first: fsdp-qcomm's workaround,
examples/train_fsdp.py), ``no_destroy`` (a plain all-reduce, no destroy_process_group, no FSDP),
``local`` (the module local to a function that destroys the group and returns, as stock
torchtitan's ``main`` does), ``local_atexit_gc`` (the same with ``gc.collect`` registered at
exit: fsdp-qcomm's workaround for torchtitan, ``titan_common/cpu.py``).
"""

import atexit
import gc
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

mode = sys.argv[1]
if mode in ("local", "local_atexit_gc"):
    if mode == "local_atexit_gc":
        atexit.register(gc.collect)

    def main():
        dist.init_process_group("gloo")
        model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        model(torch.randn(8, 64)).sum().backward()
        dist.destroy_process_group()

    main()
    sys.exit(0)
dist.init_process_group("gloo")
if mode == "no_destroy":
    t = torch.ones(4)
    dist.all_reduce(t)
    sys.exit(0)
model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
for layer in model:
    fully_shard(layer)
fully_shard(model)
model(torch.randn(8, 64)).sum().backward()
if mode == "barrier":
    dist.barrier()
if mode == "dropped":
    del model
    gc.collect()
dist.destroy_process_group()

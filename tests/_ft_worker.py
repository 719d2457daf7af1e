"""One rank of one replica group in the torchft tests (``tests/test_diloco_ft.py``).

    python tests/_ft_worker.py --replica I --group-rank G --group-size S --lighthouse ADDR
        --port PORT --out FILE [--stop-file F] [--stop-step N] [--die-at-sync K] ...

Inside the replica group: a gloo process group over its ``S`` ranks (group rank 0 hosts the
TCPStore, also the Manager's), a small MLP (FSDP2 over the group when ``S > 1``). Across
groups: a torchft ``Manager`` with fsdp-qcomm's ``diloco.ft.ProcessGroupGloo`` and ``DiLoCo``
(``replicas=manager``). Each merge appends a JSON line to ``--out``: the committed manager step,
the participants, whether this replica healed, and digests of the start-of-round weights and
of the parameters. ``--die-at-sync K``: exit inside the K-th all-reduce this process launches
(on the background thread, before it sends: the peers see the connection close mid-sync).
Stops after the merge that reaches manager step ``--stop-step`` or the number in
``--stop-file`` once that file exists.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from datetime import timedelta

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _digest(tensors) -> str:
    h = hashlib.sha1()
    for t in tensors:
        h.update(t.detach().contiguous().view(-1).numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replica", type=int, required=True)
    ap.add_argument("--group-rank", type=int, default=0)
    ap.add_argument("--group-size", type=int, default=1)
    ap.add_argument("--lighthouse", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--stop-step", type=int, default=6)
    ap.add_argument("--stop-file", default="")
    ap.add_argument("--go-file", default="", help="wait for it after building the Manager")
    ap.add_argument("--die-at-sync", type=int, default=0)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--sync-every", type=int, default=4)
    ap.add_argument("--fragments", type=int, default=2)
    ap.add_argument("--delay", type=int, default=1)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--error-feedback", type=int, default=1)
    ap.add_argument("--pg-timeout", type=float, default=20.0)
    a = ap.parse_args()

    def log(**kw):
        with open(a.out, "a") as f:
            f.write(json.dumps({"t_wall": time.time(), **kw}) + "\n")

    log(event="imported_python")
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torchft import Manager

    from fsdp_qcomm.diloco import DiLoCo, DiLoCoConfig
    from fsdp_qcomm.diloco.ft import ProcessGroupGloo

    torch.set_num_threads(1)
    log(event="imported")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}",
                            rank=a.group_rank, world_size=a.group_size,
                            timeout=timedelta(seconds=60))
    torch.manual_seed(0)  # every replica starts from the same weights (torchft heals anyway)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    if a.group_size > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (a.group_size,), mesh_dim_names=("shard",))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=a.pg_timeout)),
        load_state_dict=None, state_dict=None, min_replica_size=1, use_async_quorum=False,
        timeout=timedelta(seconds=30), quorum_timeout=timedelta(seconds=120),
        connect_timeout=timedelta(seconds=30), rank=a.group_rank, world_size=a.group_size,
        store_addr="127.0.0.1", store_port=a.port, lighthouse_addr=a.lighthouse,
        replica_id=f"replica_{a.replica}",
    )
    log(event="manager_ready")
    while a.go_file and not os.path.exists(a.go_file):
        time.sleep(0.05)
    cfg = DiLoCoConfig(sync_every=a.sync_every, fragments=a.fragments, delay=a.delay,
                       bits=a.bits, error_feedback=bool(a.error_feedback))
    launches = {"n": 0}
    diloco = DiLoCo(model, cfg, replicas=manager)

    def on_start(t_launch: int) -> None:  # the background thread, before each all-reduce
        launches["n"] += 1
        if a.die_at_sync and launches["n"] == a.die_at_sync:
            log(event="dying_in_allreduce", t=t_launch)
            os._exit(17)

    diloco._overlap.on_start = on_start
    log(event="started", t=diloco.inner_steps, step=manager.current_step(),
        healed=diloco.replicas.healed)
    w_true = torch.randn(16, 16, generator=torch.Generator().manual_seed(7))
    last = (diloco.outer_steps, diloco.failed_commits)
    while True:
        t = diloco.inner_steps
        g = torch.Generator().manual_seed(100000 * a.replica + 1000 * a.group_rank + t)
        x = torch.randn(8, 16, generator=g)
        loss = ((model(x) - x @ w_true) ** 2).mean()
        loss.backward()
        inner.step()
        inner.zero_grad()
        merging = diloco._pending.fragment if diloco._pending is not None else None
        diloco.step()
        if a.sleep:
            time.sleep(a.sleep)
        now = (diloco.outer_steps, diloco.failed_commits)
        if now == last:
            continue
        committed = now[0] > last[0]
        last = now
        frag = diloco.fragments[merging]
        params = [r.local() for r in frag.refs]
        log(event="commit" if committed else "failed", t=diloco.inner_steps,
            step=manager.current_step(), n=diloco.replicas.size(), fragment=merging,
            quorum=manager._quorum_id, loss=loss.item(), weight=diloco.last_sync["weight"],
            total_weight=diloco.last_sync["total_weight"],
            globals=_digest([f.global_ for f in diloco.fragments]),
            params=_digest(params), params_are_global=_digest([frag.global_]) == _digest(
                [torch.cat([p.reshape(-1).float() for p in params])]))
        stop = a.stop_step
        if a.stop_file and os.path.exists(a.stop_file):
            stop = int(open(a.stop_file).read() or stop)
        if committed and manager.current_step() >= stop:
            break
    diloco.close()
    log(event="done", step=manager.current_step(), stats=diloco.stats()["summary"])
    manager.shutdown(wait=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

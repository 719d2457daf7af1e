"""What the issue 30 reproducers (``gloo_stress.py``, ``gloo_status_race.py``) share: a gloo
group with a chosen number of worker threads, and the one JSON line a run leaves. Imports torch
only: the ranks of those scripts must load nothing of fsdp_qcomm."""

from __future__ import annotations

import json
import signal
import socket
from pathlib import Path

import torch
import torch.distributed as dist

#: ProcessGroupGloo's worker threads when init_process_group builds it (2 per device)
GLOO_THREADS = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world: int, port: int, threads: int = GLOO_THREADS) -> None:
    """The default group on gloo with ``threads`` worker threads (checked)."""
    backend = "gloo"
    if threads != GLOO_THREADS:
        # init_process_group passes gloo no options: the same class under another name, ours
        def gloo(store, group_rank: int, group_size: int, timeout):
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [dist.ProcessGroupGloo.create_default_device()]
            opts._threads = threads
            return dist.ProcessGroupGloo(store, group_rank, group_size, opts)

        backend = f"gloo_{threads}_threads"
        dist.Backend.register_backend(backend, gloo, devices=["cpu"])
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    got = dist.group.WORLD._get_backend(torch.device("cpu")).options._threads
    if got != threads:
        raise RuntimeError(f"gloo runs {got} worker threads, not {threads}")


def report(procs: list, queue, out: Path | None, name: str, head: dict, tail: dict) -> int:
    """Join the ranks and print (and append to ``out/name``) the run's line: ``head``, each
    rank's exit code and signal, ``tail``, and rank 0's counts when every rank exited 0.
    Returns the script's exit status."""
    for p in procs:
        p.join()
    codes = [p.exitcode for p in procs]
    ok = all(c == 0 for c in codes)
    line = {**head, "exitcodes": codes,
            "signals": [signal.Signals(-c).name if c is not None and c < 0 else None
                        for c in codes],
            **tail, **(queue.get() if ok and not queue.empty() else {})}
    print(json.dumps(line), flush=True)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        with open(out / name, "a") as f:
            f.write(json.dumps(line) + "\n")
    return 0 if ok else 1

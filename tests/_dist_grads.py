"""Run a function on N gloo processes and bring back every rank's return value.

``run(fn, world, *args, env={...})`` starts ``world`` processes (free TCP port,
``OMP_NUM_THREADS=1``, one torch thread each), calls ``fn(rank, world, *args)`` after
``init_process_group("gloo")`` and returns the list of results by rank. Processes come from a
forkserver that imported torch once: a fresh interpreter per rank spends seconds importing torch
on a loaded 2-core machine, a fork from the server milliseconds, and the server itself is a clean
single-threaded process (unlike the pytest process, which is unsafe to fork). A rank that raises
makes ``run`` raise with that rank's traceback; a rank that hangs makes it raise after ``timeout``
seconds. Processes are started here and stopped here, by handle, never left running.
``fn`` must be a module-level function (it is pickled by reference).
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback
from typing import Any, Callable, Optional

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank, world, port, env, args, results) -> None:
    import torch
    import torch.distributed as dist

    try:
        os.environ.update(env)
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
        # Plain pickle bytes: torch's queue would pass tensors as shared memory owned by a
        # process that is about to exit.
        payload = (rank, True, pickle.dumps(fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - surfaced to the parent with the traceback
        # Report before tearing down the process group: the teardown makes the other ranks
        # fail too, and their errors must not arrive first.
        payload = (rank, False, traceback.format_exc())
    results.put(payload)
    if dist.is_initialized():
        dist.destroy_process_group()


def _failure(fn, world: int, rank: int, tb: str, results, pending: int, grace: float = 3.0) -> str:
    """The first failing rank's traceback, then any other rank's that arrives within ``grace``
    seconds (usually consequences: a peer closed the connection)."""
    parts = [f"{fn.__name__} failed on rank {rank} of {world}:\n{tb}"]
    end = time.monotonic() + grace
    while pending > 0 and time.monotonic() < end:
        try:
            r, ok, value = results.get(timeout=max(end - time.monotonic(), 0.01))
        except queue.Empty:
            break
        pending -= 1
        if not ok:
            parts.append(f"then rank {r} failed:\n{value}")
    return "\n".join(parts)


def run(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    env: Optional[dict[str, str]] = None,
    timeout: float = 300.0,
) -> list[Any]:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])  # effective when it first starts
    results = ctx.Queue()
    child_env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **(env or {})}
    port = _free_port()
    procs = [
        ctx.Process(target=_child, args=(fn, r, world, port, child_env, args, results), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"{fn.__name__} on {world} ranks: ranks {sorted(set(range(world)) - set(got))} "
                    f"did not finish within {timeout:.0f} s"
                )
            try:
                rank, ok, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and r not in got]
                if dead:
                    raise RuntimeError(
                        f"{fn.__name__}: rank(s) {dead} exited with code "
                        f"{[procs[r].exitcode for r in dead]} without a result"
                    ) from None
                continue
            if not ok:
                raise RuntimeError(_failure(fn, world, rank, value, results, world - len(got) - 1))
            got[rank] = pickle.loads(value)
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return [got[r] for r in range(world)]

"""ProcessGroupGloo's double free, provoked directly: its two worker threads completing
collectives at the same moment (torch's bug; docs/known_issues.md, results/gloo_status_race).

After each collective a gloo worker thread sets ``pgStatus_->lastCompletedWorkName`` in
``ProcessGroupGloo::runLoop`` with no lock held (torch 2.13 and 2.15): a move-assignment that
deletes the string's old heap buffer. ``all_gather_into_tensor``'s name, "ALLGATHER_COALESCED",
is too long for the string's inline buffer, so each update frees a 32-byte chunk, and two
workers updating at once free the same one twice. Here each rank keeps ``--inflight`` tiny
functional all-gathers (the ones DTensor runs) in flight, so the two workers finish collectives
back to back all the time; ``--op base`` runs ``dist.all_gather_into_tensor`` instead, whose
name (``_ALLGATHER_BASE``) fits the inline buffer: nothing to free twice, the control.
``--gloo-threads 1`` runs the same collectives on one worker, which leaves one writer.

    python tools/gloo_race/reproducer.py --seconds 120 [--gloo-threads 1] [--op base] [--out DIR]

glibc's double-free check misses a second free from another thread, so under plain glibc the
heap is corrupted silently and a run crashes (SIGSEGV, SIGABRT) or hangs only now and then. The
recorded runs caught every second free in seconds under an ``LD_PRELOAD`` allocator shim that
holds freed blocks back and prints both freeing stacks; it is in git history
(``git show 83de356:scripts/free_quarantine.c``, its header says how to build and run it).

Needs torch only (nothing of fsdp_qcomm is imported). One JSON line per run is printed (and
appended to ``<out>/gloo_status_race.jsonl`` with ``--out``): rounds, collectives, each rank's
exit code or signal, and the seconds from launch to the end (to the first failure, when a rank
dies). Exit status 0 when both ranks finish, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

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


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    init_gloo(rank, world, port, args.gloo_threads)
    functional = torch.ops._c10d_functional
    group = dist.group.WORLD.group_name
    ins = [torch.full((1,), float(rank)) for _ in range(args.inflight)]
    outs = [torch.empty(world) for _ in range(args.inflight)]
    t0, rounds, stop = time.monotonic(), 0, torch.zeros(1)
    while True:
        if args.op == "coalesced":  # what DTensor and the functional collectives run
            outs = [functional.all_gather_into_tensor(i, world, group) for i in ins]
            outs = [functional.wait_tensor(o) for o in outs]
        else:
            works = [dist.all_gather_into_tensor(o, i, async_op=True) for o, i in zip(outs, ins)]
            for w in works:
                w.wait()
        rounds += 1
        if rounds % 200 == 0:  # every rank stops after the same round
            stop.fill_(float(rank == 0 and time.monotonic() - t0 >= args.seconds))
            dist.all_reduce(stop)
            if stop.item() > 0:
                break
    if any(o.tolist() != [float(r) for r in range(world)] for o in outs):
        raise AssertionError("an all-gather came back wrong")
    if rank == 0:
        queue.put({"rounds": rounds, "collectives_per_rank": rounds * args.inflight,
                   "seconds": round(time.monotonic() - t0, 1)})
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="how long to loop")
    ap.add_argument("--inflight", type=int, default=8,
                    help="asynchronous all-gathers each rank keeps in flight per round")
    ap.add_argument("--op", choices=("coalesced", "base"), default="coalesced",
                    help="coalesced: the functional all-gather (gloo's ALLGATHER_COALESCED, a "
                    "19-character name: a heap buffer); base: all_gather_into_tensor "
                    "(_ALLGATHER_BASE, 15 characters: the string's inline buffer, nothing "
                    "freed; the control)")
    ap.add_argument("--gloo-threads", type=int, default=GLOO_THREADS,
                    help="ProcessGroupGloo's worker threads (torch's default: 2)")
    ap.add_argument("--out", type=Path, help="append the run's line to OUT/gloo_status_race.jsonl")
    args = ap.parse_args(argv)
    if args.seconds <= 0 or args.inflight < 1 or args.gloo_threads < 1:
        ap.error("needs --seconds > 0, --inflight >= 1 and --gloo-threads >= 1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    start, t_start = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), time.monotonic()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, args, queue)) for r in range(2)]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        for p in procs:
            p.start()
        while any(p.is_alive() for p in procs):
            time.sleep(0.5)
            if any(p.exitcode not in (None, 0) for p in procs):
                time.sleep(5)  # the peer fails in its next collective, or is ended here
                for p in procs:
                    if p.is_alive():
                        p.kill()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return report(procs, queue, args.out, "gloo_status_race.jsonl",
                  {"start": start, "argv": sys.argv[1:] if argv is None else argv,
                   "torch": torch.__version__, "op": args.op, "gloo_threads": args.gloo_threads},
                  {"preload": os.environ.get("LD_PRELOAD", ""),
                   # start-up and the run: to the end (to the first report when a rank aborts)
                   "wall_s": round(time.monotonic() - t_start, 1)})


if __name__ == "__main__":
    sys.exit(main())

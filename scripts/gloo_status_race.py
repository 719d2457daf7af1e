"""Issue 30's double free, provoked directly: ProcessGroupGloo's two worker threads completing
collectives at the same moment.

After each collective a gloo worker thread sets ``pgStatus_->lastCompletedWorkName`` in
``ProcessGroupGloo::runLoop`` with no lock held (torch 2.13 and 2.15): a move-assignment that
deletes the string's old heap buffer. ``all_gather_into_tensor``'s name, "ALLGATHER_COALESCED",
is too long for the string's inline buffer, so each update frees a 32-byte chunk, and two
workers updating at once free the same one twice (``results/gloo_stress_pair/NOTES.md``). Here
each rank keeps ``--inflight`` tiny functional all-gathers (the ones DTensor runs) in flight, so
the two workers finish collectives back to back all the time; ``--op base`` runs
``dist.all_gather_into_tensor`` instead, whose name (``_ALLGATHER_BASE``) fits the inline
buffer: nothing to free twice, the control. Under ``scripts/free_quarantine.c`` a second free is
reported with both stacks at once:

    gcc -O2 -shared -fPIC -o /tmp/libfree_quarantine.so scripts/free_quarantine.c
    LD_PRELOAD=/tmp/libfree_quarantine.so QUARANTINE_DIR=/tmp/fq \\
        python scripts/gloo_status_race.py --seconds 120 --out /tmp/fq

``--gloo-threads 1`` runs the same collectives on one worker, which leaves one writer. Nothing of
this package is imported. One line per run goes to ``<out>/gloo_status_race.jsonl``: rounds,
collectives, each rank's exit code or signal (SIGABRT: the shim's report, or glibc's), and the
seconds from launch to the end (to the first report, when a rank aborts).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _gloo_run import GLOO_THREADS, free_port, init_gloo, report


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

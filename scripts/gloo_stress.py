"""Issue 30's crash path in plain torch: FSDP2 training and ``DTensor.full_tensor`` on gloo.

The one native crash seen in 977 contended runs of ``tests/test_weight_writes.py`` died in
glibc's ``malloc`` on gloo's work thread, inside the all-gather of ``DTensor.full_tensor``: a
corrupted free list. This script repeats that path for as long as asked, in processes that
never import fsdp_qcomm (no hooks, no C codec, no ctypes): a crash or hang here is torch's or
gloo's, with a reproducer that needs nothing of ours. One such hang showed the cause
(``results/gloo_stress_pair/NOTES.md``): ProcessGroupGloo's two workers free a shared status
string's buffer twice, which ``scripts/gloo_status_race.py`` provokes in seconds.

Each rank, in a loop: builds the test's ``TinyLM`` (tests/_models.py) sharded with
``fully_shard`` per block, trains it ``--steps`` AdamW steps, gathers every
parameter with ``full_tensor()``, runs an evaluation forward, and drops the model (the test
builds 64 models per process). Every iteration also all-gathers ``--extra`` tensors of random
small sizes through the functional collectives, to raise the rate of gloo's small all-gathers.

    python scripts/gloo_stress.py --seconds 1800 --out results/gloo_stress

One line per run is appended to ``<out>/gloo_stress.jsonl``: iterations, gathers, seconds, and
each rank's exit code (negative: the signal that killed it). Exits 0 when every rank finished,
1 otherwise. Ranks run with faulthandler on; under ``scripts/native_cores.sh`` a crash leaves
a core for gdb. A run whose ranks finish no iteration for ``--stall-seconds`` has stalled (the
other form of the bug: a gloo worker spinning in a tcp ``UnboundBuffer`` destructor,
``results/gloo_stress_pair``): each live rank's native state is written beside the log
(gdb), the line says whether a rank was in that frame, and the ranks are killed.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# scripts/_gloo_run.py (torch only), and the test's own model and batches (tests/_models.py
# imports torch only, nothing of ours): the crashed test's exact shapes, uneven shards with
# padding, and tied embedding.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _gloo_run import GLOO_THREADS, free_port, init_gloo, report  # noqa: E402
from _models import TinyLM, batch, lm_loss, shard  # noqa: E402


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, queue, progress) -> None:
    faulthandler.enable(all_threads=True)
    from torch.distributed._functional_collectives import all_gather_single

    init_gloo(rank, world, port, args.gloo_threads)
    group = dist.group.WORLD
    rng = torch.Generator().manual_seed(1234)  # the same on every rank: same extra sizes
    t0, it, gathers, stop = time.monotonic(), 0, 0, torch.zeros(1)
    while True:
        torch.manual_seed(it)
        model = TinyLM()
        shard(model, True)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-2, foreach=True)
        for step in range(args.steps):
            lm_loss(model, batch(step, rank)).backward()
            opt.step()
            opt.zero_grad()
        full = [p.full_tensor().detach().clone() for p in model.parameters()]
        gathers += len(full)
        with torch.no_grad():
            lm_loss(model, batch(50, rank))
        for _ in range(args.extra):
            n = int(torch.randint(1, 4097, (1,), generator=rng))
            out = all_gather_single(torch.full((n,), float(rank)), 0, group)
            if out.numel() != world * n or out[n * (world - 1)].item() != world - 1:
                raise AssertionError(f"iteration {it}: a gather of {n} elements came back wrong")
            gathers += 1
        del model, opt, full
        it += 1
        progress[rank] = it
        if rank == args.stall_rank:  # checks the report of a run that stalls
            time.sleep(1e6)
        if rank == args.crash_rank:  # checks the report of a rank that dies in native code
            os.kill(os.getpid(), signal.SIGSEGV)
        stop.fill_(float(rank == 0 and time.monotonic() - t0 >= args.seconds))
        dist.all_reduce(stop)  # every rank stops after the same iteration
        if stop.item() > 0:
            break
        if rank == 0 and args.report and it % args.report == 0:
            print(f"iteration {it}: {gathers} gathers in {time.monotonic() - t0:.0f} s",
                  flush=True)
    if rank == 0:
        queue.put({"iterations": it, "gathers_per_rank": gathers,
                   "seconds": round(time.monotonic() - t0, 1),
                   "fsdp_qcomm_loaded": any(m.split(".")[0] == "fsdp_qcomm" for m in sys.modules)})
    dist.destroy_process_group()


#: issue 30's gloo hang: a gloo worker spins in a tcp UnboundBuffer's destructor, whose
#: reference-count block the other gloo worker freed (results/gloo_stress_pair/NOTES.md)
GLOO_HANG_FRAME = "gloo::transport::tcp::UnboundBuffer::~UnboundBuffer"


#: before the first iteration a run has stalled only after this long at least (spawned ranks
#: import torch and build their first model: ~12 s on an idle 2-core machine)
_START_UP_S = 120.0


def _gdb(pid: int, *commands: str) -> str:
    gdb = shutil.which("gdb")
    if gdb is None:
        return "(gdb is not installed: no native stacks)\n"
    cmd = [gdb, "-p", str(pid), "-batch", "-nx"]
    for c in commands:
        cmd += ["-ex", c]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"(gdb failed: {e})\n"


def _stall_report(pid: int) -> tuple[str, bool]:
    """A stalled rank's native state: every thread's stack; for a thread in GLOO_HANG_FRAME
    also the destructor frame's registers, the words around the block its frame pointer names
    (this build keeps the control block there) and glibc's tcache key, to read as in
    results/gloo_stress_pair/hang_B1."""
    stacks = _gdb(pid, "thread apply all bt 30")
    thread = None
    for line in stacks.splitlines():
        if line.startswith("Thread "):
            thread = line.split()[1]
        elif GLOO_HANG_FRAME in line and thread is not None:
            frame = line.split()[0].lstrip("#")
            words = _gdb(pid, f"thread {thread}", f"frame {frame}", "info registers",
                         "x/6gx $rbp-16", "x/6gx $rbx", "p/x tcache_key")
            return stacks + f"\n=== thread {thread}, frame {frame} ===\n" + words, True
    return stacks, False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="how long to loop")
    ap.add_argument("--world", type=int, default=2, help="ranks (gloo, this host)")
    ap.add_argument("--steps", type=int, default=2, help="training steps per model")
    ap.add_argument("--extra", type=int, default=16,
                    help="extra functional all-gathers of random small sizes per iteration")
    ap.add_argument("--report", type=int, default=100, help="print every this many iterations")
    ap.add_argument("--crash-rank", type=int, default=-1,
                    help="this rank kills itself with SIGSEGV after its first iteration (a "
                    "check of how a crash is reported)")
    ap.add_argument("--stall-seconds", type=float, default=180.0,
                    help="a run whose ranks finish no iteration for this long (before the first "
                    f"one: {_START_UP_S:.0f} s at least) has stalled: each rank's native state "
                    "goes to OUT/stall_<start>_rank<r>.txt (gdb), then the ranks are killed")
    ap.add_argument("--stall-rank", type=int, default=-1,
                    help="this rank sleeps after its first iteration (a check of how a stall is "
                    "reported)")
    ap.add_argument("--gloo-threads", type=int, default=GLOO_THREADS,
                    help="ProcessGroupGloo's worker threads (torch's default: 2); 1 runs every "
                    "collective on one thread, the A/B of whether issue 30's block is freed by "
                    "a second worker")
    ap.add_argument("--out", type=Path, help="append this run's line to OUT/gloo_stress.jsonl")
    args = ap.parse_args(argv)
    if args.world < 2 or args.seconds <= 0 or args.steps < 1 or args.extra < 0:
        ap.error("needs --world >= 2, --seconds > 0, --steps >= 1 and --extra >= 0")
    for name in ("crash_rank", "stall_rank"):
        if getattr(args, name) >= args.world:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)} is not a rank of "
                     f"--world {args.world}")
    if args.stall_seconds <= 0 or args.gloo_threads < 1:
        ap.error("needs --stall-seconds > 0 and --gloo-threads >= 1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    start = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    port = free_port()
    progress = ctx.Array("q", args.world, lock=False)  # iterations each rank has finished
    procs = [ctx.Process(target=_rank, args=(r, args.world, port, args, queue, progress))
             for r in range(args.world)]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    killed, stall = [], {}
    try:
        for p in procs:
            p.start()
        seen, moved = list(progress), time.monotonic()
        while any(p.is_alive() for p in procs):  # a dead rank leaves the others blocked
            time.sleep(0.5)
            if any(p.exitcode not in (None, 0) for p in procs):
                time.sleep(5)  # let the others print what they were doing
                killed = [r for r, p in enumerate(procs) if p.is_alive()]
                for r in killed:
                    procs[r].kill()
            elif list(progress) != seen:
                seen, moved = list(progress), time.monotonic()
            elif time.monotonic() - moved > (args.stall_seconds if any(seen) else
                                             max(args.stall_seconds, _START_UP_S)):
                stall = {"stalled_after_s": round(time.monotonic() - moved, 1),
                         "stalled_at_iterations": seen, "gloo_hang": False}
                for r, p in enumerate(procs):
                    if not p.is_alive():
                        continue
                    text, hung = _stall_report(p.pid)
                    stall["gloo_hang"] |= hung
                    if args.out is not None:
                        args.out.mkdir(parents=True, exist_ok=True)
                        (args.out / f"stall_{start}_rank{r}.txt").write_text(text)
                    print(f"rank {r} stalled{' in ' + GLOO_HANG_FRAME if hung else ''}",
                          flush=True)
                killed = [r for r, p in enumerate(procs) if p.is_alive()]
                for r in killed:
                    procs[r].kill()
                break
    finally:  # stopped (SIGTERM, Ctrl-C): no rank outlives its launcher
        for p in procs:
            if p.is_alive():
                p.kill()
    return report(procs, queue, args.out, "gloo_stress.jsonl",
                  {"start": start, "argv": sys.argv[1:] if argv is None else argv,
                   "torch": torch.__version__, "gloo_threads": args.gloo_threads},
                  {"killed_after_a_rank_died": [] if stall else killed,
                   **({"killed_after_the_stall": killed, **stall} if stall else {})})


if __name__ == "__main__":
    sys.exit(main())

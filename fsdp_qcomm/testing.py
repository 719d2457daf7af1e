"""Multi-process CPU runs for tests and benchmarks: run a function on N gloo ranks (CPU
processes) and bring back results or tracebacks; compare tensors across ranks bit for bit.

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` processes with OMP_NUM_THREADS=1,
joins them in a gloo group (its store hosted by the caller, on a port it holds), calls
``fn(rank, world_size, *args)`` on each and returns the list of return values (rank order). If
any rank raises, the other ranks are killed and an AssertionError carries every failing rank's
traceback; if a rank hangs (a mismatched collective), the run is killed after ``timeout``
seconds and the error says which ranks never finished. ``fn`` must be a module-level function
(it is pickled by reference). Ranks listed in ``may_exit`` are allowed to die without a result
(their entry is None): for tests that kill a rank on purpose and check what its peers do;
``pg_timeout`` (default ``timeout``) is the process group's own timeout; ``env`` adds
environment variables (for example ``LOCAL_WORLD_SIZE``) in every rank. A rank that dies in
native code is reported with its signal, every thread's Python stack and its latest
``crash_note`` (which case of a loop it was running).

A native crash (a rank killed by SIGSEGV, SIGABRT or SIGBUS) is rerun ``native_crash_reruns``
times (default ``$FSDP_QCOMM_NATIVE_CRASH_RERUNS``, else 0) before it fails the caller; so is a
run that stalls in issue 30's gloo hang (``GLOO_HANG_FRAME``: a timed-out run is examined before
its ranks are killed, with gdb when there is one, and every stalled rank's native stacks join
the report). Each rerun is warned about and its full report appended to
``$FSDP_QCOMM_RERUN_LOG`` when set. CI sets both (``.ci/run`` prints the log): issue 30's rare
heap corruption inside gloo's worker thread (torch's: ProcessGroupGloo's two workers free a
shared status string's buffer twice; ``results/gloo_status_race``) must not fail CI by chance,
nor go unseen. A Python error, any other timeout or a crash that repeats is never hidden.

Processes come from a forkserver that imported torch once: a fresh interpreter per rank spends
seconds importing torch on a loaded 2-core machine, a fork from the server milliseconds, and the
server is a clean single-threaded process (unlike the pytest process, which is unsafe to fork).
Results travel as plain pickle bytes: torch's queue would pass tensors as shared memory owned by
a process that is about to exit.

``ComputeWeights(model)`` captures the weights each rank really computes with (the unsharded
parameters of every FSDP module, right after FSDP's pre-forward unshard) and ``check_same``
compares them across ranks. Comparing ``p.full_tensor()`` across ranks proves nothing: it is
an all-gather, equal on every rank by construction.
"""

from __future__ import annotations

import faulthandler
import hashlib
import os
import pickle
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.multiprocessing as mp
from torch.distributed import TCPStore

#: what the forkserver imports once, so that no rank imports it again. Per process, measured on a
#: 2-core machine: torch.distributed.fsdp with DTensor ~1.3 s, fsdp_qcomm ~1.4 s more, and
#: torch._dynamo ~2 s, which FSDP2 imports lazily at its first sharded parameter. They made a
#: group of ranks take ~5.5 s to reach its first FSDP module, now ~0.3 s. Nothing here starts a
#: thread or touches a device.
_PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp",
            "torch.distributed.checkpoint", "torch._dynamo", "fsdp_qcomm")
#: preloaded too when the calling process has them: a test module's ``import pytest`` costs each
#: rank ~0.3 s
_PRELOAD_IF_LOADED = ("pytest",)
#: environment variables that modules read as they are imported: Triton's interpreter switch is
#: read when each ``@triton.jit`` function is decorated, ``triton.language``'s own helpers (the
#: combine functions behind ``tl.max``) included, and the forkserver imported triton (through
#: ``torch._dynamo``) without it. Ranks given one of these start fresh (``spawn``) with it set.
_IMPORT_TIME_ENV = ("TRITON_INTERPRET",)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: this rank's crash log (None outside run_ranks): faulthandler writes into it, crash_note too
_crash_file = None


def crash_note(text: str) -> None:
    """Say what this rank is doing now, for the report run_ranks gives if the rank dies in native
    code: faulthandler's stacks show where, not which case of a loop (the arguments). Only the
    latest note is kept. Does nothing outside a rank of ``run_ranks``."""
    f = _crash_file
    if f is None:
        return
    f.seek(0)
    f.write(f"last crash_note: {text}\n")
    f.truncate()
    f.flush()  # faulthandler writes at the descriptor's offset: after the note


def _worker(
    fn: Callable, rank: int, world: int, port: int, args: tuple, kwargs: dict, q, timeout: float,
    env: dict, crash_log: str,
) -> None:
    global _crash_file
    # a crash in native code (a segfault) leaves no Python traceback to report: the parent
    # reads this file's stacks of every thread when the process dies without a result
    _crash_file = open(crash_log, "w")  # noqa: SIM115
    faulthandler.enable(file=_crash_file, all_threads=True)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank), OMP_NUM_THREADS="1", **env,
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        # the launcher hosts the store (on a port it holds, so no other process can take it
        # between choosing and binding); MASTER_PORT above names it for code that reads it
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False,
                              timeout=timedelta(seconds=timeout))
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout)
        )
        payload = (rank, True, pickle.dumps(fn(rank, world, *args, **kwargs)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        # Report before tearing down the process group: the teardown makes the other ranks
        # fail too, and their errors must not arrive first.
        payload = (rank, False, traceback.format_exc())
    q.put(payload)
    # The report is in the pipe before the teardown below makes the peers fail: the launcher
    # waits only briefly for more reports once one is an error, and theirs must not come alone.
    q.close()
    q.join_thread()
    if dist.is_initialized():
        if payload[1]:
            # A slower peer may still be inside its last collective: leaving first would reset
            # its connection. Wait for every rank; a peer that failed never arrives, and the
            # parent kills this process as soon as it has every report.
            try:
                dist.barrier()
            except Exception:  # noqa: BLE001 - a broken group here changes no result
                pass
        dist.destroy_process_group()


#: what a rank killed by one of these signals is: a native crash (a heap corrupted by a write
#: after free ends in glibc's abort or a segfault), the kind ``native_crash_reruns`` reruns
_NATIVE_CRASH_SIGNALS = (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS)


class NativeCrash(AssertionError):
    """A ``run_ranks`` failure in which a rank died of a native crash signal, or hung in issue
    30's gloo bug (:data:`GLOO_HANG_FRAME`)."""


#: issue 30's bug (torch's: ProcessGroupGloo's two worker threads free a shared status string's
#: buffer twice, ``results/gloo_status_race``) in its other form: the second free hits the block
#: after it was handed out again as a tcp ``UnboundBuffer``'s reference-count block;
#: the buffer's destructor (at the end of a collective) then writes into the freed block and,
#: when the bytes there are glibc's free-list key, spins forever waiting for a count that never
#: reaches zero, while the peer waits for its send (``results/gloo_stress_pair``). A timed-out
#: run with a rank in this frame is rerun like a native crash.
GLOO_HANG_FRAME = "gloo::transport::tcp::UnboundBuffer::~UnboundBuffer"


def _native_stacks(pid: int) -> str:
    """Every thread's native stack of a live process through gdb ('' without gdb or ptrace
    rights)."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return ""
    try:
        out = subprocess.run([gdb, "-p", str(pid), "-batch", "-nx", "-ex",
                              "thread apply all bt 12"], capture_output=True, text=True,
                             timeout=120).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return "\n".join(ln for ln in out.splitlines() if ln.startswith(("Thread ", "#")))


def _gloo_threads_cpu(pid: int) -> dict[str, int]:
    """CPU ticks used so far by each of a process's gloo worker threads (``pt_gloo_runloop``)."""
    ticks = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return ticks
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        if comm.startswith("pt_gloo_runloop"):
            fields = stat[stat.rindex(")") + 2:].split()
            ticks[tid] = int(fields[11]) + int(fields[12])  # utime + stime
    return ticks


def _hang_report(pids: dict[int, int]) -> tuple[str, bool]:
    """What the stalled ranks (rank -> pid) are doing: each one's native stacks (with gdb) or
    its gloo worker threads' CPU use over one second, and whether that is issue 30's gloo hang
    (the frame, or without gdb a gloo worker thread spinning while the run makes no progress:
    a gloo worker waiting for a peer sleeps)."""
    before = {r: _gloo_threads_cpu(pid) for r, pid in pids.items()}
    time.sleep(1.0)
    parts, gloo_hang = [], False
    for r, pid in sorted(pids.items()):
        now = _gloo_threads_cpu(pid)
        spin = {t: now[t] - before[r].get(t, now[t]) for t in now}
        stacks = _native_stacks(pid)
        if stacks:
            gloo_hang |= GLOO_HANG_FRAME in stacks
        else:
            gloo_hang |= any(d >= 10 for d in spin.values())  # >= 0.1 s of CPU in 1 s
        parts.append(f"--- rank {r} (pid {pid}) still running; gloo worker threads' CPU ticks "
                     f"in 1 s: {sorted(spin.values())} ---\n" +
                     (stacks or "(no native stacks: gdb is not installed or may not attach)"))
    return "\n".join(parts), gloo_hang


def _native_crash_reruns(value: Optional[int]) -> int:
    if value is None:
        raw = os.environ.get("FSDP_QCOMM_NATIVE_CRASH_RERUNS", "0")
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"FSDP_QCOMM_NATIVE_CRASH_RERUNS={raw!r}: expected a number of "
                             "reruns (0 turns them off)") from None
    if value < 0:
        raise ValueError(f"native_crash_reruns={value}: expected 0 or more")
    return value


def _crash_report(path: str, exitcode: Optional[int]) -> str:
    """A rank that exited without a result: its exit code (the signal, if one killed it) and the
    stacks faulthandler wrote, if any."""
    how = f"process exited with code {exitcode}"
    if exitcode is not None and exitcode < 0:
        try:
            how += f" ({signal.Signals(-exitcode).name})"
        except ValueError:
            pass
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        text = ""
    return f"{how} without a result" + (f"; faulthandler:\n{text}" if text else "")


def _died(procs: list, crash_logs: list[str], skip: set[int],
          signalled: set[int]) -> dict[int, str]:
    """The ranks not in ``skip`` that exited with a nonzero code (or a signal), with their
    crash reports; adds those a native crash signal killed to ``signalled``."""
    died = {r: p.exitcode for r, p in enumerate(procs)
            if r not in skip and not p.is_alive() and p.exitcode not in (0, None)}
    signalled.update(r for r, code in died.items() if -code in _NATIVE_CRASH_SIGNALS)
    return {r: _crash_report(crash_logs[r], code) for r, code in died.items()}


def run_ranks(
    fn: Callable, world_size: int, *args: Any, timeout: float = 240.0,
    may_exit: tuple[int, ...] = (), pg_timeout: Optional[float] = None,
    env: Optional[dict[str, str]] = None, native_crash_reruns: Optional[int] = None,
    **kwargs: Any
) -> list:
    reruns = _native_crash_reruns(native_crash_reruns)
    once = (fn, world_size, args, kwargs, timeout, may_exit, pg_timeout, env)
    for attempt in range(1, reruns + 1):
        try:
            return _run_once(*once)
        except NativeCrash as e:
            _note_rerun(fn, attempt, reruns, str(e))
    return _run_once(*once)  # the last try: its crash fails the caller


def _note_rerun(fn: Callable, attempt: int, reruns: int, report: str) -> None:
    import warnings

    what = ("hung in issue 30's gloo hang" if "issue 30's gloo hang" in report else
            "died of a native crash")
    head = (f"run_ranks({fn.__module__}.{fn.__qualname__}): a rank {what}; "
            f"rerun {attempt} of {reruns}")
    warnings.warn(f"{head}:\n{report[:4000]}", RuntimeWarning, stacklevel=3)
    log = os.environ.get("FSDP_QCOMM_RERUN_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"=== {time.strftime('%Y-%m-%dT%H:%M:%S')} {head}\n{report}\n")


def _run_once(
    fn: Callable, world_size: int, args: tuple, kwargs: dict, timeout: float,
    may_exit: tuple[int, ...], pg_timeout: Optional[float], env: Optional[dict[str, str]],
) -> list:
    fresh = {k: v for k, v in (env or {}).items() if k in _IMPORT_TIME_ENV}
    if fresh:
        ctx = mp.get_context("spawn")
    else:
        ctx = mp.get_context("forkserver")
        # effective when the server first starts
        ctx.set_forkserver_preload([*_PRELOAD,
                                    *(m for m in _PRELOAD_IF_LOADED if m in sys.modules)])
    q = ctx.Queue()
    # The store on a port bound here and held until the ranks are gone: a port found free and
    # bound later by rank 0 could be taken in between by another run's ranks (two test runs or
    # loops on one machine), a failure no rerun would catch.
    store = TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=pg_timeout or timeout))
    port = store.port
    # inherited by the children before torch loads
    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", *fresh)}
    os.environ.update(OMP_NUM_THREADS="1", **fresh)
    procs = []
    crash_dir = tempfile.mkdtemp(prefix="fsdp_qcomm_ranks_")
    crash_logs = [os.path.join(crash_dir, f"rank{r}.txt") for r in range(world_size)]
    try:
        for r in range(world_size):
            p = ctx.Process(
                target=_worker,
                args=(fn, r, world_size, port, args, kwargs, q, pg_timeout or timeout,
                      dict(env or {}), crash_logs[r]),
                daemon=True,
            )
            p.start()
            procs.append(p)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    signalled: set[int] = set()  # ranks a native crash signal killed (before any kill of ours)
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, ok, payload = q.get(timeout=min(left, 1.0))
            except queue.Empty:
                for r in may_exit:
                    if not procs[r].is_alive() and r not in results and r not in errors:
                        results[r] = None
                errors.update(_died(procs, crash_logs, {*results, *errors}, signalled))
                if errors:
                    break
                continue
            (results if ok else errors)[rank] = payload
            if errors:
                # Give the peers a moment to report their own failures, then stop.
                time.sleep(0.5)
                while True:
                    try:
                        rank, ok, payload = q.get_nowait()
                    except queue.Empty:
                        break
                    (results if ok else errors)[rank] = payload
                break
    finally:
        # A rank that died of a signal (a segfault, glibc's abort on a corrupted heap) before it
        # could report is the likely cause of its peers' errors ("Connection reset by peer"),
        # which may arrive first: read its stacks before the launcher kills the rest.
        crashed = _died(procs, crash_logs, {*results, *errors, *may_exit}, signalled)
        # A run that timed out, or whose error is a gloo timeout: what the ranks still running
        # are doing, before they are killed.
        stalled = {r: p.pid for r, p in enumerate(procs)
                   if p.is_alive() and r not in results and r not in errors}
        hang, gloo_hang = "", False
        if stalled and not crashed and (len(results) < world_size and not errors or any(
                "Timed out" in tb for tb in errors.values())):
            hang, gloo_hang = _hang_report(stalled)
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
        del store
        shutil.rmtree(crash_dir, ignore_errors=True)
    why = (f"\nissue 30's gloo hang: a rank is stuck in {GLOO_HANG_FRAME} (its reference-"
           "count block was freed by the other gloo worker; results/gloo_stress_pair)"
           if gloo_hang else "")
    if errors or crashed:
        errors.update(crashed)
        msg = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        kind = NativeCrash if signalled or gloo_hang else AssertionError
        raise kind(f"{fn.__name__} failed on rank(s) {sorted(errors)}:\n{msg}" +
                   (f"\n{hang}" if hang else "") + why)
    missing = [r for r in range(world_size) if r not in results]
    if missing:
        raise (NativeCrash if gloo_hang else AssertionError)(
            f"{fn.__name__}: rank(s) {missing} did not finish within {timeout:.0f} s "
            "(a collective mismatch or deadlock?)" + (f"\n{hang}" if hang else "") + why
        )
    return [None if results[r] is None else pickle.loads(results[r]) for r in range(world_size)]


def digest(t) -> str:
    """SHA-1 of a tensor's raw bytes: equal digests mean bit-identical tensors (NaNs included)."""
    raw = t.detach().contiguous().view(torch.uint8).numpy().tobytes()
    return hashlib.sha1(raw).hexdigest()


def same_on_all_ranks(tensors: dict, what: str) -> None:
    """Inside a rank: assert every rank holds bit-identical tensors under the same names."""
    import torch.distributed as dist

    mine = {k: digest(v) for k, v in sorted(tensors.items())}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    for r, d in enumerate(every):
        bad = [k for k in mine if d.get(k) != mine[k]]
        assert d.keys() == mine.keys() and not bad, f"{what}: rank {r} differs on {bad}"


class ComputeWeights:
    """The parameters each rank computes with in its forwards, captured in a forward pre-hook of
    every FSDP module under ``model`` (registered after ``fully_shard``, so it runs after FSDP's
    own pre-forward, which unshards), by parameter name; the latest forward of each module
    wins. Raises inside the forward if a parameter it reads is not the unsharded one (a
    DTensor, or not the parameter's full shape). Call ``check_same`` inside every rank."""

    def __init__(self, model) -> None:
        from torch.distributed.fsdp import FSDPModule

        from .fsdp import internals

        self.weights: dict[str, torch.Tensor] = {}
        self._handles = []
        names = {id(m): n for n, m in model.named_modules()}
        for module in model.modules():
            if not isinstance(module, FSDPModule):
                continue
            params = [(internals.owning_module(fp), internals.local_param_name(fp),
                       tuple(internals.sharded_param(fp).shape))
                      for g in internals.param_groups(module) for fp in internals.fsdp_params(g)]
            self._handles.append(module.register_forward_pre_hook(self._hook(params, names)))

    def _hook(self, params, names):
        from torch.distributed.tensor import DTensor

        def hook(module, args):
            for owner, name, shape in params:
                t = getattr(owner, name)
                key = f"{names[id(owner)]}.{name}".lstrip(".")
                if isinstance(t, DTensor) or tuple(t.shape) != shape:
                    raise AssertionError(
                        f"ComputeWeights: {key} is not unsharded in the forward pre-hook "
                        f"({type(t).__name__} of shape {tuple(t.shape)}, expected {shape})")
                self.weights[key] = t.detach().clone()
        return hook

    def check_same(self, what: str) -> None:
        """Assert every rank computed with bit-identical weights (and captured the same ones)."""
        if not self.weights:
            raise AssertionError(f"{what}: no forward captured any weights")
        same_on_all_ranks(self.weights, what)

    def clear(self) -> None:
        self.weights.clear()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

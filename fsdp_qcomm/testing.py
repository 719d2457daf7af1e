"""The multi-rank test launcher: a helper for this package's tests and benchmarks, installed with
the wheel but not part of the training API. It runs a function on N gloo ranks (CPU processes),
brings back results or tracebacks, and compares tensors across ranks bit for bit.

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` processes with OMP_NUM_THREADS=1,
joins them in a gloo group (its store hosted by the caller, on a port it holds), calls
``fn(rank, world_size, *args)`` on each and returns the list of return values (rank order). If
any rank raises, the other ranks are killed and an AssertionError carries every failing rank's
traceback; a rank that dies without a result (a signal, a native crash) is reported with its
exit code or signal, every thread's Python stack (faulthandler) and its latest ``crash_note``
(which case of a loop it was running); if a rank hangs (a mismatched collective), the run is
killed after ``timeout`` seconds and the error says which ranks never finished. ``fn`` must be
a module-level function (it is pickled by reference). Ranks listed in ``may_exit`` are allowed
to die without a result (their entry is None): for tests that kill a rank on purpose and check
what its peers do; ``pg_timeout`` (default ``timeout``) is the process group's own timeout;
``env`` adds environment variables (for example ``LOCAL_WORLD_SIZE``) in every rank;
``spawn=True`` starts every rank in a fresh interpreter instead of forking it from the server
below: what ranks that use CUDA need, since CUDA cannot be used in a process forked from one
whose imports may have initialized the CUDA driver.

Every gloo group a rank creates (the default group, ``new_group`` subgroups, DeviceMesh groups)
runs ONE gloo worker thread instead of torch's two: ProcessGroupGloo's two workers update a
shared status string without a lock and now and then free its buffer twice, a rare heap
corruption that crashes or hangs a rank (torch's bug; ``docs/known_issues.md``). One worker
cannot race with itself. The group stays a plain "gloo" group (``dist.get_backend`` says
"gloo", sequence numbers count), see :func:`_one_gloo_thread`.

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


def _unpicklable(fn: Callable, args: tuple, kwargs: dict) -> Optional[str]:
    """What of a ``run_ranks`` call does not pickle (the message names it: Python's own words
    for it change between releases), or None. Pickled as ``Process.start`` pickles it, with
    multiprocessing's ``ForkingPickler`` and the reductions torch registers there."""
    from multiprocessing.reduction import ForkingPickler

    parts = [(f"the function {getattr(fn, '__qualname__', fn)!r}", fn),
             *((f"argument {i}", a) for i, a in enumerate(args)),
             *((f"keyword argument {k!r}", v) for k, v in kwargs.items())]
    for name, obj in parts:
        try:
            ForkingPickler.dumps(obj)
        except Exception:  # noqa: BLE001 - any failure to pickle is the answer
            return name
    return None


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


#: gloo worker threads per group in a rank of run_ranks (torch builds 2; see _one_gloo_thread)
GLOO_THREADS = 1


def _one_gloo_thread() -> None:
    """From now on, every gloo group this process creates runs :data:`GLOO_THREADS` worker
    thread(s), not torch's 2: the one place run_ranks avoids ProcessGroupGloo's double free
    (``docs/known_issues.md``), called in each rank before its default group exists.

    ``init_process_group`` and ``new_group`` take no gloo options: torch's group helper builds
    ``ProcessGroupGloo(store, rank, size, timeout=...)`` (2 threads per device), looking the
    class up in ``torch.distributed.distributed_c10d`` at each call. That name is pointed at a
    subclass whose constructor builds the same options with one thread; its metaclass keeps
    torch's ``isinstance(backend, ProcessGroupGloo)`` checks true of every gloo backend (the
    objects torch hands back are of the base class: ``_set_pg_timeout``, which torchtitan calls,
    would skip them). Registering the class under another backend name
    (``Backend.register_backend``, what the crash hunt's scripts did) gives one thread too, but
    ``dist.get_backend`` then names that backend instead of "gloo" (this package checks "gloo" to
    avoid gloo's missing PREMUL_SUM), its groups have no sequence numbers
    (``internals.sequence_number``), and ``new_group(backend="gloo")`` still gets two threads.
    Here every group, whatever creates it, is a plain gloo group with one worker (the default
    group and subgroups: ``tests/test_run_ranks.py``); ``_worker`` checks the default group."""
    from torch.distributed import distributed_c10d as c10d

    base = c10d.ProcessGroupGloo
    if getattr(base, "_fsdp_qcomm_threads", None) == GLOO_THREADS:
        return  # already patched in this process

    class AnyGloo(type(base)):
        def __instancecheck__(cls, obj: Any) -> bool:
            return isinstance(obj, base)

        def __subclasscheck__(cls, sub: type) -> bool:
            return issubclass(sub, base)

    class OneThreadGloo(base, metaclass=AnyGloo):
        _fsdp_qcomm_threads = GLOO_THREADS

        def __init__(self, store, rank: int, size: int, timeout=None,
                     enable_reconfigure: Optional[bool] = None) -> None:
            if isinstance(timeout, base._Options):  # the (store, rank, size, options) form
                opts = timeout
            else:
                opts = base._Options()
                opts._devices = [base.create_default_device()]
                if timeout is not None:
                    opts._timeout = timeout
                if enable_reconfigure is not None:  # torch 2.15's keyword
                    opts.enable_reconfigure = enable_reconfigure
            opts._threads = GLOO_THREADS
            super().__init__(store, rank, size, opts)

    c10d.ProcessGroupGloo = OneThreadGloo


def gloo_threads(group=None) -> int:
    """Inside a rank: the worker threads of ``group``'s gloo backend (default: the world)."""
    import torch.distributed as dist

    pg = dist.group.WORLD if group is None else group
    return pg._get_backend(torch.device("cpu")).options._threads


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
        _one_gloo_thread()
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout)
        )
        if gloo_threads() != GLOO_THREADS:  # a torch that no longer builds gloo as patched
            raise RuntimeError(f"run_ranks: the default gloo group runs {gloo_threads()} "
                               f"worker threads, not {GLOO_THREADS} (see _one_gloo_thread)")
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


def _died(procs: list, crash_logs: list[str], skip: set[int]) -> dict[int, str]:
    """The ranks not in ``skip`` that exited with a nonzero code (or a signal), with their
    crash reports."""
    return {r: _crash_report(crash_logs[r], p.exitcode) for r, p in enumerate(procs)
            if r not in skip and not p.is_alive() and p.exitcode not in (0, None)}


def run_ranks(
    fn: Callable, world_size: int, *args: Any, timeout: float = 240.0,
    may_exit: tuple[int, ...] = (), pg_timeout: Optional[float] = None,
    env: Optional[dict[str, str]] = None, spawn: bool = False, **kwargs: Any
) -> list:
    fresh = {k: v for k, v in (env or {}).items() if k in _IMPORT_TIME_ENV}
    if fresh or spawn:
        ctx = mp.get_context("spawn")
    else:
        ctx = mp.get_context("forkserver")
        # effective when the server first starts
        ctx.set_forkserver_preload([*_PRELOAD,
                                    *(m for m in _PRELOAD_IF_LOADED if m in sys.modules)])
    q = ctx.Queue()
    # The store on a port bound here and held until the ranks are gone: a port found free and
    # bound later by rank 0 could be taken in between by another run's ranks (two test runs or
    # loops on one machine).
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
    except BaseException as e:  # an argument that does not pickle, a script without a main guard
        for p in procs:
            p.kill()
            p.join(timeout=10)
        shutil.rmtree(crash_dir, ignore_errors=True)
        what = _unpicklable(fn, args, kwargs)
        if what is not None:
            raise TypeError(
                f"run_ranks: {what} does not pickle, and each rank receives it pickled: pass a "
                f"module-level function and arguments that pickle (no lambdas or local "
                f"objects): {type(e).__name__}: {e}") from e
        raise
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
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
                errors.update(_died(procs, crash_logs, {*results, *errors}))
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
        # A rank that died (a signal, a native crash) before it could report is the likely
        # cause of its peers' errors ("Connection reset by peer"), which may arrive first: read
        # its report before the launcher kills the rest.
        crashed = _died(procs, crash_logs, {*results, *errors, *may_exit})
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
        del store
        shutil.rmtree(crash_dir, ignore_errors=True)
    if errors or crashed:
        errors.update(crashed)
        msg = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        raise AssertionError(f"{fn.__name__} failed on rank(s) {sorted(errors)}:\n{msg}")
    missing = [r for r in range(world_size) if r not in results]
    if missing:
        raise AssertionError(
            f"{fn.__name__}: rank(s) {missing} did not finish within {timeout:.0f} s "
            "(a collective mismatch or deadlock?)"
        )
    return [None if results[r] is None else pickle.loads(results[r]) for r in range(world_size)]


def digest(t) -> str:
    """SHA-1 of a tensor's raw bytes, on any device: equal digests mean bit-identical tensors
    (NaNs included); 0-dim tensors too (a step-counter buffer)."""
    raw = t.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes()
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

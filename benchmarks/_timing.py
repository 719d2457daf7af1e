"""Where a training step's time goes: exposed communication, quantization, the rest.

``install()`` wraps the ``torch.distributed`` collectives FSDP2 and fsdp_qcomm call
(``all_gather_single``, ``reduce_scatter_single``, ``all_to_all_single``, ...) and the
fsdp_qcomm hooks (``QuantizedAllGather``, ``QuantizedReduceScatter``, HSDP's
``ReplicaAllReduce``: their ``__call__``; DiLoCo's outer all-reduce, ``outer_all_reduce``, when
it runs on the training thread). Time is
counted while the caller is blocked: in the call itself and, for an async collective, in
``wait()`` of the returned work (wrapped in a real ``dist.Work`` subclass, since FSDP waits only
on those). So "communication" is the *exposed* communication time, overlap excluded:

* ``comm``  - blocked in a collective (inside or outside a hook);
* ``hook``  - inside a hook's call or its work's wait, communication included;
* quantization = ``hook - comm_in_hook``; compute and the rest = step - hook - comm_outside.

``comm_by`` splits the blocked time by collective (``all_to_all_single``, ...) and by whether
it happened inside a hook, which says which exchange a step waits for. Collectives issued by
other threads (``QCommConfig.grad_overlap``'s reduction thread) do not block the training
thread: they are only listed in ``comm_by`` as ``<name>/background``.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist

_COLLECTIVES = ("all_gather_single", "reduce_scatter_single", "all_to_all_single",
                "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather",
                "reduce_scatter", "all_reduce")


class Totals:
    def __init__(self) -> None:
        self.comm_in_hook = 0.0
        self.comm_outside = 0.0
        self.hook = 0.0
        self.bytes_outside: dict[str, int] = {}  # input bytes of FSDP's own collectives
        self.comm_by: dict[str, float] = {}  # blocked seconds per "collective[/hook]"
        self._depth = 0  # > 0 while inside a hook

    def add_comm(self, dt: float, name: str = "") -> None:
        if threading.current_thread() is not threading.main_thread():
            k = f"{name or 'collective'}/background"
            self.comm_by[k] = self.comm_by.get(k, 0.0) + dt
            return
        if self._depth:
            self.comm_in_hook += dt
        else:
            self.comm_outside += dt
        if name:
            k = f"{name}/hook" if self._depth else name
            self.comm_by[k] = self.comm_by.get(k, 0.0) + dt

    def snapshot(self) -> dict:
        return {"comm_in_hook": self.comm_in_hook, "comm_outside": self.comm_outside,
                "hook": self.hook, "bytes_outside": dict(self.bytes_outside),
                "comm_by": dict(self.comm_by)}


TOTALS = Totals()


class _TimedWork(dist.Work):
    """Forwards ``wait`` to the wrapped work and charges the blocked time."""

    def __init__(self, inner: dist.Work, charge: Callable[[float], None], hook: bool) -> None:
        super().__init__()
        self._inner = inner
        self._charge = charge
        self._hook = hook

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        if self._inner is None:
            return True
        t0 = time.perf_counter()
        if self._hook:
            TOTALS._depth += 1
        try:
            self._inner.wait() if timeout == timedelta(0) else self._inner.wait(timeout)
        finally:
            if self._hook:
                TOTALS._depth -= 1
            self._inner = None
            self._charge(time.perf_counter() - t0)
        return True

    def is_completed(self) -> bool:
        return self._inner is None or self._inner.is_completed()


def _input_bytes(args: tuple, kwargs: dict) -> int:
    t = kwargs.get("input", kwargs.get("input_tensor"))
    if t is None and len(args) > 1:
        t = args[1]
    return t.numel() * t.element_size() if hasattr(t, "element_size") else 0


def _wrap_collective(fn: Callable) -> Callable:
    name = fn.__name__

    def timed(*args: Any, **kwargs: Any):
        if not TOTALS._depth and threading.current_thread() is threading.main_thread():
            TOTALS.bytes_outside[name] = TOTALS.bytes_outside.get(name, 0) + _input_bytes(
                args, kwargs)
        t0 = time.perf_counter()
        work = fn(*args, **kwargs)
        TOTALS.add_comm(time.perf_counter() - t0, name)
        if isinstance(work, dist.Work):
            return _TimedWork(work, lambda dt: TOTALS.add_comm(dt, name), hook=False)
        return work

    timed._qcomm_timed = True  # (torch's collectives carry __wrapped__ of their own)
    return timed


def _add_hook(dt: float) -> None:
    TOTALS.hook += dt


def _wrap_hook(fn: Callable, main_thread_only: bool = False) -> Callable:
    """``main_thread_only``: a call from another thread (DiLoCo's overlap thread) blocks no
    training step and is not counted (its collectives show as ``<name>/background``)."""

    def timed(*args: Any, **kwargs: Any):
        if main_thread_only and threading.current_thread() is not threading.main_thread():
            return fn(*args, **kwargs)
        t0 = time.perf_counter()
        TOTALS._depth += 1
        try:
            work = fn(*args, **kwargs)
        finally:
            TOTALS._depth -= 1
            TOTALS.hook += time.perf_counter() - t0
        if isinstance(work, dist.Work):
            return _TimedWork(work, _add_hook, hook=True)
        return work

    timed._qcomm_timed = True  # (torch's collectives carry __wrapped__ of their own)
    return timed


def install() -> Totals:
    """Wrap the collectives and the hooks (idempotent); returns the running totals."""
    from fsdp_qcomm.fsdp.all_gather import QuantizedAllGather
    from fsdp_qcomm.fsdp.hsdp import ReplicaAllReduce
    from fsdp_qcomm.fsdp.reduce_scatter import QuantizedReduceScatter

    for name in _COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is not None and not getattr(fn, "_qcomm_timed", False):
            setattr(dist, name, _wrap_collective(fn))
    for cls in (QuantizedAllGather, QuantizedReduceScatter, ReplicaAllReduce):
        if not getattr(cls.__call__, "_qcomm_timed", False):
            cls.__call__ = _wrap_hook(cls.__call__)
    # DiLoCo's outer all-reduce (encode, exchange, decode): looked up in its engine's module at
    # each launch, so wrapping the module attribute times every sync
    from fsdp_qcomm.diloco import engine as diloco_engine

    if not getattr(diloco_engine.outer_all_reduce, "_qcomm_timed", False):
        diloco_engine.outer_all_reduce = _wrap_hook(diloco_engine.outer_all_reduce,
                                                    main_thread_only=True)
    return TOTALS

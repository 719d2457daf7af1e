"""When each fragment syncs, and where its all-reduce runs while the inner steps go on.

``Schedule`` is pure arithmetic on the inner-step counter ``t`` (the number of inner steps
done), the same on every replica:

* a sync point after every ``period = H / F`` inner steps (``t = period, 2 period, ...``);
  sync point ``k = t / period`` (1, 2, ...) launches fragment ``(k - 1) % F``, so fragment
  ``f`` launches after steps ``(f + 1) period, (f + 1) period + H, ...``: every ``H`` steps,
  the fragments offset by ``period`` (Streaming DiLoCo's round-robin; F = 1 is DiLoCo);
* the fragment launched after step ``s`` is merged after step ``s + delay``; ``delay <
  period``, so a merge always comes before the next launch and one all-reduce at most is in
  flight. A fragment's first round is ``(f + 1) period`` steps long, the later ones ``H``.

``Overlap`` runs the all-reduces: on the caller's thread (``enabled=False``, the reference),
or on one background thread (gloo: its collectives go to a private process group, since a
process group's collectives must be issued in one order on every rank; CUDA: on a side stream
that waits for the pseudo-gradient and that the main stream waits for at the merge).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch


@dataclass(frozen=True)
class Schedule:
    sync_every: int
    fragments: int
    delay: int

    @property
    def period(self) -> int:
        return self.sync_every // self.fragments

    def launch_at(self, t: int) -> Optional[int]:
        """The fragment whose all-reduce starts after inner step ``t`` (None: none)."""
        if t <= 0 or t % self.period:
            return None
        return (t // self.period - 1) % self.fragments

    def merge_at(self, t: int) -> Optional[int]:
        """The fragment merged after inner step ``t`` (None: none)."""
        return self.launch_at(t - self.delay)

    def sync_index(self, t_launch: int) -> int:
        """How many sync points came before the one after step ``t_launch`` (keys the RNG)."""
        return t_launch // self.period - 1

    def describe(self) -> str:
        f = f"{self.fragments} fragments, one every {self.period} steps" \
            if self.fragments > 1 else "the whole model"
        return (f"outer step every {self.sync_every} inner steps per fragment ({f}); "
                f"all-reduce merged {self.delay} inner step(s) after its launch")


class Overlap:
    """Runs the outer all-reduces in the background (see the module docstring). ``submit``
    returns a ``Future`` of the callable's result; exceptions travel in it.

    ``on_start``: a test seam, called on the background thread right before each all-reduce
    with the launch's inner step (the overlap test makes it wait for the next inner step)."""

    def __init__(self, enabled: bool, device: torch.device) -> None:
        self.enabled = enabled
        self.device = device
        self._pool: Optional[ThreadPoolExecutor] = None
        self._stream: Any = None
        self.on_start: Optional[Callable[[int], None]] = None
        if enabled:
            cuda = device.type == "cuda"
            # A new thread's current device is 0: the worker takes the model's for good, or
            # each stream switch back to device 0's stream would open a context on GPU 0 in
            # every rank of the node.
            self._pool = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="qcomm-diloco",
                initializer=torch.cuda.set_device if cuda else None,
                initargs=(device,) if cuda else ())
            if cuda:
                self._stream = torch.cuda.Stream(device=device)

    def submit(self, fn: Callable[[], Any], t_launch: int) -> "Future[Any]":
        if not self.enabled:
            fut: Future[Any] = Future()
            try:
                fut.set_result(fn())
            except Exception as e:  # noqa: BLE001 - delivered at the merge, like the thread
                fut.set_exception(e)
            return fut
        ready = None
        if self._stream is not None:  # the pseudo-gradient is written on the main stream
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        assert self._pool is not None
        return self._pool.submit(self._run, fn, t_launch, ready)

    def _run(self, fn: Callable[[], Any], t_launch: int, ready: Any) -> Any:
        if self.on_start is not None:
            self.on_start(t_launch)
        if self._stream is None:
            return fn()
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            try:
                out, error = fn(), None
            except Exception as e:  # noqa: BLE001 - re-raised by result(), after its wait
                out, error = None, e  # (fn may have queued kernels that use the buffers)
            done = torch.cuda.Event()
            done.record(self._stream)
        return _Done(out, done, self.device, error)

    @staticmethod
    def result(fut: "Future[Any]") -> Any:
        """Wait for ``fut`` and, on CUDA, make the current stream of its device wait for the
        side stream's work, then return its value or re-raise its exception. May be called
        again: each call makes the stream current then wait."""
        out = fut.result()
        if isinstance(out, _Done):
            torch.cuda.current_stream(out.device).wait_event(out.event)
            if out.error is not None:
                raise out.error
            return out.value
        return out

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class _Done:
    def __init__(self, value: Any, event: Any, device: torch.device,
                 error: Optional[Exception] = None) -> None:
        self.value = value
        self.event = event
        self.device = device
        self.error = error


def in_background() -> bool:
    """Whether the caller runs on the outer all-reduce thread."""
    return threading.current_thread().name.startswith("qcomm-diloco")


__all__ = ["Overlap", "Schedule", "in_background"]

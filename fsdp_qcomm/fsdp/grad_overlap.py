"""Overlap of the quantized gradient reduction with the rest of backward, on CPU.

On GPUs FSDP2 runs its reduce-scatter on a side stream, so a module's gradient exchange
overlaps the backward of the modules before it. On CPU process groups (gloo) there is no
stream: FSDP calls the reduce-scatter hook on the autograd thread and every layer's backward
waits for the previous layer's exchange. With ``QCommConfig.grad_overlap=True`` the hook hands
the reduction to one background thread per process and returns; the thread runs reductions in
call order (the same order on every rank, as FSDP's own collectives), on process groups of its
own, and the end of ``backward()`` waits for all of them. Each ``enable`` call owns one such
queue (``ReductionQueue``), which its hooks share. The bytes and values are those of
the synchronous path: only when they are computed changes.

A reduction is deferred only when FSDP will not read its output before backward ends
(``deferrable``): no gradient to accumulate into, no cast to another dtype, no post-division,
no HSDP all-reduce, no CPU offload, no post-accumulate-grad hooks that read the gradient
(fsdp_qcomm's own, which only note that a reduction happened, say ``reads_grad = False``).
Otherwise the reduction still goes through the queue, waited for at once, so every rank issues
the same collectives on the same groups whatever each rank decided. Under HSDP the
reduce-scatter inside the node stays synchronous (FSDP reads its output at once) and runs on
FSDP's own group on the autograd thread, beside the queue, which runs the all-reduces across
replicas, the slow hop (``replica_deferrable``, ``fsdp.hsdp``): that choice is structural, the
same on every rank, and the two threads then work at once instead of taking turns.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional, Union

import torch
from torch.distributed import ReduceOp

from . import internals as fsdp


class ReductionQueue:
    """One worker thread running one ``enable`` call's deferred reductions in submission order
    (owned by its ``fsdp.session.Session``; the thread stops with ``shutdown``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._executor: Optional[ThreadPoolExecutor] = None
        self._pending: list[Future] = []
        self._drain_task: Optional[int] = None  # autograd graph task that will drain
        self.deferred = 0  # reductions that were left running when their call returned

    def submit(self, fn: Callable[[], Any], defer: bool = True) -> None:
        """Run ``fn`` after everything submitted before it. Inside backward and with ``defer``,
        return at once and let the end of that backward pass (or the next ``drain``) wait;
        otherwise wait now, re-raising errors.

        A reduction that may not finish later still goes through the queue (``defer=False``):
        it then runs on the same private process groups as the deferred ones, after them, so
        every rank issues the same collectives on the same groups in the same order whatever
        each rank decided about deferring."""
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="fsdp_qcomm_grad")
            self._pending.append(self._executor.submit(fn))
        if not defer or not self._drain_at_end_of_backward():
            self.drain()
        else:
            self.deferred += 1

    def _drain_at_end_of_backward(self) -> bool:
        task = torch._C._current_graph_task_id()
        if task == -1:
            return False  # not inside backward: nobody would wait later
        if self._drain_task != task:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._drain_task = task
        return True

    def _end_of_backward(self) -> None:
        self._drain_task = None
        self.drain()

    def drain(self) -> None:
        """Wait for every submitted reduction; re-raise the first error (after waiting for the
        rest, so no reduction is left running on buffers the caller may free)."""
        with self._lock:
            pending, self._pending = self._pending, []
        error: Optional[BaseException] = None
        for f in pending:
            try:
                f.result()
            except BaseException as e:  # noqa: BLE001 - re-raised below
                error = error or e
        if error is not None:
            raise error

    @property
    def pending(self) -> int:
        with self._lock:
            return sum(not f.done() for f in self._pending)

    def shutdown(self) -> None:
        """Stop the worker thread (queued reductions still run first)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)


def _output_read_late(param_group: Any, dtype: torch.dtype) -> str:
    """Why FSDP2 (``foreach_reduce``) reads the reduced output before backward ends, or "" when
    it only makes views of it then: no cast to the gradients' dtype, no gradient to add it to,
    no CPU offload copy, no post-accumulate-grad hook reading it."""
    for fp, p in zip(fsdp.fsdp_params(param_group), fsdp.sharded_params(param_group)):
        if not p.requires_grad:
            continue
        if fsdp.sharded_grad_dtype(fp) != dtype:
            return (f"FSDP casts the reduced gradients ({dtype}) to "
                    f"{fsdp.sharded_grad_dtype(fp)} right away (mixed precision)")
        if p.grad is not None:
            return "gradients accumulate into existing .grad right away"
        if fsdp.offloads_to_cpu(fp):
            return "CPU offload copies the gradients right away"
        if any(getattr(h, "reads_grad", True) for h in fsdp.post_accumulate_grad_hooks(p)):
            return "a post-accumulate-grad hook reads the gradients inside backward"
    return ""


def defer_reason(
    param_group: Any, output_tensor: torch.Tensor, op: Union[ReduceOp, "ReduceOp.RedOpType"]
) -> str:
    """Why this reduce-scatter must finish before its call returns, or "" when FSDP2 leaves the
    output unread until backward ends, so the reduction may finish later. ``output_tensor``:
    the reduced shard, in FSDP's reduce dtype (the input may hold the gradients' own dtype,
    ``reduce_scatter._input_dtype``). Reads FSDP's private param-group state through
    ``internals`` (verified by ``enable``; a read that fails raises)."""
    if output_tensor.device.type != "cpu":
        return "not a CPU process group (CUDA overlaps on FSDP's own streams)"
    if param_group is None:
        return "no FSDP parameter group known"
    if op == ReduceOp.SUM:
        return "forced-sum mode: FSDP divides the output right after the call"
    if fsdp.is_hsdp(param_group):
        return "HSDP all-reduces the output right away (the replica all-reduce is deferred)"
    if fsdp.partial_reduce_output(param_group) is not None:
        return "FSDP adds a partial reduction to the output right away"
    if fsdp.all_reduce_hook(param_group) is not None:
        return "an all-reduce hook reads the output right away"
    return _output_read_late(param_group, output_tensor.dtype)


def replica_defer_reason(param_group: Any, tensor: torch.Tensor) -> str:
    """Why HSDP's all-reduce hook must finish before it returns, or "" when FSDP2 leaves its
    output unread until backward ends (no division after the hook, and ``_output_read_late``).
    Called from inside the hook, with FSDP's state as it will use it."""
    if tensor.device.type != "cpu":
        return "not a CPU process group (CUDA overlaps on FSDP's own streams)"
    if fsdp.post_divide_factor(param_group, tensor.dtype) is not None:
        return "FSDP divides the output right after the hook"
    return _output_read_late(param_group, tensor.dtype)


def deferrable(param_group: Any, output_tensor: torch.Tensor,
               op: Union[ReduceOp, "ReduceOp.RedOpType"]) -> bool:
    return not defer_reason(param_group, output_tensor, op)


def replica_deferrable(param_group: Any, tensor: torch.Tensor) -> bool:
    return not replica_defer_reason(param_group, tensor)


__all__ = ["ReductionQueue", "defer_reason", "deferrable", "replica_defer_reason",
           "replica_deferrable"]

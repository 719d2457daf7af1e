"""HSDP: the gradient all-reduce across replicas, quantized, behind FSDP2's all-reduce hook.

With a 2-D mesh ``(replicate, shard)`` FSDP2 (``_fsdp_collectives.foreach_reduce``)
reduce-scatters each module's gradients over the shard group (our ``QuantizedReduceScatter``:
inside a node), then runs ``dist.all_reduce(output, group=replicate_group)`` itself, in full
precision, across nodes, and only then calls the module's all-reduce hook. FSDP has no seam for
that all-reduce, so ``install`` does two things per HSDP parameter group:

1. it points FSDP's replica group at a process group holding this rank alone
   (``internals.swap_replicate_group``): FSDP's all-reduce becomes a local no-op, while the rest
   of HSDP stays FSDP's own: partial sums under ``set_requires_all_reduce(False)`` (FSDP adds
   them before the all-reduce), the all-reduce stream and buffer lifetimes, DTensor placements,
   state dicts and ``clip_grad_norm_`` (those read the device mesh, which is untouched);
2. it installs ``ReplicaAllReduce`` as the all-reduce hook, which runs
   ``collectives.replica_reduce.all_reduce_quantized`` over the real replica group, then any hook
   the user had set.

Scaling. FSDP's divide factors now count the shard group only; native HSDP averages over the
replicas in its all-reduce exactly when no gradient divide factor is set (AVG), and sums
otherwise (the factor then covers every rank). ``replica_op`` says which op the hook applies,
so the gradients end with native HSDP's scaling for every combination of divide factor, forced
sum and reduce dtype (``tests/test_hsdp.py`` checks the product of factors against FSDP's own
``_get_gradient_divide_factors``).

Guard. A later ``set_all_reduce_hook`` would replace ours and leave the replicas unsynchronized
(FSDP's own all-reduce now reaches one rank only): ``check_installed`` raises before the next
optimizer step instead of letting the replicas drift apart silently.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from ..collectives.cast import all_reduce_cast
from ..collectives.error_feedback import FeedbackState
from ..collectives.replica_reduce import (
    all_reduce_plain,
    all_reduce_quantized,
    feedback_shapes,
    replica_key,
)
from ..collectives.topology import is_alive
from ..config import QuantSpec
from ..stats import CommStats
from . import internals as fsdp
from .grad_overlap import ReductionQueue, replica_defer_reason
from .residual_state import ScaleSource, call_feedback

Hook = Callable[[torch.Tensor], None]


def replica_op(divide_factor: Optional[float]) -> "ReduceOp.RedOpType":
    """The op of the replica all-reduce that gives native HSDP's scaling once FSDP's own
    factors count only the shard group: AVG without a custom divide factor, SUM with one."""
    return ReduceOp.AVG if divide_factor is None else ReduceOp.SUM


class SoloGroup:
    """A process group of this rank alone (FSDP's all-reduce over it is a local no-op), owned
    by one ``enable`` call and destroyed by its ``disable``, and the proof that FSDP really
    all-reduces over it: every collective on a process group advances that group's sequence
    number, so between two calls of the all-reduce hooks (FSDP runs its all-reduce right before
    each hook call) the number must advance by exactly one. If FSDP had kept the real replica
    group (a cached group in a later torch), its full-precision all-reduce would run there
    beside ours and the gradients would be summed twice; ``check`` then raises instead.

    Only this rank takes part in creating the group (``use_local_synchronization``), so it may
    be created whatever the other ranks do; every rank creates its own at the same point of
    ``enable``."""

    def __init__(self) -> None:
        rank = dist.get_rank()
        self.group = dist.new_group([rank], use_local_synchronization=True,
                                    group_desc="qcomm_hsdp_solo")
        self._seen = fsdp.sequence_number(self.group)
        self._task: Optional[int] = None  # the backward pass whose end is checked
        self.hooks: list[ReplicaAllReduce] = []  # the hooks whose FSDP all-reduce runs here

    def check(self, label: str) -> None:
        """Called first thing in every all-reduce hook call; also arranges ``_end_of_backward``
        for the backward pass it runs in."""
        self._expect_one(f"FSDP module {label!r}")
        task = torch._C._current_graph_task_id()
        if task != -1 and task != self._task:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._task = task

    def _expect_one(self, where: str, ran_expected: int = 1) -> None:
        now = fsdp.sequence_number(self.group)
        ran, self._seen = now - self._seen, now
        if ran != ran_expected:
            for hook in self.hooks:  # a replaced hook explains a skipped call
                hook.check_installed()
            raise fsdp.changed(
                f"{where}: FSDP's own HSDP all-reduce ran {ran} time(s) on the one-rank group "
                f"fsdp_qcomm swapped in for the replica group (expected {ran_expected}), so "
                "it may have run on the real replica group instead and summed the gradients "
                "twice, or an all-reduce hook did not run"
            )

    def _end_of_backward(self) -> None:
        """After FSDP's own end-of-backward work (queued before ours): every all-reduce FSDP
        ran since the last hook call must have had its hook call (none is pending)."""
        self._task = None
        self._expect_one("at the end of backward", 0)

    def destroy(self) -> None:
        if is_alive(self.group):
            dist.destroy_process_group(self.group)


class ReplicaAllReduce:
    """The all-reduce hook of one HSDP parameter group.

    ``bucket`` (the module's index) and ``call_count`` key the stochastic rounding:
    ``replica_key(seed, call_count, global rank, bucket)``; ``call_count`` is checkpointed by
    the handle so a resumed run draws the same bits. ``spec`` None runs the all-reduce
    unquantized (``grad_scheme="none"`` with ``grad_overlap``); ``wire_dtype`` (bf16, with
    ``grad_scheme="bf16"``) sends it in that dtype with fp32 sums (``collectives.cast``).
    ``overlap_group``: a private copy of the replica group (``grad_overlap``); when FSDP will not
    read the output before backward ends (``replica_deferrable``) the all-reduce runs on the
    background thread over it.
    """

    def __init__(
        self,
        param_group: Any,
        replica_group: ProcessGroup,
        spec: Optional[QuantSpec],
        *,
        hadamard: bool,
        seed: int,
        bucket: int,
        stats: CommStats,
        chunks: int = 1,
        remote_peers: Optional[int] = None,
        user_hook: Optional[Hook] = None,
        label: str = "",
        overlap_group: Optional[ProcessGroup] = None,
        error_feedback: bool = False,
        feedback_decay: float = 1.0,
        solo: Optional[SoloGroup] = None,
        queue: Optional[ReductionQueue] = None,
        wire_dtype: Optional[torch.dtype] = None,
    ) -> None:
        self.param_group = param_group
        self.wire_dtype = wire_dtype
        self.solo = solo
        if overlap_group is not None and queue is None:
            queue = ReductionQueue()
        self.queue = queue  # grad_overlap: the enable call's reduction thread
        self.replica_group = replica_group
        self.spec = spec
        self.hadamard = hadamard
        self.seed = seed
        self.bucket = bucket
        self.stats = stats
        self.chunks = chunks
        self.remote_peers = remote_peers
        self.user_hook = user_hook
        self.label = label or "<root>"
        self.overlap_group = overlap_group
        self.call_count = 0
        self.feedback = (FeedbackState(feedback_decay)
                         if error_feedback and spec is not None else None)
        self.grad_scale: Optional[ScaleSource] = None  # QCommHandle.attach_grad_scaler

    @property
    def replicas(self) -> int:
        return self.replica_group.size()

    def __call__(self, reduce_output: torch.Tensor) -> None:
        if self.solo is not None:
            self.solo.check(self.label)
        op = replica_op(fsdp.gradient_divide_factor(self.param_group))
        key = replica_key(self.seed, self.call_count, dist.get_rank(), self.bucket)
        self.call_count += 1
        fb = call_feedback(self.feedback, self.param_group, reduce_output.numel(), self.stats,
                           self.grad_scale, "replica all-reduce")
        if self.overlap_group is not None:
            # Always on the private group, deferred or not (``ReductionQueue.submit``).
            why = ("a user all-reduce hook runs after it" if self.user_hook is not None
                   else replica_defer_reason(self.param_group, reduce_output))
            if why:
                self.stats.note(f"grad_overlap: a replica all-reduce finished inside its call: "
                                f"{why}")
            self.queue.submit(partial(self._reduce, reduce_output, self.overlap_group, op, key, fb),
                         defer=not why)
        else:
            self._reduce(reduce_output, self.replica_group, op, key, fb)
        if self.user_hook is not None:
            self.user_hook(reduce_output)

    def _reduce(self, tensor: torch.Tensor, group: ProcessGroup, op: Any, key: Any,
                feedback: Any = None) -> None:
        if self.wire_dtype is not None:
            all_reduce_cast(tensor, group, wire_dtype=self.wire_dtype, op=op, stats=self.stats,
                            remote_peers=self.remote_peers)
            return
        if self.spec is None:
            all_reduce_plain(tensor, group, op=op, stats=self.stats,
                             remote_peers=self.remote_peers)
            return
        all_reduce_quantized(
            tensor, group, self.spec, key, hadamard=self.hadamard, op=op, chunks=self.chunks,
            stats=self.stats, remote_peers=self.remote_peers, feedback=feedback,
        )

    def feedback_shapes(self, m: int) -> dict[str, tuple[int, ...]]:
        """The error-feedback residuals a call over ``m`` values keeps."""
        if self.feedback is None:
            return {}
        return feedback_shapes(m, self.replicas, self.spec, self.hadamard, self.chunks)

    def check_installed(self) -> None:
        """Raise if FSDP's all-reduce hook of this group is no longer this object."""
        if fsdp.all_reduce_hook(self.param_group) is not self:
            raise RuntimeError(
                f"FSDP module {self.label!r}: its all-reduce hook was replaced after "
                "fsdp_qcomm.enable(), so the gradients were not reduced across HSDP replicas "
                "(fsdp_qcomm runs that all-reduce in the hook). Call set_all_reduce_hook before "
                "enable() (fsdp_qcomm then calls your hook after its all-reduce), or "
                "handle.disable() first"
            )


class _Swap:
    """One swapped mesh-info object (shared by the groups of one ``fully_shard`` call), kept
    on that object itself so it lives and dies with the model."""

    def __init__(self, group: Any, solo: SoloGroup) -> None:
        self.original = fsdp.swap_replicate_group(group, solo.group)
        self.group = group
        self.users = 0


def install(hook: ReplicaAllReduce) -> None:
    """Route the group's HSDP all-reduce through ``hook`` (see the module docstring)."""
    if hook.solo is None:
        raise ValueError("install needs a ReplicaAllReduce built with its SoloGroup")
    group = hook.param_group
    swap = fsdp.swap_record(group)
    if swap is None:
        swap = _Swap(group, hook.solo)
        fsdp.set_swap_record(group, swap)
    swap.users += 1
    hook.solo.hooks.append(hook)
    fsdp.set_all_reduce_hook(group, hook)


def uninstall(hook: ReplicaAllReduce) -> None:
    """Undo ``install``: FSDP's own replica group and the user's hook come back."""
    group = hook.param_group
    if fsdp.all_reduce_hook(group) is hook:
        fsdp.set_all_reduce_hook(group, hook.user_hook)
    swap = fsdp.swap_record(group)
    if swap is not None:
        swap.users -= 1
        if swap.users <= 0:
            fsdp.swap_replicate_group(swap.group, swap.original)
            fsdp.set_swap_record(group, None)


def original_replicate_group(group: Any) -> Optional[ProcessGroup]:
    """The replica group FSDP would all-reduce over without fsdp_qcomm (None if not HSDP)."""
    if not fsdp.is_hsdp(group):
        return None
    swap = fsdp.swap_record(group)
    return swap.original if swap is not None else fsdp.replicate_group(group)


__all__ = ["ReplicaAllReduce", "SoloGroup", "install", "original_replicate_group", "replica_op",
           "uninstall"]

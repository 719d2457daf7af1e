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

Isolation (DiLoCo). ``isolate`` does the same swap without any all-reduce across replicas:
FSDP's all-reduce runs on the one-rank group (a no-op) and the hook, ``LocalReplica``, only
proves it did (``SoloGroup.check``) and runs the user's hook. Each replica group then trains
exactly as FSDP2 over its own shard group would: FSDP's divide factors count the shard group
only (``_get_gradient_divide_factors`` multiplies the reduce-scatter group's size by the
all-reduce group's, now 1), so without a divide factor each gradient is the mean over the shard
group, with one it is that factor's scaling (torchtitan's 1.0: the sum), and the rest of HSDP
(DTensor placements, ``clip_grad_norm_``, state dicts, accumulation) is FSDP's own. One change:
without a divide factor FSDP would pass AVG to its all-reduce over one rank, which NCCL does not
compute reliably (FSDP's own note in ``_get_gradient_divide_factors``), so ``isolate`` forces
FSDP's SUM reduction there (the same mean: SUM over the shard group, then FSDP divides by its
size). The replica group FSDP now all-reduces over is the one-rank group, and the package reads
it as such (``original_replicate_group``: no replica hop is planned, ``enable`` installs none);
the real one stays in the isolation record (``isolated_replica_group``). ``fsdp_qcomm.diloco.
isolate_replicas`` applies it to a model; ``unisolate`` undoes it.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from ..codec import FLOAT_DTYPES
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
    ``enable``.

    A backend that counts no sequence numbers (torch's ``fake``, some vendors') cannot give the
    proof: ``counted`` is then False, the check is off and ``enable`` says so in its notes."""

    def __init__(self) -> None:
        rank = dist.get_rank()
        self.group = dist.new_group([rank], use_local_synchronization=True,
                                    group_desc="qcomm_hsdp_solo")
        self._seen = fsdp.sequence_number(self.group)  # None: the backend counts none
        self._task: Optional[int] = None  # the backward pass whose end is checked
        # the hooks whose FSDP all-reduce runs here (ReplicaAllReduce, or isolate's LocalReplica)
        self.hooks: list[Any] = []

    @property
    def counted(self) -> bool:
        """Whether the backend counts collectives, so that the check runs."""
        return self._seen is not None

    def check(self, label: str) -> None:
        """Called first thing in every all-reduce hook call; also arranges ``_end_of_backward``
        for the backward pass it runs in."""
        self._expect_one(f"FSDP module {label!r}")
        task = torch._C._current_graph_task_id()
        if task != -1 and task != self._task:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._task = task

    def _expect_one(self, where: str, ran_expected: int = 1) -> None:
        if not self.counted:
            return
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
        # FSDP x TP: averages the TP-replicated parameters' reduced gradients over their TP
        # peers once the replicas agree (``tp_peers``)
        self.peer_sync: Optional[Any] = None

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
            if self.peer_sync is not None:
                why = why or "TP-replicated gradients are averaged over TP peers right after"
            if why:
                self.stats.note(f"grad_overlap: a replica all-reduce finished inside its call: "
                                f"{why}")
            self.queue.submit(partial(self._reduce, reduce_output, self.overlap_group, op, key, fb),
                         defer=not why)
        else:
            self._reduce(reduce_output, self.replica_group, op, key, fb)
        if self.peer_sync is not None:
            self.peer_sync(reduce_output, self.stats)
        if self.user_hook is not None:
            self.user_hook(reduce_output)

    def _reduce(self, tensor: torch.Tensor, group: ProcessGroup, op: Any, key: Any,
                feedback: Any = None) -> None:
        if tensor.dtype not in FLOAT_DTYPES:  # float64: a plain all-reduce, as the shards get
            if self.wire_dtype is not None or self.spec is not None:
                self.stats.note(
                    f"{self.label}: replica all-reduce fell back to a plain one: the gradients "
                    f"are {tensor.dtype}, the codec takes "
                    f"{', '.join(map(str, FLOAT_DTYPES))}")
            all_reduce_plain(tensor, group, op=op, stats=self.stats,
                             remote_peers=self.remote_peers)
            return
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


class LocalReplica:
    """The all-reduce hook of an isolated HSDP parameter group (``isolate``): nothing crosses
    replica groups. Each call checks that FSDP's own all-reduce ran on the one-rank group
    (``SoloGroup.check``: had FSDP kept the real replica group, it would have averaged the
    replicas at every step, which is what DiLoCo replaces), then runs the hook the user had set.
    ``forced_sum``: ``isolate`` set FSDP's forced-sum reduction (restored by ``unisolate``)."""

    def __init__(self, param_group: Any, solo: SoloGroup, *, user_hook: Optional[Hook] = None,
                 label: str = "") -> None:
        self.param_group = param_group
        self.solo = solo
        self.user_hook = user_hook
        self.label = label or "<root>"
        self.forced_sum = False
        self.prev_force_sum = fsdp.force_sum(param_group)

    def __call__(self, reduce_output: torch.Tensor) -> None:
        self.solo.check(self.label)
        if self.user_hook is not None:
            self.user_hook(reduce_output)

    def check_installed(self) -> None:
        """Raise if FSDP's all-reduce hook of this group is no longer this object."""
        if fsdp.all_reduce_hook(self.param_group) is not self:
            raise RuntimeError(
                f"FSDP module {self.label!r}: its all-reduce hook was replaced after "
                "isolate_replicas(), so the check that FSDP's own all-reduce stays on this rank "
                "(no averaging across replica groups) no longer runs. Call set_all_reduce_hook "
                "before isolate_replicas (its hook then runs after the check), or undo() first"
            )


class _Isolation:
    """One isolated mesh-info object (shared by the groups of one ``fully_shard`` call), kept
    on that object itself: the real replica group, and the one-rank group FSDP now uses."""

    def __init__(self, group: Any, solo: SoloGroup) -> None:
        self.original = fsdp.swap_replicate_group(group, solo.group)
        self.group = group
        self.solo = solo
        self.users = 0


def check_isolatable(group: Any, label: str = "") -> None:
    """Raise what ``isolate`` would refuse for this group (before anything is changed)."""
    name = label or "<root>"
    if not fsdp.is_hsdp(group):
        raise ValueError(f"FSDP module {name!r} is not sharded on a 2-D (replicate, shard) "
                         "mesh: there is no all-reduce across replicas to isolate")
    current = fsdp.all_reduce_hook(group)
    if isinstance(current, LocalReplica):
        raise RuntimeError(f"FSDP module {name!r}: its replicas are isolated already")
    if fsdp.swap_record(group) is not None or isinstance(current, ReplicaAllReduce):
        raise RuntimeError(
            f"FSDP module {name!r}: fsdp_qcomm.enable() already runs its all-reduce across "
            "replicas; call isolate_replicas(model) before enable() (enable then sees one "
            "replica and plans no replica hop), or handle.disable() first"
        )


def isolate(group: Any, solo: SoloGroup, label: str = "") -> LocalReplica:
    """Make FSDP's HSDP all-reduce of ``group`` a local no-op (see the module docstring);
    returns the installed hook (pass it to ``unisolate``). Refuses a group whose all-reduce
    ``enable`` already routes through its quantized hook (isolate first, then enable) and a
    group isolated already."""
    check_isolatable(group, label)
    current = fsdp.all_reduce_hook(group)
    record = fsdp.isolation_record(group)
    if record is None:
        record = _Isolation(group, solo)
        fsdp.set_isolation_record(group, record)
    record.users += 1
    hook = LocalReplica(group, record.solo, user_hook=current, label=label)
    if fsdp.gradient_divide_factor(group) is None and not hook.prev_force_sum:
        fsdp.set_force_sum(group, True)  # not AVG over one rank (see the module docstring)
        hook.forced_sum = True
    record.solo.hooks.append(hook)
    fsdp.set_all_reduce_hook(group, hook)
    return hook


def unisolate(hook: LocalReplica) -> None:
    """Undo ``isolate``: FSDP's replica group, its reduction setting and the user's hook come
    back (FSDP all-reduces across replicas again)."""
    group = hook.param_group
    if fsdp.all_reduce_hook(group) is hook:
        fsdp.set_all_reduce_hook(group, hook.user_hook)
    if hook.forced_sum:
        fsdp.set_force_sum(group, hook.prev_force_sum)
        hook.forced_sum = False
    if hook in hook.solo.hooks:
        hook.solo.hooks.remove(hook)
    record = fsdp.isolation_record(group)
    if record is not None:
        record.users -= 1
        if record.users <= 0:
            fsdp.swap_replicate_group(record.group, record.original)
            fsdp.set_isolation_record(group, None)


def is_isolated(group: Any) -> bool:
    """The group is HSDP with its replica all-reduce isolated (``isolate``)."""
    return fsdp.is_hsdp(group) and fsdp.isolation_record(group) is not None


def isolated_replica_group(group: Any) -> Optional[ProcessGroup]:
    """The real replica group of an isolated group (None if the group is not isolated)."""
    if not fsdp.is_hsdp(group):
        return None
    record = fsdp.isolation_record(group)
    return None if record is None else record.original


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
    """The replica group FSDP would all-reduce over without fsdp_qcomm (None if not HSDP);
    for a group ``isolate`` isolated, the one-rank group it all-reduces over now (DiLoCo: no
    gradient crosses replica groups, so nothing plans a replica hop)."""
    if not fsdp.is_hsdp(group):
        return None
    swap = fsdp.swap_record(group)
    return swap.original if swap is not None else fsdp.replicate_group(group)


__all__ = ["LocalReplica", "ReplicaAllReduce", "SoloGroup", "check_isolatable", "install",
           "is_isolated", "isolate", "isolated_replica_group", "original_replicate_group",
           "replica_op", "uninstall", "unisolate"]

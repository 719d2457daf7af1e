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
from .grad_overlap import QUEUE, replica_deferrable

Hook = Callable[[torch.Tensor], None]


def replica_op(divide_factor: Optional[float]) -> "ReduceOp.RedOpType":
    """The op of the replica all-reduce that gives native HSDP's scaling once FSDP's own
    factors count only the shard group: AVG without a custom divide factor, SUM with one."""
    return ReduceOp.AVG if divide_factor is None else ReduceOp.SUM


_SOLO: dict[int, ProcessGroup] = {}


def solo_group() -> ProcessGroup:
    """A process group of this rank alone, created on first use and cached (FSDP's all-reduce
    over it is a local no-op). Only this rank takes part in creating it, so it may be created
    whatever the other ranks do; every rank creates its own at the same point of ``enable``."""
    rank = dist.get_rank()
    hit = _SOLO.get(rank)
    if hit is not None and is_alive(hit):
        return hit
    solo = dist.new_group([rank], use_local_synchronization=True, group_desc="qcomm_hsdp_solo")
    _SOLO[rank] = solo
    return solo


class ReplicaAllReduce:
    """The all-reduce hook of one HSDP parameter group.

    ``bucket`` (the module's index) and ``call_count`` key the stochastic rounding:
    ``replica_key(seed, call_count, global rank, bucket)``; ``call_count`` is checkpointed by
    the handle so a resumed run draws the same bits. ``spec`` None runs the all-reduce
    unquantized (``grad_scheme="none"`` with ``grad_overlap``). ``overlap_group``: a private copy
    of the replica group (``grad_overlap``); when FSDP will not read the output before backward
    ends (``replica_deferrable``) the all-reduce runs on the background thread over it.
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
    ) -> None:
        self.param_group = param_group
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
        self.feedback = FeedbackState() if error_feedback and spec is not None else None

    @property
    def replicas(self) -> int:
        return self.replica_group.size()

    def __call__(self, reduce_output: torch.Tensor) -> None:
        op = replica_op(fsdp.gradient_divide_factor(self.param_group))
        key = replica_key(self.seed, self.call_count, dist.get_rank(), self.bucket)
        self.call_count += 1
        if (self.overlap_group is not None and self.user_hook is None
                and replica_deferrable(self.param_group, reduce_output)):
            QUEUE.submit(partial(self._reduce, reduce_output, self.overlap_group, op, key))
            return
        self._reduce(reduce_output, self.replica_group, op, key)
        if self.user_hook is not None:
            self.user_hook(reduce_output)

    def _reduce(self, tensor: torch.Tensor, group: ProcessGroup, op: Any, key: Any) -> None:
        if self.spec is None:
            all_reduce_plain(tensor, group, op=op, stats=self.stats,
                             remote_peers=self.remote_peers)
            return
        all_reduce_quantized(
            tensor, group, self.spec, key, hadamard=self.hadamard, op=op, chunks=self.chunks,
            stats=self.stats, remote_peers=self.remote_peers, feedback=self.feedback,
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
    """One swapped mesh-info object (shared by the groups of one ``fully_shard`` call)."""

    def __init__(self, group: Any, solo: ProcessGroup) -> None:
        self.original = fsdp.swap_replicate_group(group, solo)
        self.group = group
        self.users = 0


_SWAPS: dict[int, _Swap] = {}


def install(hook: ReplicaAllReduce) -> None:
    """Route the group's HSDP all-reduce through ``hook`` (see the module docstring)."""
    group = hook.param_group
    key = fsdp.mesh_info_id(group)
    swap = _SWAPS.get(key)
    if swap is None:
        swap = _SWAPS[key] = _Swap(group, solo_group())
    swap.users += 1
    fsdp.set_all_reduce_hook(group, hook)


def uninstall(hook: ReplicaAllReduce) -> None:
    """Undo ``install``: FSDP's own replica group and the user's hook come back."""
    group = hook.param_group
    if fsdp.all_reduce_hook(group) is hook:
        fsdp.set_all_reduce_hook(group, hook.user_hook)
    key = fsdp.mesh_info_id(group)
    swap = _SWAPS.get(key)
    if swap is not None:
        swap.users -= 1
        if swap.users <= 0:
            fsdp.swap_replicate_group(swap.group, swap.original)
            del _SWAPS[key]


def original_replicate_group(group: Any) -> Optional[ProcessGroup]:
    """The replica group FSDP would all-reduce over without fsdp_qcomm (None if not HSDP)."""
    if not fsdp.is_hsdp(group):
        return None
    swap = _SWAPS.get(fsdp.mesh_info_id(group))
    return swap.original if swap is not None else fsdp.replicate_group(group)


__all__ = ["ReplicaAllReduce", "install", "original_replicate_group", "replica_op", "solo_group",
           "uninstall"]

"""Who the replicas are: the process group an outer all-reduce runs over, and the agreement
points around it.

DiLoCo talks to its replicas through four calls at each sync (``ReplicaGroup``):

* ``begin_sync()`` before the fragment's pseudo-gradient is taken: returns this replica's
  contribution weight (1, or 0 when it has nothing of its own to add: a replica that just
  healed from another holds that one's weights, and its pseudo-gradient would count it twice);
* ``group`` / ``background_group``: the process group of the all-reduce (ranks with this rank's
  local index in every replica group), on the caller's thread or on the overlap thread;
* ``commit(error)`` at the merge: whether to apply the outer step (every rank of the replica
  group gets the same answer);
* ``membership()``: changes when the set of replicas changes (error-feedback residuals are
  laid out for one replica count and rank, so they restart from zero).

``StaticReplicas`` is a fixed process group (``torch.distributed``, every replica always
there). ``diloco.ft.FTReplicas`` is the torchft one (quorum, healing, commit votes).
"""

from __future__ import annotations

from typing import Any, Hashable, Optional, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..collectives._c10d import carries
from ..collectives.agreement import gather_unless_failed
from ..collectives.topology import group_layout, private_group


@runtime_checkable
class ReplicaGroup(Protocol):
    group: ProcessGroup
    background_group: ProcessGroup
    remote_peers: int

    def size(self) -> int: ...

    def rank(self) -> int: ...

    def begin_sync(self) -> float: ...

    def commit(self, error: Optional[BaseException]) -> bool: ...

    def membership(self) -> Hashable: ...


class StaticReplicas:
    """A fixed replica group: ``group`` holds one rank of every replica group (the ranks with
    this rank's local index). ``overlap``: create the private copy of it the background thread
    uses (collective over the group's members, at construction). ``ranks_per_node``: which
    members share this rank's node, for the node-crossing byte counts (None: every other
    replica is on another node, the DiLoCo layout)."""

    def __init__(self, group: ProcessGroup, *, overlap: bool = False,
                 ranks_per_node: Optional[int] = None) -> None:
        self.group = group
        self.background_group = private_group(group) if overlap and group.size() > 1 else group
        if ranks_per_node is None:
            self.remote_peers = group.size() - 1
        else:
            self.remote_peers = group_layout(group, ranks_per_node).remote_peers

    def size(self) -> int:
        return self.group.size()

    def rank(self) -> int:
        return self.group.rank()

    def begin_sync(self) -> float:
        return 1.0

    def commit(self, error: Optional[BaseException]) -> bool:
        if error is not None:
            raise RuntimeError(f"the outer all-reduce failed: {error}") from error
        return True

    def membership(self) -> Hashable:
        return ("static", self.group.size())


def replica_group_of(mesh) -> ProcessGroup:
    """The replica dimension's process group of a device mesh: its dimension named "replicate"
    (or "dp_replicate"), whatever else the mesh holds (``(replicate, dp, tp)`` with tensor
    parallelism); else dimension 0 of a 2-D ``(replicate, shard)`` mesh."""
    names = mesh.mesh_dim_names or ()
    for name in ("replicate", "dp_replicate"):
        if name in names:
            return mesh.get_group(name)
    if mesh.ndim != 2:
        raise ValueError(
            f"DiLoCo takes a 2-D device mesh (replicate, shard) or a mesh with a dimension named "
            f"'replicate' or 'dp_replicate', got {mesh.ndim}-D {mesh.mesh_dim_names}; or pass "
            "the replica process group itself"
        )
    return mesh.get_group(0)


def fixed_group(replicas) -> Optional[ProcessGroup]:
    """The fixed process group behind ``replicas`` as ``DiLoCo`` takes them (a device mesh, a
    process group or a ``ReplicaGroup`` without ``start``), found without creating any group;
    None for torchft's, whose members change (they heal instead)."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(replicas, DeviceMesh):
        return replica_group_of(replicas)
    if isinstance(replicas, ProcessGroup):
        return replicas
    if isinstance(replicas, ReplicaGroup) and not hasattr(replicas, "start"):
        return replicas.group
    return None


def check_same_run(group: Optional[ProcessGroup], record: dict[str, Any],
                   failure: Optional[BaseException] = None) -> None:
    """Every replica must run the same outer steps: the same ``DiLoCoConfig`` (the schedule,
    the outer all-reduce's format, overlap and diagnostics decide which collectives run when),
    fragments, layout and outer optimizer. One ``all_gather_object`` over ``group`` at
    construction, before any collective that depends on them, of ``record`` and of whether
    this rank's checks failed (``failure``; ``collectives.agreement``). Every member reads the
    same list, so all raise (a failing rank its own error, the others a ``RuntimeError`` naming
    it; differences a ``ValueError`` naming each field), or none does. Without it replicas
    launched with other settings (each site its own launch) would pair all-reduces of other
    sizes or rounds (gloo aborts, NCCL reads the wrong bytes or hangs) or, with only the outer
    learning rate or momentum different, merge into weights that drift apart silently."""
    if group is None or group.size() == 1 or not _exchanges_objects(group):
        if failure is not None:
            raise failure
        return
    ranks = dist.get_process_group_ranks(group)

    def stopped(failed: list[int], size: int, first: str) -> str:
        return (f"DiLoCo failed on replica(s) {failed} (global rank(s) "
                f"{[ranks[i] for i in failed]}), so it stops on every replica: {first}")

    every = gather_unless_failed(record, failure, group, stopped)
    diffs = []
    for key in dict.fromkeys(k for r in every for k in r):  # every rank's keys
        values: dict[str, list[int]] = {}
        for replica, r in enumerate(every):
            values.setdefault(repr(r.get(key, "<absent>")), []).append(replica)
        if len(values) > 1:
            diffs.append(f"{key}: " + "; ".join(
                f"{v} on replica(s) {rs} (global rank(s) {[ranks[i] for i in rs]})"
                for v, rs in values.items()))
    if diffs:
        raise ValueError(
            "DiLoCo: the replicas would not run the same outer steps. "
            + " | ".join(diffs[:6]) + (f" | and {len(diffs) - 6} more" if len(diffs) > 6 else "")
            + ". Give every replica the same DiLoCoConfig, fragments and outer optimizer, and "
            "shard its model alike (with one launch per site, check each site's settings)"
        )


def _exchanges_objects(group: ProcessGroup) -> bool:
    """Whether ``all_gather_object`` can run over ``group`` in this process: on its CPU backend,
    else on CUDA. A CUDA-only group in a process without a GPU carries nothing at all (its
    first all-reduce fails; the carry check names why), so there is nothing to compare."""
    return carries(group, torch.device("cpu")) or torch.cuda.is_available()


def as_replicas(replicas, *, overlap: bool, ranks_per_node: Optional[int]) -> ReplicaGroup:
    """``replicas`` as a ``ReplicaGroup``: one already, a process group, a device mesh
    (``replica_group_of``), or a torchft ``Manager`` (``diloco.ft.FTReplicas``)."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(replicas, ReplicaGroup):
        return replicas
    if isinstance(replicas, DeviceMesh):
        return StaticReplicas(replica_group_of(replicas), overlap=overlap,
                              ranks_per_node=ranks_per_node)
    if isinstance(replicas, ProcessGroup):
        return StaticReplicas(replicas, overlap=overlap, ranks_per_node=ranks_per_node)
    if type(replicas).__module__.startswith("torchft"):
        from .ft import FTReplicas

        return FTReplicas(replicas)
    if replicas is None and dist.is_initialized():
        raise ValueError(
            "DiLoCo needs its replicas: a 2-D device mesh (replicate, shard), the replica "
            "process group (this rank's peers with its local index in every replica group), or "
            "a torchft Manager"
        )
    raise TypeError(f"DiLoCo cannot use {type(replicas).__name__} as its replicas")


__all__ = ["ReplicaGroup", "StaticReplicas", "as_replicas", "check_same_run", "fixed_group",
           "replica_group_of"]

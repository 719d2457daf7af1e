"""DiLoCo on an HSDP model: the replica groups of a 2-D ``(replicate, shard)`` mesh train by
themselves between outer steps (``isolate_replicas``).

``DiLoCo`` wants each replica group to be FSDP2 over the group's own ranks. The plain way is to
shard over ``mesh["shard"]`` (``docs/diloco.md``). When something else shards the model over
the whole 2-D mesh (HSDP), as torchtitan 0.3 does for ``dp_replicate`` x ``dp_shard``, its
parameters must stay HSDP's (its spmd_types annotations span the whole data-parallel mesh, so
torch 2.15's ``fully_shard`` refuses a ``dp_shard``-only mesh for them). ``isolate_replicas``
keeps that model as it is and removes the one thing HSDP adds over FSDP inside a replica group:
the gradient all-reduce across replicas at every backward. For each HSDP parameter group FSDP's
replica group is swapped for a process group of this rank alone (``fsdp.hsdp.isolate``: FSDP's
all-reduce becomes a local no-op, its divide factors count the shard group only, and a check at
every reduction proves FSDP really used the one-rank group). The gradients are then exactly
those of ``fully_shard`` over the shard group: the mean over the replica group's own ranks
without a divide factor, the factor's scaling with one (torchtitan's 1.0: the sum; its loss is
normalized by the token count, which the caller must count over the replica group, see
``titan03.trainer``). The parameters stay 2-D DTensors, ``Replicate`` on the replica dimension
and ``Shard`` on the shard dimension: each replica group's values are its own between outer
steps (DiLoCo makes them equal again at each merge), placements and state dicts are HSDP's,
and ``clip_grad_norm_`` reduces over the shard dimension only (a ``Replicate`` dimension adds
no collective), which is again FSDP over the shard group.

Call it after ``fully_shard`` and before ``fsdp_qcomm.enable`` (which then sees one replica and
plans no replica hop) and before the first backward; ``DiLoCo`` then accepts the model
(``layout.replica_layout`` skips the isolated replica dimension of each parameter's mesh).
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torch.distributed import ProcessGroup

from ..fsdp import hsdp
from ..fsdp import internals as fsdp
from .layout import group_ranks


class ReplicaIsolation:
    """What ``isolate_replicas`` returns: the isolated groups' hooks, the real replica group
    (what DiLoCo's outer all-reduce runs over), the shard group (one replica group's own ranks),
    and ``undo()``."""

    def __init__(self, hooks: list[hsdp.LocalReplica], solo: hsdp.SoloGroup,
                 replica_group: ProcessGroup, shard_group: ProcessGroup) -> None:
        self.hooks = hooks
        self.solo = solo
        self.replica_group = replica_group
        self.shard_group = shard_group
        self.active = True

    @property
    def replicas(self) -> int:
        return self.replica_group.size()

    def describe(self) -> str:
        return (f"HSDP with its all-reduce across {self.replicas} replicas isolated on "
                f"{len(self.hooks)} parameter groups: each replica group trains as FSDP over "
                f"its {self.shard_group.size()} rank(s)")

    def undo(self) -> None:
        """FSDP's own HSDP comes back (its all-reduce across replicas at every backward)."""
        if not self.active:
            return
        for hook in self.hooks:
            hsdp.unisolate(hook)
        self.solo.destroy()
        self.active = False


def isolate_replicas(model: nn.Module) -> ReplicaIsolation:
    """Isolate the replica groups of every HSDP parameter group under ``model`` (see the
    module docstring). Everything is checked before anything changes: refused are a model
    without HSDP groups, a module replicated without sharding (``replicate()``), a 1-D FSDP
    group whose ranks are not one replica group's, HSDP groups on different layouts, and groups
    that ``fsdp_qcomm.enable`` already hooked (isolate first) or that are isolated already."""
    from torch.distributed.fsdp import FSDPModule

    labelled: list[tuple[str, Any]] = []
    seen: set[int] = set()
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in fsdp.param_groups(module):
            if id(group) not in seen:
                seen.add(id(group))
                labelled.append((name, group))
    groups = [(n, g) for n, g in labelled if fsdp.is_hsdp(g)]
    if not groups:
        raise ValueError(
            f"isolate_replicas: no FSDP module under {type(model).__name__} is sharded on a 2-D "
            "(replicate, shard) mesh (HSDP), so there is no all-reduce across replicas to "
            "isolate; a model sharded over each replica group's own ranks goes to DiLoCo as is"
        )
    for name, g in labelled:
        if fsdp.is_replicate_only(g):
            raise ValueError(f"isolate_replicas: FSDP module {name or '<root>'!r} is replicated "
                             "without sharding (replicate()); DiLoCo takes FSDP or HSDP modules")
    for name, g in groups:
        hsdp.check_isolatable(g, name)
    layouts = {(group_ranks(fsdp.replicate_group(g)), group_ranks(fsdp.shard_group(g)))
               for _, g in groups}
    if len(layouts) > 1:
        raise ValueError(f"isolate_replicas: the HSDP modules use {len(layouts)} different "
                         "(replicate, shard) layouts; DiLoCo needs one set of replica groups")
    replica_ranks, shard_ranks = layouts.pop()
    for name, g in labelled:
        if not fsdp.is_hsdp(g) and group_ranks(fsdp.shard_group(g)) != shard_ranks:
            raise ValueError(
                f"isolate_replicas: FSDP module {name or '<root>'!r} is sharded over ranks "
                f"{list(group_ranks(fsdp.shard_group(g)))}, not over one replica group's "
                f"{list(shard_ranks)}: its gradients would be reduced across replica groups")
    first = groups[0][1]
    replica_group = fsdp.replicate_group(first)
    shard_group = fsdp.shard_group(first)
    solo = hsdp.SoloGroup()
    hooks = [hsdp.isolate(g, solo, name) for name, g in groups]
    return ReplicaIsolation(hooks, solo, replica_group, shard_group)


def isolated_replica_ranks(modules: list[nn.Module]) -> set[tuple[int, ...]]:
    """The real replica groups' ranks of the isolated HSDP groups among ``modules``."""
    return {group_ranks(hsdp.isolated_replica_group(g)) for m in modules
            for g in fsdp.param_groups(m) if hsdp.is_isolated(g)}


__all__ = ["ReplicaIsolation", "isolate_replicas", "isolated_replica_ranks"]

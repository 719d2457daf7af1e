"""Where this rank sits inside its replica group, and which of its values its model-parallel
peers hold too.

A replica group is one copy of the model: FSDP shards it over the group's ranks and tensor
parallelism may split it further (torchtitan's ``dp_shard x tp`` inside each
``dp_replicate`` group). DiLoCo's outer state mirrors each rank's local shards, and its outer
all-reduce runs over the ranks at this rank's place in every replica group. From the layout
it needs two things:

* ``position`` of ``positions``: this rank's coordinate inside its replica over FSDP's shard
  dimension and every model-parallel dimension, flattened (shard first, then the model-parallel
  dimensions in the order the parameters' meshes list them, the same on every rank). It keys
  the outer all-reduce's random streams and names this rank's part of a checkpoint; without
  model parallelism it is the rank in the FSDP shard group.
* the values this rank shares with model-parallel peers: every parameter tensor parallelism
  leaves whole (norms, RowwiseParallel biases, modules it does not parallelize) is held by
  each TP peer, and each peer's outer all-reduce runs over its own replica group. A lossy
  all-reduce gives those copies different means (each peer encodes its own flat buffer, whose
  quantization groups also hold the values TP splits, with its own random streams), so
  ``PeerSpans.settle`` averages them over the peers after the all-reduce: every peer applies
  the same outer step and the copies stay bit-identical, as ``fsdp.tp_peers`` keeps them
  after each gradient reduction. An fp32 all-reduce is exact but its summation order follows
  each buffer's own layout, so there the first peer's values are broadcast instead (equal
  values stay equal).

Mesh dimensions are told apart by their ranks: the dimension whose ranks are a parameter's FSDP
shard group is the shard dimension; one whose ranks are its HSDP replica group (the real one,
also behind fsdp-qcomm's own HSDP all-reduce) is refused unless ``isolate_replicas`` isolated it
(DiLoCo replaces that all-reduce); any other dimension of more than one rank is
model-parallel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup

from ..fsdp import hsdp
from ..fsdp import internals as fsdp


@dataclass(frozen=True)
class MeshDim:
    """One mesh dimension as this rank sees it: its ranks, its process group, this rank's
    index in it, and its name (for messages)."""

    ranks: tuple[int, ...]
    group: ProcessGroup
    rank: int
    name: str

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class ReplicaLayout:
    """This rank's place inside its replica group (see the module docstring). ``shared``: per
    parameter (in the order given to ``replica_layout``), the model-parallel dimensions along
    which that parameter is whole, hence the same on every peer."""

    position: int
    positions: int
    peers: tuple[MeshDim, ...]
    shared: tuple[tuple[MeshDim, ...], ...]

    def describe(self) -> str:
        if not self.peers:
            return f"rank {self.position} of {self.positions} in its replica group"
        dims = ", ".join(f"{d.name} ({d.size})" for d in self.peers)
        return (f"position {self.position} of {self.positions} in its replica group; "
                f"model-parallel over {dims}")


def group_ranks(pg: Optional[ProcessGroup]) -> tuple[int, ...]:
    """The global ranks of a process group; () for None."""
    return () if pg is None else tuple(dist.get_process_group_ranks(pg))


def _fsdp_groups(modules: Sequence[nn.Module]) -> dict[int, Any]:
    """``id(sharded parameter) -> its FSDP parameter group`` for every group under ``modules``."""
    out: dict[int, Any] = {}
    for m in modules:
        for g in fsdp.param_groups(m):
            for p in fsdp.sharded_params(g):
                out[id(p)] = g
    return out


def _mesh_dims(param: torch.Tensor) -> list[tuple[MeshDim, bool]]:
    """(dimension, whole along it) for every dimension of more than one rank of a DTensor's
    mesh; [] for a plain tensor."""
    from torch.distributed.tensor import Replicate

    mesh = getattr(param, "device_mesh", None)
    if mesh is None:
        return []
    names = mesh.mesh_dim_names or tuple(f"dim{d}" for d in range(mesh.ndim))
    out = []
    for d in range(mesh.ndim):
        if mesh.size(d) == 1:
            continue
        group = mesh.get_group(d)
        dim = MeshDim(group_ranks(group), group, mesh.get_local_rank(d), names[d])
        out.append((dim, isinstance(param.placements[d], Replicate)))
    return out


_HSDP = ("HSDP all-reduces across replicas at every step, which DiLoCo replaces. Shard each "
         "replica group by itself: fully_shard(..., mesh=mesh['shard']) on the 2-D (replicate, "
         "shard) mesh, or keep HSDP and call fsdp_qcomm.diloco.isolate_replicas(model) before "
         "the first backward")


def replica_layout(params: Sequence[tuple[str, torch.Tensor]],
                   fsdp_modules: Sequence[nn.Module]) -> ReplicaLayout:
    """The layout of ``params`` (name, parameter), sharded by ``fsdp_modules``' FSDP groups
    (see the module docstring). Refuses HSDP whose replica all-reduce is not isolated, and
    parameters sharded over different FSDP groups of ranks."""
    groups = _fsdp_groups(fsdp_modules)
    shard: dict[tuple[int, ...], tuple[MeshDim, str]] = {}
    peers: dict[tuple[int, ...], MeshDim] = {}
    # per parameter: the dimensions of its mesh, and the model-parallel ones it is whole along
    seen: list[tuple[set[tuple[int, ...]], set[tuple[int, ...]]]] = []
    for name, p in params:
        g = groups.get(id(p))
        shard_ranks = group_ranks(fsdp.shard_group(g)) if g is not None else ()
        isolated = g is not None and hsdp.is_isolated(g)
        # the real replica group, also where fsdp-qcomm's HSDP all-reduce swapped FSDP's for a
        # one-rank group (enable) or isolate_replicas did
        replica_ranks = group_ranks(hsdp.isolated_replica_group(g) if isolated
                                    else hsdp.original_replicate_group(g)) if g is not None else ()
        own: set[tuple[int, ...]] = set()
        whole_along: set[tuple[int, ...]] = set()
        for dim, whole in _mesh_dims(p):
            own.add(dim.ranks)
            if dim.ranks == replica_ranks:
                if not isolated:
                    names = p.device_mesh.mesh_dim_names
                    raise ValueError(f"DiLoCo: parameter {name!r} is sharded over a mesh "
                                     f"{names} with a replica dimension: {_HSDP}")
                continue  # the replicas DiLoCo all-reduces over
            if dim.ranks == shard_ranks:
                shard.setdefault(dim.ranks, (dim, name))
                continue
            peers.setdefault(dim.ranks, dim)
            if whole:
                whole_along.add(dim.ranks)
        seen.append((own, whole_along))
    if len(shard) > 1:
        groups_seen = sorted((d.size, d.rank, n) for d, n in shard.values())
        raise ValueError(f"DiLoCo: the parameters are sharded over different FSDP groups "
                         f"(size, this rank's index, a parameter: {groups_seen}); use one shard "
                         "mesh for the model")
    order = [d for d, _ in shard.values()] + list(peers.values())
    position, positions = 0, 1
    for d in order:
        position, positions = position * d.size + d.rank, positions * d.size
    # a parameter whose mesh lacks a model-parallel dimension is whole along it (TP left it)
    shared = tuple(tuple(d for k, d in peers.items() if k in whole or k not in own)
                   for own, whole in seen)
    return ReplicaLayout(position, positions, tuple(peers.values()), shared)


class PeerSpans:
    """One fragment's values shared with model-parallel peers: per peer dimension, the
    ``(offset, length)`` runs of the fragment's flat buffer that every peer along it holds."""

    def __init__(self, shared: Sequence[tuple[MeshDim, ...]], sizes: Sequence[int]) -> None:
        runs: dict[tuple[int, ...], tuple[MeshDim, list[tuple[int, int]]]] = {}
        self._copies: list[tuple[int, int, int]] = []  # (offset, length, peers holding it)
        off = 0
        for dims, n in zip(shared, sizes):
            copies = 1
            for d in dims:
                runs.setdefault(d.ranks, (d, []))[1].append((off, n))
                copies *= d.size
            if copies > 1 and n:
                self._copies.append((off, n, copies))
            off += n
        self._runs = [(d, spans) for d, spans in runs.values() if any(n for _, n in spans)]

    def __bool__(self) -> bool:
        return bool(self._runs)

    @property
    def dims(self) -> list[MeshDim]:
        """The peer dimensions ``settle`` exchanges over."""
        return [d for d, _ in self._runs]

    def settle(self, buf: torch.Tensor, lossy: bool) -> None:
        """Make the shared values of ``buf`` (an all-reduced mean) the same on every peer:
        their mean over the peers after a lossy all-reduce, the first peer's otherwise."""
        for dim, spans in self._runs:
            part = torch.cat([buf[o:o + n] for o, n in spans])
            if lossy:
                dist.all_reduce(part, group=dim.group)
                part.div_(dim.size)
            else:
                dist.broadcast(part, group=dim.group, group_src=0)
            pos = 0
            for o, n in spans:
                buf[o:o + n].copy_(part[pos:pos + n])
                pos += n

    def once(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` (laid out like the fragment) counting each shared value once over
        its peers: what a sum over every rank of the replica divides out."""
        total = x.sum()
        for o, n, copies in self._copies:
            total = total - x[o:o + n].sum() * (1 - 1 / copies)
        return total


__all__ = ["MeshDim", "PeerSpans", "ReplicaLayout", "group_ranks", "replica_layout"]

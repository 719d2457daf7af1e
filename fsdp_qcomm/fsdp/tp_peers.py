"""Copies that tensor parallelism keeps on several ranks stay bit-identical after a lossy
gradient reduction.

With FSDP2 over a data-parallel mesh and tensor parallelism beside it (torchtitan's
``dp_shard x tp``), every parameter that TP does not shard (norms, RowwiseParallel biases,
whatever is not parallelized: embeddings, the head) is held by each TP peer: the ranks at the
same place of their FSDP groups, one per TP coordinate. FSDP2 keeps those copies equal because
every peer reduces the same gradient the same way. A quantized reduction does not: each peer's
FSDP group quantizes its flat gradient buffer in groups that also hold TP-sharded values (which
differ between peers) and with its own random stream, so the copies drift apart (measured: up
to 0.025 after 20 sdp4bit steps on 2 x 2 CPU ranks, and 0.099 in 120 steps in issue 43).

``PeerSync`` closes that after the reduction, inside the hook: the reduced gradient of every
TP-replicated parameter is averaged over its peers (one all-reduce per module and step over the
TP group, usually inside a node), so every peer gets the same bytes, and the quantization noise
of the peers averages out. The weight gathers need nothing: they quantize each parameter's
segment apart with keys of the gather group's rank, so equal shards gather equally.

Which ranks are peers is read from the parameters themselves (``peer_groups``): a dimension of
a parameter's DTensor mesh whose ranks are not all in the FSDP group is a model-parallel one; a
parameter is replicated over it when its placement there is ``Replicate`` or when its mesh lacks
that dimension (TP does not split modules, so a parameter that TP leaves alone exists on every
TP rank). Pipeline stages are separate models, so their ranks never appear.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from . import internals as fsdp

KIND = "tp_peer_sync"


@dataclass(frozen=True)
class PeerGroup:
    """One model-parallel mesh dimension as seen from this rank: its process group and ranks."""

    group: ProcessGroup
    ranks: tuple[int, ...]
    name: str


def _mesh_dims(fp: Any) -> list[tuple[PeerGroup, bool]]:
    """(dimension, replicated along it) for each dimension of this parameter's DTensor mesh."""
    from torch.distributed.tensor import Replicate

    param = fsdp.sharded_param(fp)
    mesh = param.device_mesh
    names = mesh.mesh_dim_names or tuple(f"dim{d}" for d in range(mesh.ndim))
    out = []
    for d in range(mesh.ndim):
        group = mesh.get_group(d)
        ranks = tuple(dist.get_process_group_ranks(group))
        out.append((PeerGroup(group, ranks, names[d]), isinstance(param.placements[d], Replicate)))
    return out


def peer_groups(param_groups: Sequence[Any]) -> list[PeerGroup]:
    """The model-parallel dimensions of a model: every dimension of its parameters' meshes
    whose ranks are not all in that parameter's FSDP group (in a stable order: the same on
    every rank of an SPMD program)."""
    seen: dict[tuple[int, ...], PeerGroup] = {}
    for group in param_groups:
        fsdp_ranks = set(_fsdp_ranks(group))
        for fp in fsdp.fsdp_params(group):
            for dim, _ in _mesh_dims(fp):
                if len(dim.ranks) > 1 and not set(dim.ranks) <= fsdp_ranks:
                    seen.setdefault(dim.ranks, dim)
    return [seen[k] for k in sorted(seen)]


def _fsdp_ranks(group: Any) -> list[int]:
    """The ranks of a group's data-parallel mesh: shard and replica groups. Under DiLoCo's
    ``isolate_replicas`` (or fsdp-qcomm's own HSDP all-reduce) FSDP's replica group is this rank
    alone, but the mesh's replica dimension is still data-parallel, not a TP peer: the real
    group counts."""
    from .hsdp import isolated_replica_group, original_replicate_group

    ranks = set(dist.get_process_group_ranks(fsdp.shard_group(group)))
    for replicas in (original_replicate_group(group), isolated_replica_group(group)):
        if replicas is not None:
            ranks |= set(dist.get_process_group_ranks(replicas))
    return sorted(ranks)


class PeerSync:
    """Averages the TP-replicated parameters' reduced gradients over their TP peers; call it on
    the final reduced output inside FSDP's hook (the reduce-scatter's, or HSDP's all-reduce
    hook), where ``internals.reduction_params`` can tell which parameters the buffer holds."""

    def __init__(self, param_group: Any, peers: Sequence[PeerGroup]) -> None:
        self.param_group = param_group
        fps = fsdp.fsdp_params(param_group)
        own = set(_fsdp_ranks(param_group))
        self._masks: list[tuple[PeerGroup, tuple[bool, ...]]] = []
        for peer in peers:
            if set(peer.ranks) <= own:  # data-parallel peers of this group (an expert mesh's
                continue                # dimension seen from the dense groups): other shards
            mask = []
            for fp in fps:
                dims = {d.ranks: rep for d, rep in _mesh_dims(fp)}
                # not on this dimension at all (TP left it alone), or Replicate along it
                mask.append(dims.get(peer.ranks, True))
            if any(mask):
                self._masks.append((peer, tuple(mask)))
        self.synced_params = sum(any(m[i] for _, m in self._masks) for i in range(len(fps)))

    def __bool__(self) -> bool:
        return bool(self._masks)

    def __call__(self, output: torch.Tensor, stats: Optional[Any] = None) -> None:
        if not self._masks or output.numel() == 0:
            return
        flat = output.view(-1)
        idx = fsdp.reduction_params(self.param_group, flat.numel())
        if idx is None:
            raise RuntimeError(
                "fsdp_qcomm: cannot tell which parameters this gradient reduction holds, so the "
                "TP-replicated ones cannot be kept equal across tensor-parallel peers (FSDP2 "
                "called the hook from somewhere other than foreach_reduce). Train this model "
                "without fsdp_qcomm.enable(), or report the torch version"
            )
        fps = fsdp.fsdp_params(self.param_group)
        spans, off = [], 0
        for i in idx:
            n = fsdp.padded_shard_numel(fps[i])
            spans.append((i, off, n))
            off += n
        for peer, mask in self._masks:
            parts = [(o, n) for i, o, n in spans if mask[i] and n]
            if not parts:
                continue
            buf = torch.cat([flat[o:o + n] for o, n in parts])
            dist.all_reduce(buf, group=peer.group)
            buf.div_(len(peer.ranks))
            pos = 0
            for o, n in parts:
                flat[o:o + n].copy_(buf[pos:pos + n])
                pos += n
            if stats is not None:
                stats.record(KIND, sent_bytes=buf.nbytes, recv_bytes=buf.nbytes,
                             elements=buf.numel(), baseline_bytes=0)


def plan(param_groups: Sequence[Any]) -> dict[int, Optional[PeerSync]]:
    """Per parameter group (by ``id``): its ``PeerSync``, or None when it has no TP-replicated
    parameter (no model-parallel dimension: plain FSDP or HSDP, nothing to do)."""
    peers = peer_groups(param_groups)
    out: dict[int, Optional[PeerSync]] = {}
    for group in param_groups:
        sync = PeerSync(group, peers) if peers else None
        out[id(group)] = sync if sync else None
    return out


__all__ = ["KIND", "PeerGroup", "PeerSync", "peer_groups", "plan"]

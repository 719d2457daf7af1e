"""Do all ranks install the same collectives? Checked once, at the end of ``enable``'s checks.

A quantized collective is right only when every member encodes and decodes one wire format.
``enable`` decides that format on each rank from what that rank was given: its ``QCommConfig``,
``module_filter_fn`` and ``module_configs``, and its node placement. Given other values on one
rank (a config read from that rank's environment, a filter that reads rank-local state), ranks
would pair an encoder of one format with a decoder of another. gloo aborts every rank on the
size mismatch, NCCL reads the wrong bytes or hangs, and where the sizes match (the Hadamard
rotation on one rank only, another rounding or group size of the same bytes) every rank trains
on garbage without an error. Likewise a check that fails on one rank only left that rank raising
and the others waiting in their first collective.

So ``enable`` runs every check, catches what fails, and makes one ``all_gather_object`` over the
world: each rank sends whether it failed (the exception's type and message) and, per device
mesh its modules are sharded over, the modules it would install on, their configurations and a
digest of their hop plans. Every rank reads the same list, so every rank raises (the failing rank
its own exception, the others a ``RuntimeError`` naming it), or every rank goes on. All members
of a mesh must agree, HSDP replicas included: replicas that gathered their weights differently
would compute with different weights.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Optional, Sequence

import torch.distributed as dist

from ..config import QCommConfig

#: a device mesh as ``enable`` keys it: (its ranks, flattened; its shape; its dimension names)
MeshKey = tuple[tuple[int, ...], tuple[int, ...], Optional[tuple[str, ...]]]

_FIX = ("Give every rank the same QCommConfig, module_filter_fn and module_configs (a value read "
        "from one rank's own environment or state is the usual cause)")


@dataclasses.dataclass(frozen=True)
class Entry:
    """What one rank would install on one parameter group of one FSDP module."""

    mesh: MeshKey
    label: str
    index: int
    config: QCommConfig  # the run's configuration of this module (node size resolved)
    plan: Any  # hop_plan.ModulePlan


def _fields(config: QCommConfig) -> tuple[tuple[str, str], ...]:
    return tuple((f.name, repr(getattr(config, f.name))) for f in dataclasses.fields(config))


def _plan_digest(plan: Any) -> str:
    text = repr((plan.weights, plan.node_reference, plan.reduce_scatter, plan.replica,
                 plan.kept_inside))
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def payload(failure: Optional[BaseException], entries: Sequence[Entry]) -> dict:
    """This rank's message: its failure, and per mesh ``[(label, index, config id, plan
    digest)]`` with the distinct configurations sent once (``configs``)."""
    configs: list[tuple] = []
    meshes: dict[MeshKey, list[tuple]] = {}
    for e in entries:
        fields = _fields(e.config)
        if fields not in configs:
            configs.append(fields)
        meshes.setdefault(e.mesh, []).append(
            (e.label, e.index, configs.index(fields), _plan_digest(e.plan)))
    return {
        "failure": None if failure is None else (type(failure).__name__, str(failure)),
        "configs": configs,
        "meshes": meshes,
    }


def ranks_text(ranks: Sequence[int]) -> str:
    """``[0-3, 5, 7-9]``: runs of consecutive ranks, at most 8 runs named."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    parts = [f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:8]]
    more = f", ... ({len(ranks)} ranks)" if len(runs) > 8 else ""
    return f"[{', '.join(parts)}{more}]"


def _mesh_text(key: MeshKey) -> str:
    ranks, shape, names = key
    dims = (f"({', '.join(f'{n}={s}' for n, s in zip(names, shape))})" if names
            else f"of shape {' x '.join(map(str, shape))}")
    return f"the device mesh {dims} over ranks {ranks_text(ranks)}"


def _expanded(p: dict, key: MeshKey) -> tuple:
    """A rank's modules on ``key`` with their configurations spelled out (comparable)."""
    return tuple((label, index, p["configs"][c], plan)
                 for label, index, c, plan in p["meshes"].get(key, []))


def _difference(a: tuple, b: tuple, ranks_a: str, ranks_b: str) -> str:
    """What differs between two ranks' module lists on one mesh, in words."""
    labels_a, labels_b = [m[0] for m in a], [m[0] for m in b]
    if labels_a != labels_b:
        only_a = [x for x in labels_a if x not in labels_b]
        only_b = [x for x in labels_b if x not in labels_a]
        if not only_a and not only_b:
            return (f"they install on the same FSDP modules in another order ({labels_a[:6]} "
                    f"against {labels_b[:6]})")
        return ("they install on different FSDP modules: "
                f"{only_a[:6] or 'none'} on ranks {ranks_a} only, {only_b[:6] or 'none'} on "
                f"ranks {ranks_b} only (module_filter_fn or module_configs decide differently)")
    for (label, index_a, config_a, plan_a), (_, index_b, config_b, plan_b) in zip(a, b):
        if config_a != config_b:
            diff = [f"{name}={value_a} on ranks {ranks_a}, {value_b} on ranks {ranks_b}"
                    for (name, value_a), (_, value_b) in zip(config_a, config_b)
                    if value_a != value_b]
            more = f"; and {len(diff) - 6} more" if len(diff) > 6 else ""
            return f"FSDP module {label!r} is configured differently: {'; '.join(diff[:6])}{more}"
        if index_a != index_b:
            return (f"FSDP module {label!r} has RNG bucket {index_a} on ranks {ranks_a}, "
                    f"{index_b} on ranks {ranks_b}")
        if plan_a != plan_b:
            return (f"FSDP module {label!r} has the same configuration but other planned "
                    "collectives (its groups span nodes differently: check the node placement "
                    "against the mesh)")
    return "their records differ"  # not reached: unequal tuples differ somewhere above


def verdict(payloads: Sequence[dict]) -> Optional[str]:
    """The first disagreement among the ranks' payloads, in words, or None. The same text on
    every rank, since every rank reads the same payloads."""
    failed = [r for r, p in enumerate(payloads) if p["failure"] is not None]
    if failed:
        kind, message = payloads[failed[0]]["failure"]
        return (f"fsdp_qcomm.enable() failed on rank(s) {ranks_text(failed)} of "
                f"{len(payloads)}, so it stops on every rank (none trains alone). Rank "
                f"{failed[0]}: {kind}: {message}")
    keys = sorted({k for p in payloads for k in p["meshes"]}, key=repr)
    for key in keys:
        members = [r for r in key[0] if r < len(payloads)]
        groups: dict[tuple, list[int]] = {}
        for r in members:
            groups.setdefault(_expanded(payloads[r], key), []).append(r)
        if len(groups) < 2:
            continue
        (first, ranks_a), (other, ranks_b) = sorted(groups.items(), key=lambda g: g[1][0])[:2]
        return (f"fsdp_qcomm.enable(): the ranks of {_mesh_text(key)} would install different "
                "collectives, whose bytes would not decode on each other: "
                f"{_difference(first, other, ranks_text(ranks_a), ranks_text(ranks_b))}. {_FIX}")
    return None


def check(failure: Optional[BaseException], entries: Sequence[Entry]) -> None:
    """Collective over the world (every rank calls ``enable``): raise on every rank if any rank
    failed or the ranks of a mesh would install differently, else return on every rank."""
    mine = payload(failure, entries)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    text = verdict(every)
    if text is None:
        return
    if failure is not None:
        raise failure
    if any(p["failure"] is not None for p in every):
        raise RuntimeError(text)
    raise ValueError(text)


__all__ = ["Entry", "check", "verdict"]

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
world (``collectives.agreement``): each rank sends whether it failed (the exception's type and
message) and, per device mesh its modules are sharded over, the modules it would install on,
their configurations and a digest of their hop plans. Every rank reads the same list, so every
rank raises (the failing rank its own exception, the others a ``RuntimeError`` naming it), or
every rank goes on. All members of a mesh must agree, HSDP replicas included: replicas that
gathered their weights differently would compute with different weights.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from typing import Any, Optional, Sequence

import torch.distributed as dist

from ..collectives.agreement import gather_unless_failed, ranks_text, stopped_on_ranks
from ..config import QCommConfig

logger = logging.getLogger("fsdp_qcomm")

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


def payload(entries: Sequence[Entry], unused: Sequence[str] = (),
            unused_message: str = "") -> dict:
    """This rank's record: per mesh ``[(label, index, config id, plan digest)]`` with the
    distinct configurations sent once (``configs``), and the ``module_configs`` patterns that
    chose none of its modules (``unused``)."""
    configs: list[tuple] = []
    meshes: dict[MeshKey, list[tuple]] = {}
    for e in entries:
        fields = _fields(e.config)
        if fields not in configs:
            configs.append(fields)
        meshes.setdefault(e.mesh, []).append(
            (e.label, e.index, configs.index(fields), _plan_digest(e.plan)))
    return {"configs": configs, "meshes": meshes, "unused": list(unused),
            "unused_message": unused_message}


def _mesh_text(key: MeshKey) -> str:
    ranks, shape, names = key
    dims = (f"({', '.join(f'{n}={s}' for n, s in zip(names, shape))})" if names
            else f"of shape {' x '.join(map(str, shape))}")
    return f"the device mesh {dims} over ranks {ranks_text(ranks)}"


def _expanded(p: dict, key: MeshKey, indices: bool) -> tuple:
    """A rank's modules on ``key`` with their configurations spelled out (comparable); with
    ``indices``, their RNG buckets too (a walk over every mesh: a difference on one mesh shifts
    the buckets of the others, so buckets are compared only once every mesh agrees)."""
    return tuple((label, index if indices else None, p["configs"][c], plan)
                 for label, index, c, plan in p["meshes"].get(key, []))


def _fields_differ(label: str, config_a: tuple, config_b: tuple, ranks_a: str,
                   ranks_b: str) -> str:
    names_a, names_b = [n for n, _ in config_a], [n for n, _ in config_b]
    if names_a != names_b:
        return (f"FSDP module {label!r}: the ranks' QCommConfig has other fields ({len(names_a)} "
                f"on ranks {ranks_a}, {len(names_b)} on ranks {ranks_b}): they run different "
                "fsdp_qcomm versions. Install the same fsdp_qcomm on every node")
    diff = [f"{name}={value_a} on ranks {ranks_a}, {value_b} on ranks {ranks_b}"
            for (name, value_a), (_, value_b) in zip(config_a, config_b) if value_a != value_b]
    more = f"; and {len(diff) - 6} more" if len(diff) > 6 else ""
    return (f"FSDP module {label!r} is configured differently: {'; '.join(diff[:6])}{more}. "
            f"{_FIX}")


def _difference(a: tuple, b: tuple, ranks_a: str, ranks_b: str) -> str:
    """What differs between two ranks' module lists on one mesh, in words, with the fix."""
    labels_a, labels_b = [m[0] for m in a], [m[0] for m in b]
    if labels_a != labels_b:
        only_a = [x for x in labels_a if x not in labels_b]
        only_b = [x for x in labels_b if x not in labels_a]
        if not only_a and not only_b:
            return (f"they install on the same FSDP modules in another order ({labels_a[:6]} "
                    f"against {labels_b[:6]}). {_FIX}")
        return ("they install on different FSDP modules: "
                f"{only_a[:6] or 'none'} on ranks {ranks_a} only, {only_b[:6] or 'none'} on "
                f"ranks {ranks_b} only (module_filter_fn or module_configs decide differently). "
                f"{_FIX}")
    for (label, index_a, config_a, plan_a), (_, index_b, config_b, plan_b) in zip(a, b):
        if config_a != config_b:
            return _fields_differ(label, config_a, config_b, ranks_a, ranks_b)
        if plan_a != plan_b:
            return (f"FSDP module {label!r} has the same configuration but other planned "
                    "collectives: its process groups span nodes differently on these ranks. "
                    "Lay the mesh out so that every group of a dimension has the same shape "
                    "over the nodes (QCommConfig.ranks_per_node, LOCAL_WORLD_SIZE or the host "
                    "names decide where the nodes are)")
        if index_a != index_b:
            return (f"FSDP module {label!r} has RNG bucket {index_a} on ranks {ranks_a}, "
                    f"{index_b} on ranks {ranks_b}: the ranks walk their FSDP modules in "
                    f"another order. {_FIX}")
    return "their records differ"  # not reached: unequal tuples differ somewhere above


def _unused_everywhere(payloads: Sequence[dict]) -> list[str]:
    """The ``module_configs`` patterns that chose no module on any rank."""
    return sorted(set.intersection(*(set(p["unused"]) for p in payloads)))


def _unused_refused(payloads: Sequence[dict]) -> Optional[str]:
    """Patterns that chose no module anywhere are refused (a typo, more often than not) when
    every rank's model is the whole model (its meshes span the world), with the first rank's
    message; under pipeline parallelism or DiLoCo (meshes over part of the world) a pattern may
    name another stage's or call's modules, so ``check`` only logs them."""
    if not _unused_everywhere(payloads):
        return None
    world = set(range(len(payloads)))
    whole = all({r for key in p["meshes"] for r in key[0]} >= world for p in payloads)
    return payloads[0]["unused_message"] if whole else None


#: what the ranks whose own checks passed raise when others' failed
STOPPED = stopped_on_ranks("fsdp_qcomm.enable() failed",
                           "it stops on every rank (none trains alone)")


def verdict(payloads: Sequence[dict]) -> Optional[str]:
    """The first disagreement among the ranks' payloads, in words, or None. The same text on
    every rank, since every rank reads the same payloads."""
    keys = sorted({k for p in payloads for k in p["meshes"]}, key=repr)
    for indices in (False, True):
        for key in keys:
            groups: dict[tuple, list[int]] = {}
            for r in key[0]:
                if r < len(payloads):
                    groups.setdefault(_expanded(payloads[r], key, indices), []).append(r)
            if len(groups) < 2:
                continue
            (first, ranks_a), (other, ranks_b) = sorted(groups.items(),
                                                        key=lambda g: g[1][0])[:2]
            return (f"fsdp_qcomm.enable(): the ranks of {_mesh_text(key)} would install "
                    "different collectives, whose bytes would not decode on each other: "
                    f"{_difference(first, other, ranks_text(ranks_a), ranks_text(ranks_b))}")
    return _unused_refused(payloads)


def check(failure: Optional[BaseException], entries: Sequence[Entry],
          unused: Sequence[str] = (), unused_message: str = "") -> None:
    """Collective over the world (every rank calls ``enable``): raise on every rank if any rank
    failed (``collectives.agreement``), the ranks of a mesh would install differently, or a
    ``module_configs`` pattern (``unused``: those that chose none of this rank's modules;
    ``unused_message`` says so) chose no module anywhere; else return on every rank."""
    every = gather_unless_failed(payload(entries, unused, unused_message), failure, None,
                                 STOPPED)
    text = verdict(every)
    if text is not None:
        raise ValueError(text)
    left = _unused_everywhere(every)
    if left and dist.get_rank() == 0:
        logger.warning("fsdp_qcomm.enable: module_configs pattern(s) %s match no FSDP module of "
                       "this call on any rank (with pipeline stages or DiLoCo replicas, another "
                       "call's model part may hold them)", left)


__all__ = ["Entry", "check", "verdict"]

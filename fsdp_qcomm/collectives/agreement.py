"""Every member raises, or none does: one object exchange that carries each member's failure.

A check that fails on one rank only (its own arguments, its own environment) would leave that
rank raising and the others waiting in their next collective. So a caller runs its local checks
in a ``try``, then exchanges what it decided together with whether it failed; every member reads
the same list, so every member raises, or every member goes on with the others' records to
compare: ``enable`` (``fsdp.install_agreement``), DiLoCo's construction
(``diloco.replicas.check_same_run``) and every load or save of their state (``fsdp.checkpoint``,
``integrations``, ``DiLoCo.load_state_dict``, torchtitan's pre-load check).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch.distributed as dist
from torch.distributed import ProcessGroup


def gather_unless_failed(record: Any, failure: Optional[BaseException],
                         group: Optional[ProcessGroup],
                         stopped: Callable[[list[int], int, str], str],
                         raises: type[Exception] = RuntimeError) -> list[Any]:
    """Every member's ``record`` over ``group`` (the world when None), in group rank order, from
    one ``all_gather_object``. If a member's own checks failed (``failure``), that member
    re-raises its exception and every other member raises ``raises`` (a caller whose users catch
    one type, such as ``CheckpointMismatch``, passes it: every rank then takes the same branch)
    with the text ``stopped(failed members' group ranks, group size, "Type: message" of the
    first)`` (``stopped_on_ranks`` writes the usual one). In a
    process without ``torch.distributed`` (or alone in ``group``) it raises ``failure`` or
    returns ``[record]``."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        if failure is not None:
            raise failure
        return [record]
    mine = {"failure": None if failure is None else f"{type(failure).__name__}: {failure}",
            "record": record}
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    failed = [i for i, p in enumerate(every) if p["failure"] is not None]
    if failure is not None:
        raise failure
    if failed:
        raise raises(stopped(failed, len(every), every[failed[0]]["failure"]))
    return [p["record"] for p in every]


def stopped_on_ranks(what: str, consequence: str) -> Callable[[list[int], int, str], str]:
    """The usual ``stopped`` text: "<what> on rank(s) [1, 3] of 4, so <consequence>. Rank 1:
    <its exception>"."""
    return lambda failed, size, first: (f"{what} on rank(s) {ranks_text(failed)} of {size}, so "
                                        f"{consequence}. Rank {failed[0]}: {first}")


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


__all__ = ["gather_unless_failed", "ranks_text", "stopped_on_ranks"]

"""The fsdp_qcomm state in checkpoints whose writer keeps one copy for all ranks.

A ``QCommHandle``'s state is per rank (``fsdp.checkpoint``). torch.distributed.checkpoint keeps
it per rank by itself (pass the handle in the ``dcp.save`` / ``dcp.load`` dict). Checkpointers
that save custom state from one process only, or hand it back without calling
``load_state_dict``, need it written next to their checkpoint, one file per rank:

* ``save_rank_state(handle, folder)`` / ``load_rank_state(handle, folder)``: every rank writes
  or reads ``folder/rank<r>_of_<W>.pt`` (``torch.save`` of ``handle.state_dict()``, read back
  with ``weights_only=True``); the building block of the two below, usable with any checkpoint
  folder;
* ``fsdp_qcomm.integrations.accelerate.register(accelerator, handle)``: Hugging Face Accelerate's
  ``save_state`` / ``load_state`` (its own ``register_for_checkpointing`` saves the main
  process's copy only);
* ``fsdp_qcomm.integrations.lightning.save`` / ``load``: Lightning Fabric's ``fabric.save`` /
  ``fabric.load`` (which save non-module state as rank 0's metadata and hand it back as a plain
  dict).

A state that reaches the wrong rank anyway is refused by ``handle.load_state_dict`` naming whose
it is (``CheckpointMismatch``), never loaded.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Union

import torch
import torch.distributed as dist

from ..collectives.agreement import gather_unless_failed, stopped_on_ranks
from ..fsdp.checkpoint import RESUME_WITHOUT_STATE, CheckpointMismatch, parse_rank_key, rank_key

PathLike = Union[str, "os.PathLike[str]"]


def rank_state_path(folder: PathLike, rank: int, world: int) -> Path:
    return Path(folder) / f"{rank_key(rank, world)}.pt"


def save_rank_state(handle: Any, folder: PathLike) -> Path:
    """Write this rank's ``handle.state_dict()`` to ``folder/rank<r>_of_<W>.pt`` (call on every
    rank: collective; written to a temporary name first, then renamed). Rank 0 also removes
    files that runs of other world sizes left in ``folder``, so a loader never mistakes them for
    this run's. A write that fails on one rank (a full or read-only node-local disk) raises on
    every rank, the others naming it, before any rank replaces its file: not waiting in their
    next collective with a folder of mixed saves. Returns the path written."""
    rank, world = dist.get_rank(), dist.get_world_size()
    folder = Path(folder)
    path = rank_state_path(folder, rank, world)
    tmp = path.with_name(path.name + ".tmp")
    failure = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(handle.state_dict(), tmp)
    except Exception as e:  # raised on every rank by the exchange below
        failure = e
    # every rank wrote, or none renames: a folder that held an earlier save of this world size
    # keeps that save whole (one rank's new file beside the others' old ones would load)
    try:
        gather_unless_failed(None, failure, None, stopped_on_ranks(
            f"fsdp_qcomm: writing the per-rank state to {str(folder)!r} failed",
            "no rank replaced its file there"))
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    if rank == 0:
        for f in folder.glob("rank*_of_*.pt"):
            owner = parse_rank_key(f.name[:-3])
            if owner is not None and owner[1] != world:
                f.unlink(missing_ok=True)
    return path


def load_rank_state(handle: Any, folder: PathLike) -> None:
    """Read this rank's file from ``folder`` and ``handle.load_state_dict`` it (call on every
    rank: collective). A missing or unreadable file, or one another rank, world size, placement
    or configuration wrote, raises ``CheckpointMismatch`` naming what the folder holds and what
    to do, on every rank alike (a rank whose file was fine names the one that failed)."""
    handle._load_state_from(lambda: _read_rank_state(Path(folder)))


def _read_rank_state(folder: Path) -> Any:
    rank, world = dist.get_rank(), dist.get_world_size()
    path = rank_state_path(folder, rank, world)
    if not path.is_file():
        found = sorted(o for o in (parse_rank_key(f.name[:-3])
                                   for f in folder.glob("rank*_of_*.pt")) if o)
        if not found:
            raise CheckpointMismatch(
                f"fsdp_qcomm: no fsdp_qcomm state in {str(folder)!r} (saved without it?); "
                f"{RESUME_WITHOUT_STATE}"
            )
        worlds = sorted({w for _, w in found})
        raise CheckpointMismatch(
            f"fsdp_qcomm: {str(folder)!r} holds the fsdp_qcomm state of rank(s) "
            f"{[r for r, _ in found]} of a run of {' / '.join(map(str, worlds))} ranks, none "
            f"for rank {rank} of {world}. The state is per rank and cannot move to another "
            "world size or be shared between ranks; resume with the world size that saved it, "
            "or do not load it (the next weight gathers send full precision)"
        )
    return torch.load(path, map_location="cpu", weights_only=True)


__all__ = ["load_rank_state", "rank_state_path", "save_rank_state"]

"""Lightning Fabric: the fsdp_qcomm state around ``fabric.save`` / ``fabric.load``.

``fabric.save(path, {..., "qcomm": handle})`` does not work for a ``QCommHandle``: Fabric saves
every entry that is not a module or optimizer as metadata written by rank 0 alone, and
``fabric.load`` (with a distributed checkpoint) hands that entry back as a plain dict instead of
calling ``handle.load_state_dict``: the handle would silently start afresh, or, loaded by hand,
every rank would get rank 0's state (refused by ``handle.load_state_dict``). Use these instead,
on every rank::

    state = {"model": model, "optimizer": optimizer, "step": step}
    fsdp_qcomm.integrations.lightning.save(fabric, path, state, handle)
    ...
    remainder = fsdp_qcomm.integrations.lightning.load(fabric, path, state, handle)

They call ``fabric.save`` / ``fabric.load`` with ``state`` unchanged and write / read one file per
rank: in ``path/fsdp_qcomm/`` for a distributed checkpoint (a folder, the default of
``ModelParallelStrategy``), in ``<path>.fsdp_qcomm/`` beside a single-file checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from ..fsdp.enable import QCommHandle
from . import load_rank_state, save_rank_state

FOLDER = "fsdp_qcomm"


def state_folder(path: Any) -> Path:
    """Where the per-rank files of the checkpoint at ``path`` go."""
    path = Path(path)
    if path.is_dir():
        return path / FOLDER
    return path.with_name(path.name + "." + FOLDER)


def save(fabric: Any, path: Any, state: dict[str, Any], handle: Any,
         filter: Optional[dict[str, Any]] = None) -> None:
    """``fabric.save(path, state)``, then every rank writes its fsdp_qcomm state next to it."""
    _refuse_handle_in(state, "save")
    path = Path(fabric.broadcast(str(path)))  # one path for all ranks, as fabric.save does
    fabric.save(path, state, filter=filter)
    save_rank_state(handle, state_folder(path))
    fabric.barrier()


def load(fabric: Any, path: Any, state: Optional[dict[str, Any]], handle: Any,
         strict: bool = True) -> dict[str, Any]:
    """``fabric.load(path, state, strict)``, then every rank loads its own fsdp_qcomm state
    (``CheckpointMismatch`` when the checkpoint has none for it). Returns what fabric.load
    returns."""
    _refuse_handle_in(state or {}, "load")
    path = Path(fabric.broadcast(str(path)))
    remainder = fabric.load(path, state, strict=strict)
    load_rank_state(handle, state_folder(path))
    return remainder


def _refuse_handle_in(state: dict[str, Any], what: str) -> None:
    keys = [k for k, v in state.items() if isinstance(v, QCommHandle)]
    if keys:
        raise ValueError(
            f"fsdp_qcomm.integrations.lightning.{what}: state[{keys[0]!r}] is the QCommHandle; "
            "pass it as the handle argument only (in fabric's state it would be saved as rank "
            "0's metadata)"
        )


__all__ = ["FOLDER", "load", "save", "state_folder"]

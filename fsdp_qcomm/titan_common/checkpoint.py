"""torchtitan checkpoints carry the fsdp_qcomm handles' state under the key ``"qcomm"``.

Each ``QCommHandle`` is a DCP ``Stateful``: this rank's state under its own key (per FSDP
module the RNG call counters, learned level tables, this rank's shard of the qWD reference and
its error-feedback residuals, with a record of who wrote it; ``fsdp/checkpoint.py``), so every
rank saves and loads its own. Without it a resumed run rebuilds the reference at full precision
and restarts the counters, so it continues close to, but not exactly like, a run that never
stopped. Each adapter adds one :class:`HandlesState` entry to the states its checkpoint manager
saves and loads, next to ``model``, ``optimizer``, ``lr_scheduler``, ``dataloader`` and
``train_state``: then a resume is bit for bit the uninterrupted run.

Checkpoints written without the entry (older fsdp_qcomm, or no hooks installed) lack the key;
load them with ``--checkpoint.exclude_from_loading qcomm``: the handles then start fresh and
the first gathers send full precision, as before.
"""

from __future__ import annotations

from typing import Any, Optional

from torch.distributed.checkpoint.stateful import Stateful

from .comm_stats import attachment_of

STATE_KEY = "qcomm"


class HandlesState(Stateful):
    """The handles of all model parts (pipeline stages) as one checkpoint entry."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles

    def state_dict(self) -> dict[str, Any]:
        return {f"part{i}": h.state_dict() for i, h in enumerate(self.handles)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        mine = [f"part{i}" for i in range(len(self.handles))]
        if sorted(state_dict) != sorted(mine):
            raise ValueError(
                f"the checkpoint's {STATE_KEY!r} entry covers model parts {sorted(state_dict)}, "
                f"this run has {mine}; resume with the same pipeline layout, or pass "
                f"--checkpoint.exclude_from_loading {STATE_KEY} to start the hooks fresh"
            )
        for i, h in enumerate(self.handles):
            h.load_state_dict(state_dict[f"part{i}"])


def handles_of(model_parts) -> list[Any]:
    """The live ``QCommHandle`` of each model part ``install_qcomm`` hooked."""
    return [a.handle for a in attachment_of(model_parts)
            if a.handle is not None and a.handle.enabled]


def add_handles_state(states: dict[str, Any], model_parts) -> Optional[HandlesState]:
    """Add the ``"qcomm"`` entry to a checkpoint manager's ``states`` (if hooks are installed
    and the entry is not there yet); returns the entry added."""
    handles = handles_of(model_parts)
    if not handles or STATE_KEY in states:
        return None
    states[STATE_KEY] = entry = HandlesState(handles)
    return entry


__all__ = ["HandlesState", "STATE_KEY", "add_handles_state", "handles_of"]

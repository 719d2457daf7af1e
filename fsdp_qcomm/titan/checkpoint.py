"""torchtitan checkpoints carry the fsdp_qcomm handles' state (key ``"qcomm"``).

Each ``QCommHandle`` is a DCP ``Stateful``: per FSDP module, the RNG call counters of the
weight and gradient collectives and this rank's shard of the qWD reference
(``fsdp/enable.py``). Without them a resumed run rebuilds the reference at full precision and
restarts the counters, so it continues close to, but not exactly like, a run that never
stopped. :func:`patch_checkpoint_manager` wraps ``CheckpointManager.__init__`` (no torchtitan
file is edited) to add one more entry to the states it saves and loads, next to ``model``,
``optimizer``, ``lr_scheduler``, ``dataloader`` and ``train_state``: then a resume is bit for
bit the uninterrupted run.

Checkpoints written without the entry (older fsdp_qcomm, or no hooks installed) lack the key;
load them with ``--checkpoint.exclude_from_loading qcomm``: the handles then start fresh and
the first gathers send full precision, as before.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.stateful import Stateful

from fsdp_qcomm.titan.comm_stats import attachment_of

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
    """The live ``QCommHandle`` of each model part the parallelize wrapper hooked."""
    return [a.handle for a in attachment_of(model_parts)
            if a.handle is not None and a.handle.enabled]


def patch_checkpoint_manager() -> bool:
    """Make every ``CheckpointManager`` built afterwards save and load the handles' state.
    Idempotent; returns whether it patched now."""
    from torchtitan.components import checkpoint as ckpt

    cls = ckpt.CheckpointManager
    if getattr(cls.__init__, "_fsdp_qcomm", False):
        return False
    original = cls.__init__

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        parts = kwargs.get("model_parts", args[1] if len(args) > 1 else None)
        handles = handles_of(parts)
        if handles and STATE_KEY not in self.states:
            self.states[STATE_KEY] = HandlesState(handles)

    __init__._fsdp_qcomm = True  # type: ignore[attr-defined]
    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    cls.__init__ = __init__
    return True


__all__ = ["HandlesState", "STATE_KEY", "handles_of", "patch_checkpoint_manager"]

"""torchtitan 0.2.2 checkpoints save and load the handles' state and DiLoCo's
(``titan_common.checkpoint``).

:func:`patch_checkpoint_manager` wraps ``CheckpointManager.__init__`` (no torchtitan file is
edited; 0.2.2 offers no other way in from a ``custom_import`` module) so that every manager
built afterwards adds the ``"qcomm"`` entry to the states it saves and loads, and, when a
``DiLoCoDriver`` is attached to the model part (``[diloco] enable``), the ``"diloco"`` entry.
For the latter it also wraps that manager's ``dcp_load`` (``titan_common.checkpoint.
wrap_dcp_load``, shared with the 0.3 adapter): torchtitan loads its flattened model after
``dcp.load`` returns, over every replica group alike, so the entry's replica part goes into the
model and the inner optimizer after that (``DiLoCoState.finish_load``); and a checkpoint
without the entry is refused before anything loads, naming
``--checkpoint.exclude_from_loading diloco``.
"""

from __future__ import annotations

from typing import Any

from fsdp_qcomm.titan_common.checkpoint import (
    add_diloco_state,
    add_handles_state,
    wrap_dcp_load,
)


def patch_checkpoint_manager() -> bool:
    """Make every ``CheckpointManager`` built afterwards save and load the handles' state
    (and DiLoCo's, when it is on). Idempotent; returns whether it patched now."""
    from torchtitan.components import checkpoint as ckpt

    cls = ckpt.CheckpointManager
    if getattr(cls.__init__, "_fsdp_qcomm", False):
        return False
    original = cls.__init__

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        parts = kwargs.get("model_parts", args[1] if len(args) > 1 else None)
        add_handles_state(self.states, parts)
        entry = add_diloco_state(self.states, parts, self.states.get(ckpt.OPTIMIZER))
        if entry is not None:
            wrap_dcp_load(self, entry)

    __init__._fsdp_qcomm = True  # type: ignore[attr-defined]
    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    cls.__init__ = __init__
    return True


__all__ = ["patch_checkpoint_manager"]

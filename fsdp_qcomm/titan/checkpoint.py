"""torchtitan 0.2.2 checkpoints save and load the handles' state (``titan_common.checkpoint``).

:func:`patch_checkpoint_manager` wraps ``CheckpointManager.__init__`` (no torchtitan file is
edited; 0.2.2 offers no other way in from a ``custom_import`` module) so that every manager
built afterwards adds the ``"qcomm"`` entry to the states it saves and loads.
"""

from __future__ import annotations

from typing import Any

from fsdp_qcomm.titan_common.checkpoint import add_handles_state


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
        add_handles_state(self.states, parts)

    __init__._fsdp_qcomm = True  # type: ignore[attr-defined]
    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    cls.__init__ = __init__
    return True


__all__ = ["patch_checkpoint_manager"]

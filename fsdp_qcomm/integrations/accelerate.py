"""Hugging Face Accelerate: the fsdp_qcomm state in ``save_state`` / ``load_state``.

``accelerator.register_for_checkpointing(handle)`` does not work for a ``QCommHandle``:
Accelerate writes registered objects from the main process only (``custom_checkpoint_<i>.pkl``)
and every rank loads that one file, so every rank would get rank 0's state (refused by
``handle.load_state_dict``). ``register(accelerator, handle)`` instead adds a save and a load
pre-hook (``register_save_state_pre_hook`` / ``register_load_state_pre_hook``, which run on
every process) that write and read one file per rank in ``<checkpoint>/fsdp_qcomm/``::

    model, optimizer = accelerator.prepare(model, optimizer)   # FSDP2 plugin
    handle = fsdp_qcomm.enable(model, config)
    fsdp_qcomm.integrations.accelerate.register(accelerator, handle)
    ...
    accelerator.save_state(path)    # also writes path/fsdp_qcomm/rank<r>_of_<W>.pt
    accelerator.load_state(path)    # loads model and optimizer, then this rank's file

The load hook runs after Accelerate loaded the model and optimizer and before the other state
(RNG, samplers, custom objects); a checkpoint without the folder, or from another world size,
raises ``CheckpointMismatch`` there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import load_rank_state, save_rank_state

FOLDER = "fsdp_qcomm"


def register(accelerator: Any, handle: Any) -> tuple[Any, Any]:
    """Save ``handle``'s state with every ``accelerator.save_state`` and restore it with every
    ``accelerator.load_state``, one file per rank. Returns the two hook handles (``.remove()``
    undoes). Refuses a handle already passed to ``register_for_checkpointing``."""
    if any(obj is handle for obj in getattr(accelerator, "_custom_objects", ())):
        raise ValueError(
            "this QCommHandle is registered with accelerator.register_for_checkpointing, which "
            "saves the main process's state only and loads it on every rank; do not register it "
            "there, fsdp_qcomm.integrations.accelerate.register saves one file per rank instead"
        )

    def save_hook(models: Any, weights: Any, output_dir: str) -> None:
        save_rank_state(handle, Path(output_dir) / FOLDER)

    def load_hook(models: Any, input_dir: str) -> None:
        load_rank_state(handle, Path(input_dir) / FOLDER)

    return (accelerator.register_save_state_pre_hook(save_hook),
            accelerator.register_load_state_pre_hook(load_hook))


__all__ = ["FOLDER", "register"]

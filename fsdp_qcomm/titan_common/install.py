"""Install the hooks on torchtitan's model parts: one plain function both adapters call.

torchtitan applies ``fully_shard`` inside its parallelize function, once per model part
(pipeline stages call it per stage); each adapter wraps that function and calls
:func:`install_qcomm` on what it returns. Nothing here imports torchtitan.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from fsdp_qcomm.config import QCommConfig

from .comm_stats import ATTACHMENT_ATTR, QCommAttachment

logger = logging.getLogger(__name__)


def _fsdp_module_count(model: torch.nn.Module) -> int:
    from torch.distributed.fsdp import FSDPModule

    return sum(isinstance(m, FSDPModule) for m in model.modules())


def _check_fsdp_everywhere(counts: list[int]) -> None:
    """Collective over the world: every rank's parts hold FSDP modules where every other rank's
    do. ``enable`` runs world collectives, so a part installed on some ranks and skipped (no
    FSDP modules) on others would leave those ranks waiting; every rank raises instead."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    from fsdp_qcomm.collectives.agreement import ranks_text

    mine = [n > 0 for n in counts]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if any(e != every[0] for e in every):
        kinds: dict[str, list[int]] = {}
        for rank, e in enumerate(every):
            kinds.setdefault(str(e), []).append(rank)
        raise ValueError(
            "qcomm: the model parts hold FSDP modules on some ranks only (which parts have "
            "them, per rank: " + "; ".join(f"{k} on ranks {ranks_text(r)}"
                                          for k, r in kinds.items())
            + "). fsdp_qcomm installs on every rank's part or on none: apply fully_shard alike "
            "on every rank (the same data_parallel_shard_degree for every pipeline stage)")


def install_qcomm(
    model_parts: list[torch.nn.Module], config: QCommConfig, *, preset: str = "custom",
    overrides: Optional[dict[str, Any]] = None, module_filter_fn: Optional[Any] = None,
    module_configs: Optional[dict[str, QCommConfig]] = None,
) -> list[QCommAttachment]:
    """``fsdp_qcomm.enable(part, config)`` on every model part that has FSDP modules.

    Leaves a :class:`QCommAttachment` on each part (``comm_stats.ATTACHMENT_ATTR``), which the
    metrics processors and the checkpoint entry read, and returns them. ``preset`` and
    ``overrides`` only label the run (logs, summary file); ``module_filter_fn`` and
    ``module_configs`` go to ``enable`` (the section's ``exclude_modules``/``module_presets``).

    Safe while the parameters are still on the meta device (torchtitan materializes and
    initializes them after parallelizing): ``enable`` records nothing about parameter values
    or storages; each qWD all-gather builds its reference on its first gather (full
    precision), which comes after initialization (and after a checkpoint load, which counts as
    a change outside the optimizer). ``enable`` also forces FSDP's SUM reduction where it is
    needed (modules with a quantized reduce-scatter and torchtitan's divide factor 1.0, and
    gloo modules with that factor), so nothing here touches that setting.
    """
    from fsdp_qcomm import enable

    attachments = []
    counts = [_fsdp_module_count(part) for part in model_parts]
    _check_fsdp_everywhere(counts)  # collective: before enable's, which only some would call
    for part, n_fsdp in zip(model_parts, counts):
        att = QCommAttachment(config=config, preset=preset, fsdp_modules=n_fsdp)
        if n_fsdp == 0:
            att.note = "no FSDP modules (single process or FSDP disabled): nothing to install"
            logger.info(f"qcomm: {att.note}")
        else:
            att.handle = enable(part, config, module_filter_fn=module_filter_fn,
                                module_configs=module_configs)
            groups = len(att.handle.group_labels)
            logger.info(
                f"qcomm: preset {preset!r} overrides {overrides or {}}: installed on "
                f"{len(att.handle.module_names)} of {n_fsdp} FSDP modules"
                + (f" ({groups} parameter groups)" if groups != len(att.handle.module_names)
                   else "")
            )
        setattr(part, ATTACHMENT_ATTR, att)
        attachments.append(att)
    return attachments


__all__ = ["install_qcomm"]

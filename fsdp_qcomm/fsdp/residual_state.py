"""Error-feedback residuals in checkpoints and in the memory figures.

Each rank's residuals are its own (what *its* encodings lost), so they are saved as DTensors
sharded ``Shard(0)`` over every dimension of the module's device mesh: global shape
``[mesh size * n]``, rank ``i`` of the mesh holding ``n`` values. torch.distributed.checkpoint
then writes every rank's piece (a plain tensor would be saved once, from rank 0). A resumed run
must use the same mesh; loading into another world size fails in DCP's shape check, and a run
without the saved residuals starts them at zero (``QCommHandle.load_state_dict``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

from . import internals as fsdp


def shard_numel(group: Any) -> int:
    """Values of one rank's reduce-scatter output (and of its replica all-reduce) when every
    parameter of the group has a gradient."""
    return sum(fsdp.padded_shard_numel(fp) for fp in fsdp.fsdp_params(group))


def _buffers(hook: Any, group: Any) -> dict[str, torch.Tensor]:
    if hook is None or getattr(hook, "feedback", None) is None or not fsdp.fsdp_params(group):
        return {}
    device = fsdp.group_device(group)
    return {site: hook.feedback.buffer(site, shape, device)
            for site, shape in hook.feedback_shapes(shard_numel(group)).items()}


def residual_bytes(hook: Any, group: Any) -> int:
    """fp32 bytes of the residuals ``hook`` keeps on this rank in steady state."""
    if hook is None or getattr(hook, "feedback", None) is None:
        return 0
    shapes = hook.feedback_shapes(shard_numel(group))
    return 4 * sum(torch.Size(s).numel() for s in shapes.values())


def residual_entries(hooks: dict[str, Any], group: Any) -> dict[str, DTensor]:
    """``{"<hook>.<site>": DTensor}`` of this rank's residuals (views of the live buffers)."""
    params = fsdp.sharded_params(group)
    out: dict[str, DTensor] = {}
    for name, hook in hooks.items():
        for site, buf in _buffers(hook, group).items():
            mesh = params[0].device_mesh
            flat = buf.view(-1)
            out[f"{name}.{site}"] = DTensor.from_local(
                flat, mesh, [Shard(0)] * mesh.ndim, run_check=False,
                shape=(mesh.size() * flat.numel(),), stride=(1,),
            )
    return out


def load_residuals(hooks: dict[str, Any], group: Any, entries: dict[str, Any], label: str) -> None:
    """Copy saved residuals into the hooks' buffers; without saved ones, start from zero."""
    for name, hook in hooks.items():
        for site, buf in _buffers(hook, group).items():
            saved = entries.get(f"{name}.{site}")
            if saved is None:
                buf.zero_()
                continue
            local = saved.to_local() if isinstance(saved, DTensor) else saved
            if local.numel() != buf.numel():
                raise ValueError(
                    f"FSDP module {label!r}: the checkpoint's error-feedback residual "
                    f"{name}.{site} has {local.numel()} values on this rank, this run keeps "
                    f"{buf.numel()}; resume with the same mesh and grad settings, or drop "
                    "'grad_residuals' from the saved fsdp_qcomm state to start them at zero"
                )
            buf.view(-1).copy_(local.reshape(-1))


__all__ = ["load_residuals", "residual_bytes", "residual_entries", "shard_numel"]

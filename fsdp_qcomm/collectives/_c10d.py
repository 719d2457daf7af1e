"""The c10d collectives whose names changed between the torch releases fsdp-qcomm supports.

torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to
``all_gather_single`` / ``reduce_scatter_single`` (the old names warn from 2.13); torch 2.9-2.12
have only the old ones. The name is looked up at each call, not at import, so a test or
benchmark that wraps ``torch.distributed``'s function to count bytes sees every call.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp


def all_gather_single(output: torch.Tensor, input: torch.Tensor,
                      group: Optional[ProcessGroup] = None, async_op: bool = False) -> Any:
    """``dist.all_gather_single`` (torch >= 2.13) or ``dist.all_gather_into_tensor``."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, op: Any = ReduceOp.SUM,
                          group: Optional[ProcessGroup] = None, async_op: bool = False) -> Any:
    """``dist.reduce_scatter_single`` (torch >= 2.13) or ``dist.reduce_scatter_tensor``."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, op=op, group=group, async_op=async_op)


def coalesced(group: ProcessGroup):
    """A context in which same-kind collectives on ``group`` are issued as one (NCCL: one
    grouped launch; gloo and ``fake`` run them as one call too): torch's private
    ``_coalescing_manager``, present with this signature in every torch fsdp-qcomm supports
    (2.10-2.15, ``tests/test_fsdp_canaries.py``)."""
    from torch.distributed.distributed_c10d import _coalescing_manager

    return _coalescing_manager(group=group)


def coalesces(group: ProcessGroup, device: torch.device) -> bool:
    """Whether ``coalesced`` may group all-gathers of ``device`` tensors on ``group``. Not on
    gloo with CUDA tensors: gloo's coalesced all-gather (``allgather_into_tensor_coalesced``,
    what torch issues for coalesced ``all_gather_into_tensor`` calls) has no CUDA path (read in
    torch's source and in the 2.11 and 2.15 wheels) and hands the device pointers to its host
    code without an error, where each
    single all-gather stages CUDA tensors through host memory (``docs/known_issues.md``). True
    where the group does not say (a torch without ``_get_backend``, a wrapper)."""
    if device.type == "cpu":
        return True
    try:
        name = group._get_backend(device).name()
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return True
    return name != "gloo"


def carries(group: ProcessGroup, device: torch.device) -> bool:
    """Whether ``group`` has a backend for tensors on ``device``'s type: an NCCL group carries
    no CPU tensor (torch raises "No backend type associated with device type cpu" at the first
    collective), a ``"cuda:nccl,cpu:gloo"`` group carries both. True where the group does not
    say (a torch without ``_device_types``, a wrapper that registers no backend)."""
    try:
        types = list(group._device_types)
    except (AttributeError, RuntimeError, TypeError):
        return True
    return not types or any(t.type == device.type for t in types)


def all_gather_name() -> str:
    """The name this torch gives the single-tensor all-gather (what a byte counter wraps)."""
    return "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


def reduce_scatter_name() -> str:
    return ("reduce_scatter_single" if hasattr(dist, "reduce_scatter_single")
            else "reduce_scatter_tensor")


__all__ = ["all_gather_name", "all_gather_single", "carries", "coalesced", "coalesces",
           "reduce_scatter_name", "reduce_scatter_single"]

"""The one place that reads (and, for HSDP, swaps) FSDP2's private state.

FSDP2 exposes public setters (``set_custom_all_gather``, ``set_all_reduce_hook``, ...) but no
getters: which process groups a module uses, what is installed, where a parameter's shard lives
and whether the group is inside backward are private attributes of ``FSDPParamGroup`` and
``FSDPParam`` (``torch/distributed/fsdp/_fully_shard/``). Every such read of fsdp-qcomm goes
through these functions, so a torch upgrade that renames one is a one-file change. Checked
against torch 2.13 and 2.14.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_common import (
    DDPMeshInfo,
    FSDPMeshInfo,
    TrainingState,
)

ParamGroup = Any  # torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup
FSDPParam = Any  # torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam


# ---- modules and their parameter groups -------------------------------------------------------
def param_groups(module: nn.Module) -> list[ParamGroup]:
    """The FSDP parameter groups of one ``fully_shard``-ed module (several with per-parameter
    meshes from ``shard_placement_fn``; none for a module without parameters of its own)."""
    if not isinstance(module, FSDPModule):
        raise TypeError(f"{type(module).__name__} is not an FSDP module")
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # older torch: at most one group
        group = getattr(state, "_fsdp_param_group", None)
        return [] if group is None else [group]
    return list(groups)


def fsdp_params(group: ParamGroup) -> list[FSDPParam]:
    return list(group.fsdp_params)


def group_modules(group: ParamGroup) -> tuple[nn.Module, ...]:
    """The modules sharing this group (several for ``fully_shard([a, b])``)."""
    return tuple(group.modules)


# ---- process groups ---------------------------------------------------------------------------
def shard_group(group: ParamGroup) -> dist.ProcessGroup:
    """The group FSDP all-gathers and reduce-scatters over (the whole mesh for 1-D FSDP, one
    row of the mesh under HSDP)."""
    return group.mesh_info.shard_process_group


def reduce_scatter_group(group: ParamGroup) -> dist.ProcessGroup:
    """The group FSDP hands the reduce-scatter: the shard group, or the dedicated one from
    ``set_separate_reduce_scatter_group``."""
    info = group.mesh_info
    return getattr(info, "reduce_scatter_process_group", None) or info.shard_process_group


def is_hsdp(group: ParamGroup) -> bool:
    """True for a 2-D (replicate, shard) mesh: FSDP all-reduces gradients across replicas."""
    info = group.mesh_info
    return isinstance(info, DDPMeshInfo) and isinstance(info, FSDPMeshInfo)


def replicate_group(group: ParamGroup) -> Optional[dist.ProcessGroup]:
    """The replica group FSDP all-reduces over under HSDP (None otherwise), as FSDP will use it
    now (``swap_replicate_group`` may have replaced it)."""
    if not is_hsdp(group):
        return None
    return group.mesh_info.replicate_process_group


def swap_replicate_group(group: ParamGroup, new: dist.ProcessGroup) -> dist.ProcessGroup:
    """Make FSDP's HSDP all-reduce run over ``new``; returns the group it replaces.

    FSDP reads the replica group only when it launches the all-reduce
    (``FSDPParamGroup._all_reduce_process_group``); DTensor placements, state dicts and
    ``clip_grad_norm_`` use the device mesh, which is untouched. The mesh-info object may be
    shared by the groups of one ``fully_shard`` call, so this acts on all of them at once.
    """
    if not is_hsdp(group):
        raise ValueError("swap_replicate_group needs an HSDP parameter group (2-D mesh)")
    info = group.mesh_info
    old = info.replicate_process_group
    info.replicate_process_group = new
    return old


def mesh_info_id(group: ParamGroup) -> int:
    """Identity of the group's mesh-info object (shared by the groups of one fully_shard call)."""
    return id(group.mesh_info)


# ---- installed collectives and reduction settings ----------------------------------------------
def installed_comms(group: ParamGroup) -> tuple[Any, Any]:
    """(custom all-gather, custom reduce-scatter) currently installed; FSDP's defaults are
    objects of its own classes."""
    return group._all_gather_comm, group._reduce_scatter_comm


def all_reduce_hook(group: ParamGroup) -> Optional[Callable[[torch.Tensor], None]]:
    return group._all_reduce_hook


def set_all_reduce_hook(group: ParamGroup, hook: Optional[Callable[[torch.Tensor], None]]) -> None:
    """Install (or with None, remove) the all-reduce hook of this one group. FSDP's public
    ``set_all_reduce_hook`` cannot remove a hook, which ``disable`` must do."""
    group._all_reduce_hook = hook


def force_sum(group: ParamGroup) -> bool:
    return bool(group.force_sum_reduction_for_comms)


def gradient_divide_factor(group: ParamGroup) -> Optional[float]:
    return group.gradient_divide_factor


def all_reduce_grads(group: ParamGroup) -> bool:
    """False after ``set_requires_all_reduce(False)`` (HSDP: accumulate, all-reduce later)."""
    return bool(getattr(group, "all_reduce_grads", True))


def partial_reduce_output(group: ParamGroup) -> Optional[torch.Tensor]:
    return getattr(group, "_partial_reduce_output", None)


def post_divide_factor(group: ParamGroup, reduce_dtype: torch.dtype) -> Optional[float]:
    """The factor FSDP divides the reduced output by after the reduction hooks (None: none),
    from FSDP's own ``_get_gradient_divide_factors`` and the groups it will pass."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        _get_gradient_divide_factors,
    )

    _, post, _, _ = _get_gradient_divide_factors(
        reduce_scatter_group(group), replicate_group(group), reduce_dtype,
        group.device.type, gradient_divide_factor(group), force_sum(group),
    )
    return None if post is None or post == 1 else post


def orig_dtype(group: ParamGroup) -> Optional[torch.dtype]:
    return group._orig_dtype


def param_dtype(group: ParamGroup) -> Optional[torch.dtype]:
    return group.mp_policy.param_dtype


# ---- state ------------------------------------------------------------------------------------
def in_backward(group: ParamGroup) -> bool:
    """The group is unsharding for backward (its all-gather is a backward re-gather)."""
    return group._training_state == TrainingState.PRE_BACKWARD


def autograd_running() -> bool:
    """Autograd is executing a backward pass on this thread (FSDP's ``is_bw``): forwards that
    run now are activation-checkpoint recomputations, not new forwards."""
    return torch._C._current_graph_task_id() != -1


def reshards_after_forward(group: ParamGroup) -> bool:
    """The forward frees the unsharded parameters, so backward gathers them again."""
    return group.post_forward_mesh_info is not None


def uses_post_forward_mesh(group: ParamGroup) -> bool:
    """``reshard_after_forward=<int>``: resharded to a smaller group after forward."""
    return bool(group._use_post_forward_mesh)


# ---- parameters -------------------------------------------------------------------------------
def padded_shard_numel(fp: FSDPParam) -> int:
    """Elements of the parameter's padded shard in FSDP's flat all-gather buffer."""
    return math.prod(fp.padded_sharded_param_size)


def has_pre_all_gather_extension(fp: FSDPParam) -> bool:
    """The parameter is a tensor subclass with its own all-gather (``fsdp_pre_all_gather``)."""
    return hasattr(fp._sharded_local_tensor, "fsdp_pre_all_gather")


def param_signature(fp: FSDPParam) -> tuple:
    """(param object, its version, the local shard's version, the flat data's version and
    address): changes when the sharded parameter is replaced or written by a per-tensor
    in-place op (``p.mul_``, ``p.copy_``, ``load_state_dict``). Checked on torch 2.13: foreach
    and fused kernels (``Adam(foreach=True)``, ``AdamW(fused=True)``) and writes through
    ``p.data`` leave every one of these versions unchanged, so optimizer steps must be learned
    from ``torch.optim`` step hooks, not from this signature."""
    p = fp.sharded_param
    local = fp._sharded_local_tensor
    data = fp._sharded_param_data
    return (id(p), p._version, local._version, data._version, data.data_ptr())


def post_accumulate_grad_hooks(param: torch.Tensor) -> list[Callable[[torch.Tensor], None]]:
    """Hooks FSDP calls on a sharded parameter right after writing its reduced gradient."""
    return list((getattr(param, "_post_accumulate_grad_hooks", None) or {}).values())


def owning_module(fp: FSDPParam) -> nn.Module:
    return fp._module_info.module


def local_param_name(fp: FSDPParam) -> str:
    return fp._module_info.param_name


def param_dtypes(fp: FSDPParam) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
    """(original, all-gather, reduce) dtypes; final only after FSDP's lazy init."""
    orig = getattr(fp, "orig_dtype", None) or fp.sharded_param.dtype
    pdt = getattr(fp, "param_dtype", None) or orig
    rdt = getattr(fp, "reduce_dtype", None) or pdt
    return orig, pdt, rdt


def offloads_to_cpu(fp: FSDPParam) -> bool:
    return bool(fp.offload_to_cpu)


__all__ = [
    "all_reduce_grads",
    "all_reduce_hook",
    "autograd_running",
    "force_sum",
    "fsdp_params",
    "gradient_divide_factor",
    "group_modules",
    "has_pre_all_gather_extension",
    "in_backward",
    "installed_comms",
    "is_hsdp",
    "local_param_name",
    "mesh_info_id",
    "offloads_to_cpu",
    "orig_dtype",
    "owning_module",
    "padded_shard_numel",
    "param_dtype",
    "param_dtypes",
    "param_groups",
    "param_signature",
    "partial_reduce_output",
    "post_accumulate_grad_hooks",
    "post_divide_factor",
    "reduce_scatter_group",
    "replicate_group",
    "reshards_after_forward",
    "set_all_reduce_hook",
    "shard_group",
    "swap_replicate_group",
    "uses_post_forward_mesh",
]

"""The one place that reads (and, for HSDP, swaps) FSDP2's private state, and checks it.

FSDP2 exposes public setters (``set_custom_all_gather``, ``set_all_reduce_hook``, ...) but no
getters: which process groups a module uses, what is installed, where a parameter's shard lives
and whether the group is inside backward are private attributes of ``FSDPParamGroup`` and
``FSDPParam`` (``torch/distributed/fsdp/_fully_shard/``). Every such read of fsdp-qcomm goes
through this module; the rest of the package treats FSDP's objects as opaque handles.

Each function says the behaviour it assumes. ``verify_group`` (run by ``enable`` on every
parameter group before anything is installed) reads every attribute this module relies on and
checks its type, and ``verify_torch`` checks the module-level pieces (classes, enums, the
signature of ``_get_gradient_divide_factors``); a torch release that renamed or removed one makes
``enable`` raise ``FSDPInternalsChanged`` naming the torch version, what changed and what to do,
instead of training on. Behaviours that can only be seen while training are proven at run
time where they are used (``fsdp.hsdp``: FSDP's own all-reduce ran on the one-rank group;
``fsdp.grad_overlap``: every non-deferred reduction has a reason). ``tests/test_fsdp_canaries.py``
pins each behaviour with one test, so a torch upgrade fails there first;
``tests/test_internals_guard.py`` breaks each read on purpose and expects these errors.

Checked against torch 2.11.0, 2.13.0, 2.14.1 and 2.15.0. Before 2.13 ``FSDPState`` holds one
``_fsdp_param_group`` instead of the list ``_fsdp_param_groups``, there are no per-parameter
meshes (``ShardPlacementResult``), and FSDP's PREMUL_SUM reduce op does not expose its factor
(``readable_reduce_op`` rebuilds it). What 2.15 changed that matters here:
``FSDPParamGroup.mp_policy`` and ``FSDPParamGroup._orig_dtype`` are gone (the policy is resolved
per parameter, ``FSDPParam.mp_policy``), reduced gradients are cast to each parameter's
``sharded_grad_dtype`` (new), and ``reduce_dtype=None`` now reduces in the gradients' dtype.
"""

from __future__ import annotations

import inspect
import math
import sys
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

TESTED_TORCH = ("2.10", "2.11", "2.12", "2.13", "2.14", "2.15")
#: the oldest torch whose FSDP2 passes tests/test_fsdp_canaries.py: 2.9.1 fails one canary
#: (``_get_gradient_divide_factors`` turns a divide factor equal to the shard group's size into
#: PREMUL_SUM instead of AVG), and 2.8 has no custom all-gather / reduce-scatter at all
MIN_TORCH = (2, 10)

try:  # the classes fsdp_qcomm subclasses or tests against: a release without them fails here
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        DDPMeshInfo,
        FSDPMeshInfo,
        TrainingState,
    )
except ImportError as e:
    raise ImportError(
        f"fsdp_qcomm: FSDP2 in torch {torch.__version__} does not have what fsdp_qcomm extends "
        f"({e}); fsdp_qcomm is tested with torch {', '.join(TESTED_TORCH)}. Use one of those torch "
        "versions, or run without fsdp_qcomm until it supports this release."
    ) from e

ParamGroup = Any  # torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup
FSDPParam = Any  # torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam


class FSDPInternalsChanged(RuntimeError):
    """FSDP2's private state is not what fsdp-qcomm was written against."""


def _torch_version() -> str:
    return torch.__version__.split("+")[0]


def changed(what: str, fix: str = "") -> FSDPInternalsChanged:
    """The error for a private FSDP2 behaviour that is not what fsdp-qcomm relies on."""
    tested = ", ".join(TESTED_TORCH)
    return FSDPInternalsChanged(
        f"fsdp_qcomm: FSDP2 in torch {_torch_version()} does not behave as fsdp_qcomm expects: "
        f"{what}. fsdp_qcomm is tested with torch {tested}. "
        + (fix or "Use one of those torch versions, or run without fsdp_qcomm.enable() "
           "(FSDP2's own collectives) until fsdp_qcomm supports this release.")
    )


def torch_minor() -> tuple[int, int]:
    major, minor = _torch_version().split(".")[:2]
    return int(major), int(minor)


# ---- modules and their parameter groups -------------------------------------------------------
def param_groups(module: nn.Module) -> list[ParamGroup]:
    """The FSDP parameter groups of one ``fully_shard``-ed module (several with per-parameter
    meshes from ``shard_placement_fn``; none for a module without parameters of its own).

    The way in to FSDP's private state, so each group is checked here (``verify_group``) before
    anyone reads it: a renamed or removed attribute raises ``FSDPInternalsChanged`` naming it,
    not an ``AttributeError`` from whichever read comes first (``enable`` reads the installed
    comms and the reduction settings before anything else)."""
    groups = unverified_param_groups(module)
    for group in groups:
        verify_group(group)
    return groups


def unverified_param_groups(module: nn.Module) -> list[ParamGroup]:
    """``param_groups`` without the attribute checks (tests that break an attribute on purpose
    read the groups this way). torch 2.13+ keeps a list ``_fsdp_param_groups``; torch 2.9-2.12
    one ``_fsdp_param_group`` (None without parameters)."""
    if not isinstance(module, FSDPModule):
        raise TypeError(f"{type(module).__name__} is not an FSDP module")
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        raise changed("FSDPModule has no _get_fsdp_state()")
    state = get_state()
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    if hasattr(state, "_fsdp_param_group"):
        group = state._fsdp_param_group
        return [] if group is None else [group]
    raise changed("FSDPState has neither _fsdp_param_groups (torch >= 2.13) nor "
                  "_fsdp_param_group (torch 2.9-2.12)")


def fsdp_params(group: ParamGroup) -> list[FSDPParam]:
    """The group's ``FSDPParam`` objects in all-gather order (opaque: pass them back here)."""
    return list(group.fsdp_params)


def sharded_param(fp: FSDPParam) -> nn.Parameter:
    """The parameter the model and the optimizer see: a DTensor holding this rank's shard."""
    return fp.sharded_param


def sharded_params(group: ParamGroup) -> list[nn.Parameter]:
    return [fp.sharded_param for fp in group.fsdp_params]


def group_modules(group: ParamGroup) -> tuple[nn.Module, ...]:
    """The modules sharing this group (several for ``fully_shard([a, b])``)."""
    return tuple(group.modules)


def group_device(group: ParamGroup) -> torch.device:
    return group.device


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


def is_replicate_only(group: ParamGroup) -> bool:
    """A ``replicate()`` (DDP-style) group: FSDP's all-reduce without a shard dimension."""
    info = group.mesh_info
    return isinstance(info, DDPMeshInfo) and not isinstance(info, FSDPMeshInfo)


def replicate_group(group: ParamGroup) -> Optional[dist.ProcessGroup]:
    """The replica group FSDP all-reduces over under HSDP (None otherwise), as FSDP will use it
    now (``swap_replicate_group`` may have replaced it)."""
    if not is_hsdp(group):
        return None
    return group.mesh_info.replicate_process_group


def swap_replicate_group(group: ParamGroup, new: dist.ProcessGroup) -> dist.ProcessGroup:
    """Make FSDP's HSDP all-reduce run over ``new``; returns the group it replaces.

    Assumes FSDP reads the replica group from the mesh-info object each time it launches the
    all-reduce (``FSDPParamGroup._all_reduce_process_group``, a property), never caching it;
    ``fsdp.hsdp`` proves it at every all-reduce hook call (the one-rank group's collective
    sequence number moved). DTensor placements, state dicts and ``clip_grad_norm_`` use the
    device mesh, which is untouched. The mesh-info object may be shared by the groups of one
    ``fully_shard`` call, so this acts on all of them at once.
    """
    if not is_hsdp(group):
        raise ValueError("swap_replicate_group needs an HSDP parameter group (2-D mesh)")
    info = group.mesh_info
    old = info.replicate_process_group
    info.replicate_process_group = new
    return old


_SWAP_ATTR = "_fsdp_qcomm_swap"


def swap_record(group: ParamGroup) -> Any:
    """What ``set_swap_record`` stored on the group's mesh-info object (shared by the groups
    of one ``fully_shard`` call), or None: a swapped replica group lives and dies with the
    model, not in a module-global table."""
    return getattr(group.mesh_info, _SWAP_ATTR, None)


def set_swap_record(group: ParamGroup, record: Any) -> None:
    if record is None:
        if hasattr(group.mesh_info, _SWAP_ATTR):
            delattr(group.mesh_info, _SWAP_ATTR)
        return
    setattr(group.mesh_info, _SWAP_ATTR, record)


_ISOLATION_ATTR = "_fsdp_qcomm_isolation"


def isolation_record(group: ParamGroup) -> Any:
    """What ``set_isolation_record`` stored on the group's mesh-info object, or None: the
    record of ``fsdp.hsdp.isolate`` (DiLoCo: HSDP whose replicas train by themselves), kept
    apart from ``swap_record`` so that the rest of the package sees an isolated group's replica
    group as what FSDP now all-reduces over (one rank)."""
    return getattr(group.mesh_info, _ISOLATION_ATTR, None)


def set_isolation_record(group: ParamGroup, record: Any) -> None:
    if record is None:
        if hasattr(group.mesh_info, _ISOLATION_ATTR):
            delattr(group.mesh_info, _ISOLATION_ATTR)
        return
    setattr(group.mesh_info, _ISOLATION_ATTR, record)


#: backends known to count no collectives: asking raises a C++ error, which a process run
#: under AddressSanitizer's preloaded runtime does not survive (it aborts)
_UNCOUNTED_BACKENDS = frozenset({"fake"})


def sequence_number(pg: dist.ProcessGroup) -> Optional[int]:
    """How many collectives this process has issued on ``pg`` (gloo and NCCL count them), or
    None where its backend counts none (torch's ``fake``, some vendors')."""
    if dist.get_backend(pg) in _UNCOUNTED_BACKENDS:
        return None
    try:
        return int(pg._get_sequence_number_for_group())
    except RuntimeError:  # "ProcessGroup custom does not yet support sequence numbers"
        return None


# ---- installed collectives and reduction settings ----------------------------------------------
def installed_comms(group: ParamGroup) -> tuple[Any, Any]:
    """(custom all-gather, custom reduce-scatter) currently installed; FSDP's defaults are
    objects of its own classes."""
    return group._all_gather_comm, group._reduce_scatter_comm


def is_default_comm(comm: Any) -> bool:
    """Whether an installed comm is FSDP2's own default (``DefaultAllGather`` /
    ``DefaultReduceScatter``), not a setting that installing another would drop: a custom
    hook, symmetric memory (``set_symm_mem_for_comm``) or buffers from the process
    group (``set_allocate_memory_from_process_group_for_comm``)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

    return type(comm) in (collectives.DefaultAllGather, collectives.DefaultReduceScatter)


def set_comms(group: ParamGroup, all_gather: Any = None, reduce_scatter: Any = None) -> None:
    """Install a custom all-gather and/or reduce-scatter on this one parameter group (None
    leaves that collective as it is). FSDP2's public ``set_custom_all_gather`` /
    ``set_custom_reduce_scatter`` write the same attributes on every group of a module, and
    refuse a module with several groups (``shard_placement_fn`` returning
    ``ShardPlacementResult`` with meshes of their own, as MoE experts on their expert mesh):
    one comm for groups on different meshes would be ambiguous. Each group gets its own here.
    FSDP reads them at every unshard and reduce (``tests/test_fsdp_canaries.py``)."""
    if all_gather is not None:
        group._all_gather_comm = all_gather
    if reduce_scatter is not None:
        group._reduce_scatter_comm = reduce_scatter


def set_force_sum(group: ParamGroup, value: bool) -> None:
    """``set_force_sum_reduction_for_comms`` for this one group."""
    group.force_sum_reduction_for_comms = bool(value)


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
    return bool(group.all_reduce_grads)


def reduce_grads(group: ParamGroup) -> bool:
    """False after ``set_requires_gradient_sync(False)`` (no reduction at all this backward)."""
    return bool(group.reduce_grads)


def partial_reduce_output(group: ParamGroup) -> Optional[torch.Tensor]:
    """HSDP's reduce-scatter output kept for a later all-reduce (``all_reduce_grads=False``)."""
    return group._partial_reduce_output


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


def readable_reduce_op(op: Any, group: ParamGroup) -> Any:
    """FSDP's reduce-scatter ``op`` with its PREMUL_SUM factor readable.

    torch 2.13+ exposes ``op.factor``; before, FSDP builds the op with
    ``dist._make_nccl_premul_sum(1 / factor)`` from the group's ``gradient_divide_factor`` and
    the factor cannot be read back, so it is rebuilt from that factor as a ``PremulSum`` (the
    only PREMUL_SUM FSDP makes: ``_get_gradient_divide_factors``, pinned by
    ``tests/test_fsdp_canaries.py``)."""
    from torch.distributed import ReduceOp

    from ..collectives.grad_reduce import PremulSum

    if isinstance(op, PremulSum) or op != ReduceOp.PREMUL_SUM or hasattr(op, "factor"):
        return op
    factor = gradient_divide_factor(group)
    if not factor:
        raise changed("FSDP passed a PREMUL_SUM reduce op without a gradient divide factor set")
    return PremulSum(1.0 / float(factor))


def orig_dtype(group: ParamGroup) -> Optional[torch.dtype]:
    """The dtype of the group's trainable parameters (FSDP keeps sharded parameters in their
    original dtype); None when there are none or they differ."""
    dtypes = {fp.sharded_param.dtype for fp in group.fsdp_params
              if fp.sharded_param.requires_grad}
    return next(iter(dtypes)) if len(dtypes) == 1 else None


def sharded_grad_dtype(fp: FSDPParam) -> torch.dtype:
    """The dtype FSDP casts this parameter's reduced gradient to: its ``sharded_grad_dtype``
    from torch 2.15 (the parameter's ``grad_dtype`` policy), the original dtype before."""
    if torch_minor() >= (2, 15):
        return fp.sharded_grad_dtype or fp.sharded_param.dtype
    return fp.sharded_param.dtype


def param_dtype(group: ParamGroup) -> Optional[torch.dtype]:
    """The all-gather dtype when every parameter of the group shares one (None: the parameters'
    own dtype). Read from each parameter's mixed-precision policy, which exists before FSDP's
    lazy init (checkpoint templates need it before the first forward); torch 2.15 resolves the
    policy per parameter (``param_dtype_override_fn``), older releases share the group's."""
    dtypes = {fp.mp_policy.param_dtype for fp in group.fsdp_params}
    return next(iter(dtypes)) if len(dtypes) == 1 else None


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


def post_forward_group(group: ParamGroup) -> Optional[dist.ProcessGroup]:
    """``reshard_after_forward=<int>``: the smaller group FSDP reshards the forward's unsharded
    parameters to, and gathers them over before they are used again (backward, a second
    forward); None without one."""
    if not uses_post_forward_mesh(group):
        return None
    return group.post_forward_mesh_info.shard_process_group


def sharded_post_forward(group: ParamGroup) -> bool:
    """The group's parameters are sharded over its post-forward group now, so FSDP's next
    unshard gathers over that group (its ``allocate`` comes before the group is known)."""
    return bool(group.is_sharded_post_forward)


def holds_gathered(group: ParamGroup) -> Optional[str]:
    """How the group's module holds the weights of an earlier all-gather, or None when it holds
    only its sharded parameters (``SHARDED``, nothing gathered pending). Unsharded, its next
    forward gathers nothing; sharded over its post-forward group, it gathers those shards; with
    an ``unshard(async_op=True)`` not yet waited on, it copies out that gather: either way it
    computes with what the earlier gather delivered, whatever was written to the sharded
    parameters since."""
    if group._all_gather_result is not None:
        return "gathered by an unshard(async_op=True) not yet waited on"
    if group.is_sharded:
        return None
    if group.is_sharded_post_forward:
        return "sharded over its post-forward group (reshard_after_forward=<int>) by a forward"
    return "unsharded"


# ---- parameters -------------------------------------------------------------------------------
def padded_shard_numel(fp: FSDPParam) -> int:
    """Elements of the parameter's padded shard in FSDP's flat all-gather buffer."""
    return math.prod(fp.padded_sharded_param_size)


def reduction_params(group: ParamGroup, numel: int) -> Optional[list[int]]:
    """Which of the group's parameters (indices into ``fsdp_params(group)``), in buffer order,
    fill the gradient reduction FSDP is handing a hook right now, ``numel`` values per rank
    (the reduce-scatter output shard, or HSDP's all-reduce buffer); None when that cannot be
    known. Call it from inside the hook, on the thread FSDP called it on.

    How FSDP2 builds the buffer (``FSDPParamGroup.post_backward`` -> ``_fsdp_collectives.
    foreach_reduce``, torch 2.13 to 2.15): it reduces only the parameters that have a gradient
    (or an accumulated one, or, under ``set_reduce_scatter_unused_params(True)``, a zero one
    for every parameter that requires grad; 2.15 adds parameters with an HSDP partial sum
    pending), in ``fsdp_params`` order (2.13) or in the order cached at lazy init, grouped by
    gradient dtype (2.15, ``_reduce_scatter_param_indices``). Each gradient is padded in dim 0
    to a multiple of the shard world size (``Shard(d)``, ``d > 0``, re-chunked to dim 0) and
    ``chunk_cat`` makes row ``j`` of ``input.view(world, m)`` the concatenation of every such
    parameter's chunk ``j`` (``padded_shard_numel`` values each), sent to rank ``j``. The hooks
    receive only the flat buffers; after the copy-in no state of the group tells the
    parameters that had a gradient from those that had none (both have ``.grad`` None).

    So this reads the list itself: ``foreach_reduce`` calls both hooks directly with its
    ``fsdp_params`` argument (exactly the parameters in the buffer, in buffer order) in its
    frame, a few frames up. The list is taken only if it is made of this group's parameters
    and their padded shards add up to ``numel``. Without that frame (the hook called some
    other way) the layout is still known when ``numel`` is every parameter's shard and FSDP's
    order is the parameter order (before 2.15, or one gradient dtype in the group). A torch
    that renamed the argument or stopped calling the hooks from ``foreach_reduce`` makes
    ``verify_torch`` fail; ``tests/test_error_feedback.py`` pins the behaviour.
    """
    fps = list(group.fsdp_params)
    frame = _foreach_reduce_frame(sys._getframe(1))
    if frame is not None:
        return _param_indices(fps, frame.f_locals.get("fsdp_params"), numel)
    if numel != sum(padded_shard_numel(fp) for fp in fps):
        return None
    if torch_minor() >= (2, 15) and len({sharded_grad_dtype(fp) for fp in fps}) > 1:
        return None
    return list(range(len(fps)))


_REDUCE_FRAME_DEPTH = 6  # hook -> (a wrapper or two) -> foreach_reduce


def _foreach_reduce_frame(frame: Any) -> Any:
    """The frame of FSDP's ``foreach_reduce`` at or above ``frame`` (a hook's), within
    ``_REDUCE_FRAME_DEPTH`` frames; None when the hook was called some other way."""
    code = _foreach_reduce_code()
    for _ in range(_REDUCE_FRAME_DEPTH):
        if frame is None or frame.f_code is code:
            return frame
        frame = frame.f_back
    return None


def reduce_allocation() -> tuple[bool, Optional[torch.dtype]]:
    """(whether FSDP's ``foreach_reduce`` is the caller, the one dtype of the gradients it will
    copy into this buffer), for the buffer a reduce-scatter hook's ``allocate`` is being asked
    for right now. The dtype is given only when the buffer is the input of a reduce-scatter FSDP
    will hand the hook; None otherwise (the output buffer, a one-rank group, gradients of
    several dtypes). Call it from inside ``allocate``, on the thread FSDP called it on.

    How FSDP2 (``_fsdp_collectives.foreach_reduce``, torch 2.11 to 2.15) uses the hook: it
    allocates the input (``world_size * m`` values in ``reduce_dtype``) and copies the gradients
    in (``chunk_cat``, casting), then allocates the output (``m``) and calls the hook with both
    when ``world_size > 1``; with ``reduce_dtype`` float32 or bfloat16 it neither divides nor
    otherwise writes the input, and it reads the input only through the hook. The locals of its
    frame say which allocation this is (``reduce_scatter_input`` is not bound yet for the
    input), the group's size (``world_size``) and the gradients (``unsharded_grads``)."""
    frame = _foreach_reduce_frame(sys._getframe(1))
    if frame is None:
        return False, None
    local = frame.f_locals
    grads, world = local.get("unsharded_grads"), local.get("world_size")
    if "reduce_scatter_input" in local or not isinstance(world, int) or world < 2:
        return True, None
    if not isinstance(grads, list) or not all(isinstance(g, torch.Tensor) for g in grads):
        return True, None
    dtypes = {g.dtype for g in grads}
    return True, (dtypes.pop() if len(dtypes) == 1 else None)


def _foreach_reduce_code() -> Any:
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    return inspect.unwrap(_fsdp_collectives.foreach_reduce).__code__


def _param_indices(fps: list[FSDPParam], params: Any, numel: int) -> Optional[list[int]]:
    if not isinstance(params, (list, tuple)):
        return None
    where = {id(fp): i for i, fp in enumerate(fps)}
    idx = [where.get(id(fp)) for fp in params]
    if None in idx or len(set(idx)) != len(idx):
        return None
    if sum(padded_shard_numel(fps[i]) for i in idx) != numel:
        return None
    return idx


def has_pre_all_gather_extension(fp: FSDPParam) -> bool:
    """The parameter is a tensor subclass with its own all-gather (``fsdp_pre_all_gather``)."""
    return hasattr(fp._sharded_local_tensor, "fsdp_pre_all_gather")


def local_shard(fp: FSDPParam) -> torch.Tensor:
    """This rank's padded shard as a flat tensor (what FSDP copies into the all-gather input),
    sharing storage with the sharded parameter."""
    return fp._sharded_param_data


def param_signature(fp: FSDPParam) -> tuple:
    """(param object, its version, the local shard's version, the flat data's version and
    address): changes when the sharded parameter is replaced or written by a per-tensor
    in-place op (``p.mul_``, ``p.copy_``, ``load_state_dict``). Foreach and fused kernels
    (``Adam(foreach=True)``, ``AdamW(fused=True)``) and writes through ``p.data`` leave every
    one of these versions unchanged: those are found by content (``fsdp.change_tracker``)."""
    p = fp.sharded_param
    local = fp._sharded_local_tensor
    data = fp._sharded_param_data
    return (id(p), p._version, local._version, data._version, data.data_ptr())


def post_accumulate_grad_hooks(param: torch.Tensor) -> list[Callable[[torch.Tensor], None]]:
    """Hooks FSDP calls on a sharded parameter right after writing its reduced gradient."""
    return list((param._post_accumulate_grad_hooks or {}).values())


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


# ---- checks -----------------------------------------------------------------------------------
_DIVIDE_FACTOR_ARGS = ("reduce_scatter_group", "all_reduce_group", "reduce_dtype", "device_type",
                       "factor", "force_sum_reduction_for_comms")


def verify_torch() -> None:
    """Module-level pieces: the comm base classes, the training states and the divide-factor
    helper whose positional order ``post_divide_factor`` relies on."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    if torch_minor() < MIN_TORCH:
        raise FSDPInternalsChanged(
            f"fsdp_qcomm needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]}; this is torch "
            f"{_torch_version()}, whose FSDP2 does not pass fsdp_qcomm's canaries "
            "(tests/test_fsdp_canaries.py). Upgrade torch (tested: "
            f"{', '.join(TESTED_TORCH)}), or train without fsdp_qcomm.enable()."
        )
    for cls, name in ((AllGather, "AllGather"), (ReduceScatter, "ReduceScatter")):
        if not callable(getattr(cls, "allocate", None)) or not callable(cls.__call__):
            raise changed(f"_fsdp_api.{name} has no allocate()/__call__")
    if not hasattr(TrainingState, "PRE_BACKWARD"):
        raise changed("TrainingState.PRE_BACKWARD is gone")
    fn = getattr(_fsdp_collectives, "_get_gradient_divide_factors", None)
    if fn is None:
        raise changed("_fsdp_collectives._get_gradient_divide_factors is gone")
    names = tuple(inspect.signature(fn).parameters)[:len(_DIVIDE_FACTOR_ARGS)]
    if names != _DIVIDE_FACTOR_ARGS:
        raise changed(f"_get_gradient_divide_factors takes {names}, expected "
                      f"{_DIVIDE_FACTOR_ARGS}")
    if not hasattr(torch._C, "_current_graph_task_id"):
        raise changed("torch._C._current_graph_task_id is gone")
    reduce_fn = inspect.unwrap(getattr(_fsdp_collectives, "foreach_reduce", None))
    if reduce_fn is None or next(iter(inspect.signature(reduce_fn).parameters), None) != (
            "fsdp_params"):
        raise changed("_fsdp_collectives.foreach_reduce no longer takes fsdp_params first "
                      "(error feedback reads which parameters a reduction holds from it)")
    group_cls = _param_group_class()
    if not isinstance(getattr(group_cls, "_all_reduce_process_group", None), property):
        raise changed("FSDPParamGroup._all_reduce_process_group is no longer a property read "
                      "at each all-reduce (fsdp_qcomm's HSDP replica swap depends on it)")


def _param_group_class() -> type:
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    return FSDPParamGroup


def _expect(obj: Any, attr: str, kinds: Any, where: str) -> Any:
    if not hasattr(obj, attr):
        raise changed(f"{where} has no attribute {attr!r}")
    value = getattr(obj, attr)
    if kinds is not None and not isinstance(value, kinds):
        raise changed(f"{where}.{attr} is a {type(value).__name__}, expected "
                      f"{getattr(kinds, '__name__', kinds)}")
    return value


def verify_group(group: ParamGroup) -> None:
    """Read every private attribute of one parameter group (and its parameters) that this
    module uses and check its type; raises ``FSDPInternalsChanged`` naming the first that
    moved. Cheap: attribute reads only."""
    where = "FSDPParamGroup"
    _expect(group, "fsdp_params", list, where)
    _expect(group, "modules", tuple, where)
    _expect(group, "device", torch.device, where)
    info = _expect(group, "mesh_info", (FSDPMeshInfo, DDPMeshInfo), where)
    if isinstance(info, FSDPMeshInfo):
        _expect(info, "shard_process_group", dist.ProcessGroup, "FSDPMeshInfo")
    if isinstance(info, DDPMeshInfo):
        _expect(info, "replicate_process_group", dist.ProcessGroup, "DDPMeshInfo")
    for attr in ("_all_gather_comm", "_reduce_scatter_comm", "_all_reduce_hook",
                 "_all_gather_result",
                 "_partial_reduce_output", "post_forward_mesh_info", "gradient_divide_factor"):
        _expect(group, attr, None, where)
    for attr in ("force_sum_reduction_for_comms", "all_reduce_grads", "reduce_grads",
                 "_use_post_forward_mesh", "is_sharded_post_forward", "is_sharded"):
        _expect(group, attr, bool, where)
    if group._use_post_forward_mesh:
        _expect(group.post_forward_mesh_info, "shard_process_group", dist.ProcessGroup,
                "FSDPMeshInfo (post-forward)")
    _expect(group, "_training_state", TrainingState, where)
    if torch_minor() < (2, 15) and not hasattr(group, "mp_policy"):
        raise changed("FSDPParamGroup.mp_policy is gone (expected before torch 2.15)")
    for fp in group.fsdp_params:
        w = "FSDPParam"
        p = _expect(fp, "sharded_param", nn.Parameter, w)
        _expect(fp, "padded_sharded_param_size", torch.Size, w)
        _expect(fp, "_sharded_local_tensor", torch.Tensor, w)
        data = _expect(fp, "_sharded_param_data", torch.Tensor, w)
        if data.dim() != 1:
            raise changed("FSDPParam._sharded_param_data is not the flat padded shard")
        _expect(fp, "offload_to_cpu", bool, w)
        policy = _expect(fp, "mp_policy", None, w)
        _expect(policy, "param_dtype", (torch.dtype, type(None)), "MixedPrecisionPolicy")
        info = _expect(fp, "_module_info", None, w)
        _expect(info, "module", nn.Module, "ParamModuleInfo")
        _expect(info, "param_name", str, "ParamModuleInfo")
        if torch_minor() >= (2, 15):
            _expect(fp, "sharded_grad_dtype", (torch.dtype, type(None)), w)
        if not hasattr(p, "_post_accumulate_grad_hooks"):
            raise changed("Tensor._post_accumulate_grad_hooks is gone")


__all__ = [
    "AllGather",
    "FSDPInternalsChanged",
    "MIN_TORCH",
    "ReduceScatter",
    "TESTED_TORCH",
    "all_reduce_grads",
    "all_reduce_hook",
    "autograd_running",
    "changed",
    "force_sum",
    "fsdp_params",
    "gradient_divide_factor",
    "group_device",
    "group_modules",
    "has_pre_all_gather_extension",
    "holds_gathered",
    "in_backward",
    "installed_comms",
    "is_hsdp",
    "isolation_record",
    "is_replicate_only",
    "local_param_name",
    "local_shard",
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
    "post_forward_group",
    "reduce_grads",
    "readable_reduce_op",
    "reduce_allocation",
    "reduce_scatter_group",
    "reduction_params",
    "replicate_group",
    "reshards_after_forward",
    "sequence_number",
    "set_all_reduce_hook",
    "set_comms",
    "set_force_sum",
    "set_isolation_record",
    "set_swap_record",
    "shard_group",
    "sharded_grad_dtype",
    "sharded_post_forward",
    "sharded_param",
    "sharded_params",
    "swap_record",
    "swap_replicate_group",
    "torch_minor",
    "unverified_param_groups",
    "uses_post_forward_mesh",
    "verify_group",
    "verify_torch",
]

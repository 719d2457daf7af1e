"""``enable``: install quantized collectives on every FSDP2 module of a model, and undo it.

``enable`` walks ``model.modules()`` and installs one all-gather (and, if gradients are
quantized, one reduce-scatter) per parameter group of every FSDP module, each with its own RNG
bucket (the group's index in that walk, the same on every rank). A module has one group unless
``shard_placement_fn`` gave some parameters a mesh of their own (MoE experts on an expert mesh):
FSDP2's public ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` refuse such modules, so
the collectives are installed on each group directly (``internals.set_comms``), each planned on
its own group's mesh and node placement. Everything is validated before anything is installed,
so a refused call leaves the model untouched, and refused on every rank alike: the ranks then
exchange what they checked and would install, once (``install_agreement``), so a check that fails
on one rank stops all of them, and ranks given different configurations (or module filters) stop
with the difference named instead of exchanging bytes they cannot decode.

Reduction ops. FSDP passes its reduce-scatter AVG by default, and PREMUL_SUM(1/f) once a
gradient divide factor ``f`` other than the world size is set; gloo rejects PREMUL_SUM
outright (the quantized reduce-scatter reads its factor back, ``op.factor``, and applies it). With
``set_force_sum_reduction_for_comms(True)`` FSDP passes SUM and divides the reduced shard by
``f`` (default: the data-parallel size) itself, which is the same average. A module that gets
the quantized reduce-scatter keeps FSDP's AVG where FSDP would pass it (no divide factor, no
HSDP): the hook's last decode divides in the same pass (``codec.reduce_dequantize(divide=)``),
the same bits as FSDP's division of the sum, without FSDP's pass over the reduced shard (a
launch per module and step on CUDA). ``enable`` forces SUM on the other modules with the
quantized reduce-scatter, and on gloo modules that already have such a factor (where FSDP's own
reduce-scatter would fail); ``disable`` restores the previous setting. With ``grad_overlap`` on
CPU it forces nothing: FSDP's division would run before a deferred reduction wrote its output,
so the hook applies AVG / PREMUL_SUM itself.

Node placement and process groups. ``enable`` gathers every rank's host name once and checks
the node size (``QCommConfig.ranks_per_node``, else ``LOCAL_WORLD_SIZE``, else the host names)
against them (``topology.resolve_placement``); then it creates every process group the hooks
will use (node subgroups, ``grad_overlap``'s private groups, HSDP's single-rank group) on every
rank in the same order, so none is created lazily inside a backward pass.

HSDP. On a 2-D ``(replicate, shard)`` mesh with quantized gradients, the all-reduce across
replicas runs quantized too (``fsdp.hsdp``): 8-bit inside the node (reduce-scatter), 4-bit
across nodes (all-reduce) under the sdp4bit preset, with native HSDP's scaling, accumulation
and DTensor placements, and bit-identical gradients on every replica.

Checkpoints. ``QCommHandle`` is a ``torch.distributed.checkpoint`` ``Stateful``: put it in the
dict passed to ``dcp.save`` / ``dcp.load`` next to the model and optimizer state. It carries each
module's RNG call counters (weights and gradients: stochastic rounding is keyed by them), its
learned level tables, its qWD reference shard and its error-feedback residuals, so a resumed run
draws the same random bits and computes with the same weights as a run that never stopped. The
state is this rank's own, under a key naming the rank, with a record of who wrote it that
``load_state_dict`` checks (``fsdp.checkpoint``); ``fsdp_qcomm.integrations`` saves it for
checkpointers that keep one copy for all ranks (Accelerate, Lightning Fabric).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Optional, Sequence

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from ..collectives.cast import WIRE_DTYPE
from ..collectives.topology import (
    NodePlacement,
    group_layout,
    host_names,
    layout_topology,
    node_topology,
    private_group,
    resolve_placement,
)
from ..config import QCommConfig
from ..stats import CommStats, TaggedStats
from . import checkpoint, hop_plan, hsdp, install_agreement, module_choice, tp_peers
from . import internals as fsdp
from .all_gather import QuantizedAllGather
from .grad_overlap import ReductionQueue
from .reduce_scatter import PreparedGroup, QuantizedReduceScatter
from .residual_state import residual_bytes, scaler_scale
from .session import Session

#: ``enable`` says what it decided here: one INFO line per distinct hop decision (the same lines
#: as ``handle.stats()["notes"]``) and a WARNING when the configuration quantizes nothing on this
#: layout. Logged by global rank 0 only: every rank decides alike.
logger = logging.getLogger("fsdp_qcomm")


def _log_plan(plans: dict, run: QCommConfig) -> None:
    if dist.get_rank() != 0:
        return
    for line in hop_plan.notes(plans):
        logger.info("fsdp_qcomm.enable: %s", line)
    hint = hop_plan.nothing_quantized_hint(plans, run)
    if hint is not None:
        logger.warning("fsdp_qcomm.enable: %s", hint)


class _Install:
    """One parameter group of an FSDP module: what we installed and what to put back. A
    module has one group unless ``shard_placement_fn`` put some of its parameters on a mesh of
    their own (MoE experts on the expert mesh): then each group is installed on its own, with
    its own hop plan, RNG bucket, reference, change tracking and checkpoint entry, and is
    labelled ``"<module> [group k/n: N params on R ranks]"``."""

    def __init__(self, module: FSDPModule, group: Any, name: str, index: int,
                 group_label: str = "") -> None:
        self.module = module
        self.group = group
        self.name = name
        self.index = index
        self.group_label = group_label
        self.prev_all_gather, self.prev_reduce_scatter = fsdp.installed_comms(group)
        self.prev_force_sum = fsdp.force_sum(group)
        # this module's configuration (``module_configs``; ``enable``'s otherwise) and the
        # same with the run's node size, set by ``enable``
        self.config: Optional[QCommConfig] = None
        self.run: Optional[QCommConfig] = None
        self.all_gather: Optional[QuantizedAllGather] = None
        self.reduce_scatter: Optional[Any] = None
        self.replica: Optional[hsdp.ReplicaAllReduce] = None
        self.force_sum = False

    @property
    def label(self) -> str:
        base = self.name or "<root>"
        return f"{base} [{self.group_label}]" if self.group_label else base

    @property
    def reduction_hooks(self) -> dict[str, Any]:
        """The gradient hooks that may keep error-feedback residuals, by checkpoint name."""
        return {"reduce_scatter": self.reduce_scatter, "replica": self.replica}


def _is_ours(comm: Any) -> bool:
    return type(comm).__module__.startswith("fsdp_qcomm.")


def _needs_sum_for_gloo(group: Any) -> bool:
    """FSDP would pass PREMUL_SUM (rejected by gloo) for this group's reduce-scatter."""
    factor = fsdp.gradient_divide_factor(group)
    if factor is None:
        return False
    pg = fsdp.shard_group(group)
    return dist.get_backend(pg) == "gloo" and factor != pg.size()


class QCommHandle:
    """What ``enable`` returns: statistics, a reset for qWD references, and ``disable``.
    ``placement`` says which ranks the hooks treat as one node and why."""

    def __init__(
        self, session: Session, config: QCommConfig, placement: Optional[NodePlacement] = None,
    ) -> None:
        self.config = config
        self.placement = placement
        self._session = session
        self._installs = session.installs
        self._stats = session.stats

    @property
    def _enabled(self) -> bool:
        return self._session.enabled

    @property
    def enabled(self) -> bool:
        return self._enabled

    @property
    def deferred_reductions(self) -> int:
        """``grad_overlap``: reductions left running on the background thread when their call
        returned (0 without the option)."""
        q = self._session.queue
        return q.deferred if q is not None else 0

    @property
    def module_names(self) -> list[str]:
        """FSDP modules the hooks are installed on, in RNG-bucket order ("" is the root), each
        once (a module with several parameter groups has an install per group)."""
        return list(dict.fromkeys(i.name for i in self._installs))

    @property
    def group_labels(self) -> list[str]:
        """Every parameter group the hooks are installed on, in RNG-bucket order: the module's
        name, with ``[group k/n: ...]`` for modules of several groups (``docs/moe.md``)."""
        return [i.label for i in self._installs]

    def stats(self) -> dict:
        """Bytes, calls, elements and bits per element per collective kind, a ``summary``
        (steps, bytes and node-crossing bytes per step, error-feedback memory) and notes."""
        snap = self._stats.snapshot()
        ef = self._error_feedback_bytes()
        params = sum(p.numel() for i in self._installs for p in fsdp.sharded_params(i.group))
        snap["summary"]["error_feedback_bytes"] = ef
        snap["summary"]["error_feedback_bytes_per_parameter"] = ef / params if params else 0.0
        return snap

    def _error_feedback_bytes(self) -> int:
        return sum(residual_bytes(h, i.group) for i in self._installs
                   for h in i.reduction_hooks.values())

    def reset_stats(self) -> None:
        self._stats.reset()

    def gather_modes(self) -> dict[str, int]:
        """How many weight gathers ran in each mode (plain, cast, direct, qwd_full, qwd_diff,
        qwd_restore, local, post_forward, and the ones that sent nothing: qwd_reuse,
        direct_reuse, plain_reuse), summed over modules."""
        total: dict[str, int] = {}
        for i in self._installs:
            if i.all_gather is not None:
                for k, v in i.all_gather.modes.items():
                    total[k] = total.get(k, 0) + v
        return dict(sorted(total.items()))

    def reference_bytes(self) -> int:
        """Memory this rank holds for qWD references and kept weights
        (``weight_reuse_unchanged``), in the all-gather dtype: per qWD module, the node-sharded
        reference (the shards of the ranks with this rank's local index, one per node:
        ``1/ranks_per_node`` of the module's padded parameters) or, with
        ``weight_reference="full"`` (or one rank per node), one unsharded copy plus one shard
        (``1 + 1/world`` of them); kept weights are one unsharded copy plus one shard. 0 for
        modules whose gather stays FSDP2's own (inside a node, as under HSDP)."""
        return sum(i.all_gather.reference_bytes for i in self._installs if i.all_gather is not None)

    def kept_bytes(self) -> dict[str, int]:
        """Memory this rank keeps for fsdp_qcomm between steps, by category: ``reference``
        (:meth:`reference_bytes`), ``error_feedback`` (the gradient residuals,
        ``stats()["summary"]["error_feedback_bytes"]``), ``level_tables`` (learned level tables
        of the weight gathers and gradient reductions) and ``total``. FSDP2's own sharded
        parameters, gradients and the optimizer's states are not included."""
        ef = self._error_feedback_bytes()
        tables = 0
        for i in self._installs:
            for hook in (i.all_gather, *i.reduction_hooks.values()):
                sync = getattr(hook, "levels", None)
                if sync is not None and sync.levels is not None:
                    tables += sync.levels.nbytes
        ref = self.reference_bytes()
        return {"reference": ref, "error_feedback": ef, "level_tables": tables,
                "total": ref + ef + tables}

    def state_dict(self) -> dict[str, Any]:
        """This rank's checkpointable state, under the key ``"rank<r>_of_<W>"``: who wrote it
        (``owner``: rank, world size, node placement, the ``QCommConfig`` fields that shape it,
        every FSDP module's mesh and parameter shapes) and, per FSDP module, the RNG call
        counters (``weight_calls``, ``grad_calls``, ``replica_calls``), the learned level
        tables (``weight_levels``, ``grad_levels``), this rank's shard of the qWD reference
        (``reference_valid``, ``reference``), the digest of the shard the last weight gather was
        made from (``gathered_digest``) and the error-feedback residuals
        (``grad_residuals``). Plain copies only (``fsdp.checkpoint``): any per-rank
        checkpointer can save it. With torch.distributed.checkpoint pass the handle itself (a
        ``Stateful``); with a checkpointer that keeps one copy for all ranks, use
        ``fsdp_qcomm.integrations`` (``docs/reliability.md``)."""
        self._check_enabled("state_dict")
        return checkpoint.handle_state(self._installs, self.config, self.placement)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` saved on this rank (call on every rank, with the model and
        optimizer loaded from the same checkpoint: collective over the world). Refuses, with
        ``CheckpointMismatch`` (a ``ValueError``) naming what differs and before changing
        anything, a state that another rank, world size, placement, ``QCommConfig`` or model
        wrote; refused on one rank, it is refused on every rank, so all take the same branch.
        The next gather of each qWD module re-assembles the saved reference with one
        full-precision all-gather, and sends nothing more when every rank's loaded shard is
        the one that reference was gathered from (``gathered_digest``), else a difference;
        modules saved without a reference send full-precision weights. Either way no rank
        computes with stale weights."""
        self._load_state_from(lambda: state)

    def _load_state_from(self, read: Callable[[], Any]) -> None:
        """``load_state_dict(read())``, with a failure to read (a missing or unreadable file:
        ``integrations.load_rank_state``) refused on every rank like a mismatch."""
        load_states([self], [read])

    def attach_grad_scaler(self, scaler: Any) -> None:
        """Keep the error-feedback residuals in unscaled units under a loss scaler
        (``torch.amp.GradScaler``, fp16): every gradient reduction then reads the scaler's
        current scale (its scale tensor: no host sync) and stores residuals divided by it, so a
        scale change between steps does not leave them in the old scale's units. Call on every
        rank before the first backward (residuals already kept are read as unscaled), and again
        after loading a checkpoint into a new handle."""
        self._check_enabled("attach_grad_scaler")
        read = scaler_scale(scaler)
        for i in self._installs:
            for hook in i.reduction_hooks.values():
                if hook is not None:
                    hook.grad_scale = read

    def reset(self) -> None:
        """Make the next weight gather of every module send full precision (call on every rank,
        like any FSDP API). Writes are found without it (``fsdp.change_tracker``); this forces a
        full-precision resend, for example to rule out an accumulated quantization error."""
        self._check_enabled("reset")
        for i in self._installs:
            if i.all_gather is not None:
                i.all_gather.reset()

    def mark_changed(self) -> None:
        """Say that the parameters were changed on purpose outside a ``torch.optim`` optimizer
        step (an outer DiLoCo step, an EMA blend, an optimizer of another kind): the next
        forward gather of every module sends a quantized difference (qWD) or re-quantizes under
        a new key (direct schemes), instead of the full-precision resend an unexplained write
        gets. Call it on every rank, after the write and before the next forward."""
        self._check_enabled("mark_changed")
        for i in self._installs:
            if i.all_gather is not None:
                i.all_gather.mark_changed()

    def disable(self) -> None:
        """Put FSDP's previous collectives and reduction setting back and free qWD references."""
        self._check_enabled("disable")
        self._session.close()  # grad_overlap: drains, so no reduction still writes gradients
        for i in self._installs:
            fsdp.set_comms(i.group, i.prev_all_gather, i.prev_reduce_scatter)
            if i.replica is not None:
                hsdp.uninstall(i.replica)
            if i.force_sum:
                fsdp.set_force_sum(i.group, i.prev_force_sum)
            if i.all_gather is not None:
                i.all_gather.release()
        self._session.release()

    def _check_enabled(self, what: str) -> None:
        if not self._enabled:
            raise RuntimeError(f"QCommHandle.{what}(): this handle was already disabled")

    def __repr__(self) -> str:
        state = "enabled" if self._enabled else "disabled"
        return f"QCommHandle({state}, {len(self._installs)} FSDP modules, {self.config})"


def load_states(handles: Sequence[QCommHandle], reads: Sequence[Callable[[], Any]],
                failure: Optional[Exception] = None) -> None:
    """``handles[k].load_state_dict(reads[k]())`` for each k (the model parts of one pipeline
    stage: torchtitan's ``HandlesState``) with one exchange over the world: a state refused for
    any handle on any rank, or a ``failure`` the caller found, changes no handle on any rank,
    and every rank raises ``CheckpointMismatch``. One exchange per handle instead left the parts
    before a refused one loaded."""
    for h in handles:
        h._check_enabled("load_state_dict")
    checkpoint.load_handle_state(
        [(h._installs, h.config, h.placement, read) for h, read in zip(handles, reads)], failure)


def _gather_post_forward(i: _Install, group: dist.ProcessGroup, ranks_per_node: Optional[int],
                         stats: CommStats) -> None:
    """``reshard_after_forward=<int>``: the forward's weights, resharded over ``group``, are
    gathered there by FSDP2's own all-gather (``QuantizedAllGather._post_forward_gather``)."""
    remote = group_layout(group, ranks_per_node).remote_peers
    i.all_gather.post_forward_group, i.all_gather.post_forward_remote = group, remote
    where = "inside a node" if remote == 0 else "across nodes"
    stats.note(
        f"weight all-gather after forward (reshard_after_forward={group.size()}): FSDP2's own, "
        f"unquantized, over {group.size()} rank(s) {where}, of the weights the forward computed "
        "with (exact)")


def _overlaps_on_a_thread(group: Any) -> bool:
    """Whether ``grad_overlap`` applies to an FSDP parameter group: on CPU process groups only.
    On a GPU FSDP2 calls the reduction hooks on its reduce-scatter (all-reduce) stream and
    reads their output there; the background thread's current stream is another one (the
    device's default stream), which FSDP's streams never wait for."""
    return fsdp.group_device(group).type == "cpu"


def _plan(i: _Install, run: QCommConfig) -> hop_plan.ModulePlan:
    """``hop_plan.plan_module`` on the node layouts of the module's groups."""
    rpn = run.ranks_per_node
    replicas = hsdp.original_replicate_group(i.group)
    return hop_plan.plan_module(
        run, group_layout(fsdp.shard_group(i.group), rpn),
        group_layout(fsdp.reduce_scatter_group(i.group), rpn),
        group_layout(replicas, rpn) if replicas is not None and replicas.size() > 1 else None,
        gloo=dist.get_backend(fsdp.reduce_scatter_group(i.group)) == "gloo",
    )


def _check_replaced_comms(installs: list[_Install],
                          plans: dict[str, hop_plan.ModulePlan]) -> None:
    """Refuse to replace a collective that runs through anything but FSDP2's default: enable
    installs its own all-gather on every group, and its reduce-scatter where one is planned,
    which would silently drop symmetric memory, process-group buffers or someone else's hook."""
    for i in installs:
        all_gather, reduce_scatter = fsdp.installed_comms(i.group)
        replaced = [("all-gather", all_gather, "all_gather")]
        if plans[i.label].reduce_scatter is not None:
            replaced.append(("reduce-scatter", reduce_scatter, "reduce_scatter"))
        for what, comm, setter in replaced:
            if not fsdp.is_default_comm(comm):
                raise ValueError(
                    f"FSDP module {i.label!r} already runs its {what} through "
                    f"{type(comm).__name__}, which fsdp_qcomm would replace with its own and "
                    "so drop: symmetric memory (set_symm_mem_for_comm; torchtitan's "
                    "--parallelism.enable_fsdp_symm_mem), buffers from the process group "
                    "(set_allocate_memory_from_process_group_for_comm) or a hook of "
                    f"set_custom_{setter}. Turn it off on the modules fsdp_qcomm handles, or "
                    "leave this one out (module_filter_fn)"
                )


def _check_topology(installs: list[_Install], plans: dict[str, hop_plan.ModulePlan]) -> None:
    """Two-level reduction needs every node to hold the same number of the group's ranks; check
    every module's quantized reduce-scatter group now rather than in the first backward."""
    for i in installs:
        rs = plans[i.label].reduce_scatter
        if rs is None or rs.grad_scheme != "two_level":
            continue
        layout = group_layout(fsdp.reduce_scatter_group(i.group), rs.ranks_per_node)
        if not layout.regular:
            raise ValueError(f"FSDP module {i.label!r}: {layout._irregular_message()}")


def _group_label(group: Any, k: int, n: int) -> str:
    """How a module's k-th of n parameter groups is named (empty when it is its only one)."""
    if n == 1:
        return ""
    ranks = fsdp.shard_group(group).size()
    return f"group {k + 1}/{n}: {len(fsdp.fsdp_params(group))} params on {ranks} ranks"


def _checked(module: FSDPModule, group: Any, name: str, index: int, group_label: str,
             seen: set[int]) -> Optional[_Install]:
    """The install record of one parameter group, after refusing what fsdp_qcomm cannot handle
    (naming the module); None for a group already seen (``fully_shard([a, b])``: one group
    shared by several modules)."""
    label = (name or "<root>") + (f" [{group_label}]" if group_label else "")
    if fsdp.is_replicate_only(group):
        raise ValueError(
            f"module {label!r} is replicated without sharding (replicate(), or a mesh with "
            "no shard dimension): FSDP all-reduces its gradients and never gathers its "
            "weights, and fsdp_qcomm has no quantized collective for that. Shard it with "
            "fully_shard (on a 2-D mesh for HSDP), or leave fsdp_qcomm off for this model"
        )
    if id(group) in seen:
        return None
    seen.add(id(group))
    for comm in fsdp.installed_comms(group):
        if _is_ours(comm):
            raise RuntimeError(
                f"fsdp_qcomm is already enabled on FSDP module {label!r}; call "
                "handle.disable() on the earlier handle before enabling again"
            )
    return _Install(module, group, name, index, group_label)


def _collect(model: nn.Module, config: QCommConfig,
             module_filter_fn: Optional[module_choice.ModuleFilter] = None,
             module_configs: Optional[Mapping[str, QCommConfig]] = None
             ) -> tuple[list[_Install], tuple[list[str], str]]:
    """Every parameter group of every FSDP module under ``model`` that ``module_filter_fn``
    keeps (several per module when ``shard_placement_fn`` gave some parameters a mesh of their
    own), each with its configuration (``module_choice``); refuses what we cannot handle,
    naming the module. Also the ``module_configs`` patterns that chose no module here, with
    their error (``module_choice.unused_patterns``): refused once no rank used them."""
    overrides = module_choice.check_overrides(config, module_configs)
    installs: list[_Install] = []
    seen: set[int] = set()
    found, excluded, used, names = False, [], set(), []
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        found = True
        names.append(name)
        chosen, pattern = module_choice.choose(module, name, config, module_filter_fn,
                                               overrides)
        if chosen is None:
            excluded.append(name or "<root>")
            continue
        used.add(pattern)
        groups = fsdp.param_groups(module)
        for k, group in enumerate(groups):
            install = _checked(module, group, name, len(installs), _group_label(
                group, k, len(groups)), seen)
            if install is not None:
                install.config = chosen
                installs.append(install)
    unused = module_choice.unused_patterns(overrides, used, names)
    if found and excluded and not installs:
        raise ValueError(
            f"module_filter_fn keeps every FSDP module under {type(model).__name__} out "
            f"({excluded[:8]}): there is nothing to install. Let it return True for the "
            "modules to quantize, or do not call enable()"
        )
    if not found:
        raise ValueError(
            f"no FSDP module found under {type(model).__name__}: call "
            "torch.distributed.fsdp.fully_shard on its blocks and on the model before "
            "fsdp_qcomm.enable(model, config)"
        )
    if not installs:
        raise ValueError(
            f"the FSDP modules under {type(model).__name__} manage no parameters; nothing to "
            "quantize"
        )
    return installs, unused


def _decided(model: nn.Module, config: QCommConfig,
             module_filter_fn: Optional[module_choice.ModuleFilter],
             module_configs: Optional[Mapping[str, QCommConfig]]) -> tuple:
    """Everything ``enable`` decides and checks on this rank before building anything:
    ``(installs, placement, run, streamed, plans, unused patterns)``. Local: no collective (the
    host names are gathered already)."""
    installs, unused = _collect(model, config, module_filter_fn, module_configs)
    if any(i.config.grad_levels == "learned" and _has_replicas(i.group) for i in installs):
        raise ValueError(
            "QCommConfig.grad_levels='learned' is not supported under HSDP: the all-reduce "
            "across replicas has no learned level table and would run on uniform levels. Use "
            "grad_levels='uniform' with HSDP, or a 1-D mesh (fully_shard over all ranks)"
        )
    placement = resolve_placement(config.ranks_per_node)
    run = config.replace(ranks_per_node=placement.ranks_per_node)
    fsdp.verify_torch()
    streamed = []  # modules whose reductions FSDP runs on its own CUDA streams
    for i in installs:
        fsdp.verify_group(i.group)
        i.run = run if i.config is config else i.config.replace(
            ranks_per_node=placement.ranks_per_node)
        if i.run.grad_overlap and not _overlaps_on_a_thread(i.group):
            i.run = i.run.replace(grad_overlap=False)
            streamed.append(i.label)
    plans = {i.label: _plan(i, i.run) for i in installs}
    _check_topology(installs, plans)
    _check_replaced_comms(installs, plans)
    return installs, placement, run, streamed, plans, unused


def enable(model: nn.Module, config: QCommConfig, *,
           module_filter_fn: Optional[module_choice.ModuleFilter] = None,
           module_configs: Optional[Mapping[str, QCommConfig]] = None) -> QCommHandle:
    """Install ``config``'s quantized collectives on every FSDP2 module under ``model``.

    Call after ``fully_shard`` (bottom-up, model last) and ``init_process_group``, on every
    rank of the world, with the same arguments: every rank raises, or none does. Returns a
    ``QCommHandle``: ``stats()``, ``reset()``, ``disable()``.
    ``module_filter_fn(module, fqn) -> bool``: False keeps that FSDP module on FSDP2's own
    collectives. ``module_configs``: ``{fnmatch pattern of the module's name: QCommConfig}``,
    other widths or schemes for some modules (``fsdp.module_choice``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"enable() takes the nn.Module passed to fully_shard, got {type(model).__name__}"
        )
    if not isinstance(config, QCommConfig):
        raise TypeError(
            f"enable() takes a QCommConfig (for example QCommConfig.preset('sdp4bit')), got "
            f"{type(config).__name__}"
        )
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized; call init_process_group first")
    host_names()  # collective, once per world: before anything that may fail on one rank only
    failure, entries, unused = None, [], ([], "")
    try:
        installs, placement, run, streamed, plans, unused = _decided(
            model, config, module_filter_fn, module_configs)
        entries = [install_agreement.Entry(_mesh_key(i), i.label, i.index, i.run,
                                           plans[i.label]) for i in installs]
    except Exception as e:  # raised on every rank by the agreement below
        failure = e
    install_agreement.check(failure, entries, *unused)  # collective: all raise, or none

    stats = CommStats()
    if streamed:
        stats.note(hop_plan.module_list(
            "grad_overlap: off on GPUs: FSDP2 already overlaps their reductions with backward on "
            "its reduce-scatter stream, and the background thread would run them on another "
            "stream", streamed))
    for line in hop_plan.notes(plans):
        stats.note(line)
    hint = hop_plan.nothing_quantized_hint(plans, run)
    if hint is not None:
        stats.note(hint)
    _log_plan(plans, run)
    names = {id(m): n for n, m in model.named_modules()}
    solo = None  # HSDP: the one-rank group FSDP's own all-reduce is pointed at
    if any(p.replica is not None for p in plans.values()):
        solo = hsdp.SoloGroup()
        if not solo.counted:
            stats.note(
                f"HSDP: the {dist.get_backend(solo.group)!r} backend counts no sequence "
                "numbers, so the check that FSDP's own replica all-reduce runs on fsdp_qcomm's "
                "one-rank group (not on the replica group, beside the quantized one) is off"
            )
    # this call's reduction thread
    queue = ReductionQueue() if any(i.run.grad_overlap for i in installs) else None
    agreement_group = _agreement_group(installs)
    # Build everything first (a failing constructor installs nothing), creating every process
    # group now, on every rank in the same order: never lazily inside the first backward.
    tags = _mesh_tags(installs)
    for i in installs:
        plan = plans[i.label]
        gather_group = fsdp.shard_group(i.group)
        own = stats if tags[i.index] is None else TaggedStats(stats, tags[i.index])
        i.all_gather = QuantizedAllGather(i.group, plan.weights, own, i.index,
                                          i.label if i.group_label else i.name, names)
        i.all_gather.remote_peers = group_layout(gather_group, run.ranks_per_node).remote_peers
        post_forward = fsdp.post_forward_group(i.group)
        if post_forward is not None:
            _gather_post_forward(i, post_forward, run.ranks_per_node, stats)
        if plan.node_reference:
            i.all_gather.topology = node_topology(gather_group, run.ranks_per_node)
        replicas = hsdp.original_replicate_group(i.group)
        if replicas is not None and replicas.size() > 1:
            i.all_gather.replica_group = replicas
        if plan.reduce_scatter is not None:
            i.reduce_scatter = _build_reduce_scatter(i, plan.reduce_scatter, own, queue)
            # FSDP's AVG reaches the hook, which divides in its last decode (no divide factor,
            # no HSDP), and under grad_overlap (CPU process groups) FSDP must not divide the
            # output right after the call (the reduction may still be running), so it keeps
            # passing AVG / PREMUL_SUM(1/f) to the hook. Elsewhere forced SUM: FSDP's AVG over
            # the one-rank HSDP group is documented as unreliable on NCCL.
            overlap = i.run.grad_overlap
            avg = fsdp.gradient_divide_factor(i.group) is None and not fsdp.is_hsdp(i.group)
            i.force_sum = not (overlap or avg)
        elif _needs_sum_for_gloo(i.group):
            i.force_sum = True
            stats.note(
                f"{i.label}: gloo cannot run FSDP's PREMUL_SUM reduce-scatter "
                "(gradient divide factor set); forced SUM reduction, FSDP divides afterwards"
            )
        if plan.replica is not None:
            i.replica = _build_replica(i, plan.replica, own, placement, solo, queue)
            if i.reduce_scatter is not None:
                i.reduce_scatter.replica = i.replica
    # FSDP x TP: TP-replicated parameters' gradients averaged over their TP peers after a
    # quantized reduction, so the copies TP needs equal stay bit-identical (``tp_peers``)
    syncs = tp_peers.plan([i.group for i in installs])
    synced = []
    for i in installs:
        sync = syncs[id(i.group)]
        target = i.replica if i.replica is not None else i.reduce_scatter
        if sync is None or target is None:
            continue  # FSDP2's own reduction: every TP peer reduces alike already
        target.peer_sync = sync
        synced.append((i.label, sync.synced_params))
    if synced:
        stats.note(hop_plan.module_list(
            f"tensor parallelism: {sum(n for _, n in synced)} TP-replicated parameter(s): their "
            "reduced gradients are averaged over their tensor-parallel peers after each "
            "reduction (kept bit-identical)", [label for label, _ in synced]))
    for i in installs:  # per group: FSDP's public setters refuse modules with several groups
        fsdp.set_comms(i.group, i.all_gather, i.reduce_scatter)
        i.all_gather.attach()
        if i.replica is not None:
            hsdp.install(i.replica)
        if i.force_sum:
            fsdp.set_force_sum(i.group, True)
    session = Session(model, installs, stats, queue, agreement_group, solo)
    for i in installs:
        i.all_gather.session = session
        for hook in (i.all_gather, i.reduce_scatter, i.replica):
            if hook is not None:
                hook.owner = session  # FSDP holds the hooks, the hooks hold the session
    return QCommHandle(session, config, placement)


def _mesh_key(i: _Install) -> tuple:
    mesh = fsdp.sharded_params(i.group)[0].device_mesh
    return tuple(mesh.mesh.flatten().tolist()), tuple(mesh.shape), mesh.mesh_dim_names


def _mesh_tags(installs: list[_Install]) -> list[Optional[str]]:
    """Per install (by index): None for parameter groups on the model's own mesh (the one most
    groups use), else a tag naming their mesh, under which their bytes are counted apart
    (``stats.TaggedStats``: ``weight_allgather:<tag>``, ...): MoE experts on the
    expert-data-parallel mesh show up separately from the dense weights. The tag is the mesh's
    dimension names (``efsdp``), or its shape (``mesh2x2``)."""
    keys = [_mesh_key(i) for i in installs]
    # first of the most used meshes, in install order: the same choice on every rank
    main = max(dict.fromkeys(keys), key=lambda k: (keys.count(k), len(k[0])))
    out = []
    for k in keys:
        if k == main:
            out.append(None)
            continue
        flat, shape, names = k
        out.append(",".join(names) if names else "mesh" + "x".join(str(d) for d in shape))
    return out


def _agreement_group(installs: list[_Install]) -> Optional[dist.ProcessGroup]:
    """The ranks that must agree on gather decisions: every rank of the device meshes the
    modules are sharded over (None: the whole world, the usual case). The same set on every
    rank; created here, on every member."""
    ranks: set[int] = set()
    for i in installs:
        for p in fsdp.sharded_params(i.group):
            ranks.update(int(r) for r in p.device_mesh.mesh.flatten().tolist())
    if len(ranks) == dist.get_world_size():
        return None
    return dist.new_group(sorted(ranks), use_local_synchronization=True,
                          group_desc="qcomm_agreement")

def _has_replicas(group: Any) -> bool:
    """An HSDP group with more than one replica (FSDP all-reduces across them)."""
    replicas = hsdp.original_replicate_group(group)
    return replicas is not None and replicas.size() > 1


def _build_reduce_scatter(
    i: _Install, run: QCommConfig, stats: CommStats, queue: Optional[ReductionQueue]
) -> QuantizedReduceScatter:
    """The module's quantized reduce-scatter with its process groups prepared."""
    group = fsdp.reduce_scatter_group(i.group)
    prepare = node_topology if run.grad_scheme == "two_level" else layout_topology
    prepared = PreparedGroup(group, prepare(group, run.ranks_per_node))
    overlap = None
    if run.grad_overlap and group.size() > 1:
        own = private_group(group)
        overlap = PreparedGroup(own, prepare(own, run.ranks_per_node))
    return QuantizedReduceScatter(run, stats, i.index, i.group, prepared=prepared,
                                  prepared_overlap=overlap, queue=queue, name=i.label)


def _build_replica(
    i: _Install, run: QCommConfig, stats: CommStats, placement: NodePlacement,
    solo: Optional[hsdp.SoloGroup], queue: Optional[ReductionQueue],
) -> Optional[hsdp.ReplicaAllReduce]:
    """HSDP: the quantized all-reduce across replicas (None for 1-D FSDP or one replica).

    Its quantizer is the inter-node one when the replica group crosses nodes, which is the
    standard layout. A replica group only partly spread over nodes (several replicas on one
    node) runs the same single hop over all replicas and says so in the stats notes."""
    replicas = hsdp.original_replicate_group(i.group)
    if replicas is None or replicas.size() == 1:
        return None
    layout = group_layout(replicas, run.ranks_per_node)
    remote = layout.remote_peers
    quantized = run.grad_scheme in ("one_level", "two_level")
    if 0 < remote < layout.size - 1:
        stats.note(
            f"{i.label}: {layout.size - remote - 1} other replica(s) share this rank's node "
            f"({placement.describe()}); the replica all-reduce runs as one quantized hop over "
            "all replicas with the inter-node quantizer (put one replica per node to avoid it)"
        )
    return hsdp.ReplicaAllReduce(
        i.group, replicas, run.replica_spec(crosses_nodes=remote > 0) if quantized else None,
        hadamard=run.grad_hadamard, seed=run.seed, bucket=i.index, stats=stats,
        chunks=run.grad_pipeline_chunks, remote_peers=remote,
        user_hook=fsdp.all_reduce_hook(i.group), label=i.label,
        overlap_group=private_group(replicas) if run.grad_overlap else None,
        error_feedback=run.grad_error_feedback == "all" or (
            run.grad_error_feedback == "inter" and remote > 0),
        feedback_decay=run.grad_error_feedback_decay,
        solo=solo, queue=queue,
        wire_dtype=WIRE_DTYPE if run.grad_scheme == "bf16" else None,
    )


__all__ = ["QCommHandle", "enable"]

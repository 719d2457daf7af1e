"""DiLoCo in torchtitan: the ``diloco`` config section and the driver (both adapters).

The section (``[diloco]`` in torchtitan 0.2.2's TOML, ``--diloco.<field>`` on either's CLI, the
``diloco`` field of torchtitan 0.3's trainer ``Config``) is *generated* from
``fsdp_qcomm.diloco.DiLoCoConfig``: ``enable`` (default False) plus every ``DiLoCoConfig``
field as an optional override (unset: the library default; ``sync_every`` is H, ``fragments``,
``outer_lr``, ``outer_momentum``, ``bits``, ``error_feedback``, ...). TOML has no null, so
``bits = 32`` stands for ``bits=None`` (an unquantized fp32 outer all-reduce; set
``hadamard = false`` with it). Values are checked when the section is built and again after
CLI overrides: the resolved ``DiLoCoConfig`` must construct.

With ``enable = true`` the replica groups are torchtitan's ``dp_replicate`` dimension:

* torchtitan 0.2.2: :func:`parallelize_for_diloco` runs torchtitan's parallelize function
  with ``dp_replicate`` hidden, so each replica group is sharded by itself over ``fsdp``
  (``dp_shard``; one-rank groups stay plain modules) and no gradient crosses replica groups;
  the data loader still gives every replica its own batches;
* torchtitan 0.3: hiding ``dp_replicate`` fails in torch 2.15's ``fully_shard`` (0.3 annotates
  the parameters with spmd_types over the whole data-parallel storage mesh, and a
  ``dp_shard``-only FSDP mesh leaves the ``dp_replicate`` axis "neither a non-FSDP storage-mesh
  axis nor contained in the FSDP DP mesh"). So torchtitan builds its normal HSDP model and
  :func:`isolate_for_diloco` (``fsdp_qcomm.diloco.isolate_replicas``) makes FSDP's all-reduce
  across replicas a local no-op: each replica group then trains exactly as FSDP over
  ``dp_shard`` would. torchtitan normalizes the loss by the valid tokens of every data-parallel
  rank (all replica groups); :class:`ReplicaTokens` makes it the replica group's own count, as
  a run of that replica group alone would (``titan03.trainer``);
* :func:`install_diloco` registers two hooks on torchtitan's optimizers container: before the
  first step it builds ``DiLoCo(model, config, replicas=<the dp_replicate group>,
  handle=<fsdp-qcomm's handle, if any>)`` (the weights are initialized or loaded by then; the
  replicas start from replica 0's), after every step it calls ``DiLoCo.step()``;
* checkpoints carry a ``"diloco"`` entry (``titan_common.checkpoint.DiLoCoState``, added by
  ``titan.checkpoint``'s patched ``CheckpointManager`` on 0.2.2, by ``QCommTrainer`` on 0.3): the
  outer state and each replica group's own weights and inner optimizer state, so a resumed run
  continues the round and the outer momentum bit for bit (a load before the first step builds the
  engine then, see ``DiLoCoDriver.ensure_engine``); a checkpoint without it loads with
  ``--checkpoint.exclude_from_loading diloco`` (the outer state starts fresh);
* the ``qcomm:`` console line gains ``diloco:`` figures: the outer all-reduce's node-crossing
  bytes per inner step, outer steps, staleness (``diloco/*`` metrics).

Tensor parallelism composes: each rank syncs with its ``(dp_shard, tp)`` place in every replica
group (``fsdp_qcomm.diloco.layout``). Not wired here: pipeline, context or expert parallelism with
DiLoCo (refused, naming the dimension); torchft (``fsdp_qcomm.diloco.ft`` runs without
torchtitan).

On torchtitan 0.2.2 the loss stays normalized by every replica group's tokens (its stock
``Trainer`` computes it inside ``train_step``, out of an adapter's reach): each replica group's
gradient there is its own mean times its share of the tokens (1/R with R replica groups of equal
batches), which AdamW mostly absorbs but gradient clipping and epsilon do not.
"""

# NOTE: no ``from __future__ import annotations``: torchtitan 0.2.2's ConfigManager checks
# ``dataclasses.is_dataclass(field.type)`` to recurse into sections, which fails on strings.

import dataclasses
import logging
import typing
from dataclasses import field
from typing import Any, Optional

import torch
import tyro

from fsdp_qcomm.collectives.topology import known_ranks_per_node
from fsdp_qcomm.diloco.config import DiLoCoConfig

from .section import _matches, _type_name

logger = logging.getLogger(__name__)

SECTION = "diloco"
#: the attribute the driver leaves on a model part
ATTACHMENT_ATTR = "_fsdp_qcomm_diloco"
#: ``bits`` value meaning "unquantized" (TOML has no null)
FP32_BITS = 32


def _post_init(self) -> None:
    for name, tp in self._field_types.items():
        value = getattr(self, name)
        if value is None and name != "enable":
            continue
        if name == "bits" and value == FP32_BITS:
            continue
        if not _matches(value, tp):
            raise ValueError(f"[{SECTION}] {name}={value!r} has type {type(value).__name__}; "
                             f"expected {_type_name(tp)}")
    try:
        self.resolve()
    except (ValueError, TypeError) as e:
        raise ValueError(f"[{SECTION}] {e}") from None


def _overrides(self) -> dict:
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
            if f.name != "enable" and getattr(self, f.name) is not None}


def _resolve(self) -> Optional[DiLoCoConfig]:
    """The ``DiLoCoConfig`` this section describes (None when ``enable`` is false; the
    overrides are still validated)."""
    values = self.overrides()
    if values.get("bits") == FP32_BITS:
        values["bits"] = None
    cfg = DiLoCoConfig.from_dict(values)
    return cfg if self.enable else None


def make_section_class(name: str = "DiLoCoSection") -> type:
    hints = typing.get_type_hints(DiLoCoConfig)
    spec: list = [("enable", typing.Annotated[bool, tyro.conf.arg(
        help="DiLoCo across the dp_replicate replica groups (fsdp_qcomm.diloco)")],
        field(default=False))]
    types_: dict = {"enable": bool}
    for f in dataclasses.fields(DiLoCoConfig):
        tp = hints[f.name]
        extra = f"; {FP32_BITS} = unquantized" if f.name == "bits" else ""
        spec.append((f.name, typing.Annotated[Optional[tp], tyro.conf.arg(
            help=f"override DiLoCoConfig.{f.name} ({_type_name(tp)}; library default "
                 f"{f.default!r}{extra}); unset = the library default")], field(default=None)))
        types_[f.name] = tp
    cls = dataclasses.make_dataclass(name, spec, namespace={
        "__post_init__": _post_init, "overrides": _overrides, "resolve": _resolve,
        "_field_types": types_,
        "__doc__": f"[{SECTION}] section mirroring fsdp_qcomm.diloco.DiLoCoConfig.",
    })
    cls.__module__ = __name__
    return cls


DiLoCoSection = make_section_class()


def section_of(job_config: Any) -> Any:
    return getattr(job_config, SECTION, None)


def resolve(job_config: Any) -> Optional[DiLoCoConfig]:
    """The enabled ``DiLoCoConfig`` of a parsed job config, or None."""
    section = section_of(job_config)
    return None if section is None else section.resolve()


# --------------------------------------------------------------------------- parallelize
class _NoReplicate:
    """``parallel_dims`` as seen by torchtitan's parallelize function under DiLoCo: the
    ``dp_replicate`` dimension is hidden (no HSDP, no DDP across replica groups)."""

    def __init__(self, dims: Any) -> None:
        object.__setattr__(self, "_dims", dims)

    def __getattr__(self, name: str) -> Any:
        if name == "dp_replicate_enabled":
            return False
        if name == "dp_replicate":
            return 1
        return getattr(self._dims, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._dims, name, value)


#: why ``check_layout`` (and torchtitan 0.3's config check) refuse the other dimensions
WIRED_FOR = ("DiLoCo is wired for data and tensor parallelism only (dp_replicate replica "
             "groups, dp_shard x tp inside each)")


def check_layout(parallel_dims: Any) -> None:
    """Refuse what the driver does not wire (see the module docstring)."""
    bad = [n for n in ("pp", "cp", "ep") if getattr(parallel_dims, n, 1) > 1]
    if bad:
        raise ValueError(f"[{SECTION}] enable=true with {', '.join(f'{n}>1' for n in bad)}: "
                         f"{WIRED_FOR}")
    if getattr(parallel_dims, "dp_replicate", 1) < 2:
        logger.warning(f"[{SECTION}] enable=true with dp_replicate=1: one replica group, the "
                       "outer steps have no one to average with")


def parallelize_for_diloco(parallelize, model, parallel_dims, *args, **kwargs):
    """torchtitan's parallelize function with ``dp_replicate`` hidden (FSDP over ``fsdp``
    only): each replica group trains by itself between outer steps."""
    check_layout(parallel_dims)
    return parallelize(model, _NoReplicate(parallel_dims), *args, **kwargs)


def isolate_for_diloco(model: torch.nn.Module, parallel_dims: Any) -> Any:
    """torchtitan 0.3: right after its parallelize function built HSDP over ``dp_replicate``
    x ``dp_shard`` (and before ``install_qcomm``, which then sees one replica), isolate the
    replica groups (``fsdp_qcomm.diloco.isolate_replicas``); returns the
    ``ReplicaIsolation``, or None with one replica group (plain FSDP: nothing to isolate)."""
    check_layout(parallel_dims)
    if getattr(parallel_dims, "dp_replicate", 1) < 2:
        return None
    from fsdp_qcomm.diloco import isolate_replicas

    isolation = isolate_replicas(model)
    logger.info(f"[{SECTION}] {isolation.describe()}")
    return isolation


class ReplicaTokens:
    """The loss normalizer of a replica group that trains by itself (torchtitan 0.3).

    torchtitan divides each rank's summed loss by the valid tokens of the step on every rank
    of its batch mesh (``dp_replicate`` x ``dp_shard``: all replica groups), and FSDP sums the
    gradients (divide factor 1.0). Under DiLoCo the sum covers one replica group only, so the
    normalizer must too, or each replica's gradient is its share of the tokens (about 1/R)
    times the right one. ``start_step`` wraps the step's data iterator and counts the valid
    tokens of every batch it yields (``labels != ignore_index``, torchtitan's own count); the
    first ``forward_backward`` of the step all-reduces that count over ``group`` (the replica
    group's own ranks: FSDP's shard group; one tiny all-reduce per step) and every micro-batch
    of the step runs with it as ``global_valid_tokens``. The loss it returns is rescaled to
    torchtitan's normalizer (``own / everyone``) so the logged global average loss stays the
    mean over all replica groups' tokens."""

    def __init__(self, group: Any, ignore_index: int) -> None:
        self.group = group
        self.ignore_index = ignore_index
        self._local: Optional[torch.Tensor] = None
        self._own: Optional[torch.Tensor] = None

    def start_step(self, data_iterator: Any) -> Any:
        self._local = torch.zeros((), dtype=torch.int64)
        self._own = None
        return _CountingIterator(data_iterator, self)

    def _count(self, labels: torch.Tensor) -> None:
        if self._local is None:
            self._local = torch.zeros((), dtype=torch.int64)
        self._local += (labels != self.ignore_index).sum()

    def own(self, device: torch.device) -> torch.Tensor:
        """The step's valid tokens over the replica group (int64 on ``device``)."""
        if self._own is None:
            if self._local is None:
                raise RuntimeError(f"[{SECTION}] a forward-backward step before start_step: "
                                   "the replica group's token count is unknown")
            # from pinned memory without waiting: a pageable copy would sync every step
            own = (self._local.pin_memory().to(device, non_blocking=True)
                   if device.type == "cuda" else self._local.to(device))
            if self.group is not None and self.group.size() > 1:
                torch.distributed.all_reduce(own, group=self.group)
            self._own = own
        return self._own

    def forward_backward(self, call: Any, kwargs: dict) -> torch.Tensor:
        """``call(**kwargs)`` (torchtitan's ``forward_backward_step``) with the replica
        group's token count as ``global_valid_tokens``; the loss rescaled for logging."""
        everyone = kwargs["global_valid_tokens"]
        own = self.own(everyone.device)
        loss = call(**{**kwargs, "global_valid_tokens": own})
        with torch.no_grad():
            return loss.detach() * (own.float() / everyone.float()).to(loss.dtype)


class _CountingIterator:
    """The step's data iterator, counting each batch's valid tokens as it is drawn."""

    def __init__(self, inner: Any, tokens: ReplicaTokens) -> None:
        self.inner = inner
        self.tokens = tokens

    def __iter__(self) -> "_CountingIterator":
        return self

    def __next__(self) -> Any:
        item = next(self.inner)
        self.tokens._count(item[1])
        return item


# --------------------------------------------------------------------------- the driver
class DiLoCoDriver:
    """What ``install_diloco`` leaves on the model part: the config, the replica group, and
    the ``DiLoCo`` engine once the first optimizer step starts (or a checkpoint load needs
    it, whichever comes first)."""

    def __init__(self, model: torch.nn.Module, config: DiLoCoConfig, group: Any,
                 ranks_per_node: Optional[int] = None) -> None:
        self.model = model
        self.config = config
        self.group = group
        self.ranks_per_node = ranks_per_node
        self.engine: Any = None

    def _qcomm(self, what: str) -> Any:
        """``what`` of the model part's qcomm attachment (``install_qcomm``), None without."""
        from .comm_stats import ATTACHMENT_ATTR as QCOMM_ATTR

        return getattr(getattr(self.model, QCOMM_ATTR, None), what, None)

    def _handle(self) -> Any:
        return self._qcomm("handle")

    def _ranks_per_node(self, handle: Any) -> Optional[int]:
        """For the node-crossing byte counts: this driver's own, else the placement the qcomm
        handle resolved, else the ``[qcomm]`` section's (set even where no FSDP module got a
        handle, as under DiLoCo x TP without FSDP), else ``LOCAL_WORLD_SIZE``."""
        if self.ranks_per_node is not None:
            return self.ranks_per_node
        if handle is not None:
            return handle.placement.ranks_per_node
        return known_ranks_per_node(getattr(self._qcomm("config"), "ranks_per_node", None))

    def ensure_engine(self, *, for_load: bool = False) -> Any:
        """The ``DiLoCo`` engine, built now if it is not yet. Built at the first optimizer
        step, from the weights training starts with (initialized or loaded), unless a
        checkpoint load asks for it first (``for_load``: the ``"diloco"`` checkpoint entry,
        ``titan_common.checkpoint.DiLoCoState``, needs its buffers to load into). A build for
        a load skips ``init_sync`` (replica 0's weights to all): the load replaces everything
        the engine holds and every replica's own weights, so that copy would only be sent to
        be overwritten."""
        if self.engine is None:
            import dataclasses

            from fsdp_qcomm.diloco import DiLoCo

            config = self.config
            if for_load and config.init_sync:
                config = dataclasses.replace(config, init_sync=False)
            handle = self._handle()
            self.engine = DiLoCo(self.model, config, replicas=self.group, handle=handle,
                                 ranks_per_node=self._ranks_per_node(handle))
            logger.info(f"[{SECTION}] DiLoCo over {self.engine.replicas.size()} replica groups: "
                        f"{self.engine.schedule.describe()}, outer bits {self.config.bits}, "
                        f"error feedback {self.config.error_feedback}"
                        + (" (built for a checkpoint load)" if for_load else ""))
        return self.engine

    def before_step(self, *_args: Any, **_kwargs: Any) -> None:
        self.ensure_engine()

    def after_step(self, *_args: Any, **_kwargs: Any) -> None:
        if self.engine is not None:
            self.engine.step()

    def figures(self) -> dict[str, float]:
        if self.engine is None:
            return {}
        s = self.engine.stats()["summary"]
        return {
            "diloco/outer_cross_node_bytes_per_inner_step":
                float(s["outer_cross_node_bytes_per_inner_step"]),
            "diloco/outer_sent_bytes_per_inner_step": float(s["outer_sent_bytes_per_inner_step"]),
            "diloco/outer_steps": float(s["outer_steps"]),
            "diloco/inner_steps": float(s["inner_steps"]),
            "diloco/staleness_steps": float(s["staleness_steps"]),
            "diloco/outer_state_bytes": float(s["outer_state_bytes"]),
        }

    def close(self) -> None:
        if self.engine is not None:
            self.engine.finish()
            self.engine.close()


def install_diloco(model_parts: list, optimizers: Any, parallel_dims: Any,
                   config: Optional[DiLoCoConfig], group: Any = None) -> Optional[DiLoCoDriver]:
    """Attach a :class:`DiLoCoDriver` to the (single) model part and register its hooks on
    torchtitan's optimizers container; None when DiLoCo is off. ``group``: the replica group
    (default: torchtitan's ``dp_replicate`` mesh's; 0.3 passes the one FSDP's HSDP used,
    ``ReplicaIsolation.replica_group``)."""
    if config is None:
        return None
    check_layout(parallel_dims)
    if len(model_parts) != 1:
        raise ValueError(f"[{SECTION}] enable=true with {len(model_parts)} model parts: "
                         "pipeline parallelism is not wired")
    if group is None and getattr(parallel_dims, "dp_replicate", 1) > 1:
        group = parallel_dims.get_mesh("dp_replicate").get_group()
    elif group is None and torch.distributed.is_initialized():
        group = torch.distributed.new_group([torch.distributed.get_rank()])
    driver = DiLoCoDriver(model_parts[0], config, group)
    setattr(model_parts[0], ATTACHMENT_ATTR, driver)
    optimizers.register_step_pre_hook(driver.before_step)
    optimizers.register_step_post_hook(driver.after_step)
    return driver


def driver_of(model_parts: Any) -> Optional[DiLoCoDriver]:
    for part in model_parts or []:
        d = getattr(part, ATTACHMENT_ATTR, None)
        if d is not None:
            return d
    return None


def format_figures(fig: dict) -> str:
    """The ``diloco:`` part of the console line."""
    if "diloco/inner_steps" not in fig:
        return ""
    b = fig["diloco/outer_cross_node_bytes_per_inner_step"]
    return (f"  diloco: node-crossing {b:,.0f}B/inner step, {int(fig['diloco/outer_steps'])} "
            f"outer steps in {int(fig['diloco/inner_steps'])}, staleness "
            f"{int(fig['diloco/staleness_steps'])}")


__all__ = ["DiLoCoDriver", "DiLoCoSection", "ReplicaTokens", "SECTION", "WIRED_FOR",
           "check_layout", "driver_of", "format_figures", "install_diloco", "isolate_for_diloco",
           "parallelize_for_diloco", "resolve", "section_of"]

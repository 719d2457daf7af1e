"""DiLoCo in torchtitan: the ``diloco`` config section (both adapters) and the driver (the
torchtitan 0.2.2 adapter; the 0.3 one refuses ``enable``, see ``titan03.trainer``).

The section (``[diloco]`` in torchtitan 0.2.2's TOML, ``--diloco.<field>`` on either's CLI, the
``diloco`` field of torchtitan 0.3's trainer ``Config``) is *generated* from
``fsdp_qcomm.diloco.DiLoCoConfig``: ``enable`` (default False) plus every ``DiLoCoConfig``
field as an optional override (unset: the library default; ``sync_every`` is H, ``fragments``,
``outer_lr``, ``outer_momentum``, ``bits``, ``error_feedback``, ...). TOML has no null, so
``bits = 32`` stands for ``bits=None`` (an unquantized fp32 outer all-reduce; set
``hadamard = false`` with it). Values are checked when the section is built and again after
CLI overrides: the resolved ``DiLoCoConfig`` must construct.

With ``enable = true`` the replica groups are torchtitan's ``dp_replicate`` dimension:

* :func:`parallelize_for_diloco` runs torchtitan's parallelize function with
  ``dp_replicate`` hidden, so each replica group is sharded by itself over ``fsdp``
  (``dp_shard``; one-rank groups stay plain modules) and no gradient crosses replica groups;
  the data loader still gives every replica its own batches;
* :func:`install_diloco` registers two hooks on torchtitan's optimizers container: before the
  first step it builds ``DiLoCo(model, config, replicas=<the dp_replicate group>,
  handle=<fsdp-qcomm's handle, if any>)`` (the weights are initialized or loaded by then; the
  replicas start from replica 0's), after every step it calls ``DiLoCo.step()``;
* torchtitan 0.2.2 checkpoints carry a ``"diloco"`` entry (``titan_common.checkpoint.
  DiLoCoState``, added by ``titan.checkpoint``'s patched ``CheckpointManager``): the outer
  state and each replica group's own weights and inner optimizer state, so a resumed run
  continues the round and the outer momentum bit for bit (a load before the first step builds
  the engine then, see ``DiLoCoDriver.ensure_engine``); a checkpoint without it loads with
  ``--checkpoint.exclude_from_loading diloco`` (the outer state starts fresh);
* the ``qcomm:`` console line gains ``diloco:`` figures: the outer all-reduce's node-crossing
  bytes per inner step, outer steps, staleness (``diloco/*`` metrics).

Not wired here: pipeline, tensor, context or expert parallelism with DiLoCo (refused, naming
the dimension); torchft (``fsdp_qcomm.diloco.ft`` runs without torchtitan).
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


def check_layout(parallel_dims: Any) -> None:
    """Refuse what the driver does not wire (see the module docstring)."""
    bad = [n for n in ("pp", "tp", "cp", "ep") if getattr(parallel_dims, n, 1) > 1]
    if bad:
        raise ValueError(f"[{SECTION}] enable=true with {', '.join(f'{n}>1' for n in bad)}: "
                         "DiLoCo is wired for data parallelism only (dp_replicate replica "
                         "groups, dp_shard inside each)")
    if getattr(parallel_dims, "dp_replicate", 1) < 2:
        logger.warning(f"[{SECTION}] enable=true with dp_replicate=1: one replica group, the "
                       "outer steps have no one to average with")


def parallelize_for_diloco(parallelize, model, parallel_dims, *args, **kwargs):
    """torchtitan's parallelize function with ``dp_replicate`` hidden (FSDP over ``fsdp``
    only): each replica group trains by itself between outer steps."""
    check_layout(parallel_dims)
    return parallelize(model, _NoReplicate(parallel_dims), *args, **kwargs)


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

    def _handle(self) -> Any:
        from .comm_stats import ATTACHMENT_ATTR as QCOMM_ATTR

        att = getattr(self.model, QCOMM_ATTR, None)
        return getattr(att, "handle", None)

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
            self.engine = DiLoCo(self.model, config, replicas=self.group,
                                 handle=self._handle(), ranks_per_node=self.ranks_per_node)
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
                   config: Optional[DiLoCoConfig]) -> Optional[DiLoCoDriver]:
    """Attach a :class:`DiLoCoDriver` to the (single) model part and register its hooks on
    torchtitan's optimizers container; None when DiLoCo is off."""
    if config is None:
        return None
    check_layout(parallel_dims)
    if len(model_parts) != 1:
        raise ValueError(f"[{SECTION}] enable=true with {len(model_parts)} model parts: "
                         "pipeline parallelism is not wired")
    group = None
    if getattr(parallel_dims, "dp_replicate", 1) > 1:
        group = parallel_dims.get_mesh("dp_replicate").get_group()
    elif torch.distributed.is_initialized():
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


__all__ = ["DiLoCoDriver", "DiLoCoSection", "SECTION", "check_layout", "driver_of",
           "format_figures", "install_diloco", "parallelize_for_diloco", "resolve",
           "section_of"]

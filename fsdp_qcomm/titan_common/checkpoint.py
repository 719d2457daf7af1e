"""torchtitan checkpoints carry the fsdp_qcomm handles' state under the key ``"qcomm"``.

Each ``QCommHandle`` is a DCP ``Stateful``: this rank's state under its own key (per FSDP
module the RNG call counters, learned level tables, this rank's shard of the qWD reference and
its error-feedback residuals, with a record of who wrote it; ``fsdp/checkpoint.py``), so every
rank saves and loads its own. Without it a resumed run rebuilds the reference at full precision
and restarts the counters, so it continues close to, but not exactly like, a run that never
stopped. Each adapter adds one :class:`HandlesState` entry to the states its checkpoint manager
saves and loads, next to ``model``, ``optimizer``, ``lr_scheduler``, ``dataloader`` and
``train_state``: then a resume is bit for bit the uninterrupted run.

Checkpoints written without the entry (older fsdp_qcomm, or no hooks installed) lack the key,
and ones written before ``gathered_digest`` existed (2026-12-07) lack that one (DCP:
"Missing key in checkpoint state_dict: qcomm…gathered_digest"); load them with
``--checkpoint.exclude_from_loading qcomm``: the handles then start fresh (the first qWD gathers
send full precision, direct schemes draw new keys), as before.

With ``[diloco] enable`` (torchtitan 0.2.2 and 0.3) a second entry, ``"diloco"``
(:class:`DiLoCoState`), holds DiLoCo's outer state and each replica group's own weights and inner
optimizer state, so a resumed run continues the round and the outer momentum bit for bit.
Checkpoints written without it load with ``--checkpoint.exclude_from_loading diloco`` (the outer
state starts fresh).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.stateful import Stateful

from ..collectives.agreement import gather_unless_failed, stopped_on_ranks
from ..fsdp.checkpoint import CheckpointMismatch
from ..fsdp.enable import load_states
from .comm_stats import attachment_of

STATE_KEY = "qcomm"


class HandlesState(Stateful):
    """The handles of all model parts (pipeline stages) as one checkpoint entry."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles

    def state_dict(self) -> dict[str, Any]:
        return {f"part{i}": h.state_dict() for i, h in enumerate(self.handles)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Every part's state, with one exchange over the world (``enable.load_states``): a
        state refused for any part on any rank, the parts' count included, loads no part on
        any rank, and every rank raises ``CheckpointMismatch``."""
        mine = [f"part{i}" for i in range(len(self.handles))]
        failure = None
        if sorted(state_dict) != sorted(mine):
            failure = CheckpointMismatch(
                f"the checkpoint's {STATE_KEY!r} entry covers model parts {sorted(state_dict)}, "
                f"this run has {mine}; resume with the same pipeline layout, or pass "
                f"--checkpoint.exclude_from_loading {STATE_KEY} to start the hooks fresh"
            )
        load_states(self.handles, [functools.partial(state_dict.get, k) for k in mine], failure)


def handles_of(model_parts) -> list[Any]:
    """The live ``QCommHandle`` of each model part ``install_qcomm`` hooked."""
    return [a.handle for a in attachment_of(model_parts)
            if a.handle is not None and a.handle.enabled]


def add_handles_state(states: dict[str, Any], model_parts) -> Optional[HandlesState]:
    """Add the ``"qcomm"`` entry to a checkpoint manager's ``states`` (if hooks are installed
    and the entry is not there yet); returns the entry added."""
    handles = handles_of(model_parts)
    if not handles or STATE_KEY in states:
        return None
    states[STATE_KEY] = entry = HandlesState(handles)
    return entry


DILOCO_KEY = "diloco"
MODEL_KEY = "model"  # torchtitan's model entry (checkpoint.MODEL in 0.2.2 and 0.3)
#: what to pass to load a checkpoint written without the "diloco" entry
EXCLUDE_DILOCO = f"--checkpoint.exclude_from_loading {DILOCO_KEY}"


class DiLoCoState(Stateful):
    """DiLoCo's state in a torchtitan checkpoint, under ``"diloco"``: what a resumed run needs
    to continue the round exactly as the run that never stopped.

    ``state_dict()`` holds two parts:

    * ``"engine"``: ``DiLoCo.state_dict()`` (``diloco/engine.py``): the start-of-round
      weights, the outer optimizer state (momentum), the inner/outer step counters (the round
      position), a merge still pending, under ``group_rank{g}`` (what every replica holds alike
      at shard index ``g``: DCP keeps one copy, which is the same on every replica), and with
      error feedback this rank's residuals under ``residuals.replica{r}.group_rank{g}`` (its
      own). Per shard rank, not per replica group: the start-of-round weights are laid out
      like the rank's FSDP shard.
    * ``"replica{r}"``: replica group ``r``'s own model and inner optimizer state
      (the model as torchtitan's own ``"model"`` entry saves it, through a second instance of
      the manager's model wrapper: 0.2.2's ``get_model_state_dict``, 0.3's ``state_dict()``
      whose hooks split fused projections into their canonical keys; and the optimizers
      container's ``state_dict()``: DTensors sharded over the group's ``dp_shard`` ranks).
      torchtitan's ``"model"`` and ``"optimizer"`` entries cannot hold them: mid-round the
      replica groups' weights and Adam moments differ, but their keys and shard offsets are the
      same in every group, so DCP writes one group's copy of each shard and loads it into all.
      This part costs one more model and inner optimizer state per replica group in the
      checkpoint (torchtitan's entries stay as they are: model-only loads and exports read
      them).

    Ordering. torchtitan 0.2.2 builds the optimizers (``install_diloco`` attaches the driver), then
    the checkpoint manager, then loads the checkpoint at the start of ``train()``, before the first
    step (0.3: ``QCommTrainer`` attaches the driver and this entry after its ``Trainer.__init__``
    built both; the load is in ``train()`` too); the driver builds the engine lazily at the first
    optimizer step so that it snapshots the weights training really starts from (a model-only load
    or ``initial_load_path`` changes them after ``install_diloco``). A load of this entry needs the
    engine's buffers before the first step, so ``state_dict()`` builds the engine then
    (``DiLoCoDriver.ensure_engine(for_load=True)``: without ``init_sync``) and the load overwrites
    all of it: start-of-round weights, momentum, counters, pending merge, residuals. An engine built
    from the initialized weights and then overwritten is the one the uninterrupted run had at that
    step, since nothing else in it depends on the weights. The other order (build eagerly in
    ``install_diloco``) would snapshot the initialized weights before a model-only load replaced
    them.

    torchtitan loads its flattened ``"model"`` entry after every ``Stateful`` (after
    ``dcp.load`` returns), which would put the deduplicated weights back over this replica's
    own. So the manager drives a load in three calls (:func:`wrap_dcp_load`): ``begin_load()``
    (``state_dict()`` then gives fresh buffers for the replica part instead of views of the
    live parameters and optimizer state, which torchtitan's own entries load into as well),
    the ``dcp.load`` (``load_state_dict`` restores the engine and keeps the replica part), and
    ``finish_load()`` after torchtitan's model load (the replica part goes into the model and
    the inner optimizer). Without ``begin_load`` (a plain ``dcp.load``) ``load_state_dict``
    applies the replica part at once.
    """

    def __init__(self, driver: Any, model_parts: list, optimizers: Any,
                 model_state: Optional[Any] = None) -> None:
        self.driver = driver
        self.model_parts = list(model_parts)
        self.optimizers = optimizers
        # saves and loads the model like the manager's "model" entry (same keys, same hooks)
        self.model_state = model_state if model_state is not None else _DCPModel(model_parts)
        self._loading = False
        self._loaded: Optional[dict[str, Any]] = None

    # ---- the parts -------------------------------------------------------------------------
    def _engine(self) -> Any:
        return self.driver.ensure_engine(for_load=self._loading)

    def replica_key(self) -> str:
        return f"replica{self._engine().replicas.rank()}"

    def engine_keys(self) -> list[str]:
        """This rank's keys inside the ``"engine"`` part."""
        e = self._engine()
        keys = [f"group_rank{e.group_rank}"]
        if any(f.feedback is not None for f in e.fragments):
            keys.append(e._residual_key())
        return keys

    def _replica_state(self) -> dict[str, Any]:
        return {"model": dict(self.model_state.state_dict()),
                "optimizer": self.optimizers.state_dict()}

    # ---- Stateful --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        replica = self._replica_state()
        if self._loading:  # buffers of their own: the live ones get torchtitan's copies
            replica = _fresh(replica)
        return {"engine": self._engine().state_dict(), self.replica_key(): replica}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        key = self.replica_key()
        missing = [k for k in ("engine", key) if k not in state_dict]
        if missing:
            raise ValueError(
                f"the checkpoint's {DILOCO_KEY!r} entry lacks {missing} (this rank is in "
                f"replica group {key[len('replica'):]}); resume with the same replica groups, "
                f"or pass {EXCLUDE_DILOCO} to start the outer state fresh")
        try:
            self._engine().load_state_dict(state_dict["engine"])
        except ValueError as e:  # another layout or config, named by the engine
            raise ValueError(f"{e}; or pass {EXCLUDE_DILOCO} to start the outer state "
                             "fresh") from None
        self._loaded = state_dict[key]
        if not self._loading:
            self.finish_load()

    # ---- the manager's load ------------------------------------------------------------------
    def begin_load(self) -> None:
        """Before ``dcp.load``: the replica part loads into buffers of its own."""
        self._loading = True
        self._loaded = None

    @torch.no_grad()
    def finish_load(self) -> None:
        """After the load (and after torchtitan's own model load): this replica group's
        weights and inner optimizer state into the model and the optimizers."""
        self._loading = False
        loaded, self._loaded = self._loaded, None
        if loaded is None:
            return
        self.model_state.load_state_dict(loaded["model"])
        self.optimizers.load_state_dict(loaded["optimizer"])

    def abort_load(self) -> None:
        self._loading = False
        self._loaded = None

    # ---- checks before a load ------------------------------------------------------------------
    def check_checkpoint(self, keys: Any, where: str = "the checkpoint") -> None:
        """Refuse, before loading, a checkpoint whose keys (DCP's flattened names) lack this
        entry or this rank's part of it, naming the flag that loads it anyway."""
        keys = list(keys)
        prefix = f"{DILOCO_KEY}."
        ours = [k for k in keys if k.startswith(prefix)]
        if not ours:
            raise ValueError(
                f"{where} has no {DILOCO_KEY!r} entry (DiLoCo's outer state: written by an "
                "fsdp_qcomm release that did not save it, or by a run without [diloco] enable). "
                f"Pass {EXCLUDE_DILOCO} to load it: the outer state then starts fresh (a new "
                "round from the loaded weights, zero outer momentum, replica 0's weights to "
                "every replica group), so the run does not continue bit for bit")
        need = [f"{prefix}engine.{k}." for k in self.engine_keys()] + \
               [f"{prefix}{self.replica_key()}."]
        lacking = [n[:-1] for n in need if not any(k.startswith(n) for k in ours)]
        if lacking:
            saved = sorted({_part_name(k[len(prefix):]) for k in ours})
            raise ValueError(
                f"{where}'s {DILOCO_KEY!r} entry has no {lacking} for this rank (it holds "
                f"{saved}): it was written with other replica groups, shard group size or "
                f"error feedback. Resume with the same layout, or pass {EXCLUDE_DILOCO} to "
                "start the outer state fresh")


def _part_name(key: str) -> str:
    """The part of the entry a flattened key belongs to: ``replica1``, ``engine.group_rank0``,
    ``engine.residuals.replica1.group_rank0``."""
    parts = key.split(".")
    n = 1 if parts[0] != "engine" else 4 if parts[1:2] == ["residuals"] else 2
    return ".".join(parts[:n])


def _fresh(tree: Any) -> Any:
    """``tree`` with every tensor replaced by a zero tensor of its own, alike in shape,
    dtype, device and (DTensor) placement."""
    if isinstance(tree, dict):
        return {k: _fresh(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_fresh(v) for v in tree]
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    return tree


class _DCPModel:
    """A model's state as DCP's ``get_model_state_dict`` / ``set_model_state_dict`` give it:
    the replica part's model state when the manager has no ``"model"`` wrapper to copy."""

    def __init__(self, model_parts: list) -> None:
        self.model_parts = list(model_parts)

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        out: dict[str, Any] = {}
        for part in self.model_parts:
            out.update(get_model_state_dict(part))
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        for part in self.model_parts:
            set_model_state_dict(part, state_dict, options=StateDictOptions(strict=False))


def _model_state_like(states: dict[str, Any], model_parts: list) -> Optional[Any]:
    """A second instance of the manager's ``"model"`` wrapper over ``model_parts`` (torchtitan's
    ``ModelWrapper``: its keys and state-dict hooks are the ones the checkpoint uses), or None
    when the manager holds none of that shape."""
    wrapper = states.get(MODEL_KEY)
    cls = type(wrapper)
    if wrapper is None or not all(callable(getattr(cls, m, None))
                                  for m in ("state_dict", "load_state_dict")):
        return None
    try:
        return cls(model_parts)
    except TypeError:  # a wrapper that is not built from the model parts
        return None


def add_diloco_state(states: dict[str, Any], model_parts, optimizers: Any
                     ) -> Optional[DiLoCoState]:
    """Add the ``"diloco"`` entry to a checkpoint manager's ``states`` when a
    ``DiLoCoDriver`` is attached to a model part (and the entry is not there yet); returns the
    entry added."""
    from .diloco import driver_of

    driver = driver_of(model_parts)
    if driver is None or DILOCO_KEY in states or optimizers is None:
        return None
    parts = list(model_parts)
    states[DILOCO_KEY] = entry = DiLoCoState(driver, parts, optimizers,
                                             _model_state_like(states, parts))
    return entry


def wrap_dcp_load(manager: Any, entry: DiLoCoState) -> None:
    """Make a torchtitan ``CheckpointManager``'s ``dcp_load`` (0.2.2 and 0.3 alike: the
    flattened model is loaded after ``dcp.load`` returns) check the checkpoint for the
    ``"diloco"`` entry first and put each replica group's own weights and inner optimizer state
    back last (``DiLoCoState.begin_load`` / ``finish_load``)."""
    original = manager.dcp_load

    def dcp_load(state_dict: dict[str, Any], checkpoint_id: str, *args: Any,
                 **kwargs: Any) -> None:
        if state_dict.get(DILOCO_KEY) is not entry:  # excluded, model only, or from HF
            return original(state_dict, checkpoint_id, *args, **kwargs)
        entry.begin_load()
        failure = None
        try:  # this rank's part (its replica's key): what it lacks may be there for others
            entry.engine_keys()  # builds the engine (collective) on every rank, whatever follows
            keys = checkpoint_keys(checkpoint_id)
            if keys is not None:
                entry.check_checkpoint(keys, where=f"checkpoint {checkpoint_id}")
        except Exception as e:  # raised on every rank by the exchange below
            failure = e
        try:
            # every rank refuses, or none: the others would wait in dcp.load's collectives
            gather_unless_failed(None, failure, None, stopped_on_ranks(
                f"checkpoint {checkpoint_id}: its DiLoCo entry was refused", "no rank loads it"),
                raises=ValueError)
            original(state_dict, checkpoint_id, *args, **kwargs)
        except BaseException:
            entry.abort_load()
            raise
        entry.finish_load()

    dcp_load._fsdp_qcomm = True  # type: ignore[attr-defined]
    manager.dcp_load = dcp_load


def checkpoint_keys(checkpoint_id: Any) -> Optional[list[str]]:
    """The flattened keys a DCP checkpoint directory holds (its metadata), or None when it
    cannot be read as one (then ``dcp.load`` reports what is wrong)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return list(FileSystemReader(str(checkpoint_id)).read_metadata().state_dict_metadata)
    except Exception:  # noqa: BLE001 - not a file-system checkpoint: DCP's own errors apply
        return None


__all__ = ["DILOCO_KEY", "DiLoCoState", "EXCLUDE_DILOCO", "HandlesState", "STATE_KEY",
           "add_diloco_state", "add_handles_state", "checkpoint_keys", "handles_of",
           "wrap_dcp_load"]

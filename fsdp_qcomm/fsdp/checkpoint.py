"""A rank's fsdp_qcomm state in a checkpoint: what it holds, who wrote it, and the checks on load.

``QCommHandle.state_dict()`` returns one entry, keyed ``"rank<r>_of_<W>"`` (global rank ``r`` of
a world of ``W`` ranks), that holds this rank's state in plain values only: tensors that own
their storage (copies, never views of a live buffer), ints, strings and lists. So ``torch.save``,
``torch.load(map_location="cpu", weights_only=True)`` (without ``map_location`` a GPU run's
tensors come back on the GPU index that saved them) and any per-rank checkpointer can hold it::

    {"rank1_of_4": {
        "version": 2,
        "owner": {                                # who wrote it
            "rank": 1, "world_size": 4,
            "placement": {"ranks_per_node": 2, "node": 0},
            "config": {...},                      # CONFIG_FIELDS of the QCommConfig
            "config_digest": "…",
            "modules": {label: {"mesh": [4], "coordinate": [1],
                                "params": [[name, global shape, local shape], ...]}}},
        "modules": {label: {                      # "<root>" is the model itself
            "weight_calls": int, "grad_calls": int, "replica_calls": int,  # RNG call counters
            "gathered_digest": int | None,   # digest of the shard last gathered
            "weight_levels": {...}, "grad_levels": {...},    # learned level tables (LevelSync)
            "reference_valid": 0 to 4, "reference": {param name: its padded shard},  # qWD
            "grad_residuals": {"<hook>.<site>": flat residual}}}}}      # error feedback

Why the key carries the rank: torch.distributed.checkpoint saves a plain tensor or object once
when every rank holds it under the same key, so states under one key would come back as one
rank's state on every rank. Under its own key each rank's state is written by that rank, and
at load each rank asks for its own key and gets back exactly what it saved.

``load_handle_state`` checks the owner record before it changes anything, on every rank at once
(one exchange: a state refused on one rank is refused on all), and refuses, naming
what differs and what to do, a state that another rank wrote (a checkpointer that kept one
rank's copy for all ranks, such as Accelerate's ``register_for_checkpointing`` or the metadata
of Lightning's ``fabric.save``), that a run of another world size wrote (each rank's qWD
reference shard, residuals and tables belong to its place in the run; there is no resharding),
or that another placement (node size, meshes), ``QCommConfig`` (``CONFIG_FIELDS``) or model
(FSDP modules, parameter names and shapes) wrote. The remedy for all but the first: load the
model and optimizer without the fsdp_qcomm state; the next weight gathers then send full
precision, which is correct, only not the bits of an uninterrupted run.

Under DCP a checkpoint of another world size never reaches ``load_handle_state``: its keys are
other ranks' (``dcp.load`` fails with "Missing key in checkpoint state_dict:
qcomm.rank<r>_of_<W>…"); a state whose tensors changed shape (another bit width, mesh or
model) can fail there too, with DCP's "Size mismatch … for qcomm.rank…".

The weight gather's part (``gather_state`` / ``load_gather_state``: its RNG counter, level
table, the digest of the shard it last gathered and the qWD reference) is here as well;
``QuantizedAllGather`` delegates to it.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..codec import FLOAT_DTYPES
from ..collectives.agreement import gather_unless_failed, stopped_on_ranks
from . import internals as fsdp
from .residual_state import check_residuals, load_residuals, residual_entries

#: the layout of a rank's state (1: DTensor views in one dict for all ranks, before owners)
FORMAT = 2

#: QCommConfig fields that shape a rank's state or give its values their meaning
CONFIG_FIELDS = (
    "weight_scheme", "weight_bits", "weight_group_size", "weight_symmetric", "weight_rounding",
    "weight_hadamard", "weight_levels",
    "grad_scheme", "grad_intra_bits", "grad_inter_bits", "grad_group_size", "grad_symmetric",
    "grad_rounding", "grad_hadamard", "grad_pipeline_chunks", "grad_error_feedback",
    "grad_levels", "levels_refresh_every", "scale_dtype", "seed", "quantize_intra_node",
)
#: QCommConfig fields a state does not depend on: how reductions are scheduled
#: (``grad_overlap``), whether unchanged weights are re-sent, how much of the qWD reference a
#: rank keeps (each rank saves its own shard either way, and either kind is rebuilt from the
#: shards), the guards (their period, whether weight writes are agreed on), the node size
#: (compared as placement), the budget (compared through the widths it chose) and the
#: error-feedback decay (a saved residual is valid under any decay: the next step applies
#: this run's; checkpoints saved before the field existed stay loadable)
NOT_SAVED_FIELDS = ("weight_reuse_unchanged", "weight_reference", "grad_overlap",
                    "consistency_check_every", "verify_weight_writes", "ranks_per_node",
                    "bit_budget", "grad_error_feedback_decay")

_KEY = re.compile(r"^rank(\d+)_of_(\d+)$")
#: module-path segments that wrappers insert (activation checkpointing's ``checkpoint_wrapper``,
#: ``torch.compile``'s ``OptimizedModule``) and torch's own state-dict names leave out
_WRAPPER_SEGMENTS = frozenset(("_checkpoint_wrapped_module", "_orig_mod"))


def state_name(fqn: str) -> str:
    """A parameter's name as the checkpoint keys it: without the segments of activation
    checkpointing and ``torch.compile`` wrappers, as in torch's own state-dict names, so a run
    resumes after turning either on or off (a common change after running out of memory)."""
    return ".".join(p for p in fqn.split(".") if p not in _WRAPPER_SEGMENTS)


def _by_state_name(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved reference's pieces under ``state_name``s: a checkpoint from before it kept the
    wrapper segments in its keys."""
    return {state_name(k): v for k, v in saved.items()}


# How to resume without the fsdp_qcomm state, in each integration's own terms (one text for
# every error that offers it: CheckpointMismatch here, the per-rank files' in integrations).
RESUME_WITHOUT_STATE = (
    "load the model and optimizer without the fsdp_qcomm state instead (leave the handle out of "
    "dcp.load; torchtitan: --checkpoint.exclude_from_loading qcomm; Accelerate: load_state "
    "before fsdp_qcomm.integrations.accelerate.register, or .remove() the two hooks it returned "
    "and register again after; Lightning: fabric.load instead of "
    "fsdp_qcomm.integrations.lightning.load): the next weight gathers then send full precision "
    "and the RNG counters and level tables start afresh, which is correct, only not the bits of "
    "an uninterrupted run")

_PER_RANK = ("Each rank's fsdp_qcomm state is its own (its shard of the qWD reference, its "
             "error-feedback residuals): every rank must load the state it saved itself. A "
             "checkpointer that keeps one copy for all ranks (Accelerate's "
             "register_for_checkpointing, the metadata of Lightning's fabric.save, a torch.save "
             "on rank 0 only) cannot hold it: save the handle with torch.distributed.checkpoint "
             "(the handle itself in the dcp.save/dcp.load dict), "
             "fsdp_qcomm.integrations.accelerate.register(accelerator, handle), "
             "fsdp_qcomm.integrations.lightning.save/load, or one file per rank "
             "(fsdp_qcomm.integrations.save_rank_state/load_rank_state; docs/reliability.md)")


class CheckpointMismatch(ValueError):
    """A saved fsdp_qcomm state that this rank, run or model must not load."""


def rank_key(rank: int, world: int) -> str:
    """The key of global rank ``rank``'s state in a world of ``world`` ranks."""
    return f"rank{rank}_of_{world}"


def parse_rank_key(key: Any) -> Optional[tuple[int, int]]:
    """(rank, world) of a ``rank_key``, or None."""
    m = _KEY.match(key) if isinstance(key, str) else None
    return (int(m.group(1)), int(m.group(2))) if m else None


# ---- the weight gather's part --------------------------------------------------------------
def reference_layout(g: Any) -> Optional[tuple[torch.dtype, tuple[int, ...]]]:
    """(all-gather dtype, segments) when ``g``'s gathers are qWD gathers, else None."""
    if g._scheme != "qwd":
        return None
    segs, _ = g._segments()
    params = fsdp.sharded_params(g._pg)
    if segs is None or not params:
        return None
    mp_dtype = fsdp.param_dtype(g._pg)
    dtypes = {mp_dtype or p.dtype for p in params}
    if len(dtypes) != 1 or next(iter(dtypes)) not in FLOAT_DTYPES:
        return None  # mixed dtypes: FSDP gathers raw bytes, we gather plainly
    return next(iter(dtypes)), segs


def _reference_pieces(g: Any, flat: torch.Tensor, segs: tuple[int, ...]) -> dict[str, Any]:
    """One flat tensor per parameter: a copy of its whole padded segment of the own-shard
    buffer. The padding is kept: it is quantized in one group with the parameter's last
    values, and under learned levels (no exact zero level) it drifts away from zero, so a
    reference restored with zeros there would round those values differently."""
    out: dict[str, torch.Tensor] = {}
    off = 0
    for name, seg in zip(g._param_names(), segs):
        out[name] = flat[off:off + seg].clone()
        off += seg
    return out


#: ``reference_valid`` of a reference saved with a write pending, by ``ChangeTracker.written``:
#: found by signature (``mark_changed()`` may still explain it), or taken into an optimizer step
WRITTEN = {1: 2, 2: 3}
_WRITTEN_OF = {v: k for k, v in WRITTEN.items()}  # the load's way back
#: ``reference_valid`` of a reference saved with a write found by content pending on this rank
#: (``ChangeTracker.content_pending``: per rank, or-ed by the next agreement)
CONTENT_PENDING = 4


def gather_state(g: Any) -> dict[str, Any]:
    """``g``'s RNG call counter, its learned level table, the digest of the shard its last
    gather was made from when nothing changed since (``ChangeTracker.clean_digest``; else None,
    always None for exact gathers: the key is in every gather's state, so DCP's templates match
    whatever the gathers keep), and for qWD this rank's shard of the reference (its
    ``own_ref``; zeros with ``reference_valid`` 0 before the first gather, and when the next
    gather re-sends full precision anyway: ``ChangeTracker.resends_full``; 2 or 3, ``WRITTEN``,
    with a write pending, which the resumed run then finds again; 4, ``CONTENT_PENDING``, with
    a write only this rank's digest finds pending)."""
    device = fsdp.group_device(g._pg)
    state: dict[str, Any] = {"weight_calls": g._counter, "gathered_digest": None}
    if g.levels is not None:
        state["weight_levels"] = g.levels.checkpoint_state(device)
    layout = reference_layout(g)
    valid = 1
    if layout is not None:
        dtype, segs = layout
        q = g._qwd
        if g.tracker is not None and g.tracker.resends_full():
            # the next gather re-sends full precision (reset()): the resumed run does the same
            # from a state without a reference, whatever the reference was
            flat, valid = torch.zeros(sum(segs), dtype=dtype, device=device), 0
        elif g._pending_ref is not None:
            flat = g._pending_ref
        elif q is not None and q.valid and q.segments == segs and q.own_ref.dtype == dtype:
            flat = q.own_ref
        else:  # nothing gathered yet (or a template for loading): placeholders
            flat, valid = torch.zeros(sum(segs), dtype=dtype, device=device), 0
        written = g.tracker.written() if valid and g.tracker is not None else 0
        if written:  # the resumed run finds the write again (``load_gather_state``)
            valid = WRITTEN[written]
        elif valid and g.tracker is not None and g.agrees and g.tracker.content_pending():
            valid = CONTENT_PENDING
        state["reference_valid"] = valid
        state["reference"] = _reference_pieces(g, flat, segs)
    if g.tracker is not None and not g._plain_like and valid:
        state["gathered_digest"] = g.tracker.clean_digest()
    return state


def check_gather_state(g: Any, state: dict[str, Any]) -> None:
    """Raise ``CheckpointMismatch`` unless ``load_gather_state`` can take ``state`` whole."""
    _need(state, "weight_calls", g.name)
    if g.levels is not None:
        g.levels.check_checkpoint_state(_need(state, "weight_levels", g.name),
                                        f"FSDP module {g.name!r}, weight levels")
    digest = state.get("gathered_digest")
    if digest is not None and (type(digest) is not int or not -(1 << 63) <= digest < (1 << 63)):
        raise CheckpointMismatch(
            f"FSDP module {g.name!r}: the saved gathered_digest is {digest!r}, not an int64 "
            f"or None; the state was written by something else than fsdp_qcomm. "
            f"{RESUME_WITHOUT_STATE}"
        )
    valid = state.get("reference_valid")
    if valid not in (None, 0, 1, *WRITTEN.values(), CONTENT_PENDING):
        raise CheckpointMismatch(
            f"FSDP module {g.name!r}: the saved reference_valid is {valid!r}, not one of 0 to "
            f"4; the state was written by something else than fsdp_qcomm. "
            f"{RESUME_WITHOUT_STATE}"
        )
    if reference_layout(g) is None or not valid:
        return
    ref = _need(state, "reference", g.name)
    ref = _by_state_name(ref) if isinstance(ref, dict) else ref
    _, segs = reference_layout(g)
    for name, seg in zip(g._param_names(), segs):
        t = ref.get(name) if isinstance(ref, dict) else None
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (seg,):
            got = "nothing" if t is None else (
                f"shape {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__)
            raise CheckpointMismatch(
                f"FSDP module {g.name!r}: the saved qWD reference of {name!r} is {got}, this "
                f"rank's padded shard has {seg} values; it was saved from another model or "
                f"sharding. Load the matching checkpoint, or {RESUME_WITHOUT_STATE}"
            )


def load_gather_state(g: Any, state: dict[str, Any]) -> None:
    """Restore the counter and the level table; adopt a saved qWD reference (re-assembled by
    the next gather; without one the next gather sends full precision) and the digest the next
    gather's decision compares the loaded shard with."""
    device = fsdp.group_device(g._pg)
    g._counter = int(state["weight_calls"])
    if g.levels is not None:
        g.levels.load_checkpoint_state(state["weight_levels"], device)
    layout = reference_layout(g)
    # what the next gather needs came back: the qWD reference, or a direct scheme's counter
    restored = layout is None or bool(state.get("reference_valid"))
    if g.tracker is not None:  # the next gather exchanges unless the shards match the digest
        valid = state.get("reference_valid")
        g.tracker.loaded(restored, state.get("gathered_digest"),
                         written=_WRITTEN_OF.get(valid, 0),
                         # only an agreement ors it: a rank deciding alone would send alone
                         content_pending=valid == CONTENT_PENDING and g.agrees)
        if not g._plain_like:
            g._gen += 1  # forwards before the load computed with other weights
    g._forward_gathers = 0
    g._pending_ref = None
    if g._kept is not None:
        g._kept.invalidate()
    if layout is None:
        return
    if not restored:
        g.reset()
        return
    dtype, segs = layout
    flat = torch.zeros(sum(segs), dtype=dtype, device=device)
    saved = _by_state_name(state["reference"])
    off = 0
    for name, seg in zip(g._param_names(), segs):
        flat[off:off + seg].copy_(saved[name])
        off += seg
    g._pending_ref = flat
    if g._qwd is not None:
        g._qwd.invalidate()  # FSDP gets a fresh output buffer, not the stale reference


def _need(state: Any, key: str, label: str) -> Any:
    if not isinstance(state, dict) or key not in state:
        raise CheckpointMismatch(
            f"FSDP module {label!r}: the saved fsdp_qcomm state has no {key!r} entry, which "
            f"this run's configuration keeps: it was saved by another configuration; "
            f"{RESUME_WITHOUT_STATE}"
        )
    return state[key]


# ---- the owner record ----------------------------------------------------------------------
def _module_config(record: Any) -> str:
    return ("the enable() config" if record is None
            else f"its own module_configs entry (digest {config_digest(record)})")


def config_record(config: Any) -> dict[str, Any]:
    return {k: getattr(config, k) for k in CONFIG_FIELDS}


def config_digest(record: dict[str, Any]) -> str:
    return hashlib.sha1(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]


def owner_record(installs: list[Any], config: Any, placement: Any) -> dict[str, Any]:
    """Who this rank is in this run: rank, world size, node placement, the ``CONFIG_FIELDS``
    of ``config``, and per FSDP module its mesh, this rank's coordinate in it and its
    parameters (name, global shape, local shape)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rpn = placement.ranks_per_node if placement is not None else None
    modules = {}
    for i in installs:
        params = fsdp.sharded_params(i.group)
        mesh = params[0].device_mesh
        coord = mesh.get_coordinate()
        names = i.all_gather._param_names() if i.all_gather is not None else [
            f"{i.label}[{k}]" for k in range(len(params))]
        modules[i.label] = {
            "mesh": list(mesh.shape),
            "coordinate": list(coord) if coord is not None else [],
            "params": [[n, list(p.shape), list(p.to_local().shape)]
                       for n, p in zip(names, params)],
        }
        own = getattr(i, "config", None)
        if own is not None and own != config:  # enable(module_configs=...): its own settings
            modules[i.label]["config"] = config_record(own)
    cfg = config_record(config)
    return {
        "rank": rank, "world_size": world,
        "placement": {"ranks_per_node": rpn, "node": rank // rpn if rpn else None},
        "config": cfg, "config_digest": config_digest(cfg),
        "modules": modules,
    }


# ---- the handle's state --------------------------------------------------------------------
def handle_state(installs: list[Any], config: Any, placement: Any) -> dict[str, Any]:
    """This rank's state (see the module docstring), under its ``rank_key``."""
    owner = owner_record(installs, config, placement)
    modules: dict[str, Any] = {}
    for i in installs:
        state = gather_state(i.all_gather) if i.all_gather is not None else {}
        rs = i.reduce_scatter
        state["grad_calls"] = rs.call_count if rs is not None else 0
        state["replica_calls"] = i.replica.call_count if i.replica is not None else 0
        if rs is not None and getattr(rs, "levels", None) is not None:
            state["grad_levels"] = rs.levels.checkpoint_state(fsdp.group_device(i.group))
        residuals = residual_entries(i.reduction_hooks, i.group)
        if residuals:
            state["grad_residuals"] = residuals
        modules[i.label] = state
    entry = {"version": FORMAT, "owner": owner, "modules": modules}
    return {rank_key(owner["rank"], owner["world_size"]): entry}


_REFUSED = stopped_on_ranks(
    "the fsdp_qcomm state was refused",
    "no rank loads it (the ranks would gather from different references and counters)")


def load_handle_state(parts: list[tuple[list[Any], Any, Any, Callable[[], Any]]],
                      failure: Optional[Exception] = None) -> None:
    """For each part (one handle's ``(installs, config, placement, read)``: several for the
    model parts of a pipeline stage), read this rank's state (``read()``) and check it against
    this rank and run; then, once every rank's reading and checks passed, restore every
    module's part. One exchange over the world decides (``collectives.agreement``): a state
    refused on any rank, for any part, changes nothing on any rank, which raises
    ``CheckpointMismatch`` alike (the refused rank its own, naming what differs); so does a
    ``failure`` the caller found first. Without it the ranks that accepted their state went on
    into their first gather, waiting there for the ones that raised."""
    saved = []
    try:
        if failure is None:
            saved = [_checked_modules(installs, config, placement, read())
                     for installs, config, placement, read in parts]
    except CheckpointMismatch as e:  # raised on every rank by the exchange below
        failure = e
    except Exception as e:  # an unreadable file, a malformed entry: the type every rank raises
        failure = CheckpointMismatch(
            f"the fsdp_qcomm state could not be read or checked ({type(e).__name__}: {e}); "
            f"{RESUME_WITHOUT_STATE}")
        failure.__cause__ = e
    gather_unless_failed(None, failure, None, _REFUSED, raises=CheckpointMismatch)
    for (installs, *_), modules in zip(parts, saved):
        _restore_modules(installs, modules)


def _restore_modules(installs: list[Any], saved: dict[str, Any]) -> None:
    for i in installs:
        s = saved[i.label]
        if i.all_gather is not None:
            load_gather_state(i.all_gather, s)
        rs = i.reduce_scatter
        if rs is not None:
            rs.call_count = int(s["grad_calls"])
            if getattr(rs, "levels", None) is not None:
                rs.levels.load_checkpoint_state(s["grad_levels"], fsdp.group_device(i.group))
        if i.replica is not None:
            i.replica.call_count = int(s["replica_calls"])
        load_residuals(i.reduction_hooks, i.group, s.get("grad_residuals", {}), i.label)


def _checked_modules(installs: list[Any], config: Any, placement: Any,
                     state: Any) -> dict[str, Any]:
    """``state``'s module entries, once its owner record and every module's part match this
    rank and run; else ``CheckpointMismatch`` naming what differs."""
    mine = owner_record(installs, config, placement)
    entry = _own_entry(state, mine)
    _check_owner(entry["owner"], mine)
    saved = entry.get("modules")
    if not isinstance(saved, dict) or sorted(saved) != sorted(mine["modules"]):
        raise CheckpointMismatch(
            f"the saved fsdp_qcomm state has no module entries for "
            f"{sorted(set(mine['modules']) - set(saved or {}))}; it is incomplete; "
            f"{RESUME_WITHOUT_STATE}"
        )
    try:
        for i in installs:
            _check_module(i, saved[i.label])
    except CheckpointMismatch:
        raise
    except ValueError as e:  # a level table or residual of another size
        raise CheckpointMismatch(f"{e}; {RESUME_WITHOUT_STATE}") from None
    return saved


def _check_module(i: Any, s: Any) -> None:
    if i.all_gather is not None:
        check_gather_state(i.all_gather, s)
    for key in ("grad_calls", "replica_calls"):
        _need(s, key, i.label)
    rs = i.reduce_scatter
    if rs is not None and getattr(rs, "levels", None) is not None:
        rs.levels.check_checkpoint_state(_need(s, "grad_levels", i.label),
                                         f"FSDP module {i.label!r}, gradient levels")
    check_residuals(i.reduction_hooks, i.group, s.get("grad_residuals", {}), i.label)


def _own_entry(state: Any, mine: dict[str, Any]) -> dict[str, Any]:
    """This rank's entry of ``state``, or the error that says whose state it is."""
    rank, world = mine["rank"], mine["world_size"]
    if not isinstance(state, dict):
        raise CheckpointMismatch(
            f"not a QCommHandle state: got {type(state).__name__}; pass what "
            "QCommHandle.state_dict() returned on this rank"
        )
    owners = {k: parse_rank_key(k) for k in state}
    found = sorted(v for v in owners.values() if v is not None)
    if not found:
        if "modules" in state and "version" in state:
            raise CheckpointMismatch(
                f"this fsdp_qcomm state has format {state.get('version')!r} (an fsdp_qcomm "
                f"release before {FORMAT}: one dict for every rank, without its owner), which "
                f"this release cannot tell apart per rank; {RESUME_WITHOUT_STATE}"
            )
        raise CheckpointMismatch(
            f"not a QCommHandle state (keys {sorted(map(str, state))[:6]}, expected one "
            f"'rank<r>_of_<W>' entry); pass what QCommHandle.state_dict() returned on this rank"
        )
    key = rank_key(rank, world)
    if key not in state:
        worlds = sorted({w for _, w in found})
        ranks = [r for r, _ in found]
        if worlds != [world]:
            raise CheckpointMismatch(
                f"fsdp_qcomm: rank {rank} of a run of {world} ranks was given the fsdp_qcomm "
                f"state of rank(s) {ranks} of a run of {' / '.join(map(str, worlds))} ranks. "
                "That state is per rank (qWD reference shards, residuals, level tables) and "
                f"cannot move to another world size; {RESUME_WITHOUT_STATE}"
            )
        raise CheckpointMismatch(
            f"fsdp_qcomm: rank {rank} of {world} was given the fsdp_qcomm state that rank(s) "
            f"{ranks} of {world} saved. {_PER_RANK}."
        )
    entry = state[key]
    if not isinstance(entry, dict) or entry.get("version") != FORMAT or "owner" not in entry:
        got = entry.get("version") if isinstance(entry, dict) else type(entry).__name__
        raise CheckpointMismatch(
            f"the fsdp_qcomm state under {key!r} has format {got!r}, this release reads "
            f"format {FORMAT}; {RESUME_WITHOUT_STATE}"
        )
    owner = entry["owner"]
    if not isinstance(owner, dict) or (owner.get("rank"), owner.get("world_size")) != (rank,
                                                                                      world):
        who = (owner.get("rank"), owner.get("world_size")) if isinstance(owner, dict) else None
        raise CheckpointMismatch(
            f"the fsdp_qcomm state under {key!r} says it was written by (rank, world size) "
            f"{who}: the entry was moved or edited. {_PER_RANK}."
        )
    return entry


def _check_owner(saved: dict[str, Any], mine: dict[str, Any]) -> None:
    """Every difference between the run that saved a state and this one, in one error."""
    diffs: list[str] = []
    sp, mp = saved.get("placement") or {}, mine["placement"]
    if sp.get("ranks_per_node") != mp["ranks_per_node"]:
        diffs.append(f"node size (ranks_per_node): saved {sp.get('ranks_per_node')}, now "
                     f"{mp['ranks_per_node']}")
    scfg, mcfg = saved.get("config") or {}, mine["config"]
    for k in CONFIG_FIELDS:
        if scfg.get(k, "<absent>") != mcfg[k]:
            diffs.append(f"QCommConfig.{k}: saved {scfg.get(k, '<absent>')!r}, now {mcfg[k]!r}")
    smod, mmod = saved.get("modules") or {}, mine["modules"]
    if sorted(smod) != sorted(mmod):
        diffs.append(f"the checkpoint's fsdp_qcomm state covers FSDP modules {sorted(smod)}, "
                     f"this model has {sorted(mmod)}; apply fully_shard to the same modules as "
                     "the run that saved it")
    for label in mmod:
        if label not in smod:
            continue
        s, m = smod[label], mmod[label]
        if s.get("config") != m.get("config"):
            diffs.append(f"FSDP module {label!r}: saved with "
                         f"{_module_config(s.get('config'))}, now "
                         f"{_module_config(m.get('config'))}")
        if (s.get("mesh"), s.get("coordinate")) != (m["mesh"], m["coordinate"]):
            diffs.append(f"FSDP module {label!r}: saved on a mesh of shape {s.get('mesh')} at "
                         f"coordinate {s.get('coordinate')}, now {m['mesh']} at "
                         f"{m['coordinate']}")
        # saved names through state_name too: a checkpoint from before it kept the segments
        sparams = [[state_name(x[0]), *x[1:]] if x else list(x) for x in s.get("params") or []]
        if sparams != m["params"]:
            bad = [f"{x[0]} {x[1]}" for x in m["params"] if list(x) not in sparams][:3]
            diffs.append(f"FSDP module {label!r}: saved parameters (name, global shape, local "
                         f"shape) {sparams[:3]}{'...' if len(sparams) > 3 else ''}, this model's "
                         f"differ ({', '.join(bad) or 'order or count'})")
    if diffs:
        lines = "\n".join(f"  - {d}" for d in diffs)
        raise CheckpointMismatch(
            f"fsdp_qcomm: the fsdp_qcomm state for rank {mine['rank']} of {mine['world_size']} "
            f"was saved by a run that differs from this one:\n{lines}\nResume with the same "
            "QCommConfig, node size, meshes and fully_shard layout as the run that saved it, "
            f"or {RESUME_WITHOUT_STATE}."
        )


__all__ = ["CONFIG_FIELDS", "FORMAT", "NOT_SAVED_FIELDS", "CheckpointMismatch", "state_name",
           "check_gather_state", "gather_state", "handle_state", "load_gather_state",
           "load_handle_state", "owner_record", "parse_rank_key", "rank_key",
           "reference_layout"]

"""``DiLoCo``: the inner-step driver that syncs fragments across replica groups.

Call ``step()`` once after every inner optimizer step, on every rank. Each replica group is a
normal FSDP2 model (``fully_shard`` over the group's own ranks: a 1-D mesh, or the ``shard``
dimension of a 2-D ``(replicate, shard)`` mesh), or HSDP over the 2-D mesh with its all-reduce
across replicas isolated (``isolation.isolate_replicas``: FSDP over the shard dimension, the
parameters 2-D DTensors whose local shards are read and written the same way), either with tensor
parallelism inside the group (``layout``: what TP peers share stays bit-identical); nothing
crosses replica groups except the outer all-reduces ``step()`` runs on the schedule
(``schedule.Schedule``).

Checkpoints (``state_dict`` / ``load_state_dict``; a DCP ``Stateful``). Plain tensors, keyed so
any per-rank checkpointer keeps every rank's piece:

* ``"group_rank{g}"``: what every replica holds alike at position ``g`` inside its replica group
  (``layout.ReplicaLayout``: the shard rank, with TP the shard and TP coordinates; start-of-round
  weights, outer optimizer state, counters, a merge still pending, and ``meta``: the rank,
  group size, replica count, parameter names and shapes per fragment, and the config fields
  the state depends on). ``load_state_dict`` refuses any difference in ``meta``.
* ``"residuals.replica{r}.group_rank{g}"`` (error feedback only): this rank's own residuals.

The model's parameters and the inner optimizer are not in it: they differ between replicas
mid-round, so save each replica group's model and optimizer by itself (for example
``dcp.save(..., process_group=<the group's shard group>)`` into a per-replica directory, the
DiLoCo state next to them), as torchft does.
"""

from __future__ import annotations

import dataclasses
import json
from concurrent.futures import Future
from contextlib import contextmanager
from functools import partial
from typing import Any, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from ..collectives.agreement import gather_unless_failed, stopped_on_ranks
from ..fsdp.checkpoint import state_name
from ..stats import CommStats
from .config import DiLoCoConfig
from .isolation import isolated_replica_ranks
from .layout import MeshDim, PeerSpans, replica_layout
from .outer import (
    KIND,
    KIND_INIT,
    KIND_WEIGHT,
    Fragment,
    OptimizerFactory,
    ParamRef,
    default_optimizer,
    outer_all_reduce,
    outer_key,
)
from .replicas import ReplicaGroup, as_replicas, check_same_run, fixed_group
from .schedule import Overlap, Schedule

_STATE_VERSION = 1

FragmentSpec = Union[nn.Module, Sequence[torch.Tensor]]


class _Pending:
    """A launched all-reduce of one fragment, merged after inner step ``merge_at``."""

    def __init__(self, fragment: int, merge_at: int, future: "Future[float]",
                 buf: torch.Tensor, weight: float = 1.0,
                 diag: Optional[dict[str, Any]] = None) -> None:
        self.diag = diag  # diagnostics: the fp32 mean and this rank's pseudo-gradient norm
        self.fragment = fragment
        self.merge_at = merge_at
        self.weight = weight
        self.future = future
        self.buf = buf
        self.resolved = False  # waited for once (state_dict): its result is known


class DiLoCo:
    """(Streaming) DiLoCo over fsdp-qcomm's quantized replica all-reduce.

    ``model``: this replica group's model (FSDP2 over the group's ranks, or a plain module for
    one-rank groups). ``replicas``: a 2-D device mesh ``(replicate, shard)``, the replica
    process group, a ``ReplicaGroup``, or a torchft ``Manager`` (``diloco.ft``).
    ``fragments``: F modules or parameter lists (default: the parameters in order, cut into F
    runs of about equal size). ``outer_optimizer``: a factory ``[tensor] -> Optimizer`` over a
    fragment's start-of-round weights (default SGD with the config's lr / momentum / Nesterov).
    ``handle``: the ``QCommHandle`` of per-step hooks on ``model``: each merge calls its
    ``mark_changed()`` so the next weight gather sends a quantized difference instead of a
    full-precision resend. ``ranks_per_node``: for node-crossing byte counts when replica
    groups share nodes (None: every other replica is on another node).
    """

    def __init__(
        self,
        model: nn.Module,
        config: Optional[DiLoCoConfig] = None,
        *,
        replicas: Any,
        fragments: Optional[Sequence[FragmentSpec]] = None,
        outer_optimizer: Optional[OptimizerFactory] = None,
        handle: Any = None,
        ranks_per_node: Optional[int] = None,
    ) -> None:
        config = DiLoCoConfig() if config is None else config
        if not isinstance(config, DiLoCoConfig):
            raise TypeError(f"DiLoCo takes a DiLoCoConfig, got {type(config).__name__}")
        self.config = config
        self.schedule = Schedule(config.sync_every, config.fragments, config.delay)
        self.handle = handle
        self._spec = config.spec()
        # FSDP modules whose parameters may be left unsharded between steps (the root after a
        # no_grad forward): resharded before DiLoCo reads or writes the local shards
        self._fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        self._reshard()
        fixed = fixed_group(replicas)  # None for torchft's replicas: their own groups
        failure, record = None, {}
        try:  # local: what fails on one replica fails on all (check_same_run)
            self._build_fragments(model, fragments, outer_optimizer, fixed)
            record = self._run_record()
        except Exception as e:
            failure = e
        check_same_run(fixed, record, failure)  # before any collective that depends on it
        self.replicas: ReplicaGroup = as_replicas(replicas, overlap=config.overlaps,
                                                  ranks_per_node=ranks_per_node)
        self._weighted = hasattr(self.replicas, "start")  # torchft: replicas may heal
        self._stats = CommStats()
        self._overlap = Overlap(config.overlaps, self.device)
        self.inner_steps = 0
        self.outer_steps = 0
        self.failed_commits = 0
        self._pending: Optional[_Pending] = None
        self._diagnostics: list[dict[str, Any]] = []
        if config.diagnostics and self._weighted:
            raise ValueError("DiLoCoConfig.diagnostics=True needs a fixed replica group (a mesh "
                             "or process group), not torchft's: its replicas may heal")
        #: the latest merge: fragment, inner steps of its launch and merge, this replica's
        #: contribution weight and the sum over replicas, committed, the all-reduce's error
        self.last_sync: Optional[dict[str, Any]] = None
        # the replica set the residuals are laid out for (torchft: None before a quorum)
        self._membership: Any = self.replicas.membership()
        start = getattr(self.replicas, "start", None)
        if start is not None:
            weight = start(self)  # torchft: quorum, maybe heal; a weight when joining a sync
            if weight is not None:
                f = self.schedule.launch_at(self.inner_steps)
                if f is None:
                    raise RuntimeError(
                        f"DiLoCo healed to inner step {self.inner_steps}, which is not a sync "
                        "point; the replicas do not share this schedule "
                        f"({self.schedule.describe()})"
                    )
                self._launch(f, self.inner_steps, weight)
        elif config.init_sync:
            self._init_sync()

    # ---- the loop ------------------------------------------------------------------------
    def step(self) -> None:
        """Call once after every inner optimizer step, on every rank: launches and merges the
        outer all-reduces the schedule puts after this step."""
        self.inner_steps += 1
        t = self.inner_steps
        f = self.schedule.launch_at(t)
        if f is not None:
            if self._pending is not None:  # delay < period: never, unless state was altered
                raise RuntimeError("DiLoCo: a fragment's all-reduce was still pending at the "
                                   "next launch")
            self._launch(f, t, None)
        if self._pending is not None and self._pending.merge_at == t:
            self._merge()

    def _reshard(self) -> None:
        """Make every FSDP module hold its sharded parameters (``FSDPModule.reshard``): the
        local shards are what DiLoCo reads and writes, and a module left unsharded would
        compute its next forward with the unsharded copy it still holds."""
        for m in self._fsdp_modules:
            m.reshard()

    def _launch(self, f: int, t: int, weight: Optional[float]) -> None:
        self._reshard()
        if weight is None:
            weight = self.replicas.begin_sync()
            f = self.schedule.launch_at(self.inner_steps)  # a heal may have moved the counter
            t = self.inner_steps
            assert f is not None
        membership = self.replicas.membership()
        if membership != self._membership:  # residuals are laid out for one replica set
            self._membership = membership
            self.reset_residuals()
        frag = self.fragments[f]
        buf = frag.pseudo_gradient() if weight else torch.zeros_like(frag.global_)
        diag = self._diagnose_launch(buf, f) if self.config.diagnostics else None
        residuals = frag.feedback if weight else None
        if residuals is not None:  # allocate here, on the main thread
            frag.residuals(self.replicas.size(), self._spec, self.config.hadamard)
        key = outer_key(self.config.seed, self.schedule.sync_index(t),
                        self.replicas.rank() * self.group_size + self.group_rank, f)
        group = self.replicas.background_group if self._overlap.enabled else self.replicas.group
        run = partial(outer_all_reduce, buf, weight, group, self._spec, key,
                      hadamard=self.config.hadamard, feedback=residuals, stats=self._stats,
                      remote_peers=self.replicas.remote_peers, weighted=self._weighted)
        usable = getattr(self.replicas, "usable", None)
        if usable is not None and not usable():
            run = partial(_refuse, "the quorum before this sync failed; not all-reducing")
        self._pending = _Pending(f, t + self.config.delay, self._overlap.submit(run, t), buf,
                                 weight, diag)

    def _merge(self) -> None:
        p = self._pending
        assert p is not None
        self._pending = None
        error: Optional[BaseException] = None
        total = 0.0
        try:
            total = Overlap.result(p.future)
        except Exception as e:  # noqa: BLE001 - the replica group decides (torchft: no commit)
            error = e
        frag = self.fragments[p.fragment]
        self._reshard()
        committed = self.replicas.commit(error)
        self.last_sync = {"fragment": p.fragment, "launched_after": p.merge_at - self.config.delay,
                          "merged_after": p.merge_at, "weight": p.weight,
                          "total_weight": total, "committed": committed,
                          "error": None if error is None else repr(error)}
        if not committed:
            # Nothing applied: the parameters keep their local progress, which the fragment's
            # next pseudo-gradient carries (its start-of-round weights did not move).
            self.failed_commits += 1
            return
        before = frag.global_.clone() if p.diag is not None else None
        if total > 0:
            self._peers[p.fragment].settle(p.buf, lossy=self._spec is not None)
            frag.outer_step(p.buf)
        if p.diag is not None:
            self._diagnose_merge(p, frag.global_ - before)
        frag.write(self.config.alpha)
        self.outer_steps += 1
        if self.handle is not None:
            self.handle.mark_changed()

    # ---- diagnostics (DiLoCoConfig.diagnostics) ------------------------------------------
    def _diagnose_launch(self, buf: torch.Tensor, fragment: int) -> dict[str, Any]:
        """Before the quantized all-reduce changes ``buf``: the exact fp32 mean over the
        replicas (an extra, unquantized all-reduce, on this thread) and this rank's squared
        pseudo-gradient norm."""
        ref = buf.clone()
        if self.replicas.size() > 1:
            dist.all_reduce(ref, group=self.replicas.group)
            ref.div_(self.replicas.size())
        once = self._peers[fragment].once
        return {"ref": ref, "pg_sq": float(once(buf.double().pow(2)))}

    def _diagnose_merge(self, p: _Pending, update: torch.Tensor) -> None:
        """Compare the quantized mean with the fp32 one and record the applied update's norm.
        Each rank holds its shard of the fragment: the squared sums add up over every rank
        (one small all-reduce), and each replica contributes the same means once."""
        q, ref = p.buf.double(), p.diag["ref"].double()
        once = self._peers[p.fragment].once  # a value TP peers share counts once
        parts = torch.tensor([float(once(q * ref)), float(once(q.pow(2))),
                              float(once(ref.pow(2))), float(once((q - ref).pow(2))),
                              float(once(update.double().pow(2))), p.diag["pg_sq"]],
                             dtype=torch.float64, device=p.buf.device)
        if dist.get_world_size() > 1:
            dist.all_reduce(parts)
        dot, qq, ff, dd, uu, pg = (float(v) / self.replicas.size() for v in parts.tolist())
        self._diagnostics.append({
            "outer_step": self.outer_steps + 1, "fragment": p.fragment,
            "inner_step": p.merge_at - self.config.delay,
            "pseudo_gradient_norm": pg ** 0.5,  # root mean square over the replicas
            "mean_fp32_norm": ff ** 0.5, "mean_quantized_norm": qq ** 0.5,
            "cosine": dot / (qq * ff) ** 0.5 if qq > 0 and ff > 0 else None,
            "relative_error": (dd / ff) ** 0.5 if ff > 0 else None,
            "update_norm": uu ** 0.5,
        })

    def diagnostics(self) -> list[dict[str, Any]]:
        """Per merged outer step (``DiLoCoConfig.diagnostics``): the pseudo-gradient's norm
        (root mean square over the replicas), the norms of its fp32 mean and of the quantized
        mean the outer step used, their cosine and relative error, and the norm of the update
        the outer optimizer applied; empty without diagnostics."""
        return [dict(d) for d in self._diagnostics]

    def finish(self) -> None:
        """Wait for an all-reduce still in flight and merge it now (end of training)."""
        if self._pending is not None:
            self._merge()

    @contextmanager
    def global_weights(self) -> Iterator[None]:
        """Inside the block the parameters are the start-of-round weights, the same on every
        replica (evaluate the model DiLoCo trains there); each rank's own weights come back on
        exit. With fsdp-qcomm's weight hooks (``handle``) the first gather inside sends full
        precision (``handle.reset()``: a replica group's qWD reference is its own, so a
        quantized difference would not compute with exactly the shared weights), and so does
        the first one after (the restore is a parameter write)."""
        self._reshard()
        saved = [f.local_flat() for f in self.fragments]
        for f in self.fragments:
            f.write()
        if self.handle is not None:
            self.handle.reset()
        try:
            yield
        finally:
            self._reshard()
            for f, local in zip(self.fragments, saved):
                f.write_flat(local)

    def close(self) -> None:
        """Stop the background thread (after ``finish`` if a merge is pending)."""
        self._overlap.shutdown()

    def _init_sync(self) -> None:
        """Every replica takes replica 0's weights (full precision, once)."""
        import torch.distributed as dist

        self._reshard()
        group = self.replicas.group
        for frag in self.fragments:
            buf = frag.local_flat()
            if self.replicas.size() > 1 and buf.numel():
                dist.broadcast(buf, group=group, group_src=0)
                root = self.replicas.rank() == 0
                nbytes = buf.numel() * buf.element_size()
                cross = nbytes * self.replicas.remote_peers if root else 0
                self._stats.record(KIND_INIT, sent_bytes=nbytes if root else 0,
                                   recv_bytes=0 if root else nbytes, elements=buf.numel(),
                                   baseline_bytes=nbytes, cross_node_bytes=cross,
                                   baseline_cross_node_bytes=cross)
            frag.global_.copy_(buf)
            frag.write()

    # ---- what it costs ---------------------------------------------------------------------
    @property
    def staleness(self) -> int:
        """Inner steps of local progress a merged fragment's new weights lack (``delay``)."""
        return self.config.staleness

    def reset_residuals(self) -> None:
        for frag in self.fragments:
            if frag.feedback is not None:
                frag.feedback.clear()

    def outer_state_breakdown(self) -> dict[str, int]:
        """Bytes of outer state this rank keeps, by part: ``global`` (start-of-round weights),
        ``optimizer`` (outer optimizer state: SGD's momentum), ``residuals`` (error feedback,
        steady state), and ``in_flight`` (the pseudo-gradient buffer that lives from a launch
        to its merge: the largest fragment, counted only with ``delay`` > 0)."""
        r = self.replicas.size()
        out = {
            "global": sum(f.global_.numel() * 4 for f in self.fragments),
            "optimizer": sum(f.optimizer_bytes() for f in self.fragments),
            "residuals": sum(f.residual_bytes(r, self._spec, self.config.hadamard)
                             for f in self.fragments),
            "in_flight": max(f.numel for f in self.fragments) * 4 if self.config.delay else 0,
        }
        return out

    def outer_state_bytes(self) -> int:
        """Total of ``outer_state_breakdown()``: this rank's memory for DiLoCo."""
        return sum(self.outer_state_breakdown().values())

    def stats(self) -> dict:
        """Per-kind byte counters (``outer_allreduce``; ``outer_weight`` under torchft;
        ``outer_init``) and a summary: ``inner_steps``, ``outer_steps``, ``failed_commits``,
        ``staleness_steps``, ``outer_state_bytes``, and the outer all-reduce's bytes and
        node-crossing bytes per inner step (the one-time ``outer_init`` copy not included)."""
        snap = self._stats.snapshot()
        t = self.inner_steps
        kinds = [snap[k] for k in (KIND, KIND_WEIGHT) if k in snap]
        sent = sum(k["sent_bytes"] for k in kinds)
        cross = sum(k["cross_node_bytes"] for k in kinds)
        snap["summary"].update(
            inner_steps=t, outer_steps=self.outer_steps, failed_commits=self.failed_commits,
            staleness_steps=self.staleness, alpha=self.config.alpha,
            outer_sent_bytes=sent, outer_cross_node_bytes=cross,
            outer_sent_bytes_per_inner_step=sent / t if t else 0.0,
            outer_cross_node_bytes_per_inner_step=cross / t if t else 0.0,
            outer_state_bytes=self.outer_state_bytes(),
        )
        return snap

    def reset_stats(self) -> None:
        self._stats.reset()

    # ---- checkpoints -----------------------------------------------------------------------
    def _build_fragments(self, model: nn.Module, fragments: Optional[Sequence[FragmentSpec]],
                         outer_optimizer: Optional[OptimizerFactory],
                         fixed: Optional[dist.ProcessGroup]) -> None:
        """The fragments, their outer optimizers and layout, checked against the replica
        group (``fixed``); no collective."""
        config = self.config
        refs = fragment_refs(model, fragments, config.fragments)
        self.layout = replica_layout([(r.name, r.param) for f in refs for r in f],
                                     self._fsdp_modules)
        self.group_rank, self.group_size = self.layout.position, self.layout.positions
        factory = outer_optimizer or default_optimizer(config.outer_lr, config.outer_momentum,
                                                       config.outer_nesterov)
        self.fragments = [Fragment(i, f, factory, config.error_feedback and self._spec is not None)
                          for i, f in enumerate(refs)]
        shared = iter(self.layout.shared)
        self._peers = [PeerSpans([next(shared) for _ in f.refs], f.sizes) for f in self.fragments]
        self.device = self.fragments[0].device
        _check_isolated_replicas(self._fsdp_modules, fixed)
        # every fragment's spans name the same TP dimensions: each group is checked once
        _check_carries(fixed, self.device, config.diagnostics,
                       list({d.ranks: d for spans in self._peers for d in spans.dims}.values()))

    def _run_record(self) -> dict[str, Any]:
        """What every replica must share (``replicas.check_same_run``): every config field,
        this rank's position in its replica group, the fragments' parameters and shapes, and
        each fragment's outer optimizer with its hyperparameters."""
        groups = [g for f in self.fragments for g in f.optimizer.param_groups]
        hyper = {k: [_plain(g.get(k)) for g in groups] for g in groups for k in g
                 if k != "params"}
        config = {f"config.{f.name}": getattr(self.config, f.name)
                  for f in dataclasses.fields(self.config)}
        config["config.overlap"] = self.config.overlaps  # None and False alike at delay 0
        return {
            **config,
            "position": (self.group_rank, self.group_size),
            "fragments": [[[state_name(r.name), *r.shapes()] for r in f.refs]
                          for f in self.fragments],
            "outer_optimizer": [type(f.optimizer).__name__ for f in self.fragments],
            **{f"outer_optimizer.{k}": vs for k, vs in hyper.items()},  # per parameter group
        }

    def _meta(self, with_replicas: bool = True) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "group_rank": self.group_rank, "group_size": self.group_size,
            "fragments": [[[r.name, *r.shapes()] for r in f.refs] for f in self.fragments],
            "config": {k: getattr(self.config, k) for k in DiLoCoConfig.STATE_FIELDS},
        }
        if with_replicas:
            meta["replicas"] = self.replicas.size()
        return meta

    def _check_meta(self, saved: str, with_replicas: bool) -> None:
        mine = self._meta(with_replicas)
        theirs = json.loads(saved)
        if isinstance(theirs.get("fragments"), list):  # names from before state_name kept
            theirs["fragments"] = [[[state_name(r[0]), *r[1:]] for r in f]  # wrapper segments
                                   for f in theirs["fragments"]]
        diff = [k for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]
        if diff:
            what = "; ".join(f"{k}: saved {theirs.get(k)!r}, this run {mine.get(k)!r}"
                             for k in diff)
            raise ValueError(
                f"DiLoCo state does not match this run ({what}). Resume with the same replica "
                "groups, group size, fragments, parameter shapes and DiLoCoConfig fields "
                f"{', '.join(DiLoCoConfig.STATE_FIELDS)}"
            )

    def _resolve_pending(self) -> None:
        """Wait for an all-reduce in flight (its result is part of the state). The future is
        kept: the merge waits on it again, on the stream current there (a checkpointer may call
        ``state_dict`` under another one)."""
        p = self._pending
        if p is None or p.resolved:
            return
        Overlap.result(p.future)  # a failed all-reduce raises here
        p.resolved = True

    def _pending_capacity(self) -> int:
        return max(f.numel for f in self.fragments) if self.config.delay else 0

    def _shared_state(self) -> dict[str, Any]:
        frags = {}
        for f in self.fragments:
            state, present = f.optimizer_state()
            frags[str(f.index)] = {"global": f.global_, "outer": state,
                                   "outer_present": torch.tensor(int(present))}
        pend = torch.zeros(self._pending_capacity(), dtype=torch.float32, device=self.device)
        info = torch.tensor([-1, -1], dtype=torch.int64)
        total = torch.zeros((), dtype=torch.float64)
        if self._pending is not None:
            p = self._pending
            # first: this stream waits for the all-reduce (a second state_dict may run under
            # another stream than the first, which resolved it), then reads its buffer
            total = torch.tensor(float(Overlap.result(p.future)), dtype=torch.float64)
            pend[:p.buf.numel()] = p.buf
            info = torch.tensor([p.fragment, p.merge_at], dtype=torch.int64)
        return {
            "meta": json.dumps(self._meta()),
            "counters": torch.tensor([self.inner_steps, self.outer_steps, self.failed_commits],
                                     dtype=torch.int64),
            "fragments": frags,
            "pending": {"info": info, "total": total, "buf": pend},
        }

    def _residual_key(self) -> str:
        return f"residuals.replica{self.replicas.rank()}.group_rank{self.group_rank}"

    def state_dict(self) -> dict[str, Any]:
        """This rank's DiLoCo state (see the module docstring); waits for an all-reduce in
        flight. The tensors are the live buffers (save before the next ``step``)."""
        self._resolve_pending()
        out: dict[str, Any] = {"version": _STATE_VERSION,
                               f"group_rank{self.group_rank}": self._shared_state()}
        if any(f.feedback is not None for f in self.fragments):
            r = self.replicas.size()
            out[self._residual_key()] = {
                str(f.index): f.residuals(r, self._spec, self.config.hadamard)
                for f in self.fragments}
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()`` (with the model and inner optimizer of the same step; call on
        every rank: collective). Refuses a state saved by another layout or configuration,
        naming the difference, before anything changes; refused on one rank, it is refused on
        every rank (``collectives.agreement``), so no rank trains on while others raise."""
        failure, shared, saved = None, None, None
        try:
            shared, saved = self._checked_state(state)
        except ValueError as e:  # raised on every rank by the exchange below
            failure = e
        except Exception as e:  # a malformed state, a load mid-round: the type all raise
            failure = ValueError(f"DiLoCo.load_state_dict: {type(e).__name__}: {e}")
            failure.__cause__ = e
        gather_unless_failed(None, failure, None,
                             stopped_on_ranks("DiLoCo: the state was refused", "no rank loads it"),
                             raises=ValueError)
        self._load_shared(shared)
        self.reset_residuals()
        if saved is not None:
            r = self.replicas.size()
            for f in self.fragments:
                for site, buf in f.residuals(r, self._spec, self.config.hadamard).items():
                    buf.copy_(saved[str(f.index)][site])

    def _checked_state(self, state: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        """``state``'s shared part and residuals, once they fit this engine; else ValueError."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"not a DiLoCo state (version {state.get('version')!r}, expected "
                             f"{_STATE_VERSION}); pass what DiLoCo.state_dict() returned")
        key = f"group_rank{self.group_rank}"
        if key not in state:
            raise ValueError(
                f"the DiLoCo state holds {sorted(k for k in state if k.startswith('group_rank'))}"
                f", not {key!r} (this rank's local index {self.group_rank} of "
                f"{self.group_size}); resume with the same group size"
            )
        shared = state[key]
        self._check_meta(shared["meta"], with_replicas=True)
        if self._pending is not None:
            raise RuntimeError("DiLoCo.load_state_dict: an all-reduce is in flight; load "
                               "before training, or call finish() first")
        saved = state.get(self._residual_key())
        if saved is not None:
            r = self.replicas.size()
            for f in self.fragments:
                for site, buf in f.residuals(r, self._spec, self.config.hadamard).items():
                    src = saved[str(f.index)][site]
                    if src.shape != buf.shape:
                        raise ValueError(f"DiLoCo residual {f.index}.{site}: saved shape "
                                         f"{tuple(src.shape)}, this run {tuple(buf.shape)}")
        return shared, saved

    def _load_shared(self, shared: dict[str, Any]) -> None:
        c = shared["counters"].tolist()
        self.inner_steps, self.outer_steps, self.failed_commits = int(c[0]), int(c[1]), int(c[2])
        for f in self.fragments:
            s = shared["fragments"][str(f.index)]
            f.global_.copy_(s["global"])
            f.load_optimizer_state(s["outer"], bool(int(s["outer_present"])))
        pend = shared.get("pending")
        if pend is not None and int(pend["info"][0]) >= 0:
            frag, merge_at = (int(v) for v in pend["info"].tolist())
            # on this engine's device whatever the checkpointer mapped it to (a per-rank file
            # read with map_location="cpu"): the merge assigns it as the outer gradient
            buf = pend["buf"][:self.fragments[frag].numel].to(self.device, torch.float32,
                                                              copy=True)
            done: Future[float] = Future()
            done.set_result(float(pend["total"]))
            self._pending = _Pending(frag, merge_at, done, buf)
            self._pending.resolved = True

    # ---- torchft recovery (``diloco.ft``) -------------------------------------------------
    def ft_state_dict(self) -> dict[str, Any]:
        """What a healing replica receives: the shared state without residuals (never
        transferred: they are the sender's own errors) and without the replica count (a
        quorum changes it). Called at a sync point, where nothing is pending, from torchft's
        quorum thread under its recovery stream, which never waited for the compute stream's
        last merge: on a GPU the device drains first (heals are rare)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        s = self._shared_state()
        s["meta"] = json.dumps(self._meta(with_replicas=False))
        del s["pending"]
        return s

    def ft_load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a healthy replica's state at its sync point: counters, start-of-round weights,
        outer optimizer state; the parameters become the start-of-round weights (the healed
        replica's own progress is that of another state) and residuals restart from zero."""
        self._check_meta(state["meta"], with_replicas=False)
        self._pending = None
        self._load_shared(state)
        self.reset_residuals()
        self._reshard()
        for f in self.fragments:
            f.write()


def _plain(value: Any) -> Any:
    """An optimizer hyperparameter as replicas can compare it: a tensor by its values (not its
    device), containers element by element, numbers, strings and None as they are, anything
    else by its type (its repr may hold an address)."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return f"<{type(value).__qualname__}>"


def _refuse(why: str) -> float:
    raise RuntimeError(why)


def _check_isolated_replicas(modules: list[nn.Module], group: Optional[dist.ProcessGroup]
                             ) -> None:
    """Isolated HSDP (``isolate_replicas``): the outer all-reduce must run over the replica
    group the isolation took FSDP's all-reduce from (one rank of every replica group).
    ``group``: the replicas' fixed group (``replicas.fixed_group``; None for torchft's)."""
    isolated = isolated_replica_ranks(modules)
    if not isolated or group is None:
        return
    mine = tuple(dist.get_process_group_ranks(group))
    if isolated != {mine}:
        raise ValueError(
            f"DiLoCo: its replicas (ranks {list(mine)}) are not the replica group of the "
            f"isolated HSDP modules (ranks {[list(r) for r in sorted(isolated)]}); pass the 2-D "
            "mesh or its replicate dimension's process group as replicas"
        )


def _check_carries(group: Optional[dist.ProcessGroup], device: torch.device, diagnostics: bool,
                   peers: Sequence[MeshDim] = ()) -> None:
    """The outer all-reduce runs on the local shards' device: with FSDP's ``CPUOffloadPolicy``
    that is the CPU, which an NCCL-only group cannot carry. Refused here, not after the first
    round of inner steps. ``peers``: the model-parallel groups the merge settles shared values
    over (``layout.PeerSpans``)."""
    from ..collectives._c10d import carries

    groups = [(f"tensor-parallel ({d.name})", d.group) for d in peers]
    if group is not None:  # torchft: its own process groups
        groups.append(("replica", group))
        if diagnostics:
            groups.append(("default", dist.group.WORLD))
    for what, g in groups:
        if isinstance(g, dist.ProcessGroup) and g.size() > 1 and not carries(g, device):
            raise ValueError(
                f"DiLoCo: the parameters' local shards are on {device} (FSDP's CPUOffloadPolicy "
                f"keeps them on the CPU) and the {what} process group has no backend for "
                f"{device.type} tensors, so DiLoCo's outer step cannot run on them. Initialize "
                "the process group with a backend for both, e.g. "
                "init_process_group(backend='cuda:nccl,cpu:gloo'), or train without CPU offload"
            )


def fragment_refs(model: nn.Module, fragments: Optional[Sequence[FragmentSpec]],
                  count: int) -> list[list[ParamRef]]:
    """The parameters of each fragment, each parameter in exactly one."""
    owners: dict[int, ParamRef] = {}
    order: list[ParamRef] = []
    for mname, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in owners:
                continue
            ref = ParamRef(state_name(f"{mname}.{pname}".lstrip(".")), module, pname)
            owners[id(p)] = ref
            order.append(ref)
    if not order:
        raise ValueError(f"DiLoCo: {type(model).__name__} has no parameters")
    if fragments is None:
        return _split(order, count)
    if len(fragments) != count:
        raise ValueError(f"DiLoCo: {len(fragments)} fragments given, DiLoCoConfig.fragments="
                         f"{count}")
    out: list[list[ParamRef]] = []
    seen: dict[int, int] = {}
    for i, spec in enumerate(fragments):
        params = list(spec.parameters()) if isinstance(spec, nn.Module) else list(spec)
        refs = []
        for p in params:
            if id(p) not in owners:
                raise ValueError(f"DiLoCo: fragment {i} holds a parameter that is not the "
                                 "model's")
            if id(p) in seen:
                if seen[id(p)] == i:
                    continue
                raise ValueError(f"DiLoCo: parameter {owners[id(p)].name!r} is in fragments "
                                 f"{seen[id(p)]} and {i}; each parameter syncs in one fragment")
            seen[id(p)] = i
            refs.append(owners[id(p)])
        if not refs:
            raise ValueError(f"DiLoCo: fragment {i} has no parameters")
        out.append(refs)
    missing = [r.name for r in order if id(r.param) not in seen]
    if missing:
        raise ValueError(f"DiLoCo: parameters {missing[:5]}{'...' if len(missing) > 5 else ''} "
                         "are in no fragment and would never sync across replicas")
    return out


def _split(order: list[ParamRef], count: int) -> list[list[ParamRef]]:
    """Cut the parameters, in order, into ``count`` runs of about equal size (global
    numel, the same on every rank)."""
    sizes = [r.param.numel() for r in order]
    total = sum(sizes)
    out: list[list[ParamRef]] = [[] for _ in range(count)]
    cum = 0
    for ref, n in zip(order, sizes):
        idx = min(count - 1, int(count * (cum + n / 2) / total)) if total else 0
        out[idx].append(ref)
        cum += n
    empty = [i for i, f in enumerate(out) if not f]
    if empty:
        raise ValueError(
            f"DiLoCo: cutting {len(order)} parameters into {count} fragments of about equal "
            f"size leaves fragment(s) {empty} empty; pass fragments= (modules or parameter "
            "lists) or use fewer fragments"
        )
    return out


__all__ = ["DiLoCo", "fragment_refs"]

"""FSDP2's all-gather, quantized: the ``AllGather`` subclass ``enable`` installs on each module.

What FSDP2 (torch 2.13, ``_fsdp_collectives.foreach_all_gather``) hands us: ``allocate`` is
asked for the flat output (``world * n`` values in the all-gather dtype), FSDP copies this
rank's shard into the output's own slot, then calls us with ``input_tensor`` = that slot. The
shard is the module's parameters back to back, each padded on dim 0 to FSDP's padded shard
size; those sizes (our segments) come from the module's ``FSDPParamGroup``. When the
parameters have mixed dtypes FSDP sends raw uint8 bytes: we then run a plain gather and say so
in ``CommStats.note``.

One exchange per optimizer step. A forward gather whose weights nothing changed since the
module's previous gather sends nothing and reuses what that gather delivered (qWD's reference,
kept anyway; for the other schemes the kept weights of ``weight_reuse_unchanged``). What
changed is decided by the module's ``ChangeTracker`` (``fsdp.change_tracker``): optimizer steps,
``handle.mark_changed()``, ``handle.reset()``, loaded checkpoints, writes seen by version
counters and writes seen by content only (``p.data``), agreed on by every rank at a fixed point
(before the root module's forward, ``fsdp.session``, or inside a gather that runs outside one),
so all ranks take the same branch, and ranks that disagree on what they must all have seen
fail at once with an error naming them instead of hanging.

So gradient-accumulation micro-batches, forward-only evaluation between steps, backward
re-gathers (``reshard_after_forward=True``) and activation-checkpoint recomputation all reuse,
and every way of writing weights ends in a forward on the new weights.

qWD state machine, per module: the first gather, after ``handle.reset()`` or after a write no
optimizer step or ``mark_changed()`` explains: full precision, which sets the reference to the
exact weights; unchanged: nothing sent (unless ``weight_reuse_unchanged=False``); otherwise:
quantized differences (error feedback keeps the gap bounded). Direct scheme (QSDP, ZeRO++
qwZ): a gather of changed weights quantizes the current shard under a new RNG key; a gather of
unchanged weights uses the previous key, so it sends the very same bytes (every forward of the
step, the backward re-gather and recomputations compute with the same weights, which is what
makes the gradient an unbiased estimate at that point), or, with
``weight_reuse_unchanged=True``, sends nothing and reuses the kept copy. With
``weight_levels="learned"`` a ``LevelSync`` refits the module's table from all ranks' shards
every ``levels_refresh_every`` keys. ``weight_scheme="none"`` with
``weight_reuse_unchanged=True`` keeps the plain gather's output the same way.

Backward exactness. A backward must compute with the weights its forward used. Inside a
backward pass a gather that would send (the weights changed since the forward: an optimizer
step, an outside write, ``reset()`` or a checkpoint load between a forward and its backward)
is refused with a ``RuntimeError`` before anything is sent; and a forward hook records which
weights each grad-enabled forward used, so a backward that reaches a forward made with older
weights than the module holds (several forwards before one backward, something changed in
between) is refused too. Under ``weight_scheme="none"`` the weights are exact and FSDP's own
semantics apply.

The allocated output of a qWD module (or of a module with kept weights) *is* the kept copy (no
second unsharded buffer); the own slot's previous value is kept in ``own_ref`` because FSDP
writes the new shard over it.

Checkpoints (``checkpoint_state`` / ``load_checkpoint_state``, gathered by
``QCommHandle.state_dict``, in ``fsdp.checkpoint``): the RNG call counter, the learned level
table, and for qWD this rank's shard of the reference (``own_ref``) as one tensor per parameter.
A loaded reference is re-assembled by one full-precision all-gather of the shards at the next
gather, which then sends the usual difference, or nothing when every rank's loaded shard is the
one its reference was gathered from (the digest saved with the state). Likewise, when the
digest matches, a direct scheme's next gather re-sends under the loaded counter's key. Either
way the resumed run computes with the bits the uninterrupted run would have used. Without a
loaded reference the next qWD gather sends the weights themselves.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from ..codec import FLOAT_DTYPES, RngKey
from ..collectives.cast import cast_all_gather
from ..collectives.level_sync import LevelSync
from ..collectives.topology import Topology
from ..collectives.weight_gather import (
    GatherOutcome,
    KeptWeights,
    NodeShardedQwd,
    QwdAllGather,
    direct_all_gather,
    plain_all_gather,
    segment_offsets,
)
from ..config import QCommConfig
from ..stats import CommStats
from . import checkpoint
from . import internals as fsdp
from .change_tracker import Agreement, Change, ChangeTracker, describe, loaded_unchanged, plan
from .consistency import consistency_error, stop_everywhere
from .internals import AllGather

KIND = "weight_allgather"
KIND_INTRA = "weight_allgather_intra"

class QuantizedAllGather(AllGather):
    """The all-gather of one FSDP module under ``config.weight_scheme``.

    ``bucket`` (the module's index in ``enable``'s traversal) and a per-module call counter
    make the ``RngKey(seed, counter, rank, bucket)`` of every quantization call.
    """

    def __init__(
        self,
        param_group: Any,
        config: QCommConfig,
        stats: CommStats,
        bucket: int,
        name: str,
        module_names: Optional[dict[int, str]] = None,
    ) -> None:
        super().__init__()
        self._pg = param_group
        # id(module) -> qualified name from the model root (``enable`` passes the model's
        # ``named_modules``): names parameters in checkpoints and error messages.
        self._module_names = module_names
        self._config = config
        self._spec = config.weight_spec()
        self._scheme = config.weight_scheme
        self._reuse = config.reuses_unchanged_weights
        self._keep = self._reuse and self._scheme != "qwd"
        self._stats = stats
        self.bucket = bucket
        self.name = name or "<root>"
        self.modes: Counter = Counter()
        self._qwd: Optional[QwdAllGather | NodeShardedQwd] = None
        # qWD's node-sharded reference: the gather group's node layout and its subgroups,
        # prepared by ``enable`` (None: the full reference on every rank)
        self.topology: Optional[Topology] = None
        self._kept: Optional[KeptWeights] = None
        self._counter = 0
        # Generation of the weights the module computes with: bumped by every gather that can
        # change them, recorded by grad-enabled forwards, compared in backward.
        self._gen = 0
        # What changed since the previous gather (none for FSDP's own semantics: plain gathers
        # without kept weights decide nothing). ``session`` is set by ``enable``: whether a root
        # forward has agreed already, else the gather agrees itself.
        self.tracker: Optional[ChangeTracker] = None
        # bf16 gathers without kept weights re-send every time, like plain ones: FSDP's semantics
        self._plain_like = self._scheme in ("none", "bf16")
        # a tensor subclass with its own all-gather (torchao's float8 weights: an 8-bit payload
        # from ``fsdp_pre_all_gather``) is gathered as it sends itself, never quantized
        # (``_segments``), so nothing here decides on its weights or reads their memory
        extension = param_group is not None and any(
            fsdp.has_pre_all_gather_extension(fp) for fp in fsdp.fsdp_params(param_group))
        if (not self._plain_like or self._keep) and not extension:
            self.tracker = ChangeTracker(param_group, self.name)
        # take part in the agreement before each root forward (``verify_weight_writes``)
        self.agrees = self.tracker is not None and config.verify_weight_writes
        self.changed_while_held = False  # without a tracker: ``note_change``
        self.session: Optional[Any] = None
        self.levels: Optional[LevelSync] = None
        if config.weight_levels == "learned":
            self.levels = LevelSync(self._spec, config.levels_refresh_every,
                                    early_refreshes=config.weight_scheme == "qwd")
        self._check_every = config.consistency_check_every
        self._forward_gathers = 0
        self._pending_ref: Optional[torch.Tensor] = None
        self._names: Optional[list[str]] = None
        # members of the gather group on other nodes (set by ``enable``; None: count all peers)
        self.remote_peers: Optional[int] = None
        # HSDP: the replicas of this shard group, compared too by the consistency check
        self.replica_group: Optional[dist.ProcessGroup] = None
        # reshard_after_forward=<int>: the post-forward group and its members on other nodes
        self.post_forward_group: Optional[dist.ProcessGroup] = None
        self.post_forward_remote = 0
        self._attached = False
        self._hooks: list[Any] = []  # forward hooks of the group's modules
        self._grad_hooks: list[Any] = []  # post-accumulate-grad hooks of its parameters
        self._grad_hooked: tuple[int, ...] = ()

    # ---- state queries used by the handle ---------------------------------------------------
    @property
    def reference_bytes(self) -> int:
        """Bytes of the qWD reference or of the kept weights (``weight_reuse_unchanged``)."""
        return sum(k.nbytes for k in (self._qwd, self._kept) if k is not None)

    def reset(self) -> None:
        """Next gather re-sends: full precision under qWD, a new RNG key for direct schemes."""
        if self.tracker is not None:
            self.tracker.reset()

    def mark_changed(self) -> None:
        """The parameters were changed on purpose (outside a ``torch.optim`` step): the next
        forward gather sends a quantized difference (a new key for direct schemes)."""
        if self.tracker is not None:
            self.tracker.mark_changed()
        else:
            self.note_change()

    def note_change(self) -> None:
        """Without a tracker (FSDP's own weights, nothing decided): the shards changed, by an
        optimizer step or ``mark_changed()``; remembered while FSDP holds weights gathered
        before it (``internals.holds_gathered``), which the next root forward refuses
        (``session``), until a gather from the shards. Not for a one-rank gather group: FSDP
        calls no all-gather there (it copies the shards at every unshard's wait), so no call
        here would clear it."""
        if self._pg is None or fsdp.shard_group(self._pg).size() == 1:
            return
        if fsdp.holds_gathered(self._pg) is not None:
            self.changed_while_held = True

    def attach(self) -> None:
        """Install the hooks the gathers decide with (once ``enable`` installed the gather):
        a post-accumulate-grad hook per sharded parameter (a gradient reduction finished), and
        for quantized schemes a forward hook per module of the group recording which weights
        each grad-enabled forward used, so that a backward reaching it with other weights is
        refused (under ``weight_scheme="none"`` the weights are exact: FSDP's semantics)."""
        if self._attached:
            return
        self._attached = True
        if not self._plain_like:
            # not traced by torch.compile, like FSDP's own hooks (wrapped here, not at import:
            # importing torch._dynamo imports triton, which must see TRITON_INTERPRET first)
            hook = torch.compiler.disable(self._after_forward)
            for m in fsdp.group_modules(self._pg):
                self._hooks.append(m.register_forward_hook(hook))
        self._watch_grads()

    def release(self) -> None:
        """Drop the qWD reference, kept weights and hooks (on ``disable``)."""
        self._qwd = None
        self._kept = None
        self._pending_ref = None
        self._attached = False
        for h in self._hooks + self._grad_hooks:
            h.remove()
        self._hooks.clear()
        self._grad_hooks.clear()
        self._grad_hooked = ()

    def _watch_grads(self) -> None:
        """(Re-)hook the sharded parameters' gradient writes, if they are new objects."""
        if not self._attached or self.tracker is None:
            return
        params = fsdp.sharded_params(self._pg)
        ids = tuple(id(p) for p in params)
        if ids == self._grad_hooked:
            return
        for h in self._grad_hooks:
            h.remove()
        # (not on CPU-offloaded parameters: any such hook makes FSDP copy their gradients to
        # the CPU synchronously; there only optimizer step hooks tell of an update)
        note = _NoteReduction(self)
        self._grad_hooks = [
            p.register_post_accumulate_grad_hook(note)
            for p, fp in zip(params, fsdp.fsdp_params(self._pg))
            if p.requires_grad and not fsdp.offloads_to_cpu(fp)
        ]
        self._grad_hooked = ids

    # ---- checkpoints ---------------------------------------------------------------------------
    def _param_names(self) -> list[str]:
        """Qualified names of the module's parameters from the model root, as checkpoints key
        them (``checkpoint.state_name``; FSDP's own ``_param_fqn`` is only set at its lazy
        init, so checkpoint templates could not use it).
        A group shared by several modules (``fully_shard([norm, output])``) names each
        parameter after its own module, so equal local names (two ``weight``) stay apart."""
        if self._names is None:
            where = dict(self._module_names or {})
            if not where:  # built without the root map: prefix this module's name
                top = "" if self.name == "<root>" else self.name
                for m in fsdp.group_modules(self._pg):
                    for n, sub in m.named_modules():
                        where.setdefault(id(sub), ".".join(p for p in (top, n) if p))
            names = []
            for k, fp in enumerate(fsdp.fsdp_params(self._pg)):
                base = where.get(id(fsdp.owning_module(fp)), f"{self.name}[{k}]")
                names.append(checkpoint.state_name(
                    ".".join(p for p in (base, fsdp.local_param_name(fp)) if p)))
            if len(set(names)) < len(names):  # never two entries under one name
                names = [f"{self.name}[{k}].{fsdp.local_param_name(fp)}"
                         for k, fp in enumerate(fsdp.fsdp_params(self._pg))]
            self._names = names
        return self._names

    def checkpoint_state(self) -> dict[str, Any]:
        """RNG call counter, level table, the digest of the shard last gathered and, for qWD,
        this rank's shard of the reference, as copies (``fsdp.checkpoint.gather_state``)."""
        return checkpoint.gather_state(self)

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Restore what ``checkpoint_state`` saved (``fsdp.checkpoint.load_gather_state``)."""
        checkpoint.check_gather_state(self, state)
        checkpoint.load_gather_state(self, state)

    # ---- decisions ---------------------------------------------------------------------------
    def _decide(self, backward: bool, group: dist.ProcessGroup) -> tuple[int, bool]:
        """The agreed change code of this gather (``change_tracker``), and whether it came from
        an agreement round (which compared every rank's shard with its digest: its ``CONTENT``
        is the group's): inside backward the declared events only; in a root forward the code
        agreed before it (the first gather of the forward consumes it; later ones in the same
        forward see declared events only); elsewhere one agreement round over the gather
        group, here."""
        t = self.tracker
        assert t is not None
        if backward:
            return t.local_flags(backward=True), False
        if not self._config.verify_weight_writes:  # this rank's own facts, no collective
            return t.local_flags(backward=False), False
        if t.pending is not None:
            return t.pending, True
        if self.session is not None and self.session.in_root_forward:
            return t.local_flags(backward=True), False
        where = f"a gather of FSDP module {self.name!r} outside the root module's forward"
        return Agreement(group, self._stats).agree([t], where)[0], True

    # ---- backward exactness ----------------------------------------------------------------
    def _refuse_in_backward(self, change: str) -> None:
        raise RuntimeError(
            f"fsdp_qcomm: the backward of FSDP module {self.name!r} needs the weights its forward "
            f"computed with, but they changed since that forward ({change}). Under "
            f"weight_scheme={self._scheme!r} the backward would compute with other weights than "
            "the forward did. Step the optimizer, write parameters, call handle.reset() or load "
            "checkpoints after the backward, not between a forward and its backward. If the "
            "forward ran on weights FSDP still held from before such a change "
            "(set_reshard_after_backward(False), unshard() or a forward without backward before "
            "the optimizer step), reshard() the module before the change."
        )

    def _after_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self._attached or not torch.is_grad_enabled() or self._gen == 0:
            return
        check = functools.partial(self._check_backward, self._gen)
        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(check)

    def _check_backward(self, gen: int, grad: torch.Tensor) -> None:
        """Runs when a gradient reaches the output of a forward made with weights ``gen``."""
        if self._attached and gen != self._gen:
            raise RuntimeError(
                f"fsdp_qcomm: the backward of FSDP module {self.name!r} reached a forward that "
                "computed with older weights than the module holds now: several forwards ran "
                "before one backward and the weights changed between them (an optimizer step, "
                "a write to the parameters, handle.reset() or a checkpoint load). Under "
                f"weight_scheme={self._scheme!r} that backward would compute with the newer "
                "weights. Run the backward of each forward before changing the weights."
            )

    # ---- layout ------------------------------------------------------------------------------
    def _segments(self) -> tuple[Optional[tuple[int, ...]], str]:
        """Per-parameter shard sizes of the flat buffer, or None and why not. (Gathers over
        the post-forward group of ``reshard_after_forward=<int>`` never get here.)"""
        segs = []
        for fp in fsdp.fsdp_params(self._pg):
            if fsdp.has_pre_all_gather_extension(fp):
                return None, "a parameter defines fsdp_pre_all_gather (tensor-subclass extension)"
            segs.append(fsdp.padded_shard_numel(fp))
        return tuple(segs), ""

    def _fallback_reason(
        self, input_tensor: torch.Tensor, world: int
    ) -> tuple[Optional[tuple[int, ...]], str]:
        """The segments to quantize (or keep) with, or None and why the gather stays plain."""
        if (self._plain_like and not self._keep) or world == 1:
            return None, ""
        if input_tensor.dtype not in FLOAT_DTYPES:
            return None, (
                f"all-gather input dtype is {input_tensor.dtype} (parameters of mixed dtypes, or "
                "not floating point)"
            )
        segs, why = self._segments()
        if segs is None:
            return None, why
        if sum(segs) != input_tensor.numel():
            return None, (
                f"FSDP's all-gather buffer has {input_tensor.numel()} values per rank but the "
                f"module's padded shards sum to {sum(segs)}"
            )
        return segs, ""

    # ---- the Comm interface --------------------------------------------------------------
    def allocate(
        self,
        size: Sequence[int | torch.SymInt],
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        numel = math.prod(int(s) for s in size)
        if self.post_forward_group is not None and fsdp.sharded_post_forward(self._pg):
            return torch.empty(*size, dtype=dtype, device=device)  # never the reference
        q = self._qwd
        if isinstance(q, QwdAllGather) and q.valid and _fits(q, numel, dtype, device):
            return q.ref.view(*size)
        k = self._kept  # overwritten by every gather that sends, so valid or not
        if k is not None and _fits(k, numel, dtype, device):
            return k.ref.view(*size)
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> Optional[dist.Work]:
        if group is self.post_forward_group and group is not None:
            return self._post_forward_gather(output_tensor, input_tensor, group, async_op)
        self.changed_while_held = False  # gathered from the shards as they are now
        world = group.size()
        segs, why = self._fallback_reason(input_tensor, world)
        record = self._checked_record(output_tensor, segs, group)
        backward = fsdp.in_backward(self._pg) or fsdp.autograd_running()
        if segs is None:
            if self.tracker is not None:
                self.tracker.gathered(backward)
            return self._plain_fallback(output_tensor, input_tensor, group, why, async_op, record)

        self._watch_grads()
        code, compared = self._decide(backward, group)
        exchange, full = plan(code)
        if compared and loaded_unchanged(code):
            # what the uninterrupted run does here: qWD sends nothing (after re-assembling the
            # loaded reference), a direct scheme re-sends under the loaded counter's key
            exchange = False
        if exchange and backward and self.tracker.gathered_once and self._scheme != "none":
            self._refuse_in_backward(describe(code))  # every rank alike, before anything is sent
        if self._scheme == "qwd":
            return self._qwd_gather(output_tensor, input_tensor, group, segs, backward, code,
                                    exchange, full, async_op, record)
        self.tracker.gathered(backward)
        if exchange:
            self._counter += 1  # new weights: a new key (direct) and a new generation
            self._gen += 1
        kept = self._kept_for(input_tensor, segs, group) if self._keep else None
        if kept is not None and kept.valid and not exchange:
            kept.reuse(f"{'plain' if self._scheme == 'none' else 'direct'}_reuse", on_done=record)
            return None
        on_done = record
        if kept is not None:
            kept.invalidate()  # until this gather lands

            def on_done(o: GatherOutcome) -> None:
                kept.keep(output_tensor)
                record(o)

        if self._scheme == "none":
            return plain_all_gather(
                output_tensor, input_tensor, group, async_op=async_op, on_done=on_done
            )
        if self._scheme == "bf16":
            return cast_all_gather(
                output_tensor, input_tensor, group, async_op=async_op, on_done=on_done
            )
        key = RngKey(self._config.seed, self._counter, group.rank(), self.bucket)
        levels = None
        if self.levels is not None:
            # each segment is its own wire row, so it is its own histogram row
            rows = [input_tensor[a:a + n] for a, n in zip(segment_offsets(segs), segs) if n]
            levels = self.levels.table(rows, group, self._counter, self._stats)
        return direct_all_gather(
            output_tensor, input_tensor, self._spec, key, group,
            segments=segs, async_op=async_op, on_done=on_done, levels=levels,
            hadamard=self._config.weight_hadamard,
        )

    def _post_forward_gather(self, output: torch.Tensor, input: torch.Tensor,
                             group: dist.ProcessGroup, async_op: bool) -> Optional[dist.Work]:
        """``reshard_after_forward=<int>``: FSDP kept the weights this forward computed with,
        sharded over the smaller post-forward group (inside a node when its size divides the
        node's), and gathers them again there before their next use (backward, recomputation,
        a second forward). FSDP2's own gather of them is exact and leaves the reference, the
        change tracking and the keys alone: nothing to quantize or to decide."""

        def record(o: GatherOutcome) -> None:  # ``_record`` counts the group's remote members
            self._record(dataclasses.replace(o, mode="post_forward"))

        return plain_all_gather(output, input, group, async_op=async_op, on_done=record)

    def _plain_fallback(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup,
        why: str,
        async_op: bool,
        record: Any,
    ) -> Optional[dist.Work]:
        """FSDP's plain gather (world size 1, mixed dtypes, unknown layout, or nothing to do)."""
        if why:
            what = (f"weight_scheme={self._scheme!r}" if self._scheme != "none"
                    else "weight_reuse_unchanged")
            self._stats.note(
                f"{self.name}: weight all-gather fell back to FSDP's plain gather ({what} not "
                f"applied): {why}"
            )
        elif self._scheme == "bf16" and self._kept is None:
            # not a fallback: a bf16 gather without kept weights (or of a one-rank group)
            return cast_all_gather(output, input, group, async_op=async_op, on_done=record)
        if self._kept is not None:
            self._kept.invalidate()
        done = record
        q = self._qwd
        if isinstance(q, NodeShardedQwd):
            q.invalidate()  # the next qWD gather rebuilds it at full precision
        elif q is not None and output.data_ptr() == q.ref.data_ptr():
            # the reference is overwritten by exact weights: adopt them
            def done(o: GatherOutcome) -> None:
                q.own_ref.copy_(q.own_slot())
                record(o)

        return plain_all_gather(output, input, group, async_op=async_op, on_done=done)

    def _kept_for(
        self, input: torch.Tensor, segs: tuple[int, ...], group: dist.ProcessGroup
    ) -> KeptWeights:
        k = self._kept
        if (k is None or k.group is not group or k.segments != segs
                or not k.matches(input.numel(), input.dtype, input.device)):
            k = self._kept = KeptWeights(
                input.numel(), input.dtype, input.device, group, segments=segs
            )
        return k

    # ---- qWD -------------------------------------------------------------------------------
    def _qwd_gather(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup,
        segs: tuple[int, ...],
        backward: bool,
        code: int,
        exchange: bool,
        full: bool,
        async_op: bool,
        record: Any,
    ) -> Optional[dist.Work]:
        q = self._qwd
        stale = q is None or q.group is not group or q.segments != segs
        if stale or not q.matches(input.numel(), input.dtype, input.device):
            q = self._qwd = self._new_reference(input, group, segs)
        if isinstance(q, NodeShardedQwd):
            aliased = False
            on_done = record
            into = {"output": output}
        else:
            aliased = output.data_ptr() == q.ref.data_ptr()
            on_done = record
            into = {}
            if not aliased:
                def on_done(o: GatherOutcome) -> None:
                    output.copy_(q.ref)
                    record(o)

        if self._pending_ref is not None and code & (Change.RESET | Change.WRITE
                                                     | Change.CONTENT_SINCE_STEP):
            self._pending_ref = None  # re-sent at full precision: no loaded reference needed
        if self._pending_ref is not None:
            input = self._restore_reference(q, input, aliased)
            full = False  # the loaded reference belongs to these weights
        elif full and q.valid and (why := _unexplained(code)):
            self._stats.note(
                f"{self.name}: parameters changed where no torch.optim optimizer step explains "
                f"it ({describe(why)}); qWD re-sent them at full precision. After a deliberate "
                "change (a write that belongs to the step, such as clipping or a projection), "
                "handle.mark_changed() on every rank sends a quantized difference instead"
            )
        full = full or not q.valid
        self.tracker.gathered(backward)
        if not exchange and not full and (backward or self._reuse):
            q.reuse("qwd_reuse", on_done=on_done, **into)
            return None
        self._counter += 1
        self._gen += 1
        key = RngKey(self._config.seed, self._counter, group.rank(), self.bucket)
        levels = None
        if self.levels is not None and not full and q.valid:
            # fitted on the differences about to be sent, one histogram row per segment
            levels = self.levels.table(q.differences(input), group, self._counter, self._stats)
        return q(input, key, full=full, async_op=async_op, on_done=on_done, levels=levels,
                 **into)

    def _new_reference(
        self, input: torch.Tensor, group: dist.ProcessGroup, segs: tuple[int, ...]
    ) -> QwdAllGather | NodeShardedQwd:
        """The node-sharded reference when ``enable`` prepared this group's node topology, else
        the full one."""
        topo = self.topology
        hadamard = self._config.weight_hadamard
        if topo is not None and topo.intra is not None and topo.inter is not None:
            if tuple(dist.get_process_group_ranks(group)) != topo.layout.global_ranks:
                raise RuntimeError(
                    f"FSDP module {self.name!r}: FSDP gathers over another process group than "
                    "the one fsdp_qcomm.enable() prepared the node-sharded qWD reference for; "
                    "change FSDP's meshes before enable(), or disable and enable again"
                )
            return NodeShardedQwd(
                input.numel(), input.dtype, input.device, self._spec, group, topo.layout,
                topo.intra, topo.inter, segments=segs, hadamard=hadamard,
            )
        return QwdAllGather(input.numel(), input.dtype, input.device, self._spec, group,
                            segments=segs, hadamard=hadamard)

    def _restore_reference(
        self, q: QwdAllGather | NodeShardedQwd, input: torch.Tensor, aliased: bool
    ) -> torch.Tensor:
        """Re-assemble a checkpointed reference: one full-precision all-gather of every rank's
        saved shard (across nodes only, for a node-sharded one). Returns the input (copied
        first if it lives in the reference)."""
        pending, self._pending_ref = self._pending_ref, None
        if aliased:
            input = input.clone()
        if pending.is_cuda:  # built at load on another stream than FSDP's all-gather one,
            # which reads it below: its memory must not be reused before that read has run
            pending.record_stream(torch.cuda.current_stream(pending.device))
        base = q.restore(pending)
        self.modes["qwd_restore"] += 1
        sharded = isinstance(q, NodeShardedQwd)
        peers = (q.nodes - 1) if sharded else self._remote()
        self._stats.record(
            KIND, sent_bytes=base, recv_bytes=(q.nodes if sharded else q.world) * base,
            elements=q.numel, baseline_bytes=base, cross_node_bytes=base * peers,
            shares_baseline=True,  # the gather that follows counts FSDP2's one gather
        )
        return input

    def _checked_record(
        self, output: torch.Tensor, segs: Optional[tuple[int, ...]], group: dist.ProcessGroup
    ) -> Any:
        """``_record``, plus the consistency check when this forward gather is due one."""
        if not self._check_every or group.size() == 1:
            return self._record
        if fsdp.in_backward(self._pg):
            return self._record
        self._forward_gathers += 1
        if (self._forward_gathers - 1) % self._check_every:
            return self._record
        world = group.size()
        if segs is None and output.dtype in FLOAT_DTYPES:  # a plain gather: name parameters
            segs, _ = self._segments()
            if segs is not None and sum(segs) * world != output.numel():
                segs = None
        if segs is None:  # raw bytes or an unknown layout: one checksum
            segs, names = (output.numel() // world,), [f"{self.name} (all parameters)"]
        else:
            names = self._param_names()
        where = f"forward gather #{self._forward_gathers} of FSDP module {self.name!r}"

        def done(o: GatherOutcome) -> None:
            self._record(o)
            # the decisions so far must agree too: same RNG key counter, same generation
            decisions = (self._counter, self._gen)
            # HSDP: the replicas must compute with the same weights too. Every comparison runs
            # before anything raises (each is collective; no peer may be left waiting).
            errors = [consistency_error(output, world, segs, names, group, where, decisions)]
            if self.replica_group is not None:
                errors.append(consistency_error(output, world, segs, names, self.replica_group,
                                                f"{where}, across HSDP replicas", decisions))
            msg = next((e for e in errors if e is not None), None)
            # other shard groups' verdicts: inside a root forward only, where the change
            # agreement makes every rank of its group take the same gathers in the same order
            session = self.session
            if session is not None and session.in_root_forward:
                wide = session.agreement.group
                if (wide.size() if wide is not None else dist.get_world_size()) > group.size():
                    msg = stop_everywhere(msg, output.device, wide, where)
            if msg is not None:
                raise RuntimeError(msg)

        return done

    def _remote(self) -> int:
        if self.remote_peers is None:
            return fsdp.shard_group(self._pg).size() - 1
        return self.remote_peers

    def _record(self, o: GatherOutcome) -> None:
        self.modes[o.mode] += 1
        # every other member receives this rank's row: the remote ones over the slow link
        remote = self.post_forward_remote if o.mode == "post_forward" else self._remote()
        cross = o.sent_bytes * remote if o.cross_node_bytes is None else o.cross_node_bytes
        self._stats.record(
            KIND, sent_bytes=o.sent_bytes, recv_bytes=o.recv_bytes, elements=o.elements,
            baseline_bytes=o.baseline_bytes, cross_node_bytes=cross,
            baseline_cross_node_bytes=o.baseline_bytes * remote,
        )
        if o.intra is not None:  # the node-sharded reference's hop inside the node
            sent, recv, elements = o.intra
            self._stats.record(KIND_INTRA, sent_bytes=sent, recv_bytes=recv, elements=elements,
                               baseline_bytes=sent, shares_baseline=True)


class _NoteReduction:
    """A post-accumulate-grad hook that only notes that a reduction of the module's gradients
    finished; it never reads the gradient, so reductions stay deferrable (``grad_overlap``)."""

    reads_grad = False

    def __init__(self, gather: QuantizedAllGather) -> None:
        self._gather = gather

    def __call__(self, param: torch.Tensor) -> None:
        if self._gather.tracker is not None:
            self._gather.tracker.reduction_finished()


def _fits(k: KeptWeights, numel: int, dtype: torch.dtype, device: torch.device) -> bool:
    """``numel`` values of ``dtype`` on ``device`` are exactly ``k``'s unsharded buffer."""
    return numel % k.world == 0 and k.matches(numel // k.world, dtype, device)


def _unexplained(code: int) -> int:
    """The changes in an agreed code that no optimizer step, load or gradient reduction
    explains (what a full-precision resend's note names; 0 after ``reset()`` alone)."""
    why = code & (Change.WRITE | Change.CONTENT_SINCE_STEP)
    if not code & (Change.STEP | Change.LOADED | Change.REDUCED):
        why |= code & Change.CONTENT
    return why


__all__ = ["KIND", "KIND_INTRA", "QuantizedAllGather"]

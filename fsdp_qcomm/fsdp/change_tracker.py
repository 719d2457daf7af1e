"""Did an FSDP module's weights change since its previous gather? Decided the same on every rank.

A quantized weight gather may send nothing when the weights are those its previous gather
delivered (gradient-accumulation micro-batches, evaluation between steps, backward re-gathers),
must send a quantized difference after an optimizer step, and should re-send full precision
after any other write (a loaded checkpoint, an EMA swap): a quantized difference of a large
jump would leave the reference off by a quantization step of that jump for as long as the
weights stay put. And every rank of the gather group must take the same decision, or one rank
sends bytes its peers do not expect and the group hangs.

``ChangeTracker`` (one per FSDP parameter group) collects what this rank knows, as ``Change``
flags:

* declared events, the same on every rank of an SPMD program: the first gather (``FIRST``), a
  ``torch.optim`` step over the group's parameters (``STEP``, from the optimizer step hooks
  ``enable`` installs) or ``handle.mark_changed()`` (``STEP`` too: the caller vouches for the
  new values), ``handle.reset()`` (``RESET``), a loaded checkpoint (``LOADED``), and a gradient
  reduction of the group's parameters outside backward while no ``torch.optim`` step was ever
  seen for them (``REDUCED``: an optimizer of another kind may have consumed it);
* writes found by the parameters' signature (objects, storages, version counters: ``p.mul_``,
  ``p.copy_``, ``load_state_dict``, new tensors) that no declared event explains (``WRITE``);
* writes found by content only (``CONTENT``): an exact integer digest of this rank's shard
  differs from the one taken at the previous gather. This is what catches ``p.data.copy_``,
  ``p.data = t`` and foreach kernels run outside an optimizer, which leave every version counter
  unchanged. A step explains such a change, so each optimizer step digests the shard again
  (``step_digests``): a change since that digest (``CONTENT_SINCE_STEP``) is a write after the
  step, which no step explains. A checkpoint saved with such a write pending carries it
  (``content_pending``), so the resumed run re-sends it as the uninterrupted one does.

``Agreement`` turns local flags into one decision per module at a fixed point: one small
all-gather of every module's flags (int64) over the ranks that gather together, before the
root module's forward (``fsdp.session``), or inside a gather that runs outside a root forward.
Every rank sees the same gathered rows, so every rank decides alike:

* the declared and signature flags must agree across ranks (they are SPMD facts); when they do
  not (a parameter written on some ranks only, an optimizer stepped on some ranks only), every
  rank raises the same error naming the module and the ranks, at once, instead of hanging in
  the gather that follows;
* ``CONTENT`` and ``CONTENT_SINCE_STEP`` are or-ed over the ranks: a write through ``p.data``
  may leave one rank's shard unchanged (all zeros halved), so one changed shard is enough for
  all to exchange, which is what FSDP2 itself computes (each rank gathers the shards as they
  are).

Inside a backward pass (a re-gather for backward, or an activation-checkpoint recomputation)
only the declared flags count and nothing is exchanged to agree: FSDP's backward must compute
with the weights its forward used, and those flags are SPMD facts.

What an agreed code means (``plan``): nothing to exchange for no flag or ``REDUCED`` alone;
full precision for ``FIRST``, ``RESET``, ``WRITE``, ``CONTENT_SINCE_STEP``, and ``CONTENT``
that no ``STEP``, ``LOADED`` or ``REDUCED`` explains; a quantized difference otherwise.
``LOADED`` has its own path: qWD's saved reference is re-assembled; then, when the load set
each rank's previous digest to the one saved with the state and no rank's loaded shard differs
from it (``loaded_unchanged``), qWD sends nothing and direct schemes re-send under the loaded
counter (no new key); else a quantized difference under a new key (full precision after
``reset()`` or without a saved reference).

Cost: one digest pass over this rank's shard per forward gather decision (integer view, a
position-weighted int64 sum) and one per optimizer step (no host read), and one all-gather of
``8 * modules`` bytes per root forward (``4 + 8 * modules`` bytes on the wire for gloo); on
CUDA one host read per root forward.
"""

from __future__ import annotations

import enum
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from ..codec import cpu_native
from ..codec._checks import raw_memory_ok
from ..collectives import _c10d
from . import internals as fsdp


class Change(enum.IntFlag):
    NONE = 0
    FIRST = 1
    STEP = 2
    RESET = 4
    LOADED = 8
    WRITE = 16
    REDUCED = 32
    CONTENT = 64
    CONTENT_SINCE_STEP = 128


#: what the digests find, or-ed over the ranks (a write may leave one rank's shard unchanged)
FOUND = Change.CONTENT | Change.CONTENT_SINCE_STEP


#: facts every rank of an SPMD program has alike: ranks must agree on them
SPMD = Change.FIRST | Change.STEP | Change.RESET | Change.LOADED | Change.WRITE | Change.REDUCED
#: changes that make the next exchange send full precision
FULL = Change.FIRST | Change.RESET | Change.WRITE | FOUND

_DESCRIBE = {
    Change.FIRST: "first gather",
    Change.STEP: "an optimizer step or handle.mark_changed()",
    Change.RESET: "handle.reset()",
    Change.LOADED: "a loaded checkpoint",
    Change.WRITE: "a write outside an optimizer step (p.mul_/p.copy_/load_state_dict/new "
                  "tensors)",
    Change.REDUCED: "a gradient reduction (an optimizer that is not a torch.optim.Optimizer)",
    Change.CONTENT: "values written without a version bump (p.data writes)",
    Change.CONTENT_SINCE_STEP: "values written without a version bump after the optimizer "
                               "step (p.data writes)",
}


def describe(code: int) -> str:
    """The events behind a code, in words."""
    parts = [text for flag, text in _DESCRIBE.items() if code & flag]
    return ", ".join(parts) or "nothing"


def plan(code: int) -> tuple[bool, bool]:
    """(exchange, full precision) for an agreed code. Changed values are explained by an
    optimizer step, ``mark_changed()`` or a loaded checkpoint; with a gradient reduction alone
    they are taken for an optimizer step of another kind (a quantized difference); a reduction
    alone changes nothing; unexplained changes re-send full precision, among them values written
    after the optimizer step that explains the rest (``CONTENT_SINCE_STEP``)."""
    c = Change(code)
    if c & Change.CONTENT and c & (Change.STEP | Change.LOADED | Change.REDUCED):
        c &= ~Change.CONTENT
        if c & Change.REDUCED:
            c |= Change.STEP
    c &= ~Change.REDUCED
    return bool(c), bool(c & FULL)


def loaded_unchanged(code: int) -> bool:
    """Whether an agreed code from an agreement round (which compared every rank's shard with
    its digest) says a checkpoint load left every shard as the one the saved state's last
    gather was made from: ``LOADED`` without ``CONTENT``, and nothing else that re-sends.
    Optimizer steps since then changed no value (torch's ``set_state_dict`` initializes an
    optimizer's state with a step at learning rate 0; a ``mark_changed()`` or a step after the
    load that changes no value is not told apart from it). The uninterrupted run sends no new
    weights here: qWD's re-assembled reference is its reference (nothing is sent), and a direct
    scheme's loaded counter keys the bits it computes with (re-sent under the same key)."""
    return bool(code & Change.LOADED) and not code & ~(Change.LOADED | Change.STEP
                                                       | Change.REDUCED)


def values_changed(code: int) -> bool:
    """Whether an agreed code says the shards' values changed since the previous gather (an
    optimizer step, ``mark_changed()``, a write, a load that left another shard), not only
    that the next gather re-sends (the first gather, ``reset()``, an unchanged load)."""
    changed = code & (Change.STEP | Change.WRITE | FOUND | Change.LOADED | Change.REDUCED)
    return bool(changed & ~Change.REDUCED) and not loaded_unchanged(changed)


_BITS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16,
         torch.float16: torch.int16}
_PRIME = 65521


def shard_digests(groups: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
    """An exact integer digest of each group of flat tensors (an int64 vector, one value per
    group, on their device; the groups on one device): the raw bits of each value weighted by
    its position in its group (modulo 65521). For 16- and 32-bit values any single changed
    value, and any exchange of two values fewer than 65521 positions apart, changes it; other
    changes are missed with a 64-bit checksum's odds (what a resume that sends nothing relies
    on, ``loaded_unchanged``). float64 values are weaker: a change of only their top bits (a
    sign flip) is missed where the weight is even;
    equal inputs give equal digests on every device and in any order of summation (integer
    arithmetic wraps modulo 2^64, deterministically). CPU tensors take the C codec's one-pass
    loop (``codec.cpu_native.digest``), CUDA tensors one launch of the Triton kernel over every
    group per element width (``kernels/digest.py``; ``_kernel_plan``), others the torch formula
    (``_torch_digest``): the same values (``tests/test_codec_native.py``,
    ``tests/test_kernels.py``)."""
    shards = [x for g in groups for x in g]
    device = shards[0].device if shards else torch.device("cpu")
    if device.type == "cpu":
        return torch.tensor([_cpu_digest(g) for g in groups], dtype=torch.int64)
    if device.type == "cuda":
        plan, rest = _kernel_plan(groups)
        if plan:
            return _kernel_digests(len(groups), plan, rest, device)
    return torch.stack([_torch_digest(g) for g in groups])


def _kernel_digests(count: int, plan: list[tuple], rest: list[tuple],
                    device: torch.device) -> torch.Tensor:
    """``count`` digests from ``_kernel_plan``'s launches, and the torch formula for the rest."""
    from ..kernels.digest import digest_many

    out = torch.zeros(count, dtype=torch.int64, device=device)
    for tensors, positions, slots in plan:
        digest_many(tensors, out, positions, slots)
    for x, position, slot in rest:
        out[slot:slot + 1] += _torch_digest([x], position)
    return out


def _cpu_digest(shards: Sequence[torch.Tensor]) -> int:
    total, off = 0, 0
    for x in shards:
        n = x.numel()
        if n == 0:
            continue
        part = cpu_native.digest(x.detach().reshape(-1), off)
        if part is None:  # no C loops, or a layout they do not take
            return int(_torch_digest(shards))
        total += part
        off += n
    total &= (1 << 64) - 1
    return total - (1 << 64) if total >> 63 else total


def _kernel_plan(groups: Sequence[Sequence[torch.Tensor]]) -> tuple[list[tuple], list[tuple]]:
    """How to digest ``groups`` with the Triton kernel (``kernels.digest.digest_many``): one
    launch ``(tensors, positions, slots)`` per element width (FSDP groups of one dtype take one
    launch for all), and the ``(tensor, position, slot)`` the kernel cannot read (a tensor
    subclass, another layout), for the torch formula; every tensor there without triton."""
    try:  # imported lazily: triton is only needed on GPUs
        from ..kernels.digest import supports
    except ImportError:  # no triton (a preset that quantizes nothing): the torch formula
        supports = None
    by_width: dict[int, tuple[list, list, list]] = {}
    rest = []
    for k, g in enumerate(groups):
        off = 0
        for x in g:
            if x.numel():
                d = x.detach()
                if supports is not None and raw_memory_ok(d.device.type, d) and supports([d]):
                    tensors, positions, slots = by_width.setdefault(d.element_size(),
                                                                    ([], [], []))
                    tensors.append(d)
                    positions.append(off)
                    slots.append(k)
                else:
                    rest.append((x, off, k))
            off += x.numel()
    return list(by_width.values()), rest


def _torch_digest(shards: Sequence[torch.Tensor], start: int = 0) -> torch.Tensor:
    """The digest's formula in torch operations, the shards back to back from ``start``."""
    device = shards[0].device if shards else torch.device("cpu")
    total = torch.zeros((), dtype=torch.int64, device=device)
    off = start
    for x in shards:
        n = x.numel()
        if n == 0:
            continue
        bits = x.detach().reshape(-1)
        if bits.dtype in _BITS:
            bits = bits.view(_BITS[bits.dtype])
        w = (torch.arange(off, off + n, device=device, dtype=torch.int64) % _PRIME) + 1
        total += (bits.to(torch.int64) * w).sum()
        off += n
    return total


class ChangeTracker:
    """What this rank knows about changes to one FSDP parameter group's weights since its
    previous gather (see the module docstring). ``gathered`` marks the point the state is
    measured from; events accumulate until a gather consumes them."""

    def __init__(self, param_group: Any, name: str) -> None:
        self._pg = param_group
        self.name = name
        self._flags = Change.FIRST
        self._expected: Optional[list[tuple]] = None  # signatures explained so far
        self._digest: Optional[torch.Tensor] = None  # at the previous forward gather
        self._digest_now: Optional[torch.Tensor] = None
        self._digest_step: Optional[torch.Tensor] = None  # after the last optimizer step
        self._content_pending = False  # saved with such a write pending (``loaded``)
        self._undigested = False  # stepped, its digest due when the outermost step ends
        self._optim_tracked = False  # a torch.optim step over these parameters was seen
        self._written = False  # a write saved with a loaded state, still pending (``loaded``)
        self.pending: Optional[int] = None  # agreed code for the next forward gather
        self.gathered_once = False

    # ---- declared events (call on every rank) ------------------------------------------
    def mark_changed(self) -> None:
        """The parameters were changed on purpose: the next gather sends a quantized
        difference, and their current signatures are explained."""
        self._flags |= Change.STEP
        self._expected = None
        self._written = False
        self._digest_step = None  # writes since the last step are vouched for too
        self._content_pending = self._undigested = False

    def reset(self) -> None:
        self._flags |= Change.RESET

    def loaded(self, restored: bool = False, digest: Optional[int] = None,
               written: int = 0, content_pending: bool = False) -> None:
        """A checkpoint was loaded. ``restored``: it holds what this group's next gather needs
        (qWD's reference, a direct scheme's counter), which stands in for a first gather and
        for any earlier ``reset()`` (a ``reset()`` after the load still re-sends). ``digest``:
        the saved ``clean_digest``, the shard the saved state was gathered from; the agreement
        compares the loaded shard with it (``CONTENT``), and without one the loaded shard
        counts as changed. ``written``: the state was saved with a write pending
        (``written()``): it stays pending as in the run that saved it, until ``mark_changed()``
        explains it (1 only) or a gather sends it. A load does not turn 1 into 2 through
        optimizer steps: ``set_state_dict`` takes one at learning rate 0 after every load.
        ``content_pending``: saved with a write found by content that no step explains
        (``content_pending()``), likewise pending until ``mark_changed()`` or a gather."""
        self._flags |= Change.LOADED
        if restored:
            self._flags &= ~(Change.FIRST | Change.RESET)
        if written == 2:
            self._flags |= Change.WRITE
        self._expected = None
        self._written = written == 1
        self._content_pending = content_pending
        self._undigested = False
        self._digest_now = self._digest_step = None
        self._digest = None if digest is None else torch.tensor(
            digest, dtype=torch.int64, device=self.shard_device())

    def clean_digest(self) -> Optional[int]:
        """The digest of the shard this group's last forward gather was made from (or a load
        restored), when the uninterrupted run's next gather would send no new weights: no
        declared event but a load (an optimizer step, ``mark_changed``, ``handle.reset()``, the
        first gather), no write found by signature or content; else None. Saved with the
        state, it lets the first gather after a load keep what that gather sent when the loaded
        shard is still that one (a checkpoint written after an evaluation forward): qWD sends
        nothing, a direct scheme keeps its key. One digest pass and one host read."""
        flags = self.local_flags(backward=False)
        if self._digest is None or self.pending is not None or flags & (
                Change.FIRST | Change.RESET | Change.WRITE):
            return None
        if flags & Change.STEP and not flags & Change.LOADED:
            return None  # the uninterrupted run sends a difference even if no value changed
        if not bool(shard_digests([self.shards()])[0] == self._digest):
            return None  # written without a version bump since (the next gather re-sends)
        return int(self._digest)

    def awaits_step_digest(self) -> None:
        """A step changed the shard; its digest (``step_digests``) is taken when the outermost
        step ends. Until then, and for good where that step raised, a ``p.data`` write since
        cannot be told apart from the step: a forward gather re-sends full precision, exactly,
        and a save records the write as pending (``content_pending``)."""
        self._undigested = True

    def content_pending(self) -> bool:
        """Whether this rank's shard holds a write found by content that nothing explains,
        which the next agreement re-sends at full precision: a change since the last optimizer
        step's digest, or, with no step or load since the last forward gather, since that
        gather's. Per rank (a write may leave some shards unchanged): the agreement ors it
        over the ranks. One digest pass and one host read; for the saved state."""
        if self._content_pending or self._undigested:
            return True
        then = self._digest_step
        if then is None and not self._flags & (Change.STEP | Change.LOADED | Change.REDUCED):
            then = self._digest
        return then is not None and not bool(shard_digests([self.shards()])[0] == then)

    def resends_full(self) -> bool:
        """Whether a declared event (the first gather, ``handle.reset()``: alike on every rank,
        and nothing but a gather clears it) makes the next forward gather re-send full
        precision: a checkpoint saved now needs no qWD reference, and one loaded without it
        re-sends (the same bits)."""
        return bool(self._flags & (Change.FIRST | Change.RESET))

    def written(self) -> int:
        """A write is pending, which the next forward gather re-sends at full precision: 0
        none; 1 found by signature, which ``mark_changed()`` may still explain; 2 found by an
        optimizer step that covered the written parameters (only a gather clears it). Saved
        with the state (``loaded(written=...)``)."""
        if self._flags & Change.WRITE:
            return 2
        return 1 if self.local_flags(backward=False) & Change.WRITE else 0

    def optimizer_step_pre(self, param_ids: set[int]) -> None:
        """Before an optimizer step: parameters it covers must still be as last explained."""
        if self._expected is None:
            return
        for i, fp in enumerate(fsdp.fsdp_params(self._pg)):
            if id(fsdp.sharded_param(fp)) in param_ids and \
                    fsdp.param_signature(fp) != self._expected[i]:
                self._flags |= Change.WRITE

    def optimizer_step_post(self, param_ids: set[int]) -> bool:
        """After an optimizer step: the weights changed, and its version bumps are explained.
        Returns whether the step covered this group."""
        hit = False
        for i, fp in enumerate(fsdp.fsdp_params(self._pg)):
            if id(fsdp.sharded_param(fp)) in param_ids:
                hit = True
                if self._expected is not None:
                    self._expected[i] = fsdp.param_signature(fp)
        if hit:
            self._flags |= Change.STEP
            self._optim_tracked = True
        return hit

    def reduction_finished(self) -> None:
        """A gradient reduction of these parameters finished: until a ``torch.optim`` step over
        them is seen, an optimizer of another kind may consume it (``REDUCED``; it counts from
        the next forward on, never inside the backward that made it)."""
        if not self._optim_tracked:
            self._flags |= Change.REDUCED

    # ---- local facts ---------------------------------------------------------------------
    def local_flags(self, backward: bool) -> int:
        """This rank's host-side flags (declared events and signature writes)."""
        if backward:
            return int(self._flags & (Change.FIRST | Change.STEP | Change.RESET | Change.LOADED))
        flags = self._flags
        if self._written or (self._expected is not None and self._signature() != self._expected):
            flags |= Change.WRITE
        if self._content_pending or self._undigested:
            flags |= Change.CONTENT_SINCE_STEP
        if flags & Change.LOADED and self._digest is None:
            flags |= Change.CONTENT  # loaded without a digest: the shard counts as changed
        return int(flags)

    def shards(self) -> list[torch.Tensor]:
        """This rank's flat shards of the group's parameters (what the digest reads)."""
        return [fsdp.local_shard(fp) for fp in fsdp.fsdp_params(self._pg)]

    @property
    def device(self) -> torch.device:
        """FSDP's compute device for this group (the shards' device unless offloaded)."""
        return fsdp.group_device(self._pg)

    def shard_device(self, shards: Optional[list[torch.Tensor]] = None) -> torch.device:
        """Where this rank's shards (``shards()``, read here unless given), and so their
        digest, live."""
        shards = self.shards() if shards is None else shards
        return shards[0].device if shards else self.device

    def _signature(self) -> list[tuple]:
        return [fsdp.param_signature(fp) for fp in fsdp.fsdp_params(self._pg)]

    # ---- after a gather --------------------------------------------------------------------
    def gathered(self, backward: bool) -> None:
        """The module's weights are now what this gather delivered: consumed events are
        cleared, and later changes are measured from here (in backward, only declared events:
        the forward's measurements stay)."""
        self.gathered_once = True
        self.pending = None
        if backward:
            self._flags &= ~(Change.FIRST | Change.STEP | Change.RESET | Change.LOADED)
            return
        self._written = self._content_pending = self._undigested = False  # sent
        self._digest_step = None
        self._flags = Change.NONE
        self._expected = self._signature()
        if self._digest_now is not None:
            self._digest = self._digest_now
            self._digest_now = None


def _digests_by_device(trackers: Sequence[ChangeTracker]
                       ) -> list[tuple[list[int], torch.Tensor]]:
    """The trackers' shard digests, batched per device (``shard_digests``: one launch per
    element width on CUDA): ``(indices into trackers, their digests)`` for each device."""
    by_device: dict[torch.device, list[tuple[int, list[torch.Tensor]]]] = {}
    for k, t in enumerate(trackers):
        shards = t.shards()
        by_device.setdefault(t.shard_device(shards), []).append((k, shards))
    return [([k for k, _ in items], shard_digests([shards for _, shards in items]))
            for items in by_device.values()]


def _differs(now: torch.Tensor, then: list[Optional[torch.Tensor]]) -> torch.Tensor:
    """``now != then`` elementwise, where a missing ``then`` counts as equal."""
    return now != torch.stack([now[i] if d is None else d for i, d in enumerate(then)])


def step_digests(trackers: Sequence[ChangeTracker]) -> None:
    """After an optimizer step over these groups: each keeps its stepped shard's digest, so
    the next agreement tells the step's values from a ``p.data`` write after it (an EMA swap
    for an evaluation, a checkpoint's weights copied in), which must re-send full precision:
    a quantized difference of that jump would leave the evaluation's weights off by its
    quantization step. One digest pass per step, batched like ``content_changes``; on CUDA
    no host read."""
    for ks, now in _digests_by_device(trackers):
        for i, k in enumerate(ks):
            trackers[k]._digest_step = now[i]
            trackers[k]._undigested = False


def content_changes(trackers: Sequence[ChangeTracker]) -> list[torch.Tensor]:
    """For each tracker, an int64 code on its shards' device: ``CONTENT`` when its shard
    differs from the one at its previous forward gather (never before the first), and
    ``CONTENT_SINCE_STEP`` when it differs from the one its last optimizer step left
    (``step_digests``). Each takes the digest its next ``gathered`` records. Batched: per
    device, the digests of every group in one call (``shard_digests``: one launch per element
    width on CUDA) and one comparison each, where a call per group took three launches (17
    groups of a 16-layer model: 51 a step)."""
    out: list[Optional[torch.Tensor]] = [None] * len(trackers)
    for ks, now in _digests_by_device(trackers):
        code = _differs(now, [trackers[k]._digest for k in ks]).to(torch.int64) \
            * int(Change.CONTENT)
        stepped = [trackers[k]._digest_step for k in ks]
        if any(d is not None for d in stepped):
            code |= _differs(now, stepped).to(torch.int64) * int(Change.CONTENT_SINCE_STEP)
        for i, k in enumerate(ks):
            trackers[k]._digest_now = now[i]
            out[k] = code[i]
    return out  # type: ignore[return-value]


KIND = "agreement"


class Agreement:
    """One all-gather of per-module change codes over ``group``; every rank gets the same
    agreed codes or the same error (see the module docstring). Its bytes are recorded under
    the stats kind ``"agreement"`` (elements 0, baseline 0: pure overhead)."""

    def __init__(self, group: Optional[dist.ProcessGroup], stats: Optional[Any] = None) -> None:
        self.group = group
        self.stats = stats
        self._pinned: Optional[torch.Tensor] = None  # CUDA: the flags' host staging buffer
        self._copied: Optional[Any] = None  # the event after its last copy to the device

    def _to_device(self, flags: list[int], device: torch.device) -> torch.Tensor:
        """The local flags on ``device``. On CUDA through a pinned buffer with an asynchronous
        copy: a copy from pageable memory waits for the stream to drain, a second host stall
        per forward beside the one read below (``results/gpu_check/h200_2026-12-04``)."""
        local = torch.tensor(flags, dtype=torch.int64)
        if device.type != "cuda":
            return local.to(device)
        buf = self._pinned
        if buf is None or buf.numel() != len(flags) or (
                self._copied is not None and not self._copied.query()):
            buf = self._pinned = torch.empty(len(flags), dtype=torch.int64, pin_memory=True)
        buf.copy_(local)
        out = buf.to(device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record(torch.cuda.current_stream(device))  # the copy's, whatever is current
        return out

    def agree(self, trackers: Sequence[ChangeTracker], where: str) -> list[int]:
        if not trackers:
            return []
        # FSDP's compute device, where its own collectives over these ranks run. CPU-offloaded
        # shards (``CPUOffloadPolicy``) digest on the host, and an NCCL group carries no CPU
        # tensor ("No backend type associated with device type cpu"): their answers join the
        # host flags, which travel to the device anyway.
        device = trackers[0].device
        flags = [t.local_flags(backward=False) for t in trackers]
        contents = content_changes(trackers)
        if device.type != "cpu" and any(c.device.type == "cpu" for c in contents):
            zero = torch.zeros((), dtype=torch.int64, device=device)
            for k, c in enumerate(contents):
                if c.device.type == "cpu":
                    flags[k] |= int(c)
                    contents[k] = zero
        local = self._to_device(flags, device)
        mine = local | torch.stack(contents)
        world = dist.get_world_size(self.group)
        if world == 1:
            return mine.cpu().tolist()
        every = torch.empty(world * len(trackers), dtype=torch.int64, device=device)
        _c10d.all_gather_single(every, mine, group=self.group)
        if self.stats is not None:
            self.stats.record(KIND, sent_bytes=mine.nbytes, recv_bytes=every.nbytes, elements=0,
                              baseline_bytes=0)
        rows = every.view(world, len(trackers)).cpu().tolist()  # the one host read
        out = []
        for k, t in enumerate(trackers):
            col = [row[k] for row in rows]
            spmd = [c & int(SPMD) for c in col]
            if any(c != spmd[0] for c in spmd):
                raise RuntimeError(_disagreement(t.name, spmd, where, self.group))
            found = 0
            for c in col:
                found |= c & int(FOUND)
            out.append(spmd[0] | found)
        return out


def _disagreement(name: str, codes: list[int], where: str,
                  group: Optional[dist.ProcessGroup]) -> str:
    by_code: dict[int, list[int]] = {}
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    for r, c in enumerate(codes):
        by_code.setdefault(c, []).append(ranks[r])
    seen = "; ".join(f"global rank(s) {rs}: {describe(c)}" for c, rs in sorted(by_code.items()))
    return (
        f"fsdp_qcomm: the ranks disagree about what changed in FSDP module {name!r}'s "
        f"parameters since its previous gather ({where}) — {seen}. Every rank must take the "
        "same gather decision, and these events happen on every rank of an SPMD program: "
        "step the optimizer, write parameters, load checkpoints and call handle.reset() on "
        "every rank. After a deliberate write on some ranks only, call handle.mark_changed() "
        "on every rank before the next forward."
    )


__all__ = ["FOUND", "KIND", "Agreement", "Change", "ChangeTracker", "FULL", "SPMD",
           "content_changes", "describe", "loaded_unchanged", "plan", "shard_digests",
           "step_digests", "values_changed"]

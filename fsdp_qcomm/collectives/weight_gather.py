"""Quantized weight all-gathers on flat buffers: direct (QSDP / ZeRO++ qwZ) and qWD (SDP4Bit).

These functions speak plain ``torch.distributed`` and know nothing about FSDP, so they can be
reused by any code that gathers one equally sized flat shard per rank. Layout conventions are
those of ``all_gather_single``: rank ``r``'s shard of ``n`` values lands in
``output[r*n:(r+1)*n]``, and the input may be a view of that slot (FSDP's in-place gather).

Segments. A shard may be the concatenation of several tensors (FSDP packs every parameter of a
module into one buffer). ``segments`` lists their lengths (identical on every rank); each
segment is encoded as its own wire row so quantization groups never straddle two parameters
(a LayerNorm scale next to a linear weight would otherwise share one absmax). The shard's wire
bytes are the segments' wire rows back to back: ``sum(wire_bytes(s, spec) for s in segments)``.

Randomness. Stochastic rounding of segment ``k`` uses ``key.fold(_WEIGHT_SALT + k)``, so the
call's ``RngKey(seed, step, rank, bucket)`` fixes every bit, and weight keys never collide with
gradient keys built from the same four numbers.

Learned levels (QSDP, ``codec.levels``): pass ``levels`` (a table identical on all ranks, see
``collectives.level_sync``) to ``direct_all_gather`` / ``encode_shard`` and ``learned=True`` to
``decode_shards`` / ``shard_wire_bytes``; every segment row then carries the table in front of
its scales (``levels_wire_bytes``).

Every rank, the sender included, decodes the very same bytes with the same code, so all ranks
end with bit-identical weights. World size 1 sends nothing: the output is the input, exactly.

Async calls return a ``dist.Work`` subclass whose ``wait()`` waits for the collective and then
decodes (FSDP only waits on real ``dist.Work`` objects); blocking calls decode before returning
and return ``None``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..codec import (
    FLOAT_DTYPES,
    RngKey,
    _through_row_base,
    dequantize_segments,
    hadamard_len,
    quantize_segments,
    wire_bytes,
)
from ..codec.levels import dequantize_levels, levels_wire_bytes, quantize_levels
from ..config import QuantSpec
from . import _c10d
from .topology import NodeLayout

_WEIGHT_SALT = 1 << 40


def _check_shard(input: torch.Tensor, numel: int, dtype: torch.dtype) -> None:
    """A gather's input must be this rank's flat shard in the reference's dtype."""
    if input.dim() != 1 or input.numel() != numel:
        raise ValueError(f"input must be a flat shard of {numel} values")
    if input.dtype != dtype:
        raise TypeError(f"input dtype {input.dtype} differs from the reference's {dtype}")


@dataclass(frozen=True)
class GatherOutcome:
    """What one gather put on the wire, reported to ``on_done`` once the output is ready.

    mode: "plain" (unquantized), "cast" (bf16 on the wire, ``collectives.cast``), "direct",
        "qwd_full" (full-precision reference reset),
        "qwd_diff" (quantized differences), "qwd_restore" (a checkpointed reference
        re-assembled), "local" (world size 1), "post_forward" (``reshard_after_forward=<int>``:
        the forward's weights gathered over the smaller group, unquantized), and
        "<scheme>_reuse" (nothing sent, kept weights reused: "qwd_reuse", "direct_reuse",
        "plain_reuse").
    sent_bytes: bytes of the input handed to the process group (summed over its calls).
    recv_bytes: bytes of the outputs the process group wrote.
    elements: values in this rank's shard (what the bytes carry per rank).
    baseline_bytes: what an unquantized all-gather of the shard would have sent.
    cross_node_bytes: bytes this rank sent to ranks on other nodes, when the gather knows it
        (a node-sharded gather does); None: the caller counts ``sent_bytes`` once per remote
        member of the group.
    intra: the node-sharded gather's second hop, an all-gather inside the node of the rebuilt
        reference slices in the all-gather dtype: (sent bytes, received bytes, elements), or
        None when there is none.
    """

    mode: str
    sent_bytes: int
    recv_bytes: int
    elements: int
    baseline_bytes: int
    cross_node_bytes: Optional[int] = None
    intra: Optional[tuple[int, int, int]] = None


OnDone = Optional[Callable[[GatherOutcome], None]]


class _DeferredWork(dist.Work):
    """Waits on the collective, then runs the decode step once. A real ``dist.Work`` subclass:
    FSDP silently skips waiting on anything else.

    CUDA streams: the decode runs on the stream current at ``wait()``, which may differ from
    the one the buffers were allocated on at launch (an ``unshard(async_op=True)`` waited on
    another stream). ``buffers`` (the collective's input and output, which the decode reads) are
    then marked as used by the waiting stream (``record_stream``), so the caching allocator does
    not hand their memory to the launch stream before the decode has run."""

    def __init__(self, inner: dist.Work, finish: Callable[[], None],
                 buffers: tuple[torch.Tensor, ...] = ()) -> None:
        super().__init__()
        self._inner: Optional[dist.Work] = inner
        self._finish: Optional[Callable[[], None]] = finish
        self._buffers = buffers
        self._stream = _current_stream(buffers)

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        if self._inner is not None:
            self._inner.wait() if timeout == timedelta(0) else self._inner.wait(timeout)
            self._inner = None
            finish, self._finish = self._finish, None
            try:
                finish()
            finally:  # a decode that raised may still have queued kernels that read them
                now = _current_stream(self._buffers)
                if now is not None and now != self._stream:
                    for t in self._buffers:
                        t.record_stream(now)
                self._buffers = ()
        return True

    def is_completed(self) -> bool:
        return self._inner is None

    def is_success(self) -> bool:
        return self._inner is None


def _current_stream(buffers: Sequence[torch.Tensor]) -> Optional[torch.cuda.Stream]:
    """The current CUDA stream of the buffers' device (None for CPU buffers)."""
    if not buffers or not buffers[0].is_cuda:
        return None
    return torch.cuda.current_stream(buffers[0].device)


def _launch(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    async_op: bool,
    finish: Callable[[], None],
) -> Optional[dist.Work]:
    """One ``all_gather_single``, then ``finish`` (now or in the returned Work's wait)."""
    work = _c10d.all_gather_single(output, input, group=group, async_op=async_op)
    if async_op:
        return _DeferredWork(work, finish, (output, input))
    finish()
    return None


# ---- segments and their wire layout ---------------------------------------------------------
def check_segments(segments: Optional[Sequence[int]], numel: int) -> tuple[int, ...]:
    """Validate per-rank segment lengths (default: one segment of ``numel``)."""
    if segments is None:
        return (numel,)
    segs = tuple(int(s) for s in segments)
    if any(s < 0 for s in segs) or sum(segs) != numel:
        raise ValueError(
            f"segments {list(segs)} must be non-negative and sum to the shard size {numel}"
        )
    return segs


def _row_bytes(n: int, spec: QuantSpec, learned: bool, hadamard: bool) -> int:
    if learned:
        return levels_wire_bytes(n, spec)
    return wire_bytes(hadamard_len(n) if hadamard else n, spec)


def shard_wire_bytes(
    segments: Sequence[int], spec: QuantSpec, learned: bool = False, hadamard: bool = False
) -> int:
    """Bytes one rank sends for a shard made of ``segments`` (each segment is its own row;
    ``hadamard``: rotated rows, each padded to whole 32-blocks)."""
    return sum(_row_bytes(s, spec, learned, hadamard) for s in segments)


def segment_offsets(segments: Sequence[int]) -> list[int]:
    """Where each segment starts in the flat shard."""
    out, a = [], 0
    for n in segments:
        out.append(a)
        a += n
    return out


def _segment_key(key: Optional[RngKey], k: int) -> Optional[RngKey]:
    return None if key is None else key.fold(_WEIGHT_SALT + k)


def encode_shard(
    x: torch.Tensor,
    segments: Sequence[int],
    spec: QuantSpec,
    key: Optional[RngKey],
    *,
    ref: Optional[torch.Tensor] = None,
    levels: Optional[torch.Tensor] = None,
    hadamard: bool = False,
) -> torch.Tensor:
    """Encode a flat shard (or ``x - ref``) segment by segment into one uint8 wire buffer
    (on the level table ``levels`` when given; rotated by the 32-point Hadamard transform with
    ``hadamard``, which spreads an outlier's magnitude over its block)."""
    learned = levels is not None
    if learned and hadamard:
        raise ValueError("learned levels and the Hadamard rotation do not combine; pick one")
    if not learned:
        return quantize_segments(x, segments, spec, key, key_salt=_WEIGHT_SALT, ref=ref,
                                 hadamard=hadamard)
    out = torch.empty(
        shard_wire_bytes(segments, spec, learned, hadamard), dtype=torch.uint8, device=x.device
    )
    off = woff = 0
    for k, n in enumerate(segments):
        w = _row_bytes(n, spec, learned, hadamard)
        r = None if ref is None else ref[off:off + n]
        if n:
            v = x[off:off + n] if r is None else x[off:off + n].float() - r.float()
            out[woff:woff + w] = quantize_levels(v, spec, levels, _segment_key(key, k))
        off += n
        woff += w
    return out


def decode_shards(
    data: torch.Tensor,
    segments: Sequence[int],
    spec: QuantSpec,
    out: torch.Tensor,
    *,
    accumulate: bool = False,
    learned: bool = False,
    hadamard: bool = False,
    row_base: Optional[tuple[int, torch.Tensor]] = None,
) -> None:
    """Decode ``data[world, W]`` (one wire buffer per rank) into ``out[world, n]`` (or add);
    ``learned``: the rows are learned-levels rows; ``hadamard``: rotated rows; ``row_base``:
    as ``codec.dequantize_segments``'s (one row adds into a base of its own)."""
    if not learned:
        dequantize_segments(data, segments, spec, out=out, accumulate=accumulate,
                            hadamard=hadamard, row_base=row_base)
        return

    def each_segment() -> None:
        off = woff = 0
        for n in segments:
            w = _row_bytes(n, spec, learned, hadamard)
            if n:
                dequantize_levels(data[:, woff:woff + w], n, spec, out=out[:, off:off + n],
                                  accumulate=accumulate)
            off += n
            woff += w

    _through_row_base(out, row_base, each_segment)


def _check_float(t: torch.Tensor, what: str) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{what} has dtype {t.dtype}; quantized gathers take float32/bfloat16/float16 "
            "(use plain_all_gather for other dtypes)"
        )


def _world_rank(group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def _check_shapes(output: torch.Tensor, input: torch.Tensor, world: int) -> int:
    if input.dim() != 1 or output.dim() != 1:
        raise ValueError("weight gathers take flat 1-D input and output buffers")
    n = input.numel()
    if output.numel() != world * n:
        raise ValueError(f"output has {output.numel()} values; world {world} x shard {n} needed")
    if output.dtype != input.dtype:
        raise TypeError(f"output dtype {output.dtype} differs from input dtype {input.dtype}")
    return n


# ---- the gathers -----------------------------------------------------------------------------
def plain_all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Optional[dist.ProcessGroup] = None,
    *,
    async_op: bool = False,
    on_done: OnDone = None,
) -> Optional[dist.Work]:
    """An ordinary all-gather (any dtype) that reports its bytes like the quantized ones."""
    world, _ = _world_rank(group)
    n = _check_shapes(output, input, world)
    nbytes = n * input.element_size()

    def finish() -> None:
        if on_done is not None:
            on_done(GatherOutcome("plain", nbytes, world * nbytes, n, nbytes))

    return _launch(output, input, group, async_op, finish)


def direct_all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    spec: QuantSpec,
    key: Optional[RngKey],
    group: Optional[dist.ProcessGroup] = None,
    *,
    segments: Optional[Sequence[int]] = None,
    async_op: bool = False,
    on_done: OnDone = None,
    levels: Optional[torch.Tensor] = None,
    hadamard: bool = False,
) -> Optional[dist.Work]:
    """Quantize this rank's shard, gather codes and scales, decode every rank's slot.

    The own slot is overwritten by its decoded value too, so every rank computes with the same
    weights. Error per element is below one quantization step (absmax of its group / qmax).
    ``levels``: encode on this learned level table (the same on all ranks) instead of uniform
    codes; with stochastic rounding the decoded weights are unbiased either way.
    """
    _check_float(input, "input")
    world, _ = _world_rank(group)
    n = _check_shapes(output, input, world)
    segs = check_segments(segments, n)
    base = n * input.element_size()
    if world == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        if on_done is not None:
            on_done(GatherOutcome("local", 0, 0, n, base))
        return None
    wire = encode_shard(input, segs, spec, key, levels=levels, hadamard=hadamard)
    gathered = torch.empty(world * wire.numel(), dtype=torch.uint8, device=input.device)

    def finish() -> None:
        decode_shards(
            gathered.view(world, -1), segs, spec, output.view(world, n),
            learned=levels is not None, hadamard=hadamard,
        )
        if on_done is not None:
            on_done(GatherOutcome("direct", wire.numel(), gathered.numel(), n, base))

    return _launch(gathered, wire, group, async_op, finish)


class KeptWeights:
    """An unsharded copy of gathered weights that every rank keeps, bit-identical on all ranks.

    ``ref`` (``world * n`` values) holds what the last gather delivered; a caller that knows the
    weights have not changed since (same optimizer step, no other write) can ``reuse()`` it and
    send nothing. ``own_ref`` keeps this rank's slot, because the caller may gather in place,
    i.e. write the new shard into ``ref``'s own slot before the call (FSDP's all-gather input is
    that slot); ``reuse()`` puts the kept value back.

    Memory: ``(world + 1) * n`` values of the gather dtype, i.e. one unsharded copy of the
    parameters plus one shard (``nbytes``).
    """

    def __init__(
        self,
        numel: int,
        dtype: torch.dtype,
        device: torch.device,
        group: Optional[dist.ProcessGroup] = None,
        *,
        segments: Optional[Sequence[int]] = None,
    ) -> None:
        if dtype not in FLOAT_DTYPES:
            raise TypeError(
                f"kept weights (and the qWD reference) are float32/bfloat16/float16; dtype "
                f"{dtype} is not supported"
            )
        self.group = group
        self.world, self.rank = _world_rank(group)
        self.numel = int(numel)
        self.segments = check_segments(segments, self.numel)
        self.ref = torch.zeros(self.world * self.numel, dtype=dtype, device=device)
        self.own_ref = torch.zeros(self.numel, dtype=dtype, device=device)
        self.valid = False

    @property
    def nbytes(self) -> int:
        """Bytes of state this copy keeps alive (the unsharded copy and the own-slot copy)."""
        return self.ref.nbytes + self.own_ref.nbytes

    def matches(self, numel: int, dtype: torch.dtype, device: torch.device) -> bool:
        return (
            numel == self.numel and dtype == self.ref.dtype and device == self.ref.device
        )

    def own_slot(self) -> torch.Tensor:
        return self.ref.narrow(0, self.rank * self.numel, self.numel)

    def invalidate(self) -> None:
        """Forget the kept weights: they may not be reused until the next gather sets them."""
        self.valid = False

    def keep(self, gathered: Optional[torch.Tensor] = None) -> None:
        """Adopt what a gather delivered (``gathered``, or ``ref`` itself when it gathered in
        place) as the kept weights."""
        if gathered is not None and gathered.data_ptr() != self.ref.data_ptr():
            self.ref.copy_(gathered)
        self.own_ref.copy_(self.own_slot())
        self.valid = True

    def reuse(self, mode: str = "reuse", *, on_done: OnDone = None) -> None:
        """Send nothing; ``ref`` already holds the weights (undoing any in-place write)."""
        if not self.valid:
            raise RuntimeError("reuse() needs kept weights; gather first")
        self.own_slot().copy_(self.own_ref)
        if on_done is not None:
            on_done(GatherOutcome(mode, 0, 0, self.numel, self._base()))

    def _base(self) -> int:
        return self.numel * self.ref.element_size()


class QwdAllGather(KeptWeights):
    """SDP4Bit's quantized weight differences for one flat buffer, and the reference they need.

    Every rank holds ``ref`` (``world * n`` values, bit-identical on all ranks): the weights
    everyone computes with. A gather sends ``quantize(x_shard - ref_own)``; every rank, the
    owner included, adds the decoded differences to its copy of ``ref``. What the quantizer
    drops stays in ``x - ref`` and is sent again next time (error feedback), so the gap to the
    true weights stays at one quantization step of the latest difference instead of growing.

    ``full=True`` (and the first gather) sends the shard at full precision instead and sets
    ``ref`` to the exact weights. ``reuse("qwd_reuse")`` sends nothing and keeps ``ref``: for
    callers that know the weights have not changed since the last gather.

    Callers must make the same sequence of calls (full / diff / reuse) on every rank; the
    decision is theirs, and nothing is exchanged to agree on it.
    """

    def __init__(
        self,
        numel: int,
        dtype: torch.dtype,
        device: torch.device,
        spec: QuantSpec,
        group: Optional[dist.ProcessGroup] = None,
        *,
        segments: Optional[Sequence[int]] = None,
        hadamard: bool = False,
    ) -> None:
        super().__init__(numel, dtype, device, group, segments=segments)
        self.spec = spec
        self.hadamard = hadamard

    def differences(self, input: torch.Tensor) -> list[torch.Tensor]:
        """The fp32 differences the next gather would encode, one block per segment (what a
        learned level table for them is fitted on)."""
        return [input[a:a + n].float() - self.own_ref[a:a + n].float()
                for a, n in zip(segment_offsets(self.segments), self.segments) if n]

    def restore(self, own: torch.Tensor) -> int:
        """Re-assemble a saved reference from every rank's own shard ``own`` (one
        full-precision all-gather); returns the bytes this rank sent."""
        self.own_ref.copy_(own)
        _c10d.all_gather_single(self.ref, self.own_ref, group=self.group)
        self.valid = True
        return self.numel * self.ref.element_size()

    def __call__(
        self,
        input: torch.Tensor,
        key: Optional[RngKey],
        *,
        full: bool = False,
        async_op: bool = False,
        on_done: OnDone = None,
        levels: Optional[torch.Tensor] = None,
    ) -> Optional[dist.Work]:
        """Bring ``ref`` up to every rank's new shard ``input`` (``numel`` values); the
        differences are encoded on ``levels`` when given (a table identical on all ranks)."""
        _check_shard(input, self.numel, self.ref.dtype)
        own = self.own_slot()
        base = self._base()
        if self.world == 1:
            if input.data_ptr() != own.data_ptr():
                own.copy_(input)
            self.own_ref.copy_(own)
            self.valid = True
            if on_done is not None:
                on_done(GatherOutcome("local", 0, 0, self.numel, base))
            return None

        if full or not self.valid:
            if input.data_ptr() != own.data_ptr():
                own.copy_(input)
            self.valid = False  # until the gather lands

            def finish_full() -> None:
                self.own_ref.copy_(own)
                self.valid = True
                if on_done is not None:
                    on_done(GatherOutcome("qwd_full", base, self.world * base, self.numel, base))

            return _launch(self.ref, own, self.group, async_op, finish_full)

        wire = encode_shard(input, self.segments, self.spec, key, ref=self.own_ref,
                            levels=levels, hadamard=self.hadamard)
        gathered = torch.empty(self.world * wire.numel(), dtype=torch.uint8, device=wire.device)

        def finish_diff() -> None:
            # the own slot may hold the input (FSDP's copy-in): the own row adds to own_ref
            # instead, and both take the new reference, in the decode's pass
            decode_shards(
                gathered.view(self.world, -1), self.segments, self.spec,
                self.ref.view(self.world, self.numel), accumulate=True,
                learned=levels is not None, hadamard=self.hadamard,
                row_base=(self.rank, self.own_ref),
            )
            if on_done is not None:
                on_done(GatherOutcome("qwd_diff", wire.numel(), gathered.numel(), self.numel, base))

        return _launch(gathered, wire, self.group, async_op, finish_diff)


def _node_blocks(layout: "NodeLayout") -> Optional[list[int]]:
    """The first slot of each node's members in a gather's output, if every node's members are
    consecutive slots in local-index order (then one all-gather inside the node fills a node's
    block in place); None otherwise."""
    starts = []
    for members in layout.nodes:
        if list(members) != list(range(members[0], members[0] + len(members))):
            return None
        starts.append(members[0])
    return starts


class NodeShardedQwd:
    """qWD with the reference sharded inside each node (ZeRO++'s hpZ partitioning, applied to
    SDP4Bit's reference).

    The gather group's ``W = N * L`` members are laid out as ``N`` nodes of ``L``
    (``topology.NodeLayout``); member ``(q, p)`` (node ``q``, local index ``p``) keeps the
    reference only of the ``N`` shards ``(q', p)`` that share its local index, one per node:
    ``N * n`` values, ``1/L`` of the unsharded buffer, where the full reference
    (``QwdAllGather``) keeps all ``W * n``. A gather is two hops:

    1. across nodes, over the ranks with the same local index (``inter``): the quantized
       difference of each one's shard against its own slice, exactly the bytes and random bits
       of the full reference's gather (same key, same segments); each of them adds the decoded
       differences to its ``N`` slices, all from the same bytes, so they stay bit-identical;
    2. inside the node (``intra``): an all-gather of the ``N`` rebuilt slices in the all-gather
       dtype, which lands every shard's reference in ``output``. Where each node's members are
       consecutive slots of ``output`` (every layout of sorted ranks), that is ``N``
       all-gathers, one per node's block of ``output``, coalesced into one collective: no
       staging buffer of the unsharded size and no permuting copy out of it (at 8 nodes of 8
       and 1B parameters, 9.9 GB a step: ``docs/gpu_path.md`` section 7).

    The result is bit for bit the full reference's output. A gather of unchanged weights
    (``reuse``: backward re-gathers, accumulation micro-batches) runs hop 2 only and crosses no
    node. A full-precision gather (first gather, unexplained writes) sends the shard itself over
    hop 1. ``own_ref`` is this rank's own slice: what checkpoints save.
    """

    def __init__(
        self,
        numel: int,
        dtype: torch.dtype,
        device: torch.device,
        spec: QuantSpec,
        group: dist.ProcessGroup,
        layout: "NodeLayout",
        intra: dist.ProcessGroup,
        inter: dist.ProcessGroup,
        *,
        segments: Optional[Sequence[int]] = None,
        hadamard: bool = False,
    ) -> None:
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"the qWD reference is float32/bfloat16/float16; got {dtype}")
        if not layout.regular or layout.local_size < 2 or layout.num_nodes < 2:
            raise ValueError("a node-sharded reference needs a regular layout of at least 2 "
                             "nodes of at least 2 members; use QwdAllGather")
        self.group = group
        self.layout = layout
        self.intra = intra
        self.inter = inter
        self.world = group.size()
        self.nodes = layout.num_nodes
        self.local = layout.local_size
        self.node, self.index = layout.position(layout.rank)
        self.numel = int(numel)
        self.segments = check_segments(segments, self.numel)
        self.spec = spec
        self.hadamard = hadamard
        # slices[q'] = the reference of member (q', self.index)
        self.slices = torch.zeros(self.nodes, self.numel, dtype=dtype, device=device)
        self.valid = False
        # where each (local index p', node q') block of hop 2's output goes in FSDP's buffer
        self._slots = torch.tensor(
            [layout.nodes[q][p] for p in range(self.local) for q in range(self.nodes)],
            dtype=torch.long, device=device)
        self._node_starts = _node_blocks(layout)
        self._coalesce = _c10d.coalesces(intra, self.slices.device)

    @property
    def own_ref(self) -> torch.Tensor:
        return self.slices[self.node]

    @property
    def nbytes(self) -> int:
        return self.slices.nbytes

    def matches(self, numel: int, dtype: torch.dtype, device: torch.device) -> bool:
        return (numel == self.numel and dtype == self.slices.dtype
                and device == self.slices.device)

    def invalidate(self) -> None:
        self.valid = False

    def differences(self, input: torch.Tensor) -> list[torch.Tensor]:
        """The fp32 differences the next gather would encode, one block per segment."""
        own = self.own_ref
        return [input[a:a + n].float() - own[a:a + n].float()
                for a, n in zip(segment_offsets(self.segments), self.segments) if n]

    def _intra_gather(self, output: torch.Tensor) -> tuple[int, int, int]:
        """Hop 2: every member's slices into ``output`` in FSDP's slot order."""
        n = self.numel
        rows = output.view(self.world, n)
        received = self.local * self.slices.nbytes
        if self._node_starts is not None:
            with _c10d.coalesced(self.intra) if self._coalesce else contextlib.nullcontext():
                for q, first in enumerate(self._node_starts):
                    _c10d.all_gather_single(rows[first:first + self.local].view(-1),
                                            self.slices[q], group=self.intra)
            return self.slices.nbytes, received, self.nodes * n
        gathered = torch.empty(self.local * self.nodes * n, dtype=self.slices.dtype,
                               device=self.slices.device)
        _c10d.all_gather_single(gathered, self.slices.view(-1), group=self.intra)
        rows.index_copy_(0, self._slots, gathered.view(-1, n))
        return self.slices.nbytes, received, self.nodes * n

    def _base(self) -> int:
        return self.numel * self.slices.element_size()

    def reuse(self, mode: str, *, output: torch.Tensor, on_done: OnDone = None) -> None:
        """Nothing crosses nodes: hop 2 rebuilds ``output`` from the kept slices."""
        if not self.valid:
            raise RuntimeError("reuse() needs a reference; gather first")
        intra = self._intra_gather(output)
        if on_done is not None:
            on_done(GatherOutcome(mode, 0, 0, self.numel, self._base(), 0, intra))

    def restore(self, own: torch.Tensor) -> int:
        """Re-assemble a saved reference from every rank's own slice: hop 1 at full
        precision; returns the bytes this rank sent."""
        self.own_ref.copy_(own)
        _c10d.all_gather_single(self.slices.view(-1), self.own_ref.clone(), group=self.inter)
        self.valid = True
        return self._base()

    def __call__(
        self,
        input: torch.Tensor,
        key: Optional[RngKey],
        *,
        output: torch.Tensor,
        full: bool = False,
        async_op: bool = False,
        on_done: OnDone = None,
        levels: Optional[torch.Tensor] = None,
    ) -> Optional[dist.Work]:
        """Bring every slice up to its owner's new shard (``input``, this rank's) and write the
        reference of every shard into ``output`` (``world * numel`` values, FSDP's layout;
        ``input`` may be a view of ``output``'s own slot: it is read before ``output`` is
        written)."""
        _check_shard(input, self.numel, self.slices.dtype)
        base = self._base()
        remote = self.nodes - 1
        if full or not self.valid:
            self.valid = False  # until the gather lands
            own = input.clone()

            def finish_full() -> None:
                self.valid = True
                intra = self._intra_gather(output)
                if on_done is not None:
                    on_done(GatherOutcome("qwd_full", base, self.nodes * base, self.numel, base,
                                          base * remote, intra))

            return _launch(self.slices.view(-1), own, self.inter, async_op, finish_full)

        wire = encode_shard(input, self.segments, self.spec, key, ref=self.own_ref,
                            levels=levels, hadamard=self.hadamard)
        gathered = torch.empty(self.nodes * wire.numel(), dtype=torch.uint8, device=wire.device)

        def finish_diff() -> None:
            decode_shards(
                gathered.view(self.nodes, -1), self.segments, self.spec, self.slices,
                accumulate=True, learned=levels is not None, hadamard=self.hadamard,
            )
            intra = self._intra_gather(output)
            if on_done is not None:
                on_done(GatherOutcome("qwd_diff", wire.numel(), gathered.numel(), self.numel,
                                      base, wire.numel() * remote, intra))

        return _launch(gathered, wire, self.inter, async_op, finish_diff)


__all__ = [
    "GatherOutcome",
    "KeptWeights",
    "NodeShardedQwd",
    "QwdAllGather",
    "check_segments",
    "decode_shards",
    "direct_all_gather",
    "encode_shard",
    "plain_all_gather",
    "segment_offsets",
    "shard_wire_bytes",
]

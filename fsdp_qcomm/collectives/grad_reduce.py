"""Quantized reduce-scatter of gradients over a process group (no FSDP needed).

Same contract as ``dist.reduce_scatter_single(output, input, op, group)``: row ``j`` of
``input.view(world, m)`` is reduced into group rank ``j``'s ``output`` (``m`` values). The
reduction is replaced by all-to-alls of quantized rows (``fsdp_qcomm.codec``) and sums in fp32:

one level (QSDP / ZeRO++-style, ``grad_scheme="one_level"``)
    quantize every destination row with ``grad_inter_spec()``, one ``all_to_all_single`` over the
    group, dequantize the ``world`` received rows and sum them.

two level (SDP4Bit TLq, ``grad_scheme="two_level"``)
    with the group laid out as ``nodes x local`` (``topology``):
    hop 1, inside the node, ``grad_intra_spec()`` (8 bits): local peer ``p`` receives the rows
    of every rank whose local index is ``p`` (ordered by node). It sums the ``local`` copies it
    receives and re-quantizes each of those ``nodes`` rows with ``grad_inter_spec()`` (4 bits).
    hop 2, across nodes, among the ranks sharing a local index: node ``q`` receives the row of
    rank ``(q, p)``, which is that rank's own shard, summed over nodes.
    One node degenerates to hop 1 alone (intra spec), one rank per node to hop 2 alone (inter
    spec), a group of one to a copy.

``grad_hadamard`` (TLq-HS) rotates 32-element blocks before the first quantization and undoes
the rotation once after the final sum; the partial sums of hop 1 stay rotated (sums commute with
the rotation). Rows are zero-padded to whole 32-blocks on the wire.

Pipelining: the columns of ``input.view(world, m)`` are split into ``grad_pipeline_chunks``
spans aligned to whole quantization groups (and Hadamard blocks), so the group boundaries and
the bytes on the wire do not depend on the chunk count. Hop 1 of span ``c + 1`` is in flight
while span ``c`` is re-quantized and its hop 2 runs (asynchronous ``all_to_all_single`` on two
different subgroups).

Learned levels (QSDP, ``codec.levels``): ``levels=`` (a table identical on all ranks, see
``collectives.level_sync``) encodes every row of the one-level scheme on that table; each wire
row then starts with the table (``levels_wire_bytes``). Two-level and Hadamard are refused.

Every rank quantizes its own row too and sends it to itself through the all-to-all, so the row
for oneself is counted in the bytes sent and carries quantization noise like the others.

Ops: SUM, AVG (sum / world) and PREMUL_SUM (sum * factor; its factor may be a float or a
tensor). The factor is applied once to the fp32 sum before it is written: absmax quantization is
scale-equivariant, so this equals pre-multiplying the gradients. Non-finite inputs stay
non-finite: a quantization group holding NaN/inf is sent with a NaN scale (``codec.wire``), so
the reduced shard holds NaN wherever an input group did.

Stats (``CommStats``), one record per call and hop, summed over chunks:
kind ``"grad_intra"`` for a hop whose peers all share a node, ``"grad_inter"`` for one that
crosses nodes. Two-level records both; the one-level hop is ``"grad_intra"`` only when the whole
group sits on one node, else ``"grad_inter"`` (also when node placement is unknown).
``cross_node_bytes``: the rows addressed to group members on other nodes.
``sent_bytes`` / ``recv_bytes``: bytes of the send / receive buffers handed to
``all_to_all_single`` (all rows, the row for oneself included); ``elements``: logical values those
rows carry (before Hadamard padding); ``baseline_bytes``: what ``reduce_scatter_single`` would
have been passed in the reduce dtype, the output's (``input.numel() * output.element_size()``:
the input may hold 16-bit gradients where FSDP asked for float32,
``fsdp.reduce_scatter._input_dtype``), recorded on every kind, so do not add baselines across
kinds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from .. import codec
from ..codec import FLOAT_DTYPES, RngKey
from ..codec import levels as _levels
from ..codec.wire import HADAMARD_BLOCK
from ..config import QCommConfig, QuantSpec
from ..stats import CommStats
from . import _c10d
from .error_feedback import Feedback, Site, compensated, open_residuals
from .topology import NodeLayout, Topology, group_layout, known_ranks_per_node, node_topology

# One quantize call may cover at most 2^32 RNG counters (codec.rng); stay well below.
_MAX_CALL_ELEMENTS = 1 << 31

Finish = Optional[Callable[[torch.Tensor], torch.Tensor]]


@dataclass(frozen=True)
class PremulSum:
    """``ReduceOp.PREMUL_SUM`` with its factor, for a torch whose op does not expose it: before
    2.13 FSDP builds the op with ``dist._make_nccl_premul_sum`` and Python cannot read the factor
    back (``fsdp.internals.readable_reduce_op`` recovers it from FSDP's divide factor)."""

    factor: Union[float, torch.Tensor]


def premul_sum(factor: Union[float, torch.Tensor]) -> Union[ReduceOp, PremulSum]:
    """PREMUL_SUM(``factor``) as the collectives here take it: ``ReduceOp.PREMUL_SUM(factor)``
    where torch exposes the factor (2.13+), else a ``PremulSum``."""
    if callable(ReduceOp.PREMUL_SUM):  # torch >= 2.13: an op whose factor reads back
        return ReduceOp.PREMUL_SUM(factor)
    return PremulSum(factor)


@dataclass(frozen=True)
class Divide:
    """AVG's finish: the fp32 sum divided by the group's size, in place. The last hop's decode
    can take it in the same pass (``codec.reduce_dequantize(divide=)``)."""

    divisor: int

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return t.div_(self.divisor)


def reduce_op_finisher(op: Union[ReduceOp, "ReduceOp.RedOpType", PremulSum],
                       world: int) -> Finish:
    """What to apply to the fp32 sum for ``op``: None (SUM), ``Divide(world)`` (AVG) or
    ``* factor`` (PREMUL_SUM). Any other op is an error: min/max/product do not commute with
    quantization."""
    if isinstance(op, PremulSum) or op == ReduceOp.PREMUL_SUM:
        try:
            factor = op.factor
        except (AttributeError, RuntimeError):
            raise ValueError(
                "ReduceOp.PREMUL_SUM needs its factor: build the op with "
                "ReduceOp.PREMUL_SUM(factor) (FSDP does; before torch 2.13 "
                "fsdp_qcomm.collectives.grad_reduce.premul_sum(factor)) instead of passing the "
                "bare enum"
            ) from None
        if isinstance(factor, torch.Tensor):
            return lambda t: t.mul_(factor.to(device=t.device, dtype=torch.float32))
        return lambda t: t.mul_(float(factor))
    if op == ReduceOp.SUM:
        return None
    if op == ReduceOp.AVG:
        return Divide(world)
    raise ValueError(
        f"quantized reduce-scatter supports ReduceOp SUM, AVG and PREMUL_SUM, got {op!r}; "
        "use dist.reduce_scatter_single for other ops"
    )


def chunk_spans(m: int, chunks: int, align: int) -> list[tuple[int, int]]:
    """Split ``[0, m)`` into at most ``chunks`` spans whose starts are multiples of ``align``."""
    if m == 0:
        return []
    width = -(-m // chunks)
    width = -(-width // align) * align
    return [(a, min(a + width, m)) for a in range(0, m, width)]


@dataclass(frozen=True)
class _Hop:
    """One all-to-all: its group, quantizer and stats kind."""

    group: Optional[ProcessGroup]
    spec: QuantSpec
    kind: str


@dataclass
class _Tally:
    sent: int = 0
    recv: int = 0


def reduce_scatter_quantized(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Optional[ProcessGroup],
    config: QCommConfig,
    key: RngKey,
    *,
    op: Union[ReduceOp, "ReduceOp.RedOpType"] = ReduceOp.SUM,
    stats: Optional[CommStats] = None,
    levels: Optional[torch.Tensor] = None,
    topology: Optional[Topology] = None,
    feedback: Feedback = None,
) -> None:
    """Quantized ``reduce_scatter_single``: writes this rank's reduced shard into ``output``.

    Blocking (returns once ``output`` is written). Collective over ``group`` (None: the default
    group). ``topology``: the group's node layout and subgroups, as ``enable`` creates them up
    front (``node_topology`` for two levels, ``layout_topology`` for one); without it a two-level
    call creates the node subgroups on first use. ``key`` seeds stochastic rounding: the same key
    and inputs give the same bits; pass a fresh key (``RngKey(seed, step, rank, bucket)``) every
    call. ``feedback``: this rank's error-feedback residuals for the module, used at the sites
    ``config.grad_error_feedback`` names (``feedback_shapes``; ``collectives.error_feedback``):
    a ``FeedbackState`` in this call's layout, or a ``MappedFeedback`` that says where the
    call's ``m`` columns sit in the layout the residuals are kept in.
    """
    if config.grad_scheme == "none":
        raise ValueError(
            "QCommConfig.grad_scheme='none' does not quantize gradients; use "
            "dist.reduce_scatter_single, or set grad_scheme='one_level' or 'two_level'"
        )
    if levels is not None and (config.grad_scheme != "one_level" or config.grad_hadamard):
        raise ValueError(
            "learned levels (levels=) work with grad_scheme='one_level' without Hadamard; got "
            f"grad_scheme={config.grad_scheme!r}, grad_hadamard={config.grad_hadamard}"
        )
    world = dist.get_world_size(group)
    m = output.numel()
    _check_buffers(output, input, world)
    finish = reduce_op_finisher(op, world)
    if m == 0:
        return
    x = input.reshape(world, m)
    if world == 1:
        res = x[0].to(torch.float32)
        output.view(-1).copy_(finish(res.clone()) if finish is not None else res)
        return

    hadamard = config.grad_hadamard
    spans = _spans(config, world, m)
    out = output.view(-1)
    baseline = input.numel() * output.element_size()  # in the reduce dtype

    if config.grad_scheme == "two_level":
        topo = topology or node_topology(group, config.ranks_per_node)
        lay = topo.layout
    else:
        lay = topology.layout if topology is not None else _known_layout(group, config)
    res, done = open_residuals(feedback, lambda n: feedback_sites(config, world, n, lay), m,
                               input.device)
    if config.grad_scheme == "two_level":
        if lay.num_nodes > 1 and lay.local_size > 1:
            hop1 = _Hop(topo.intra, config.grad_intra_spec(), "grad_intra")
            hop2 = _Hop(topo.inter, config.grad_inter_spec(), "grad_inter")
            t1, t2 = _two_hops(out, x, spans, hop1, hop2, tuple(lay.hop1_order()),
                               lay.local_size, lay.num_nodes, hadamard, key, finish,
                               res.get("a2a"), res.get("requant"))
            done()
            if stats is not None:
                # hop 2 sends one row to each node, all but one of them remote
                stats.record(hop1.kind, sent_bytes=t1.sent, recv_bytes=t1.recv,
                             elements=world * m, baseline_bytes=baseline, shares_baseline=True)
                stats.record(hop2.kind, sent_bytes=t2.sent, recv_bytes=t2.recv,
                             elements=lay.num_nodes * m, baseline_bytes=baseline,
                             cross_node_bytes=t2.sent * (lay.num_nodes - 1) // lay.num_nodes,
                             baseline_cross_node_bytes=baseline * lay.remote_peers // world)
            return
        if lay.num_nodes == 1:
            hop = _Hop(group, config.grad_intra_spec(), "grad_intra")
        else:
            hop = _Hop(group, config.grad_inter_spec(), "grad_inter")
        remote = lay.remote_peers
    else:
        kind = "grad_inter" if lay is None or lay.num_nodes > 1 else "grad_intra"
        hop = _Hop(group, config.grad_inter_spec(), kind)
        remote = world - 1 if lay is None else lay.remote_peers
    t = _one_hop(out, x, spans, hop, hadamard, key, finish, levels, res.get("a2a"))
    done()
    if stats is not None:
        # one equal row per group rank; placement unknown counts every peer as remote
        stats.record(hop.kind, sent_bytes=t.sent, recv_bytes=t.recv, elements=world * m,
                     baseline_bytes=baseline, cross_node_bytes=t.sent * remote // world,
                     baseline_cross_node_bytes=baseline * remote // world)


def _spans(config: QCommConfig, world: int, m: int) -> list[tuple[int, int]]:
    """The pipeline spans of a call: ``grad_pipeline_chunks`` (and as many as the RNG counter
    range needs), aligned to the quantization groups and Hadamard blocks."""
    hadamard = config.grad_hadamard
    align = math.lcm(config.grad_group_size, HADAMARD_BLOCK) if hadamard else config.grad_group_size
    padded = codec.hadamard_len(m) if hadamard else m
    chunks = max(config.grad_pipeline_chunks, -(-world * padded // _MAX_CALL_ELEMENTS))
    return chunk_spans(m, chunks, align)


def feedback_shapes(
    config: QCommConfig, world: int, m: int, layout: Optional[NodeLayout]
) -> dict[str, tuple[int, ...]]:
    """The error-feedback residuals a call of ``m`` values per rank keeps on each rank:
    ``"a2a"`` (``[world, m]``, the rows this rank sends in the first or only all-to-all) and
    ``"requant"`` (``[nodes, P]``, hop 2's re-encoded partial sums, ``P`` the Hadamard-padded
    span lengths). ``grad_error_feedback="inter"`` keeps the sites whose bytes cross nodes (the
    single hop when the group spans nodes or its placement is unknown; hop 2), ``"all"`` every
    site."""
    return {s: g.shape for s, g in feedback_sites(config, world, m, layout).items()}


def feedback_sites(
    config: QCommConfig, world: int, m: int, layout: Optional[NodeLayout]
) -> dict[str, Site]:
    """``feedback_shapes`` with what each buffer holds (``error_feedback.Site``): column ``c``
    of every row is the residual of output value ``c`` of the rank (``"a2a"``) or node
    (``"requant"``) the row is sent to, whatever the layout; ``"requant"`` is stored
    Hadamard-rotated per pipeline span under ``grad_hadamard``."""
    mode = config.grad_error_feedback
    if mode == "none" or world == 1 or m == 0 or config.grad_scheme == "none":
        return {}
    two = (config.grad_scheme == "two_level" and layout is not None and layout.num_nodes > 1
           and layout.local_size > 1)
    if two:
        sites: dict[str, Site] = {}
        if mode == "all":
            sites["a2a"] = Site((world, m), world, 0, m)
        nodes = layout.num_nodes
        if not config.grad_hadamard:
            sites["requant"] = Site((nodes, m), nodes, 0, m)
            return sites
        rotated, off = [], 0
        for a, b in _spans(config, world, m):
            rotated.append((a, b, off))
            off += codec.hadamard_len(b - a)
        sites["requant"] = Site((nodes, off), nodes, 0, m, tuple(rotated))
        return sites
    crosses = layout is None or layout.num_nodes > 1
    return {"a2a": Site((world, m), world, 0, m)} if mode == "all" or crosses else {}


def reduce_scatter_plain(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Optional[ProcessGroup],
    *,
    op: Union[ReduceOp, "ReduceOp.RedOpType"] = ReduceOp.SUM,
    stats: Optional[CommStats] = None,
    topology: Optional[Topology] = None,
) -> None:
    """An unquantized ``reduce_scatter_single`` (SUM, then ``op`` applied like the quantized
    one) that reports its bytes like the quantized ones: the reference point that shows what
    quantization alone gains (``QCommConfig.grad_overlap`` with ``grad_scheme="none"``).
    Blocking. Stats: ``sent_bytes`` = the input handed to the process group, ``recv_bytes`` =
    the output; ``cross_node_bytes`` = the rows of group members on other nodes."""
    world = dist.get_world_size(group)
    _check_buffers(output, input, world, _PLAIN_DTYPES)
    finish = reduce_op_finisher(op, world)
    if output.numel() == 0:
        return
    acc = torch.promote_types(output.dtype, torch.float32)  # float64 sums stay float64
    if world == 1:
        res = input.reshape(-1).to(acc)
        output.view(-1).copy_(finish(res.clone()) if finish is not None else res)
        return
    _c10d.reduce_scatter_single(output.view(-1), input.reshape(-1), op=ReduceOp.SUM, group=group)
    if finish is not None:
        output.copy_(finish(output.to(acc)))
    if stats is not None:
        lay = topology.layout if topology is not None else None
        remote = world - 1 if lay is None else lay.remote_peers
        kind = "grad_inter" if lay is None or lay.num_nodes > 1 else "grad_intra"
        sent = input.numel() * input.element_size()
        stats.record(kind, sent_bytes=sent, recv_bytes=output.numel() * output.element_size(),
                     elements=input.numel(), baseline_bytes=sent,
                     cross_node_bytes=sent * remote // world,
                     baseline_cross_node_bytes=sent * remote // world)


#: what the unquantized reduce-scatter also takes (FSDP's float64 gradients, summed in float64)
_PLAIN_DTYPES = (*FLOAT_DTYPES, torch.float64)


def _check_buffers(output: torch.Tensor, input: torch.Tensor, world: int,
                   dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES) -> None:
    for name, t in (("input", input), ("output", output)):
        if t.dtype not in dtypes:
            raise TypeError(
                f"{'reduce-scatter' if dtypes is _PLAIN_DTYPES else 'quantized reduce-scatter'} "
                f"{name} must be {'/'.join(str(d)[6:] for d in dtypes)}, got {t.dtype}"
            )
    if input.numel() != world * output.numel():
        raise ValueError(
            f"input has {input.numel()} elements but a group of {world} with an output of "
            f"{output.numel()} needs {world * output.numel()}"
        )
    if not output.is_contiguous():
        raise ValueError("output must be contiguous: the reduced shard is written into it in place")
    if input.device != output.device:
        raise ValueError(f"input is on {input.device} but output on {output.device}")


def _known_layout(group: Optional[ProcessGroup], config: QCommConfig) -> Optional[NodeLayout]:
    """The group's node layout, or None when the placement is unknown (the hop then counts as
    crossing nodes)."""
    rpn = known_ranks_per_node(config.ranks_per_node)
    return None if rpn is None else group_layout(group, rpn)


def _a2a(send: torch.Tensor, group: Optional[ProcessGroup], tally: _Tally):
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    tally.sent += send.numel() * send.element_size()
    tally.recv += recv.numel() * recv.element_size()
    return work, recv


def _write(out: torch.Tensor, res: torch.Tensor, finish: Finish) -> None:
    if finish is not None:
        res = finish(res)
    out.copy_(res.view(-1))


def _encoder(spec: QuantSpec, key: RngKey, hadamard: bool, n: int,
             levels: Optional[torch.Tensor] = None):
    """(encode, decode) of ``n``-value rows: the pair error feedback needs."""
    if levels is not None:
        return (lambda t: _levels.quantize_levels(t, spec, levels, key),
                lambda w: _levels.dequantize_levels(w, n, spec))
    return (lambda t: codec.quantize(t, spec, key, hadamard=hadamard),
            lambda w: codec.dequantize(w, n, spec, hadamard=hadamard))


def _encode(x: torch.Tensor, spec: QuantSpec, key: RngKey, hadamard: bool,
            levels: Optional[torch.Tensor], e: Optional[torch.Tensor]) -> torch.Tensor:
    enc, dec = _encoder(spec, key, hadamard, x.shape[-1], levels)
    return enc(x) if e is None else compensated(e, x, enc, dec)


def _one_hop(out, x, spans, hop: _Hop, hadamard: bool, key: RngKey, finish: Finish,
             levels: Optional[torch.Tensor] = None, e_a2a: Optional[torch.Tensor] = None
             ) -> _Tally:
    """Single all-to-all: row j of every span goes to group rank j; the transfer of span c
    overlaps quantizing span c + 1."""
    tally = _Tally()
    pending = None
    for c, (a, b) in enumerate(spans):
        e = None if e_a2a is None else e_a2a[:, a:b]
        send = _encode(x[:, a:b], hop.spec, key.fold(c).fold(1), hadamard, levels, e)
        work, recv = _a2a(send, hop.group, tally)
        if pending is not None:
            _finish_last_hop(out, pending, hop.spec, hadamard, finish, levels is not None)
        pending = (work, send, recv, a, b)
    _finish_last_hop(out, pending, hop.spec, hadamard, finish, levels is not None)
    return tally


def _finish_last_hop(out, pending, spec: QuantSpec, hadamard: bool, finish: Finish,
                     learned: bool = False) -> None:
    work, _send, recv, a, b = pending
    work.wait()
    divide = finish.divisor if isinstance(finish, Divide) else None
    if learned:
        res = _levels.reduce_dequantize_levels(recv, b - a, spec)
    elif out.dtype == torch.float32 or finish is None or divide is not None:
        # the sum straight into the output, AVG's division in the same pass; another op after
        codec.reduce_dequantize(recv, b - a, spec, hadamard=hadamard, out=out[a:b],
                                divide=divide)
        if finish is not None and divide is None:
            finish(out[a:b])
        return
    else:
        res = codec.reduce_dequantize(recv, b - a, spec, hadamard=hadamard)
    _write(out[a:b], res, finish)


def _two_hops(out, x, spans, hop1: _Hop, hop2: _Hop, order: tuple[int, ...], local: int,
              nodes: int, hadamard: bool, key: RngKey, finish: Finish,
              e_a2a: Optional[torch.Tensor] = None, e_requant: Optional[torch.Tensor] = None
              ) -> tuple[_Tally, _Tally]:
    """Intra-node all-to-all, sum + re-quantize, inter-node all-to-all, sum.

    Send buffer of hop 1: ``[local, nodes, W1]``, block ``p`` = rows of the ranks with local
    index ``p`` (``order``: ``NodeLayout.hop1_order``), encoded in that order. Its receive
    buffer ``[local (source), nodes, W1]`` reduces to ``[nodes, W2]``, row ``q`` = partial sum
    for rank ``(q, my local index)``, which is hop 2's send buffer.
    """
    t1, t2 = _Tally(), _Tally()

    def start_hop1(c: int):
        a, b = spans[c]
        k1 = key.fold(c).fold(1)
        if e_a2a is None:
            send = codec.quantize(x[:, a:b], hop1.spec, k1, hadamard=hadamard, order=order)
        else:  # the residual is kept per input row: encode in input order, then reorder
            wire = _encode(x[:, a:b], hop1.spec, k1, hadamard, None, e_a2a[:, a:b])
            send = codec._rows_in_order(wire, order)
        send = send.view(local, nodes, send.shape[-1])
        work, recv = _a2a(send, hop1.group, t1)
        return work, send, recv

    in_hop1 = start_hop1(0)
    in_hop2 = None
    off = 0  # into e_requant's columns: the spans' Hadamard-padded lengths back to back
    for c, (a, b) in enumerate(spans):
        cur = in_hop1
        if c + 1 < len(spans):
            in_hop1 = start_hop1(c + 1)
        work, _send, recv = cur
        work.wait()
        n = codec.hadamard_len(b - a) if hadamard else b - a
        key2 = key.fold(c).fold(2)
        if e_requant is None:
            send2 = codec.reduce_requantize(recv, n, hop1.spec, hop2.spec, key2)
        else:  # decode and sum (rotation kept), then encode with the residual
            partial = codec.reduce_dequantize(recv, n, hop1.spec)
            send2 = compensated(e_requant[:, off:off + n], partial,
                                *_encoder(hop2.spec, key2, False, n))
        off += n
        work2, recv2 = _a2a(send2, hop2.group, t2)
        if in_hop2 is not None:
            _finish_last_hop(out, in_hop2, hop2.spec, hadamard, finish)
        in_hop2 = (work2, send2, recv2, a, b)
    _finish_last_hop(out, in_hop2, hop2.spec, hadamard, finish)
    return t1, t2


__all__ = ["Divide", "PremulSum", "chunk_spans", "feedback_shapes", "feedback_sites", "premul_sum",
           "reduce_op_finisher", "reduce_scatter_plain", "reduce_scatter_quantized"]

"""Quantized all-reduce of one flat buffer among replicas: HSDP's cross-node gradient hop.

Same contract as ``dist.all_reduce(tensor, op, group)`` (in place), with the sum built from
quantized copies (no FSDP needed):

1. The ``m`` values are cut into ``R`` rows of ``c = ceil(m / R)`` (zero-padded to ``R * c``);
   row ``j`` is quantized (after the 32-point Hadamard rotation with ``hadamard=True``) and sent
   to replica ``j`` by one ``all_to_all_single``.
2. Replica ``j`` decodes the ``R`` rows it received, sums them in fp32 in source order and
   re-encodes the sum (``codec.reduce_requantize``; the rotation is kept, sums commute with it).
3. One ``all_gather_single`` of the re-encoded rows. Every replica, the owner of each row
   included, decodes the very same ``R`` rows with the same code (inverse rotation once), applies
   the op in fp32 and writes the ``m`` values. Every replica therefore ends with bit-identical
   values; none keeps its exact partial sum.

So each value crosses the replica group twice at the spec's width (``2 (R-1)/R`` rows of
``wire_bytes(c)`` per replica, where a ring all-reduce of fp32 sends ``2 (R-1)/R * 4m`` bytes).
Columns are split into spans aligned to the quantization groups (``chunks``, and as many as the
RNG counter range needs); the all-to-all of span ``s + 1`` is in flight while span ``s`` is
re-encoded and gathered. Group boundaries and bytes do not depend on the span count.

Stats: one ``CommStats`` record per call under ``kind`` (default ``"grad_replica"``):
``sent_bytes`` = the all-to-all send buffer (all ``R`` rows) plus this replica's all-gather row;
``recv_bytes`` = the all-to-all receive buffer plus the gathered rows; ``elements`` = the values
those sends carry, ``R * c + c`` (padding included, before Hadamard padding);
``baseline_bytes`` = what ``dist.all_reduce`` is handed (``m`` values in the tensor's dtype);
``cross_node_bytes`` = the rows addressed to replicas on other nodes (``remote_peers`` of them:
``R - 1`` when the placement is unknown).
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from .. import codec
from ..codec import RngKey
from ..codec._checks import FLOAT_DTYPES
from ..codec.wire import HADAMARD_BLOCK
from ..config import QuantSpec
from ..stats import CommStats
from . import _c10d
from .error_feedback import Feedback, Site, compensated, open_residuals
from .grad_reduce import _MAX_CALL_ELEMENTS, chunk_spans, reduce_op_finisher

KIND = "grad_replica"
# Keys of this collective never repeat a reduce-scatter's or a weight gather's stream.
_REPLICA_SALT = 1 << 41


def replica_key(seed: int, call: int, rank: int, bucket: int) -> RngKey:
    """The RNG key of call ``call`` of module ``bucket``'s replica all-reduce on global rank
    ``rank`` (independent of the reduce-scatter keys built from the same numbers)."""
    return RngKey(seed, call, rank, bucket).fold(_REPLICA_SALT)


def group_rank(group: Optional[ProcessGroup]) -> int:
    """This rank's index in ``group`` (None: the default group). ``ProcessGroup.rank()`` also
    answers for process groups ``torch.distributed`` has not registered (torchft's, whose
    members change with each quorum), where ``dist.get_rank(group)`` raises."""
    return dist.get_rank() if group is None else group.rank()


def replica_wire_bytes(m: int, replicas: int, spec: QuantSpec, hadamard: bool) -> int:
    """Bytes of one wire row (all-to-all and all-gather rows are equal) for ``m`` values in a
    single span: each replica sends ``R + 1`` such rows per call."""
    c = -(-m // replicas)
    return codec.wire_bytes(codec.hadamard_len(c) if hadamard else c, spec)


def all_reduce_quantized(
    tensor: torch.Tensor,
    group: Optional[ProcessGroup],
    spec: QuantSpec,
    key: RngKey,
    *,
    hadamard: bool = False,
    op: Union[ReduceOp, "ReduceOp.RedOpType"] = ReduceOp.SUM,
    chunks: int = 1,
    stats: Optional[CommStats] = None,
    kind: str = KIND,
    remote_peers: Optional[int] = None,
    feedback: Feedback = None,
) -> None:
    """Quantized in-place ``all_reduce`` of a flat float ``tensor`` over ``group`` (blocking).

    ``op``: SUM, AVG (sum / R) or PREMUL_SUM (sum * factor), applied once to the fp32 sum.
    ``key`` seeds stochastic rounding (pass a fresh one per call, e.g. ``replica_key``).
    ``remote_peers``: members of ``group`` on other nodes than this rank, for the stats.
    ``feedback``: error-feedback residuals of both encodings (``feedback_shapes``; the rows
    sent in the all-to-all, and the reduced row this replica re-encodes for the all-gather): a
    ``FeedbackState`` in this call's layout or a ``MappedFeedback`` (``error_feedback``).
    A quantization group holding NaN/Inf decodes as NaN on every replica.
    """
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"quantized all-reduce takes float32/bfloat16/float16, got {tensor.dtype}; use "
            "dist.all_reduce for other dtypes"
        )
    if not tensor.is_contiguous():
        raise ValueError("the all-reduced tensor must be contiguous: it is written in place")
    replicas = dist.get_world_size(group)
    finish = reduce_op_finisher(op, replicas)
    m = tensor.numel()
    if m == 0:
        return
    flat = tensor.view(-1)
    if replicas == 1:
        if finish is not None:
            flat.copy_(finish(flat.to(torch.float32)))
        return
    c = -(-m // replicas)
    # Rows of c values, one per replica. Without padding they are the tensor itself, and an fp32
    # tensor also takes the decoded sums: a span's columns are encoded (start) before they are
    # decoded into (decode), and no span reads another's, so reading and writing one buffer
    # gives the same bytes and values as separate ones without three passes over the gradient.
    padded = replicas * c != m
    if not padded:
        x = flat.view(replicas, c)
    else:
        x = torch.empty(replicas * c, dtype=tensor.dtype, device=tensor.device)
        x[:m].copy_(flat)
        x[m:].zero_()
        x = x.view(replicas, c)
    spans = _spans(c, replicas, spec, hadamard, chunks)
    index = group_rank(group)
    res, done = open_residuals(
        feedback, lambda n: feedback_sites(n, replicas, spec, hadamard, chunks, index), m,
        tensor.device)
    e_a2a, e_requant = res.get("a2a"), res.get("requant")
    in_place = not padded and tensor.dtype == torch.float32
    out = x if in_place else torch.empty(replicas, c, dtype=torch.float32, device=tensor.device)
    sent = recv = row = 0  # row: bytes of one a2a row plus one gathered row, over all spans

    def start(s: int):
        nonlocal sent, recv, row
        a, b = spans[s]
        enc, dec = _codec_pair(spec, key.fold(s).fold(1), hadamard, b - a)
        send = enc(x[:, a:b]) if e_a2a is None else compensated(e_a2a[:, a:b], x[:, a:b], enc,
                                                                 dec)
        got = torch.empty_like(send)
        work = dist.all_to_all_single(got, send, group=group, async_op=True)
        sent += send.numel()
        recv += got.numel()
        row += send.shape[-1]
        return work, send, got

    def gather(s: int, in_flight):
        nonlocal sent, recv, row
        work, _send, got = in_flight
        work.wait()
        a, b = spans[s]
        n = codec.hadamard_len(b - a) if hadamard else b - a
        if e_requant is None:
            mine = codec.reduce_requantize(got, n, spec, spec, key.fold(s).fold(2))
        else:  # decode and sum (rotation kept), then encode with the residual
            off = sum((codec.hadamard_len(q - p) if hadamard else q - p) for p, q in spans[:s])
            mine = compensated(e_requant[off:off + n], codec.reduce_dequantize(got, n, spec),
                               *_codec_pair(spec, key.fold(s).fold(2), False, n))
        every = torch.empty(replicas * mine.numel(), dtype=torch.uint8, device=tensor.device)
        gwork = _c10d.all_gather_single(every, mine, group=group, async_op=True)
        sent += mine.numel()
        recv += every.numel()
        row += mine.numel()
        return gwork, mine, every

    def decode(s: int, in_flight) -> None:
        gwork, _mine, every = in_flight
        gwork.wait()
        a, b = spans[s]
        rows = every.view(replicas, -1)
        codec.dequantize(rows, b - a, spec, hadamard=hadamard, out=out[:, a:b])

    hop1 = start(0)
    hop2 = None
    for s in range(len(spans)):
        cur = hop1
        if s + 1 < len(spans):
            hop1 = start(s + 1)
        nxt = gather(s, cur)
        if hop2 is not None:
            decode(s - 1, hop2)
        hop2 = nxt
    decode(len(spans) - 1, hop2)
    done()

    res = out.view(-1)[:m]
    if finish is not None:
        res = finish(res)  # in place
    if not in_place:
        flat.copy_(res)
    if stats is not None:
        remote = replicas - 1 if remote_peers is None else remote_peers
        base = m * tensor.element_size()
        stats.record(
            kind, sent_bytes=sent, recv_bytes=recv, elements=replicas * c + c,
            baseline_bytes=base, cross_node_bytes=remote * row,
            baseline_cross_node_bytes=2 * base * remote // replicas,
        )


def _spans(c: int, replicas: int, spec: QuantSpec, hadamard: bool,
           chunks: int) -> list[tuple[int, int]]:
    padded = codec.hadamard_len(c) if hadamard else c
    align = math.lcm(spec.group_size, HADAMARD_BLOCK) if hadamard else spec.group_size
    return chunk_spans(c, max(chunks, -(-replicas * padded // _MAX_CALL_ELEMENTS)), align)


def _codec_pair(spec: QuantSpec, key: RngKey, hadamard: bool, n: int):
    return (lambda t: codec.quantize(t, spec, key, hadamard=hadamard),
            lambda w: codec.dequantize(w, n, spec, hadamard=hadamard))


def feedback_shapes(m: int, replicas: int, spec: QuantSpec, hadamard: bool,
                    chunks: int = 1) -> dict[str, tuple[int, ...]]:
    """Error-feedback residuals of one call on each replica: ``"a2a"`` ``[R, c]`` (the rows it
    sends) and ``"requant"`` ``[P]`` (its reduced row, rotated, ``P`` the Hadamard-padded span
    lengths), ``c = ceil(m / R)``: ``(R + 1) c`` fp32 values, about ``(1 + 1/R) m``."""
    return {s: g.shape for s, g in feedback_sites(m, replicas, spec, hadamard, chunks).items()}


def feedback_sites(m: int, replicas: int, spec: QuantSpec, hadamard: bool, chunks: int = 1,
                   index: int = 0) -> dict[str, Site]:
    """``feedback_shapes`` with what each buffer holds (``error_feedback.Site``) on the replica
    of group rank ``index``: ``"a2a"`` holds a residual for every value (value ``k`` at row
    ``k // c``, column ``k % c``); ``"requant"`` for the values of the row this replica
    reduces, ``[index * c, (index + 1) * c)``, stored Hadamard-rotated per span with
    ``hadamard``. Which replica reduces a value depends on the layout, so a value whose row
    changes owner leaves its ``"requant"`` residual with the replica that holds it."""
    if replicas == 1 or m == 0:
        return {}
    c = -(-m // replicas)
    lo = index * c
    width = max(0, min(c, m - lo))
    if hadamard:
        rotated, off = [], 0
        for a, b in _spans(c, replicas, spec, hadamard, chunks):
            rotated.append((a, b, off))
            off += codec.hadamard_len(b - a)
        requant = Site((off,), 1, lo, width, tuple(rotated))
    else:
        requant = Site((c,), 1, lo, width)
    return {"a2a": Site((replicas, c), 1, 0, m), "requant": requant}


def all_reduce_plain(
    tensor: torch.Tensor,
    group: Optional[ProcessGroup],
    *,
    op: Union[ReduceOp, "ReduceOp.RedOpType"] = ReduceOp.SUM,
    stats: Optional[CommStats] = None,
    kind: str = KIND,
    remote_peers: Optional[int] = None,
) -> None:
    """An unquantized in-place ``dist.all_reduce`` (SUM, then ``op`` in fp32) that reports its
    bytes like ``all_reduce_quantized``: the reference point for the gain of quantization alone.
    ``cross_node_bytes`` counts what a bandwidth-optimal all-reduce sends to remote replicas
    (a reduce-scatter and an all-gather, each ``(R - 1) / R`` of the buffer: ``2 m / R`` values
    per remote replica). Any floating dtype (float64 gradients too)."""
    replicas = dist.get_world_size(group)
    finish = reduce_op_finisher(op, replicas)
    if tensor.numel() == 0:
        return
    if replicas > 1:
        dist.all_reduce(tensor, op=ReduceOp.SUM, group=group)
    if finish is not None:  # float64 sums stay float64
        tensor.copy_(finish(tensor.to(torch.promote_types(tensor.dtype, torch.float32))))
    if stats is not None and replicas > 1:
        nbytes = tensor.numel() * tensor.element_size()
        remote = replicas - 1 if remote_peers is None else remote_peers
        cross = 2 * nbytes * remote // replicas
        stats.record(kind, sent_bytes=nbytes, recv_bytes=nbytes, elements=tensor.numel(),
                     baseline_bytes=nbytes, cross_node_bytes=cross,
                     baseline_cross_node_bytes=cross)


__all__ = ["KIND", "all_reduce_plain", "all_reduce_quantized", "feedback_shapes", "feedback_sites",
           "group_rank", "replica_key", "replica_wire_bytes"]

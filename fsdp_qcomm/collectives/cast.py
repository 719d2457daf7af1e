"""bf16 exchanges: collectives that send values rounded to bfloat16 and sum in fp32.

The conservative middle between fp32 and 4 bits (the ``bf16`` preset), and the wire of what GPU
users run (FSDP2 with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32 or bf16)``)
reproduced for fp32 models, so that a CPU cluster, where bf16 arithmetic is slow, can time it.

* ``cast_all_gather``: this rank's shard rounded to bf16 (round to nearest even, as
  ``Tensor.to``), one all-gather of the bf16 shards, every slot (the own one included) written
  back in the all-gather dtype: every rank computes with the same bf16-rounded weights. A shard
  already in bf16 (or narrower) goes as it is.
* ``reduce_scatter_cast``: each destination row rounded to bf16, one all-to-all, and the
  receiver sums the rows it got in fp32, in source order (VeOmni's low-precision reduce-scatter:
  the same bytes as a bf16 reduce-scatter, without its bf16 partial sums).
* ``all_reduce_cast``: HSDP's replica hop the same way: the buffer cut into ``R`` rows, a bf16
  all-to-all, an fp32 sum per row, the sums rounded to bf16 and all-gathered; every replica
  decodes the same bytes, so replicas stay bit-identical.

The wire is the raw bf16 bytes, passed to the process group as ``uint8`` (gloo takes any
dtype as bytes for these collectives). Stats as the quantized collectives: ``sent_bytes`` the
send buffers, ``baseline_bytes`` what the unquantized collective is handed in the input's dtype,
``cross_node_bytes`` the rows addressed to ranks on other nodes.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from ..codec import FLOAT_DTYPES
from ..stats import CommStats
from . import _c10d
from .grad_reduce import _check_buffers, reduce_op_finisher
from .topology import Topology
from .weight_gather import GatherOutcome, OnDone, _check_shapes, _launch, plain_all_gather

WIRE_DTYPE = torch.bfloat16


def _narrower(dtype: torch.dtype, wire: torch.dtype) -> bool:
    """Whether sending ``dtype`` values as ``wire`` saves bytes."""
    return dtype in FLOAT_DTYPES and torch.empty((), dtype=dtype).element_size() > \
        torch.empty((), dtype=wire).element_size()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def cast_all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Optional[ProcessGroup] = None,
    *,
    wire_dtype: torch.dtype = WIRE_DTYPE,
    async_op: bool = False,
    on_done: OnDone = None,
) -> Optional[dist.Work]:
    """All-gather of flat shards sent as ``wire_dtype`` (layout of ``all_gather_single``;
    ``input`` may be the output's own slot). Reports mode ``"cast"``."""
    if not _narrower(input.dtype, wire_dtype):
        return plain_all_gather(output, input, group, async_op=async_op, on_done=on_done)
    world = dist.get_world_size(group)
    n = _check_shapes(output, input, world)
    base = n * input.element_size()
    if world == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        if on_done is not None:
            on_done(GatherOutcome("local", 0, 0, n, base))
        return None
    wire = _bytes(input.to(wire_dtype))
    gathered = torch.empty(world * wire.numel(), dtype=torch.uint8, device=input.device)

    def finish() -> None:
        output.copy_(gathered.view(wire_dtype))
        if on_done is not None:
            on_done(GatherOutcome("cast", wire.numel(), gathered.numel(), n, base))

    return _launch(gathered, wire, group, async_op, finish)


def reduce_scatter_cast(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Optional[ProcessGroup],
    *,
    wire_dtype: torch.dtype = WIRE_DTYPE,
    op: Union[ReduceOp, "ReduceOp.RedOpType"] = ReduceOp.SUM,
    stats: Optional[CommStats] = None,
    topology: Optional[Topology] = None,
) -> None:
    """``reduce_scatter_single`` with ``wire_dtype`` rows on the wire and an fp32 sum at the
    receiver (``op`` applied after it, as the quantized reduce-scatter does). Blocking."""
    world = dist.get_world_size(group)
    _check_buffers(output, input, world)
    finish = reduce_op_finisher(op, world)
    m = output.numel()
    if m == 0:
        return
    x = input.reshape(world, m)
    if world == 1:
        res = x[0].to(torch.float32)
        output.view(-1).copy_(finish(res.clone()) if finish is not None else res)
        return
    send = _bytes(x.to(wire_dtype))
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    rows = recv.view(wire_dtype).view(world, m)
    acc = rows[0].to(torch.float32)
    for j in range(1, world):
        acc += rows[j].to(torch.float32)
    output.view(-1).copy_(finish(acc) if finish is not None else acc)
    if stats is not None:
        lay = topology.layout if topology is not None else None
        remote = world - 1 if lay is None else lay.remote_peers
        kind = "grad_inter" if lay is None or lay.num_nodes > 1 else "grad_intra"
        base = input.numel() * output.element_size()
        stats.record(kind, sent_bytes=send.numel(), recv_bytes=recv.numel(),
                     elements=world * m, baseline_bytes=base,
                     cross_node_bytes=send.numel() * remote // world,
                     baseline_cross_node_bytes=base * remote // world)


def all_reduce_cast(
    tensor: torch.Tensor,
    group: Optional[ProcessGroup],
    *,
    wire_dtype: torch.dtype = WIRE_DTYPE,
    op: Union[ReduceOp, "ReduceOp.RedOpType"] = ReduceOp.SUM,
    stats: Optional[CommStats] = None,
    kind: str = "grad_replica",
    remote_peers: Optional[int] = None,
) -> None:
    """In-place all-reduce among replicas with ``wire_dtype`` on the wire both ways (module
    docstring); the result is the bf16 rounding of the fp32 sum, then ``op`` in fp32, the same
    on every replica."""
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(f"all_reduce_cast takes float32/bfloat16/float16, got {tensor.dtype}")
    replicas = dist.get_world_size(group)
    finish = reduce_op_finisher(op, replicas)
    m = tensor.numel()
    if m == 0:
        return
    if replicas == 1:
        if finish is not None:
            tensor.copy_(finish(tensor.to(torch.float32)))
        return
    c = -(-m // replicas)
    flat = torch.zeros(replicas * c, dtype=torch.float32, device=tensor.device)
    flat[:m] = tensor.reshape(-1)
    send = _bytes(flat.to(wire_dtype))
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    rows = recv.view(wire_dtype).view(replicas, c)
    acc = rows[0].to(torch.float32)
    for j in range(1, replicas):
        acc += rows[j].to(torch.float32)
    mine = _bytes(acc.to(wire_dtype))
    gathered = torch.empty(replicas * mine.numel(), dtype=torch.uint8, device=tensor.device)
    _c10d.all_gather_single(gathered, mine, group=group)
    res = gathered.view(wire_dtype)[:m].to(torch.float32)
    tensor.copy_((finish(res) if finish is not None else res).view(tensor.shape))
    if stats is not None:
        remote = replicas - 1 if remote_peers is None else remote_peers
        row = mine.numel()
        base = m * tensor.element_size()
        stats.record(kind, sent_bytes=send.numel() + row, recv_bytes=recv.numel() +
                     gathered.numel(), elements=replicas * c + c,
                     baseline_bytes=base, cross_node_bytes=2 * row * remote,
                     baseline_cross_node_bytes=2 * base * remote // replicas)


__all__ = ["WIRE_DTYPE", "all_reduce_cast", "cast_all_gather", "reduce_scatter_cast"]

"""The consistency guard: do all ranks compute with the same weights?

Quantized gathers are correct only while every rank decodes the same bytes into the same
reference; a flipped bit, a rank that skipped an update or a bug would make ranks train
different models without any error. With ``QCommConfig.consistency_check_every = K`` every K-th
forward gather of each FSDP module checksums the gathered (unsharded) buffer, per parameter,
and all ranks of the module's group compare their checksums, together with the gather
decisions so far (the module's RNG key counter and weight generation: ranks that decided
differently whether to send would otherwise only show up as a hang or as drifting weights);
under HSDP the replicas of the group compare them too (they must compute with the same
weights). Where the model's meshes hold more ranks than the group (HSDP's other shard groups,
tensor parallelism's other columns), one all-reduce of a flag in root forwards makes a group's
verdict every rank's (``stop_everywhere``), so no rank goes on alone.

Checksum: the raw bits of each value (fp32 as int32, bf16/fp16 as int16), split into 16-bit
halves, summed plainly and weighted by position (``index % 251 + 1``) in int64. Integer sums are
exact and independent of the reduction order, so equal buffers give equal checksums on any
device, NaN payloads included, and a single changed bit or two swapped values change them. Each
term is below 2^24, so no overflow before 2^39 values per parameter. Cost per check: a few
elementwise passes over the module's unsharded buffer and one all-gather of ``4 * params + 2``
int64 values.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..codec import BITS_DTYPE

_INT_VIEW = {**BITS_DTYPE, torch.float64: torch.int64}


def _bits(x: torch.Tensor) -> list[torch.Tensor]:
    """The value bits of ``x`` as non-negative int64 pieces of at most 16 bits each."""
    if x.dtype == torch.uint8:
        return [x.to(torch.int64)]
    v = x.contiguous().view(_INT_VIEW[x.dtype]).to(torch.int64)
    width = 8 * x.element_size()
    return [(v >> s) & 0xFFFF for s in range(0, width, 16)]


def weight_checksums(flat: torch.Tensor, world: int, segments: Sequence[int]) -> torch.Tensor:
    """Checksums of a gathered FSDP buffer (``world`` slots of ``sum(segments)`` values), one row
    per segment (parameter), covering that parameter's slice in every slot: int64[S, 2 * pieces]."""
    n = sum(segments)
    slots = flat.view(world, n)
    rows = []
    off = 0
    for s in segments:
        part = slots[:, off:off + s].reshape(-1)
        w = torch.arange(part.numel(), device=part.device, dtype=torch.int64) % 251 + 1
        row = []
        for piece in _bits(part):
            row.append(piece.sum())
            row.append((piece * w).sum())
        rows.append(torch.stack(row))
        off += s
    return torch.stack(rows)


def consistency_error(
    flat: torch.Tensor,
    world: int,
    segments: Sequence[int],
    names: Sequence[str],
    group: dist.ProcessGroup,
    where: str,
    decisions: Sequence[int] = (),
) -> Optional[str]:
    """Compare ``weight_checksums`` and the integers ``decisions`` (what the gathers decided so
    far, e.g. the RNG key counter) across ``group``; the message naming what differs first, or
    None. Every rank sees the same gathered values, so either all ranks get a message or none
    does. Collective: callers that run several comparisons must run all of them before raising,
    or a peer is left waiting in the next one."""
    sums = weight_checksums(flat, world, segments)
    extra = torch.tensor([int(d) for d in decisions], dtype=torch.int64, device=sums.device)
    mine = torch.cat([extra, sums.reshape(-1)])
    every = [torch.empty_like(mine) for _ in range(group.size())]
    dist.all_gather(every, mine, group=group)
    every = [e.cpu() for e in every]
    nd = len(decisions)
    bad = [r for r in range(len(every)) if not torch.equal(every[r][:nd], every[0][:nd])]
    if bad:
        return (
            f"fsdp_qcomm consistency check failed at {where}: the ranks took different gather "
            f"decisions (RNG key counter, weight generation): group rank 0 has "
            f"{every[0][:nd].tolist()}, group rank(s) {bad} have "
            f"{[every[r][:nd].tolist() for r in bad]}. Every rank must decide from the same "
            "facts; a parameter written on some ranks only (or a bug in fsdp_qcomm) breaks "
            "that. Resume from the last checkpoint and report it."
        )
    every = [e[nd:].view(sums.shape) for e in every]
    for k, name in enumerate(names):
        bad = [r for r in range(len(every)) if not torch.equal(every[r][k], every[0][k])]
        if bad:
            return (
                f"fsdp_qcomm consistency check failed at {where}: the gathered weights of "
                f"parameter {name!r} differ between group rank 0 and group rank(s) {bad}, so the "
                "ranks are training different models. Resume from the last checkpoint (or call "
                "handle.reset() on every rank to resend full-precision weights) and report it: "
                "this is a bug or memory corruption, not a numerical effect."
            )
    return None


def stop_everywhere(msg: Optional[str], device: torch.device,
                    wide: Optional[dist.ProcessGroup], where: str) -> Optional[str]:
    """``msg`` (this rank's verdict), or, if another rank of ``wide`` (every rank of the model's
    meshes, ``enable``'s agreement group; None: the world) found a difference, a message saying
    so. A comparison covers one shard group (and its HSDP replicas): other tensor-parallel
    columns or shard groups compared other ranks, whose verdict this rank would not see, and it
    would go on into a collective they never reach. One all-reduce of a flag over ``wide``."""
    flag = torch.tensor([int(msg is not None)], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=wide)
    if msg is None and int(flag.item()):
        return (f"fsdp_qcomm consistency check failed at {where} on another rank of the model's "
                "meshes (its error names the parameter and ranks), so every rank stops. Resume "
                "from the last checkpoint and report it.")
    return msg


__all__ = ["consistency_error", "stop_everywhere", "weight_checksums"]

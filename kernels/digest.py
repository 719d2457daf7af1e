"""The change tracker's shard digests in one pass (``fsdp.change_tracker.shard_digests``).

The digest of flat values ``x`` at positions ``off, off + 1, ...`` is the sum of each value's
raw bits, sign-extended to 64 bits, times ``(position % 65521) + 1``, modulo 2^64. The torch
formula takes six passes with int64 temporaries (about 84 bytes moved per 4-byte value, seven
launches per parameter: 4 ms and 1,000 launches per step of a 1.5B model on 8 ranks,
``results/gpu_codec_model``). This kernel reads each value once, and one launch covers the
shards of every FSDP group the agreement asks about, whose addresses, positions and output
slots a table built once per layout gives. Each program sums ``BLOCK`` values in wrapping int64
and adds its sum into its tensor's slot of an int64 vector with an atomic add: integer sums wrap
alike in any order, so each value is exact and the same on every run, equal to the C loop's
(``codec.cpu_native.digest``) and the torch formula's.
"""

from __future__ import annotations

import functools
import itertools
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from . import _common as C

PRIME = 65521
#: values per program; below the prime, so a program's weights wrap around it at most once
BLOCK = 4096
#: raw-bit widths by dtype (the integer the bits are read as)
INT_BITS = {torch.float32: 32, torch.float64: 64, torch.bfloat16: 16, torch.float16: 16,
            torch.int16: 16, torch.int32: 32, torch.int64: 64}


@triton.jit
def _digest_many_kernel(tab, blk_shard, out_ptr, IBITS: tl.constexpr, BLOCK: tl.constexpr,
                        P: tl.constexpr):
    """``BLOCK`` values of one tensor: the tensor is ``blk_shard[program]``, whose address,
    length, first position, first program and output slot are ``tab[tensor, 0:5]``. Raw bits
    are read as integers of their width, summed in wrapping int64 with their position weights,
    and the sum added into ``out_ptr[slot]`` atomically."""
    pid = tl.program_id(0)
    t = tab + tl.load(blk_shard + pid).to(tl.int64) * 5
    ptr, n, off, first = tl.load(t), tl.load(t + 1), tl.load(t + 2), tl.load(t + 3)
    slot = tl.load(t + 4)
    blk = (pid - first).to(tl.int64)
    i = blk * BLOCK + tl.arange(0, BLOCK)
    if IBITS == 16:
        b = tl.load(ptr.to(tl.pointer_type(tl.int16)) + i, mask=i < n, other=0).to(tl.int64)
    elif IBITS == 32:
        b = tl.load(ptr.to(tl.pointer_type(tl.int32)) + i, mask=i < n, other=0).to(tl.int64)
    else:
        b = tl.load(ptr.to(tl.pointer_type(tl.int64)) + i, mask=i < n, other=0)
    w0 = ((off % P + (blk * BLOCK) % P) % P).to(tl.int32)
    w = w0 + tl.arange(0, BLOCK)
    w = tl.where(w >= P, w - P, w) + 1
    tl.atomic_add(out_ptr + slot, tl.sum(b * w.to(tl.int64), axis=0))


@functools.lru_cache(maxsize=256)
def _table(layout: tuple, device: str):
    """(rows of address, length, first position, first program, slot; program -> tensor;
    programs; the copy's event) for tensors at ``layout`` ((address, length, first position,
    slot) each), on ``device``: built once per layout, since FSDP keeps its shards where they
    are (``C.table_to``)."""
    rows, blk_shard = [], []
    for ptr, n, off, slot in layout:
        if n:
            rows.append([ptr, n, off, len(blk_shard), slot])
            blk_shard += [len(rows) - 1] * C.cdiv(n, BLOCK)
    tab, idx, done = C.table_to(device, torch.tensor(rows or [[0] * 5], dtype=torch.int64),
                                torch.tensor(blk_shard, dtype=torch.int32))
    return tab, idx, len(blk_shard), done


def digest_many(shards: Sequence[torch.Tensor], out: torch.Tensor,
                positions: Optional[Sequence[int]] = None,
                slots: Optional[Sequence[int]] = None) -> None:
    """Adds the digest of each of ``shards``, its first value at ``positions[i]`` (default:
    back to back from 0), into ``out.view(-1)[slots[i]]`` (default: 0), ``out`` int64 on their
    device; one launch, asynchronous on CUDA (no host read); the shards as ``supports``
    requires."""
    if not shards:
        return
    if not supports(shards):
        raise ValueError("digest_many reads contiguous tensors of one element width from "
                         f"{sorted(map(str, INT_BITS))}; got "
                         f"{[(str(x.dtype), x.is_contiguous()) for x in shards]}")
    if positions is None:
        positions = [0, *itertools.accumulate(x.numel() for x in shards[:-1])]
    if slots is None:
        slots = [0] * len(shards)
    if not len(positions) == len(slots) == len(shards) or not (
            out.dtype == torch.int64 and out.is_contiguous()
            and all(0 <= k < out.numel() for k in slots)):
        raise ValueError(f"digest_many: one position and one slot of the contiguous int64 out "
                         f"({out.dtype}, {out.numel()} values) per shard; got "
                         f"{len(positions)} positions and slots {list(slots)} for "
                         f"{len(shards)} shards")
    tab, idx, nblk, done = _table(tuple((x.data_ptr(), x.numel(), int(p), int(k))
                                        for x, p, k in zip(shards, positions, slots)),
                                  str(out.device))
    if nblk == 0:
        return
    C.wait_for(done, out.device, tab, idx)
    with C.on_device(out):
        _digest_many_kernel[(nblk,)](tab, idx, out, IBITS=INT_BITS[shards[0].dtype],
                                     BLOCK=BLOCK, P=PRIME, **C.launch_opts(BLOCK))


def supports(shards: Sequence[torch.Tensor]) -> bool:
    """Whether ``digest_many`` reads these tensors: contiguous, of dtypes in ``INT_BITS``, all
    of one element width."""
    return (all(x.dtype in INT_BITS and x.is_contiguous() for x in shards)
            and len({INT_BITS[x.dtype] for x in shards}) <= 1)

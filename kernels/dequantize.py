"""Fused dequantize: unpack codes, scale (and shift), optional inverse Hadamard-32, optional
accumulate into an output of any float dtype (qWD receive: ``ref += d``).

Element-tiled: one program decodes ``BLK8`` 8-blocks of one row, reading each block's scale by
group index, so any group size works. Torch twin: ``torch_codec.dequantize``.

``dequantize_segments`` decodes rows made of several wire rows back to back (a weight shard's
parameters, each encoded on its own: ``collectives.weight_gather``) in one launch instead of one
per segment: a table, built once per layout, tells each program its segment.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from ..codec import wire
from ..config import QuantSpec
from . import _common as C


@triton.jit
def _dequantize_kernel(
    data_b, data_s, out_ptr, n, m, W, WS, G, out_stride, nblk,
    BITS: tl.constexpr, QMAX: tl.constexpr, SYM: tl.constexpr, SKIND: tl.constexpr,
    GS: tl.constexpr, BLK8: tl.constexpr, HADAMARD: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    row, blk, row64 = C.row_block(nblk)
    e8 = blk * BLK8 + tl.arange(0, BLK8)
    v = C.decode8(data_b + row64 * W, data_s + row64 * WS, e8, e8 * 8 < m, G,
                  BITS, QMAX, SYM, SKIND, GS)
    if HADAMARD:
        v = C.hadamard_blocks(v, BLK8 // 4)
        v = v * (1.0 / 32)
    C.write_values(out_ptr, row64, out_stride, e8, v, n, ACCUMULATE)


@triton.jit
def _dequantize_segments_kernel(
    data_b, data_s, out_ptr, seg_tab, blk_seg, W, WS, out_stride, nblk, base_ptr, base_row,
    BITS: tl.constexpr, QMAX: tl.constexpr, SYM: tl.constexpr, SKIND: tl.constexpr,
    GS: tl.constexpr, BLK8: tl.constexpr, HADAMARD: tl.constexpr, ACCUMULATE: tl.constexpr,
    ALIGNED: tl.constexpr, BASE: tl.constexpr,
):
    """``_dequantize_kernel`` on segment ``blk_seg[blk]`` of the row: its first block, values,
    encoded length, wire offset, output offset and groups are ``seg_tab[segment, 0:6]``
    (``ALIGNED``: as in ``quantize._quantize_segments_kernel``). ``BASE``: row ``base_row``
    adds into ``base_ptr`` (one row) instead of its own output row, and both take the sums."""
    row, blk, row64 = C.row_block(nblk)
    t = seg_tab + tl.load(blk_seg + blk).to(tl.int64) * 6
    first, n, m, G = C.segment_sizes(t)
    woff, off = tl.load(t + 3), tl.load(t + 4)
    n, m, off, woff = C.segment_hints(n, m, off, woff, ALIGNED)
    SBYTES: tl.constexpr = 4 if SKIND == 0 else 2
    e8 = (blk - first) * BLK8 + tl.arange(0, BLK8)
    v = C.decode8(data_b + row64 * W + woff, data_s + row64 * WS + woff // SBYTES, e8,
                  e8 * 8 < m, G, BITS, QMAX, SYM, SKIND, GS)
    if HADAMARD:
        v = C.hadamard_blocks(v, BLK8 // 4)
        v = v * (1.0 / 32)
    if BASE:
        if row == base_row:
            C.write_values(out_ptr + off, row64, out_stride, e8, v, n, ACCUMULATE, base_ptr + off)
        else:
            C.write_values(out_ptr + off, row64, out_stride, e8, v, n, ACCUMULATE)
    else:
        C.write_values(out_ptr + off, row64, out_stride, e8, v, n, ACCUMULATE)


@functools.lru_cache(maxsize=1024)
def _segment_table(segments: tuple, spec: QuantSpec, hadamard: bool, blk8: int, device: str):
    """(table int64 [S, 6], block -> segment int32, blocks per row, row bytes, whether every
    segment is ``C.aligned_segment``, the tables' copy event: ``C.table_to``) of a layout."""
    rows, blk_seg, woff, off, aligned = [], [], 0, 0, True
    for n in segments:
        m = wire.hadamard_len(n) if hadamard else n
        if n:
            C.check_row_len(m, spec.group_size)
            lay = C.RowLayout.of(m, spec)
            nblk = C.cdiv(C.cdiv(n, 8), blk8)
            rows.append([len(blk_seg), n, m, woff, off, lay.groups])
            aligned &= C.aligned_segment(n, off, woff)
            blk_seg += [len(rows) - 1] * nblk
            woff += lay.width
        off += n
    tab, idx, done = C.table_to(device, torch.tensor(rows or [[0] * 6], dtype=torch.int64),
                                torch.tensor(blk_seg, dtype=torch.int32))
    return tab, idx, len(blk_seg), woff, aligned, done


def dequantize_segments(
    data: torch.Tensor,
    segments: tuple,
    spec: QuantSpec,
    hadamard: bool,
    out: torch.Tensor,
    accumulate: bool,
    row_base: Optional[tuple[int, torch.Tensor]] = None,
) -> torch.Tensor:
    """Rows of back-to-back wire rows of ``segments`` values each -> written (or added) into
    ``out`` [R, sum(segments)]: ``dequantize`` of each segment into its columns, one launch.
    ``row_base`` ``(r, base)`` (with ``accumulate``): row ``r`` adds into the flat ``base``
    instead of into ``out[r]``, and both take the sums (``codec.dequantize_segments``)."""
    R = data.shape[0]
    blk8 = C.TILE // 8
    tab, blk_seg, nblk, width, aligned, done = _segment_table(tuple(segments), spec, hadamard,
                                                              blk8, str(data.device))
    if data.shape[1] != width:
        raise ValueError(f"data rows have {data.shape[1]} bytes but segments {segments} under "
                         f"{spec} take {width}")
    if R == 0 or nblk == 0:
        return out
    if out.stride(-1) != 1 or (row_base is not None and row_base[1].stride(-1) != 1):
        # the kernel writes unit-stride rows
        o = out.contiguous()
        b = None if row_base is None else (row_base[0], row_base[1].contiguous())
        dequantize_segments(data, segments, spec, hadamard, o, accumulate, b)
        if b is not None and b[1] is not row_base[1]:
            row_base[1].copy_(b[1])
        return out.copy_(o)
    data = C.aligned_rows(data, spec)
    lay = C.RowLayout.of(max(segments), spec)  # constexprs only: they do not depend on n
    C.wait_for(done, data.device, tab, blk_seg)
    with C.on_device(data):
        _dequantize_segments_kernel[(R * nblk,)](
            data, C.scale_view(data, spec), out, tab, blk_seg, width,
            width // spec.torch_scale_dtype.itemsize, out.stride(0), nblk,
            out if row_base is None else row_base[1], -1 if row_base is None else row_base[0],
            **lay.constexprs(), BLK8=blk8, HADAMARD=hadamard, ACCUMULATE=accumulate,
            ALIGNED=aligned, BASE=row_base is not None, **C.launch_opts(C.TILE),
        )
    return out


def dequantize(
    data: torch.Tensor,
    n: int,
    spec: QuantSpec,
    hadamard: bool = False,
    out: Optional[torch.Tensor] = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """uint8 wire rows [R, W] -> [R, n] (fp32, or written/added into ``out``); same values as
    ``torch_codec.dequantize``."""
    if accumulate and out is None:
        raise ValueError("accumulate=True needs out= (the tensor to add into)")
    R = data.shape[0]
    m = wire.hadamard_len(n) if hadamard else n
    lay = C.RowLayout.of(m, spec)
    if data.shape[1] != lay.width:
        raise ValueError(f"data rows have {data.shape[1]} bytes but {m} values under {spec} "
                         f"take {lay.width}")
    dst = out if out is not None else torch.empty(R, n, dtype=torch.float32, device=data.device)
    if R == 0 or n == 0:
        return dst
    C.check_row_len(m, spec.group_size)
    o = dst if dst.stride(-1) == 1 else torch.empty_like(dst, memory_format=torch.contiguous_format)
    if o is not dst and accumulate:
        o.copy_(dst)
    data = C.aligned_rows(data, spec)
    blk8 = C.TILE // 8
    nblk = C.cdiv(C.cdiv(n, 8), blk8)
    with C.on_device(data):
        _dequantize_kernel[(R * nblk,)](
            data, C.scale_view(data, spec), o, n, m, lay.width, lay.scale_words, lay.groups,
            o.stride(0), nblk, **lay.constexprs(), BLK8=blk8, HADAMARD=hadamard,
            ACCUMULATE=accumulate, **C.launch_opts(C.TILE),
        )
    if o is not dst:
        dst.copy_(o)
    return dst

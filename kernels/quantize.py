"""Fused quantize: (x - ref), optional Hadamard-32, per-group scales, rounding, bit packing.

One program encodes ``GPB`` whole groups of one row (groups up to ``GROUP_TILE`` elements;
held as 8-blocks, or with the rotation as one row per group: ``_common.flat_tile``) or one large
group in two passes over sub-tiles (statistics, then codes). Torch twin: ``torch_codec.quantize``.
"""

from __future__ import annotations

import functools
import sys
from typing import Optional

import torch
import triton
import triton.language as tl

from ..codec import wire
from ..codec._checks import require_key
from ..codec.rng import RngKey, check_counter_range
from ..config import QuantSpec
from . import _common as C


@triton.jit
def _values(x_row, r_row, i, lmask, HAS_REF: tl.constexpr, HADAMARD: tl.constexpr,
            M32: tl.constexpr):
    """fp32 x (- ref) at element indices i [A, B, 8], then H32 on consecutive 32-blocks."""
    v = C.load_f32(x_row + i, lmask)
    if HAS_REF:
        v = v - C.load_f32(r_row + i, lmask)
    if HADAMARD:
        v = C.hadamard_blocks(v, M32)
    return v


@triton.jit
def _encode_groups(
    x_row, r_row, row_b, row_s, g0, n, m, G, row, k0, k1,
    BITS: tl.constexpr, QMAX: tl.constexpr, SYM: tl.constexpr, SKIND: tl.constexpr,
    GS: tl.constexpr, GS_P2: tl.constexpr, GPB: tl.constexpr, SUB: tl.constexpr,
    STOCH: tl.constexpr, HAS_REF: tl.constexpr, HADAMARD: tl.constexpr, FLAT: tl.constexpr,
):
    """Encode the groups ``g0 + arange(GPB)`` of one row (``row``: its index, for the RNG
    counters)."""
    grp = g0 + tl.arange(0, GPB)
    gmask = grp < G
    NB8: tl.constexpr = SUB // 8
    M32: tl.constexpr = GPB * SUB // 32
    if SUB == GS_P2:
        # Whole groups in registers: one load, statistics, codes.
        if FLAT:
            v, i, valid, inside = C.flat_group_tile(x_row, r_row, g0, G, n, m, GPB, GS, SUB,
                                                    BITS, HAS_REF)
            if HADAMARD:
                v = C.hadamard_blocks(v, M32)
            e8, e8_ok = g0 * (GS // 8), inside  # the tile's first 8-block (encode_codes)
        else:
            e8, e8_ok, i, valid = C.group_tile(grp, gmask, 0, m, GS, NB8)
            v = _values(x_row, r_row, i, valid & (i < n), HAS_REF, HADAMARD, M32)
        bad, lo, hi = C.group_stats(v, valid, SYM)
        scale, mins = C.group_scales(lo, hi, QMAX, SYM, SKIND)
        C.store_scales(row_s, grp, gmask, G, scale, mins, bad, SYM, SKIND)
        C.encode_codes(v, valid, i, e8, e8_ok, row, m, row_b, G, scale, mins, bad, k0, k1,
                       BITS, QMAX, SYM, SKIND, STOCH, GS)
    else:
        # One group larger than a tile (GPB == 1): statistics over sub-tiles, then codes.
        NSUB: tl.constexpr = (GS + SUB - 1) // SUB
        bad = tl.zeros([GPB], tl.int32)
        lo = tl.full([GPB], float("inf"), tl.float32)
        hi = tl.full([GPB], -float("inf"), tl.float32)
        for s in range(NSUB):
            e8, e8_ok, i, valid = C.group_tile(grp, gmask, s, m, GS, NB8)
            v = _values(x_row, r_row, i, valid & (i < n), HAS_REF, HADAMARD, M32)
            b_, l_, h_ = C.group_stats(v, valid, SYM)
            bad = tl.maximum(bad, b_)
            lo = tl.minimum(lo, l_)
            hi = tl.maximum(hi, h_)
        scale, mins = C.group_scales(lo, hi, QMAX, SYM, SKIND)
        C.store_scales(row_s, grp, gmask, G, scale, mins, bad, SYM, SKIND)
        for s in range(NSUB):
            e8, e8_ok, i, valid = C.group_tile(grp, gmask, s, m, GS, NB8)
            v = _values(x_row, r_row, i, valid & (i < n), HAS_REF, HADAMARD, M32)
            C.encode_codes(v, valid, i, e8, e8_ok, row, m, row_b, G, scale, mins, bad, k0, k1,
                           BITS, QMAX, SYM, SKIND, STOCH, GS)


@triton.jit
def _quantize_kernel(
    x_ptr, r_ptr, out_b, out_s, src_rows, n, m, x_stride, r_stride, W, WS, G, nblk, k0, k1,
    BITS: tl.constexpr, QMAX: tl.constexpr, SYM: tl.constexpr, SKIND: tl.constexpr,
    GS: tl.constexpr, GS_P2: tl.constexpr, GPB: tl.constexpr, SUB: tl.constexpr,
    STOCH: tl.constexpr, HAS_REF: tl.constexpr, HADAMARD: tl.constexpr, FLAT: tl.constexpr,
    ORDERED: tl.constexpr,
):
    """Output row ``row`` encodes input row ``row``, or with ``ORDERED`` input row
    ``src_rows[row]``, with that input row's random numbers (``quantize_ordered``)."""
    row, blk, row64 = C.row_block(nblk)
    src, src64 = row, row64
    if ORDERED:
        src = tl.load(src_rows + row)
        src64 = src.to(tl.int64)
    _encode_groups(x_ptr + src64 * x_stride, r_ptr + src64 * r_stride, out_b + row64 * W,
                   out_s + row64 * WS, blk * GPB, n, m, G, src, k0, k1,
                   BITS, QMAX, SYM, SKIND, GS, GS_P2, GPB, SUB, STOCH, HAS_REF, HADAMARD, FLAT)


@triton.jit
def _splitmix64(x):
    """``codec.rng._splitmix64`` on uint64 (wrapping adds and multiplies)."""
    x = x + tl.full([], 0x9E3779B97F4A7C15, tl.uint64)
    x = (x ^ (x >> 30)) * tl.full([], 0xBF58476D1CE4E5B9, tl.uint64)
    x = (x ^ (x >> 27)) * tl.full([], 0x94D049BB133111EB, tl.uint64)
    return x ^ (x >> 31)


@triton.jit
def _quantize_segments_kernel(
    x_ptr, r_ptr, out_b, out_s, seg_tab, blk_seg, h3, bucket, salt,
    BITS: tl.constexpr, QMAX: tl.constexpr, SYM: tl.constexpr, SKIND: tl.constexpr,
    GS: tl.constexpr, GS_P2: tl.constexpr, GPB: tl.constexpr, SUB: tl.constexpr,
    STOCH: tl.constexpr, HAS_REF: tl.constexpr, HADAMARD: tl.constexpr, FLAT: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    """``_quantize_kernel`` on one row of back-to-back segments, each its own wire row: this
    program's segment is ``blk_seg[program]``, whose first block, values, encoded length,
    value offset, wire offset, groups and index are ``seg_tab[segment, 0:7]``. Its RNG key is
    ``RngKey.fold(salt + index)``, derived here from the key's ``prefix()`` (``h3``) and its
    ``bucket``. ``ALIGNED``: the host found every segment's length and value offset multiples
    of 8 (``C.aligned_segment``)."""
    pid = tl.program_id(0)
    t = seg_tab + tl.load(blk_seg + pid).to(tl.int64) * 7
    first, n, m, G = C.segment_sizes(t)
    xoff, woff = tl.load(t + 3), tl.load(t + 4)
    n, m, xoff, woff = C.segment_hints(n, m, xoff, woff, ALIGNED)
    k0 = 0
    k1 = 0
    if STOCH:
        salted = (tl.cast(salt, tl.int64) + tl.load(t + 6)).to(tl.uint64, bitcast=True) << 20
        b = _splitmix64(tl.cast(bucket, tl.int64).to(tl.uint64, bitcast=True) ^ salted)
        h = _splitmix64(tl.cast(h3, tl.int64).to(tl.uint64, bitcast=True) ^ b)
        k0 = (h & 0xFFFFFFFF).to(tl.uint32).to(tl.int32, bitcast=True)
        k1 = (h >> 32).to(tl.uint32).to(tl.int32, bitcast=True)
    SBYTES: tl.constexpr = 4 if SKIND == 0 else 2
    g0 = (pid - first) * GPB
    _encode_groups(x_ptr + xoff, r_ptr + xoff, out_b + woff, out_s + woff // SBYTES, g0, n, m,
                   G, 0, k0, k1, BITS, QMAX, SYM, SKIND, GS, GS_P2, GPB, SUB, STOCH, HAS_REF,
                   HADAMARD, FLAT)


@triton.jit
def _hadamard_rows_kernel(x_ptr, r_ptr, y_ptr, n, m, x_stride, r_stride, nblk,
                          NB32: tl.constexpr, HAS_REF: tl.constexpr):
    """y[R, m] = H32 (x - ref) zero-padded; used when groups do not hold whole 32-blocks."""
    row, blk, row64 = C.row_block(nblk)
    i = (blk * NB32 + tl.arange(0, NB32))[:, None] * 32 + tl.arange(0, 32)[None, :]
    lmask = i < n
    v = C.load_f32(x_ptr + row64 * x_stride + i, lmask)
    if HAS_REF:
        v = v - C.load_f32(r_ptr + row64 * r_stride + i, lmask)
    v = C.hadamard_blocks(v, NB32)
    tl.store(y_ptr + row64 * m + i, v, mask=i < m)


def _hadamard_rows(x: torch.Tensor, ref: Optional[torch.Tensor], m: int) -> torch.Tensor:
    rows, n = x.shape
    y = torch.empty(rows, m, dtype=torch.float32, device=x.device)
    nb32 = max(1, min(C.TILE, C.next_power_of_2(m)) // 32)
    nblk = C.cdiv(m, nb32 * 32)
    r = ref if ref is not None else x
    with C.on_device(x):
        _hadamard_rows_kernel[(rows * nblk,)](
            x, r, y, n, m, x.stride(0), r.stride(0), nblk, NB32=nb32, HAS_REF=ref is not None,
            **C.launch_opts(nb32 * 32),
        )
    return y


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@functools.lru_cache(maxsize=1024)
def _segment_table(segments: tuple, spec: QuantSpec, hadamard: bool, device: str, gpb: int):
    """(table int64 [S, 7], program -> segment int32, programs, wire bytes, whether any row has
    padding after its codes, whether every segment is ``C.aligned_segment``, the tables' copy
    event: ``C.table_to``) of one layout of back-to-back segment rows, ``gpb`` groups a
    program (part of the key: a tile set at run time gets its own table)."""
    rows, blk_seg, xoff, woff, pad, aligned = [], [], 0, 0, False, True
    for k, n in enumerate(segments):
        m = wire.hadamard_len(n) if hadamard else n
        if n:
            C.check_row_len(m, spec.group_size)
            check_counter_range(1, m)
            lay = C.RowLayout.of(m, spec)
            rows.append([len(blk_seg), n, m, xoff, woff, lay.groups, k])
            aligned &= C.aligned_segment(n, xoff, woff)
            blk_seg += [len(rows) - 1] * C.cdiv(lay.groups, gpb)
            woff += lay.width
            pad |= lay.width > lay.code_end
        xoff += n
    tab, idx, done = C.table_to(device, torch.tensor(rows or [[0] * 7], dtype=torch.int64),
                                torch.tensor(blk_seg, dtype=torch.int32))
    return tab, idx, len(blk_seg), woff, pad, aligned, done


def _signed64(v: int) -> int:
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >> 63 else v


def quantize_segments(
    x: torch.Tensor,
    segments: tuple,
    spec: QuantSpec,
    key: Optional[RngKey],
    key_salt: int,
    ref: Optional[torch.Tensor] = None,
    hadamard: bool = False,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """A flat row of back-to-back segments -> their wire rows back to back, in one launch:
    segment ``k`` as ``quantize`` of it alone with ``key.fold(key_salt + k)`` (``out``: the
    flat wire buffer to write; x, ref and out contiguous)."""
    require_key(spec, key)
    segments = tuple(segments)
    if hadamard and spec.group_size % wire.HADAMARD_BLOCK:
        # Groups cut 32-blocks apart: the two-pass transform, segment by segment.
        from ..codec import _each_quantize, _widths

        if out is None:
            out = torch.empty(sum(_widths(segments, spec, True)), dtype=torch.uint8,
                              device=x.device)
        return _each_quantize(sys.modules[__name__], x, segments, spec, key, key_salt, ref,
                              True, out)
    gs_p2, gpb, sub = C.group_tiling(spec.group_size)
    tab, blk_seg, nblk, width, pad, aligned, done = _segment_table(segments, spec, hadamard,
                                                                   str(x.device), gpb)
    if out is None:
        out = torch.empty(width, dtype=torch.uint8, device=x.device)
    if nblk == 0:
        return out
    if pad:
        out.zero_()
    h3 = key.prefix() if key is not None else 0
    bucket = int(key.bucket) if key is not None else 0
    r = ref if ref is not None else x
    C.wait_for(done, x.device, tab, blk_seg)
    with C.on_device(x):
        _quantize_segments_kernel[(nblk,)](
            x, r, out, C.scale_view(out, spec), tab, blk_seg, _signed64(h3), _signed64(bucket),
            _signed64(key_salt), **C.RowLayout.of(1, spec).constexprs(), GS_P2=gs_p2, GPB=gpb,
            SUB=sub, STOCH=spec.stochastic, HAS_REF=ref is not None, HADAMARD=hadamard,
            FLAT=C.flat_tile(spec.bits, hadamard), ALIGNED=aligned, **C.launch_opts(gpb * sub),
        )
    return out


def _packed_rows(out: torch.Tensor, lay: "C.RowLayout", spec: QuantSpec) -> bool:
    """Whether the kernel may write ``out`` [R, W] as it writes its own buffer: unit column
    stride, rows ``W`` bytes apart, and a start the scale view can take."""
    itemsize = spec.torch_scale_dtype.itemsize
    return (out.stride(-1) == 1 and (out.shape[0] <= 1 or out.stride(0) == lay.width)
            and out.storage_offset() % itemsize == 0)


def quantize(
    rows: torch.Tensor,
    spec: QuantSpec,
    key: Optional[RngKey],
    ref: Optional[torch.Tensor] = None,
    hadamard: bool = False,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """[R, n] float rows -> uint8 wire rows; same contract and bytes as
    ``torch_codec.quantize`` (``ref``: encode ``x - ref``; ``hadamard``: encode ``H32 x``;
    ``out``: [R, W] written in place, directly when its rows are packed and their start is
    aligned for the scales, else through a copy)."""
    require_key(spec, key)
    m = wire.hadamard_len(rows.shape[1]) if hadamard else rows.shape[1]
    lay = C.RowLayout.of(m, spec)
    if out is not None and not _packed_rows(out, lay, spec):
        out.copy_(quantize(rows, spec, key, ref, hadamard))
        return out
    if out is None:
        out = torch.empty(rows.shape[0], lay.width, dtype=torch.uint8, device=rows.device)
    return _encode_rows(rows, spec, key, ref, hadamard, lay, out, None)


@functools.lru_cache(maxsize=256)
def _order_table(order: tuple, device: str):
    """(int32 table of ``order`` on ``device``, its copy event: ``C.table_to``)."""
    return C.table_to(device, torch.tensor(order, dtype=torch.int32))


def quantize_ordered(
    rows: torch.Tensor,
    spec: QuantSpec,
    key: Optional[RngKey],
    ref: Optional[torch.Tensor],
    hadamard: bool,
    order: tuple,
) -> torch.Tensor:
    """``quantize(rows, ...)[order]`` in one pass, without the wire rows in input order: output
    row j encodes input row ``order[j]`` with that row's random numbers, so the bytes are the
    same (the gradient's first hop sends its rows grouped by local peer: ``grad_reduce``).
    ``order``: host ints in ``[0, R)``, checked by ``codec.quantize``."""
    require_key(spec, key)
    m = wire.hadamard_len(rows.shape[1]) if hadamard else rows.shape[1]
    lay = C.RowLayout.of(m, spec)
    out = torch.empty(len(order), lay.width, dtype=torch.uint8, device=rows.device)
    if not order:
        return out
    return _encode_rows(rows, spec, key, ref, hadamard, lay, out,
                        _order_table(order, str(rows.device)))


def _encode_rows(rows, spec, key, ref, hadamard, lay, out, order) -> torch.Tensor:
    """Launch the encoder: every input row into ``out``, or with ``order`` (a ``_order_table``)
    the rows it lists, in its order."""
    R, n = rows.shape
    m = wire.hadamard_len(n) if hadamard else n
    if R == 0 or m == 0:
        return out
    C.check_row_len(m, spec.group_size)
    if spec.stochastic:
        check_counter_range(R, m)
    x = _unit_stride(rows)
    r = _unit_stride(ref) if ref is not None else None
    if hadamard and spec.group_size % wire.HADAMARD_BLOCK:
        # Groups cut 32-blocks apart: transform in a first pass, then quantize that.
        x, r, n, hadamard = _hadamard_rows(x, r, m), None, m, False
    gs_p2, gpb, sub = C.group_tiling(spec.group_size)
    nblk = C.cdiv(lay.groups, gpb)
    k0, k1 = C.key_words(key, spec.stochastic)
    rr = r if r is not None else x
    src = x
    if order is not None:
        src, done = order
        C.wait_for(done, x.device, src)
    with C.on_device(x):
        _quantize_kernel[(out.shape[0] * nblk,)](
            x, rr, out, C.scale_view(out, spec), src, n, m, x.stride(0), rr.stride(0),
            lay.width, lay.scale_words, lay.groups, nblk, k0, k1,
            **lay.constexprs(), GS_P2=gs_p2, GPB=gpb, SUB=sub, STOCH=spec.stochastic,
            HAS_REF=r is not None, HADAMARD=hadamard, FLAT=C.flat_tile(spec.bits, hadamard),
            ORDERED=order is not None, **C.launch_opts(gpb * sub),
        )
    if lay.width > lay.code_end:
        out[:, lay.code_end:].zero_()
    return out

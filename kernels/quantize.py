"""Fused quantize: (x - ref), optional Hadamard-32, per-group scales, rounding, bit packing.

One program encodes ``GPB`` whole groups of one row (groups up to ``TILE`` elements) or one
large group in two passes over sub-tiles (statistics, then codes). Torch twin:
``torch_codec.quantize``.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..codec import wire
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
        v = tl.reshape(C.hadamard32(tl.reshape(v, [M32, 32]), M32), v.shape)
    return v


@triton.jit
def _quantize_kernel(
    x_ptr, r_ptr, out_b, out_s, n, m, x_stride, r_stride, W, WS, G, nblk, k0, k1,
    BITS: tl.constexpr, QMAX: tl.constexpr, SYM: tl.constexpr, SKIND: tl.constexpr,
    GS: tl.constexpr, GS_P2: tl.constexpr, GPB: tl.constexpr, SUB: tl.constexpr,
    STOCH: tl.constexpr, HAS_REF: tl.constexpr, HADAMARD: tl.constexpr,
):
    row, blk, row64 = C.row_block(nblk)
    x_row = x_ptr + row64 * x_stride
    r_row = r_ptr + row64 * r_stride
    row_b = out_b + row64 * W
    row_s = out_s + row64 * WS
    grp = blk * GPB + tl.arange(0, GPB)
    gmask = grp < G
    NB8: tl.constexpr = SUB // 8
    M32: tl.constexpr = GPB * SUB // 32
    if SUB == GS_P2:
        # Whole groups in registers: one load, statistics, codes.
        e8, e8_ok, i, valid = C.group_tile(grp, gmask, 0, m, GS, NB8)
        v = _values(x_row, r_row, i, valid & (i < n), HAS_REF, HADAMARD, M32)
        bad, lo, hi = C.group_stats(v, valid, SYM)
        scale, mins = C.group_scales(lo, hi, QMAX, SYM, SKIND)
        C.store_scales(row_s, grp, gmask, G, scale, mins, bad, SYM, SKIND)
        C.encode_codes(v, valid, i, e8, e8_ok, row, m, row_b, G, scale, mins, bad, k0, k1,
                       BITS, QMAX, SYM, SKIND, STOCH)
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
                           BITS, QMAX, SYM, SKIND, STOCH)


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
    v = C.hadamard32(v, NB32)
    tl.store(y_ptr + row64 * m + i, v, mask=i < m)


def _hadamard_rows(x: torch.Tensor, ref: Optional[torch.Tensor], m: int) -> torch.Tensor:
    rows, n = x.shape
    y = torch.empty(rows, m, dtype=torch.float32, device=x.device)
    nb32 = max(1, min(C.TILE, triton.next_power_of_2(m)) // 32)
    nblk = triton.cdiv(m, nb32 * 32)
    r = ref if ref is not None else x
    with C.on_device(x):
        _hadamard_rows_kernel[(rows * nblk,)](
            x, r, y, n, m, x.stride(0), r.stride(0), nblk, NB32=nb32, HAS_REF=ref is not None,
            **C.launch_opts(nb32 * 32),
        )
    return y


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


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
    if spec.stochastic and key is None:
        raise ValueError(
            f"{spec} rounds stochastically and needs key=RngKey(seed, step, rank, bucket)")
    R, n = rows.shape
    m = wire.hadamard_len(n) if hadamard else n
    lay = C.RowLayout.of(m, spec)
    if out is not None and not _packed_rows(out, lay, spec):
        out.copy_(quantize(rows, spec, key, ref, hadamard))
        return out
    if out is None:
        out = torch.empty(R, lay.width, dtype=torch.uint8, device=rows.device)
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
    nblk = triton.cdiv(lay.groups, gpb)
    k0, k1 = C.key_words(key, spec.stochastic)
    rr = r if r is not None else x
    with C.on_device(x):
        _quantize_kernel[(R * nblk,)](
            x, rr, out, C.scale_view(out, spec), n, m, x.stride(0), rr.stride(0), lay.width,
            lay.scale_words, lay.groups, nblk, k0, k1,
            **lay.constexprs(), GS_P2=gs_p2, GPB=gpb, SUB=sub, STOCH=spec.stochastic,
            HAS_REF=r is not None, HADAMARD=hadamard, **C.launch_opts(gpb * sub),
        )
    if lay.width > lay.code_end:
        out[:, lay.code_end:].zero_()
    return out

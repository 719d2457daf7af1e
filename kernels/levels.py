"""Learned (non-uniform) level tables (QSDP): encode on a table, decode and sum.

The row format is ``codec.levels``'s: the 2^b fp32 levels, then the scale (and min) section and
the codes of ``wire.py``, all shifted by the table's bytes. The arithmetic is the torch twin's
(``torch_codec.quantize_levels`` / ``dequantize_levels_sum``) op for op:

* per group: non-finite test, ``scale = absmax`` (symmetric) or ``min``, ``max - min``
  (min-max), rounded to the scale dtype, a zero stored as +0;
* ``t = (x * f) * (1 / (s * f))``, ``x - min`` for ``x`` if asymmetric (``s`` the scale, 1 if
  zero; a reciprocal per group, ``wire.py``'s "Encoding"), clamped to the table's domain;
  ``k`` = the last level ``<= t`` among levels ``0 .. 2^b - 2`` (a branch-free binary search
  over the table, equal to ``searchsorted(L, t, right=True) - 1`` clamped);
* ``d = t - L[k]``, ``gap = L[k + 1] - L[k]``; code ``k + (u * gap < d)`` (stochastic, ``u``
  the counter hash of ``rng.py``) or ``k + (d + d >= gap)`` (nearest): ``d / gap`` compared
  without a division per element; a non-finite group sends code 0;
* decode ``L[u] * scale (+ min)``, summed over chunks in order 0..k-1.

Tiling: like ``quantize`` (whole groups per program, or one large group in sub-tiles) and
``dequantize`` (element tiles), so any group size works.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from ..codec import wire
from ..codec.rng import RngKey, check_counter_range
from ..config import QuantSpec
from . import _common as C

#: steps of the encoders' search whose candidates (1, 2, 4 for the tile) are picked from levels
#: loaded once per program, not gathered per element (``_search``)
_PICKED = tl.constexpr(3)


@triton.jit
def _search(lv_ptr, t, BITS: tl.constexpr, PICKED: tl.constexpr):
    """(k, L[k], L[k + 1]) for the largest k in [0, 2^BITS - 2] with L[k] <= t (t >= L[0]): a
    binary search of BITS steps, each of which tests candidate c = k + 2^(BITS - 1 - step).

    The two levels come with the search rather than from two more loads per element: the
    candidates rejected shrink the upper end (L[c] > t, or c = 2^BITS - 1, which k may not
    reach), so the last one rejected is k + 1, and the last one accepted is k (else k = 0).
    The first ``PICKED`` steps have 1, 2, 4, ... candidates for the whole tile: their levels
    are loaded once per program and picked per element by comparisons, so only the later
    steps gather from the table (a gather's lanes hit up to 8 cache lines of an 8-bit table).
    """
    K: tl.constexpr = 1 << BITS
    k = tl.zeros(t.shape, tl.int32)
    left = tl.zeros(t.shape, tl.float32) + tl.load(lv_ptr)
    right = left
    for j in tl.static_range(BITS):
        span = 1 << (BITS - j)  # k is a multiple of span before this step
        c = k + span // 2  # <= K - 1
        if j < PICKED:
            lc = tl.zeros(t.shape, tl.float32) + tl.load(lv_ptr + span // 2)
            for m in tl.static_range(1, 1 << j):
                lc = tl.where(k >= m * span, tl.load(lv_ptr + (m * span + span // 2)), lc)
        else:
            lc = tl.load(lv_ptr + c)
        take = (lc <= t) & (c <= K - 2)
        k = tl.where(take, c, k)
        left = tl.where(take, lc, left)
        right = tl.where(take, right, lc)
    return k, left, right


@triton.jit
def _stats(x_row, i, valid, n, SYM: tl.constexpr):
    v = C.load_f32(x_row + i, valid & (i < n))
    bad, lo, hi = C.group_stats(v, valid, SYM)
    return v, bad, lo, hi


@triton.jit
def _level_scales(lo, hi, SYM: tl.constexpr, SKIND: tl.constexpr):
    """(scale, mins) as stored: the group's range rounded to the scale dtype, zeros as +0."""
    if SYM:
        scale = C.round_scale(hi, SKIND) + 0.0
        mins = tl.zeros_like(scale)
    else:
        mins = C.round_min(lo, SKIND) + 0.0
        scale = C.round_scale(hi - mins, SKIND) + 0.0
    return scale, mins


@triton.jit
def _encode_level_codes(
    v, valid, i, e8, e8_ok, row, numel, row_b, G, scale, mins, bad, lv_ptr, k0, k1,
    BITS: tl.constexpr, SYM: tl.constexpr, SKIND: tl.constexpr, STOCH: tl.constexpr,
):
    f, r = C.group_reciprocal(tl.where(scale == 0.0, 1.0, scale), v)
    if SYM:
        t = (v * f) * r
        t = tl.minimum(tl.maximum(t, -1.0), 1.0)
    else:
        t = ((v - mins[:, None, None]) * f) * r
        t = tl.minimum(tl.maximum(t, 0.0), 1.0)
    nonfinite = bad[:, None, None] != 0
    t = tl.where(nonfinite, 0.0, t)
    k, left, right = _search(lv_ptr, t, BITS, _PICKED)
    d = t - left
    gap = right - left
    if STOCH:
        up = C.uniform(row, numel, i, k0, k1) * gap < d
    else:
        up = d + d >= gap
    q = k + up.to(tl.int32)
    q = tl.where(nonfinite, 0, q)
    codes = tl.where(valid, q, 0)
    C.store_codes(codes, row_b, G, e8, e8_ok, BITS, SYM, SKIND)


@triton.jit
def _quantize_levels_kernel(
    x_ptr, lv_ptr, out_b, out_s, out_l, n, x_stride, W, WS, WL, TB, TBS, G, nblk, k0, k1,
    BITS: tl.constexpr, SYM: tl.constexpr, SKIND: tl.constexpr, GS: tl.constexpr,
    GS_P2: tl.constexpr, GPB: tl.constexpr, SUB: tl.constexpr, STOCH: tl.constexpr,
):
    """out_b / out_s / out_l: the output as bytes / scale-width integers / fp32; TB, TBS: the
    table's size in bytes and in scale words (the row's scale section starts there)."""
    K: tl.constexpr = 1 << BITS
    row, blk, row64 = C.row_block(nblk)
    x_row = x_ptr + row64 * x_stride
    row_b = out_b + row64 * W + TB
    row_s = out_s + row64 * WS + TBS
    kk = tl.arange(0, K)
    tl.store(out_l + row64 * WL + kk, tl.load(lv_ptr + kk), mask=kk + blk * K < K)  # blk 0 only
    grp = blk * GPB + tl.arange(0, GPB)
    gmask = grp < G
    NB8: tl.constexpr = SUB // 8
    if SUB == GS_P2:
        e8, e8_ok, i, valid = C.group_tile(grp, gmask, 0, n, GS, NB8)
        v, bad, lo, hi = _stats(x_row, i, valid, n, SYM)
        scale, mins = _level_scales(lo, hi, SYM, SKIND)
        C.store_scales(row_s, grp, gmask, G, scale, mins, bad, SYM, SKIND)
        _encode_level_codes(v, valid, i, e8, e8_ok, row, n, row_b, G, scale, mins, bad, lv_ptr,
                            k0, k1, BITS, SYM, SKIND, STOCH)
    else:
        NSUB: tl.constexpr = (GS + SUB - 1) // SUB
        bad = tl.zeros([GPB], tl.int32)
        lo = tl.full([GPB], float("inf"), tl.float32)
        hi = tl.full([GPB], -float("inf"), tl.float32)
        for s in range(NSUB):
            e8, e8_ok, i, valid = C.group_tile(grp, gmask, s, n, GS, NB8)
            v, b_, l_, h_ = _stats(x_row, i, valid, n, SYM)
            bad = tl.maximum(bad, b_)
            lo = tl.minimum(lo, l_)
            hi = tl.maximum(hi, h_)
        scale, mins = _level_scales(lo, hi, SYM, SKIND)
        C.store_scales(row_s, grp, gmask, G, scale, mins, bad, SYM, SKIND)
        for s in range(NSUB):
            e8, e8_ok, i, valid = C.group_tile(grp, gmask, s, n, GS, NB8)
            v = C.load_f32(x_row + i, valid)
            _encode_level_codes(v, valid, i, e8, e8_ok, row, n, row_b, G, scale, mins, bad,
                                lv_ptr, k0, k1, BITS, SYM, SKIND, STOCH)


@triton.jit
def _decode_levels8(row_b, row_s, row_l, e8, ok, G, TB, TBS,
                    BITS: tl.constexpr, SYM: tl.constexpr, SKIND: tl.constexpr,
                    GS: tl.constexpr):
    """Values of the 8-blocks e8 [B] of one learned-levels row -> fp32 [B, 8]."""
    codes = C.load_codes8(row_b + TB, e8, ok, G, BITS, SYM, SKIND)
    grp = (e8 * 8) // GS
    scale = C.bits_to_scale(tl.load(row_s + TBS + grp, mask=ok, other=0), SKIND)
    lv = tl.load(row_l + codes, mask=ok[:, None], other=0.0)
    v = lv * scale[:, None]
    if not SYM:
        mins = C.bits_to_scale(tl.load(row_s + TBS + G + grp, mask=ok, other=0), SKIND)
        v = v + mins[:, None]
    return v


@triton.jit
def _decode_levels_kernel(
    data_b, data_s, data_l, out_ptr, k, chunk_b, chunk_s, chunk_l, n, W, WS, WL, TB, TBS, G,
    out_stride, nblk,
    BITS: tl.constexpr, SYM: tl.constexpr, SKIND: tl.constexpr, GS: tl.constexpr,
    BLK8: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    row, blk, row64 = C.row_block(nblk)
    e8 = blk * BLK8 + tl.arange(0, BLK8)
    ok = e8 * 8 < n
    row_b = data_b + row64 * W
    row_s = data_s + row64 * WS
    row_l = data_l + row64 * WL
    v = _decode_levels8(row_b, row_s, row_l, e8, ok, G, TB, TBS, BITS, SYM, SKIND, GS)
    for c in range(1, k):
        c64 = tl.cast(c, tl.int64)
        v = v + _decode_levels8(row_b + c64 * chunk_b, row_s + c64 * chunk_s,
                                row_l + c64 * chunk_l, e8, ok, G, TB, TBS, BITS, SYM, SKIND, GS)
    C.write_values(out_ptr, row64, out_stride, e8, v, n, ACCUMULATE)


def _layout(n: int, spec: QuantSpec) -> tuple[C.RowLayout, int]:
    """The row layout of the uniform part and the table's bytes in front of it."""
    tb = wire.table_bytes(spec)
    lay = C.RowLayout.of(n, spec)
    return lay, tb


def quantize_levels(
    rows: torch.Tensor, spec: QuantSpec, levels: torch.Tensor, key: Optional[RngKey]
) -> torch.Tensor:
    """[R, n] float rows -> learned-levels wire rows; same bytes as
    ``torch_codec.quantize_levels`` (``levels``: fp32 [2^b], validated by the caller)."""
    if spec.stochastic and key is None:
        raise ValueError(
            f"{spec} rounds stochastically and needs key=RngKey(seed, step, rank, bucket)")
    R, n = rows.shape
    lay, tb = _layout(n, spec)
    width = tb + lay.width if n else 0
    out = torch.empty(R, width, dtype=torch.uint8, device=rows.device)
    if R == 0 or n == 0:
        return out
    C.check_row_len(n, spec.group_size)
    if spec.stochastic:
        check_counter_range(R, n)
    x = rows if rows.stride(-1) == 1 else rows.contiguous()
    lv = levels.to(device=rows.device, dtype=torch.float32).contiguous()
    gs_p2, gpb, sub = C.group_tiling(spec.group_size)
    nblk = C.cdiv(lay.groups, gpb)
    k0, k1 = C.key_words(key, spec.stochastic)
    isz = spec.torch_scale_dtype.itemsize
    with C.on_device(x):
        _quantize_levels_kernel[(R * nblk,)](
            x, lv, out, C.scale_view(out, spec), out.view(torch.float32), n, x.stride(0), width,
            width // isz, width // 4, tb, tb // isz, lay.groups, nblk, k0, k1,
            BITS=spec.bits, SYM=spec.symmetric, SKIND=C._SCALE_KIND[spec.scale_dtype],
            GS=spec.group_size, GS_P2=gs_p2, GPB=gpb, SUB=sub, STOCH=spec.stochastic,
            **C.launch_opts(gpb * sub),
        )
    if lay.width > lay.code_end:
        out[:, tb + lay.code_end:].zero_()
    return out


def dequantize_levels_sum(
    chunks: Sequence[torch.Tensor],
    n: int,
    spec: QuantSpec,
    out: Optional[torch.Tensor] = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """k learned-levels blocks [R, W] -> their decoded sum [R, n] (fp32, or written into /
    added to ``out``); same values as ``torch_codec.dequantize_levels_sum``."""
    if len(chunks) == 0:
        raise ValueError("need at least one chunk to reduce")
    if accumulate and out is None:
        raise ValueError("accumulate=True needs out= (the tensor to add into)")
    R = chunks[0].shape[0]
    lay, tb = _layout(n, spec)
    width = tb + lay.width if n else 0
    first, step = C.chunk_stack(chunks, spec, (R, width),
                                lambda: f"{n} values with learned levels under {spec}")
    dst = out if out is not None else torch.empty(R, n, dtype=torch.float32, device=first.device)
    if R == 0 or n == 0:
        return dst
    C.check_row_len(n, spec.group_size)
    o = dst if dst.stride(-1) == 1 else torch.empty_like(dst, memory_format=torch.contiguous_format)
    if o is not dst and accumulate:
        o.copy_(dst)
    if first.storage_offset() % 4 or step % 4:  # the fp32 table view needs 4-byte alignment
        stacked = torch.stack([c.contiguous() for c in chunks])
        first, step = stacked[0], stacked.stride(0)
    isz = spec.torch_scale_dtype.itemsize
    blk8 = C.TILE // 8
    nblk = C.cdiv(C.cdiv(n, 8), blk8)
    with C.on_device(first):
        _decode_levels_kernel[(R * nblk,)](
            first, C.scale_view(first, spec), first.view(torch.float32), o, len(chunks), step,
            step // isz, step // 4, n, width, width // isz, width // 4, tb, tb // isz,
            lay.groups, o.stride(0), nblk,
            BITS=spec.bits, SYM=spec.symmetric, SKIND=C._SCALE_KIND[spec.scale_dtype],
            GS=spec.group_size, BLK8=blk8, ACCUMULATE=accumulate, **C.launch_opts(C.TILE),
        )
    if o is not dst:
        dst.copy_(o)
    return dst


__all__ = ["dequantize_levels_sum", "quantize_levels"]

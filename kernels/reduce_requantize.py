"""Fused reduce + requantize: hop 1 -> hop 2 of the two-level gradient reduce-scatter.

Decodes k received wire blocks (``spec_in``), sums them in fp32 in order 0..k-1 and encodes the
sum with ``spec_out`` without leaving registers; the Hadamard rotation, if any, is kept (sums
commute with it). Tiled by ``spec_out`` groups like ``quantize``. Torch twin:
``torch_codec.reduce_requantize``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from ..codec.rng import RngKey, check_counter_range
from ..config import QuantSpec
from . import _common as C


@triton.jit
def _sum_values(row_b, row_s, chunk_b, chunk_s, e8, e8_ok, G, K: tl.constexpr,
                BITS: tl.constexpr, QMAX: tl.constexpr, SYM: tl.constexpr,
                SKIND: tl.constexpr, GS: tl.constexpr):
    """Sum over chunks of the decoded 8-blocks e8 [A, B] -> [A, B, 8]."""
    A: tl.constexpr = e8.shape[0]
    B: tl.constexpr = e8.shape[1]
    e = tl.reshape(e8, [A * B])
    ok = tl.reshape(e8_ok, [A * B])
    v = C.decode8_sum(row_b, row_s, chunk_b, chunk_s, e, ok, G, K, BITS, QMAX, SYM, SKIND, GS)
    return tl.reshape(v, [A, B, 8])


@triton.jit
def _reduce_requantize_kernel(
    in_b, in_s, out_b, out_s, chunk_b, chunk_s, n, W_in, WS_in, G_in, W, WS, G, nblk,
    k0, k1, K: tl.constexpr,
    I_BITS: tl.constexpr, I_QMAX: tl.constexpr, I_SYM: tl.constexpr, I_SKIND: tl.constexpr,
    I_GS: tl.constexpr,
    BITS: tl.constexpr, QMAX: tl.constexpr, SYM: tl.constexpr, SKIND: tl.constexpr,
    GS: tl.constexpr, GS_P2: tl.constexpr, GPB: tl.constexpr, SUB: tl.constexpr,
    STOCH: tl.constexpr,
):
    row, blk, row64 = C.row_block(nblk)
    rin_b = in_b + row64 * W_in
    rin_s = in_s + row64 * WS_in
    row_b = out_b + row64 * W
    row_s = out_s + row64 * WS
    grp = blk * GPB + tl.arange(0, GPB)
    gmask = grp < G
    NB8: tl.constexpr = SUB // 8
    if SUB == GS_P2:
        e8, e8_ok, i, valid = C.group_tile(grp, gmask, 0, n, GS, NB8)
        v = _sum_values(rin_b, rin_s, chunk_b, chunk_s, e8, e8_ok, G_in, K,
                        I_BITS, I_QMAX, I_SYM, I_SKIND, I_GS)
        bad, lo, hi = C.group_stats(v, valid, SYM)
        scale, mins = C.group_scales(lo, hi, QMAX, SYM, SKIND)
        C.store_scales(row_s, grp, gmask, G, scale, mins, bad, SYM, SKIND)
        C.encode_codes(v, valid, i, e8, e8_ok, row, n, row_b, G, scale, mins, bad, k0, k1,
                       BITS, QMAX, SYM, SKIND, STOCH, GS)
    else:
        NSUB: tl.constexpr = (GS + SUB - 1) // SUB
        bad = tl.zeros([GPB], tl.int32)
        lo = tl.full([GPB], float("inf"), tl.float32)
        hi = tl.full([GPB], -float("inf"), tl.float32)
        for s in range(NSUB):
            e8, e8_ok, i, valid = C.group_tile(grp, gmask, s, n, GS, NB8)
            v = _sum_values(rin_b, rin_s, chunk_b, chunk_s, e8, e8_ok, G_in, K,
                            I_BITS, I_QMAX, I_SYM, I_SKIND, I_GS)
            b_, l_, h_ = C.group_stats(v, valid, SYM)
            bad = tl.maximum(bad, b_)
            lo = tl.minimum(lo, l_)
            hi = tl.maximum(hi, h_)
        scale, mins = C.group_scales(lo, hi, QMAX, SYM, SKIND)
        C.store_scales(row_s, grp, gmask, G, scale, mins, bad, SYM, SKIND)
        for s in range(NSUB):
            e8, e8_ok, i, valid = C.group_tile(grp, gmask, s, n, GS, NB8)
            v = _sum_values(rin_b, rin_s, chunk_b, chunk_s, e8, e8_ok, G_in, K,
                            I_BITS, I_QMAX, I_SYM, I_SKIND, I_GS)
            C.encode_codes(v, valid, i, e8, e8_ok, row, n, row_b, G, scale, mins, bad, k0, k1,
                           BITS, QMAX, SYM, SKIND, STOCH, GS)


def reduce_requantize(
    chunks: Sequence[torch.Tensor],
    n: int,
    spec_in: QuantSpec,
    spec_out: QuantSpec,
    key: Optional[RngKey],
) -> torch.Tensor:
    """k wire blocks [R, W_in] (``spec_in``) -> their sum as wire rows [R, W_out]
    (``spec_out``); same bytes as ``torch_codec.reduce_requantize``."""
    if len(chunks) == 0:
        raise ValueError("need at least one chunk to reduce")
    if spec_out.stochastic and key is None:
        raise ValueError(f"{spec_out} rounds stochastically and needs key=RngKey(...)")
    R = chunks[0].shape[0]
    lin = C.RowLayout.of(n, spec_in)
    lay = C.RowLayout.of(n, spec_out)
    first, step = C.chunk_stack(chunks, spec_in, (R, lin.width),
                                lambda: f"{n} values under {spec_in}")
    out = torch.empty(R, lay.width, dtype=torch.uint8, device=first.device)
    if R == 0 or n == 0:
        return out
    C.check_row_len(n, max(spec_in.group_size, spec_out.group_size))
    if spec_out.stochastic:
        check_counter_range(R, n)
    gs_p2, gpb, sub = C.group_tiling(spec_out.group_size)
    nblk = C.cdiv(lay.groups, gpb)
    k0, k1 = C.key_words(key, spec_out.stochastic)
    with C.on_device(first):
        _reduce_requantize_kernel[(R * nblk,)](
            first, C.scale_view(first, spec_in), out, C.scale_view(out, spec_out),
            step, step // spec_in.torch_scale_dtype.itemsize, n, lin.width, lin.scale_words,
            lin.groups, lay.width, lay.scale_words, lay.groups, nblk, k0, k1, K=len(chunks),
            **lin.constexprs("I_"), **lay.constexprs(), GS_P2=gs_p2, GPB=gpb, SUB=sub,
            STOCH=spec_out.stochastic, **C.launch_opts(gpb * sub),
        )
    if lay.width > lay.code_end:
        out[:, lay.code_end:].zero_()
    return out

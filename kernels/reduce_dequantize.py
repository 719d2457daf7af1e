"""Fused reduce + dequantize + inverse Hadamard-32: the last hop of the gradient reduce-scatter.

Decodes k received wire blocks of the same rows, sums them in fp32 in order 0..k-1 (starting
from chunk 0, like the torch code), undoes the Hadamard rotation once, optionally divides by the
group size (a reduce-scatter's AVG, which FSDP would otherwise apply in a pass of its own over
the output) and writes ``n`` values. Torch twin: ``torch_codec.reduce_dequantize``.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from ..codec import wire
from ..config import QuantSpec
from . import _common as C


@triton.jit
def _reduce_dequantize_kernel(
    data_b, data_s, out_ptr, chunk_b, chunk_s, n, m, W, WS, G, out_stride, nblk, divisor,
    K: tl.constexpr, BITS: tl.constexpr, QMAX: tl.constexpr, SYM: tl.constexpr,
    SKIND: tl.constexpr, GS: tl.constexpr, BLK8: tl.constexpr, HADAMARD: tl.constexpr,
    DIVIDE: tl.constexpr,
):
    row, blk, row64 = C.row_block(nblk)
    e8 = blk * BLK8 + tl.arange(0, BLK8)
    ok = e8 * 8 < m
    row_b = data_b + row64 * W
    row_s = data_s + row64 * WS
    v = C.decode8_sum(row_b, row_s, chunk_b, chunk_s, e8, ok, G, K, BITS, QMAX, SYM, SKIND,
                      GS)
    if HADAMARD:
        v = C.hadamard_blocks(v, BLK8 // 4)
        v = v * (1.0 / 32)
    if DIVIDE == 1:  # by a power of two: the product with its reciprocal is the same value
        v = v * divisor
    elif DIVIDE == 2:  # IEEE, as torch's sum.div_(divisor)
        v = tl.math.div_rn(v, tl.full(v.shape, divisor, tl.float32))
    C.write_values(out_ptr, row64, out_stride, e8, v, n, False)


def reduce_dequantize(
    chunks: Sequence[torch.Tensor],
    n: int,
    spec: QuantSpec,
    hadamard: bool = False,
    out: Optional[torch.Tensor] = None,
    divide: Optional[float] = None,
) -> torch.Tensor:
    """k wire blocks [R, W] -> [R, n] sum (fp32, or written into ``out``), divided by
    ``divide`` when given; same values as ``torch_codec.reduce_dequantize``."""
    if len(chunks) == 0:
        raise ValueError("need at least one chunk to reduce")
    R = chunks[0].shape[0]
    m = wire.hadamard_len(n) if hadamard else n
    lay = C.RowLayout.of(m, spec)
    first, step = C.chunk_stack(chunks, spec, (R, lay.width), lambda: f"{m} values under {spec}")
    dst = out if out is not None else torch.empty(R, n, dtype=torch.float32, device=first.device)
    if R == 0 or n == 0:
        return dst
    C.check_row_len(m, spec.group_size)
    o = dst if dst.stride(-1) == 1 else torch.empty_like(dst, memory_format=torch.contiguous_format)
    how, divisor = _division(divide)
    isz = spec.torch_scale_dtype.itemsize
    blk8 = C.TILE // 8
    nblk = C.cdiv(C.cdiv(n, 8), blk8)
    with C.on_device(first):
        _reduce_dequantize_kernel[(R * nblk,)](
            first, C.scale_view(first, spec), o, step, step // isz, n, m, lay.width,
            lay.scale_words, lay.groups, o.stride(0), nblk, divisor, K=len(chunks),
            **lay.constexprs(), BLK8=blk8, HADAMARD=hadamard, DIVIDE=how,
            **C.launch_opts(C.TILE),
        )
    if o is not dst:
        dst.copy_(o)
    return dst


def _division(divide: Optional[float]) -> tuple[int, float]:
    """(the kernel's ``DIVIDE``, its ``divisor`` argument): 0 for none; 1 and the reciprocal
    for a power of two from 2^-126 to 2^126 (then ``x * (1 / d)`` is ``x / d`` for every ``x``:
    both round the same exact value), one multiply instead of an IEEE division's ~15
    instructions; else 2 and ``d``."""
    if divide is None:
        return 0, 1.0
    mantissa, exponent = math.frexp(divide)
    if mantissa == 0.5 and -125 <= exponent <= 127:
        return 1, 1.0 / divide
    return 2, float(divide)

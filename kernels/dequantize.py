"""Fused dequantize: unpack codes, scale (and shift), optional inverse Hadamard-32, optional
accumulate into an output of any float dtype (qWD receive: ``ref += d``).

Element-tiled: one program decodes ``BLK8`` 8-blocks of one row, reading each block's scale by
group index, so any group size works. Torch twin: ``torch_codec.dequantize``.
"""

from __future__ import annotations

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
        v = tl.reshape(C.hadamard32(tl.reshape(v, [BLK8 // 4, 32]), BLK8 // 4), [BLK8, 8])
        v = v * (1.0 / 32)
    C.write_values(out_ptr, row64, out_stride, e8, v, n, ACCUMULATE)


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
    nblk = triton.cdiv(triton.cdiv(n, 8), blk8)
    with C.on_device(data):
        _dequantize_kernel[(R * nblk,)](
            data, C.scale_view(data, spec), o, n, m, lay.width, lay.scale_words, lay.groups,
            o.stride(0), nblk, **lay.constexprs(), BLK8=blk8, HADAMARD=hadamard,
            ACCUMULATE=accumulate, **C.launch_opts(C.TILE),
        )
    if o is not dst:
        dst.copy_(o)
    return dst

"""The torch implementation of the wire format (``wire.py``): the CPU path and the reference
the Triton kernels are tested against.

All functions take and return 2-D row blocks ``[rows, n]``; ``fsdp_qcomm.codec`` handles shapes
and dispatch. Arithmetic is fp32 and written op for op like the kernels (``floor(t + u)``, no
fused multiply-adds, sums over received chunks in order 0..k-1) so both give the same bytes.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..config import QuantSpec
from . import wire
from .rng import RngKey, uniform_rows

_PACK_SHIFTS: dict[tuple[int, str], torch.Tensor] = {}

# Same-width integer views of the scale dtypes: NaN scales are written as these bit patterns
# (``wire.NAN_BITS``) because float casts of NaN differ between CPU paths and GPUs.
_BITS_DTYPE = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _shifts(step: int, count: int, device: torch.device) -> torch.Tensor:
    k = (step, count, str(device))
    t = _PACK_SHIFTS.get(k)
    if t is None:
        t = torch.arange(count, dtype=torch.int64, device=device) * step
        _PACK_SHIFTS[k] = t
    return t


# ---- bit packing ----------------------------------------------------------------------------
def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, 8m] codes (< 2^bits) -> [R, m*bits] bytes, little-endian bit stream."""
    rows = codes.shape[0]
    if bits == 8:
        return codes.to(torch.uint8)
    if bits == 4:
        c = codes.to(torch.uint8).view(rows, -1, 2)
        return c[..., 0] | (c[..., 1] << 4)
    if bits == 2:
        c = codes.to(torch.uint8).view(rows, -1, 4)
        return c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)
    # General width: eight codes make ``bits`` whole bytes; build that 8*bits-bit word in int64.
    c = codes.to(torch.int64).view(rows, -1, 8)
    word = (c << _shifts(bits, 8, codes.device)).sum(-1, keepdim=True)
    out = (word >> _shifts(8, bits, codes.device)) & 0xFF
    return out.to(torch.uint8).view(rows, -1)


def unpack_codes(data: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, m*bits] bytes -> [R, 8m] int32 codes; inverse of ``pack_codes``."""
    rows = data.shape[0]
    if bits == 8:
        return data.to(torch.int32)
    if bits in (2, 4):
        per = 8 // bits
        c = data.to(torch.int32).unsqueeze(-1) >> _shifts(bits, per, data.device).to(torch.int32)
        return (c & ((1 << bits) - 1)).view(rows, -1)
    b = data.to(torch.int64).view(rows, -1, bits)
    word = (b << _shifts(8, bits, data.device)).sum(-1, keepdim=True)
    c = (word >> _shifts(bits, 8, data.device)) & ((1 << bits) - 1)
    return c.to(torch.int32).view(rows, -1)


# ---- Hadamard -------------------------------------------------------------------------------
def hadamard32(v: torch.Tensor) -> torch.Tensor:
    """Unnormalized Sylvester Hadamard on each 32-element block (butterflies, h = 1..16).

    The caller pads rows to a multiple of 32. ``hadamard32(hadamard32(x)) == 32 * x``.
    """
    shape = v.shape
    x = v.reshape(-1, 32)
    h = 1
    while h < 32:
        y = x.view(-1, 32 // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        x = torch.stack((a + b, a - b), dim=2).view(-1, 32)
        h *= 2
    return x.view(shape)


def _pad_cols(v: torch.Tensor, width: int, mode: str) -> torch.Tensor:
    n = v.shape[1]
    if width == n:
        return v
    if mode == "zero":
        return torch.nn.functional.pad(v, (0, width - n))
    return torch.cat((v, v[:, -1:].expand(-1, width - n)), dim=1)


# ---- encode / decode ------------------------------------------------------------------------
def encode(v: torch.Tensor, spec: QuantSpec, key: Optional[RngKey]) -> torch.Tensor:
    """fp32 [R, n] -> uint8 [R, wire_bytes(n)]."""
    rows, n = v.shape
    out = torch.zeros(rows, wire.wire_bytes(n, spec), dtype=torch.uint8, device=v.device)
    if n == 0:
        return out
    gs = spec.group_size
    groups = wire.num_groups(n, spec)
    # Replicate the last value into the partial group: it changes neither absmax nor min/max.
    g = _pad_cols(v, groups * gs, "edge").view(rows, groups, gs)
    sdt = spec.torch_scale_dtype
    if spec.symmetric:
        amax = g.abs().amax(-1)
        bad = ~torch.isfinite(amax)
        scale = (amax / spec.qmax).to(sdt).to(torch.float32)
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        t = g / scale[..., None]
        lo, hi, bias = -spec.qmax, spec.qmax, spec.qmax
        mins = None
    else:
        mn = g.amin(-1)
        mx = g.amax(-1)
        bad = ~(torch.isfinite(mn) & torch.isfinite(mx))
        mins = mn.to(sdt).to(torch.float32) + 0.0  # + 0.0 turns a -0 minimum into +0
        scale = ((mx - mins) / spec.qmax).to(sdt).to(torch.float32)
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        t = (g - mins[..., None]) / scale[..., None]
        lo, hi, bias = 0, spec.qmax, 0
    if spec.stochastic:
        if key is None:
            raise ValueError("stochastic rounding needs an RngKey; pass key=RngKey(...)")
        t = t + uniform_rows(rows, groups * gs, n, key, v.device).view_as(t)
    else:
        t = t + 0.5
    q = torch.floor(t).clamp_(lo, hi)
    q = torch.where(bad[..., None], torch.zeros_like(q), q)  # NaN codes would be undefined
    codes = (q + bias).view(rows, -1)
    n8 = -(-n // 8) * 8
    codes = codes[:, :n8].clone()  # groups * gs >= n8 because gs is a multiple of 8
    codes[:, n:] = 0
    nan = torch.tensor(wire.NAN_BITS[spec.scale_dtype], dtype=_BITS_DTYPE[sdt], device=v.device)
    sbytes = groups * sdt.itemsize

    def _scale_bytes(s: torch.Tensor) -> torch.Tensor:
        s = torch.where(bad, nan, s.to(sdt).view(_BITS_DTYPE[sdt]))
        return s.view(torch.uint8).view(rows, sbytes)

    out[:, :sbytes] = _scale_bytes(scale)
    off = sbytes
    if mins is not None:
        out[:, off:off + sbytes] = _scale_bytes(mins)
        off += sbytes
    out[:, off:off + wire.code_bytes(n, spec)] = pack_codes(codes, spec.bits)
    return out


def decode(data: torch.Tensor, n: int, spec: QuantSpec) -> torch.Tensor:
    """uint8 [R, wire_bytes(n)] -> fp32 [R, n]."""
    rows = data.shape[0]
    if n == 0:
        return torch.empty(rows, 0, dtype=torch.float32, device=data.device)
    gs = spec.group_size
    groups = wire.num_groups(n, spec)
    sdt = spec.torch_scale_dtype
    sbytes = groups * sdt.itemsize
    scale = data[:, :sbytes].contiguous().view(sdt).to(torch.float32)
    off = sbytes
    mins = None
    if not spec.symmetric:
        mins = data[:, off:off + sbytes].contiguous().view(sdt).to(torch.float32)
        off += sbytes
    codes = unpack_codes(data[:, off:off + wire.code_bytes(n, spec)], spec.bits)
    codes = _pad_cols(codes, groups * gs, "zero")[:, : groups * gs].view(rows, groups, gs)
    if spec.symmetric:
        x = (codes - spec.qmax).to(torch.float32) * scale[..., None]
    else:
        x = codes.to(torch.float32) * scale[..., None]
        x = x + mins[..., None]
    return x.view(rows, -1)[:, :n]


# ---- fused forms used by the collectives ----------------------------------------------------
def quantize(
    x: torch.Tensor,
    spec: QuantSpec,
    key: Optional[RngKey],
    ref: Optional[torch.Tensor] = None,
    hadamard: bool = False,
) -> torch.Tensor:
    """[R, n] -> wire rows. ``ref``: encode ``x - ref`` (qWD send). ``hadamard``: encode
    ``H32 x`` of the row zero-padded to ``hadamard_len(n)``."""
    v = x.to(torch.float32)
    if ref is not None:
        v = v - ref.to(torch.float32)
    if hadamard:
        v = hadamard32(_pad_cols(v, wire.hadamard_len(v.shape[1]), "zero"))
    return encode(v.contiguous(), spec, key)


def dequantize(
    data: torch.Tensor,
    n: int,
    spec: QuantSpec,
    hadamard: bool = False,
    out: Optional[torch.Tensor] = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """Wire rows -> [R, n]. ``accumulate`` adds into ``out`` (qWD receive: ``ref += d``)."""
    x = decode(data, wire.hadamard_len(n) if hadamard else n, spec)
    if hadamard:
        x = hadamard32(x)[:, :n] * (1.0 / 32)
    return _write(x, out, accumulate)


def _sum_decoded(chunks: Sequence[torch.Tensor], n: int, spec: QuantSpec) -> torch.Tensor:
    acc = decode(chunks[0], n, spec)
    for c in chunks[1:]:
        acc = acc + decode(c, n, spec)
    return acc


def reduce_requantize(
    chunks: Sequence[torch.Tensor],
    n: int,
    spec_in: QuantSpec,
    spec_out: QuantSpec,
    key: Optional[RngKey],
) -> torch.Tensor:
    """Sum of k decoded wire blocks (in order) re-encoded with ``spec_out`` (hop 1 -> hop 2).
    ``n`` is the encoded row length (already Hadamard-padded where used)."""
    return encode(_sum_decoded(chunks, n, spec_in), spec_out, key)


def reduce_dequantize(
    chunks: Sequence[torch.Tensor],
    n: int,
    spec: QuantSpec,
    hadamard: bool = False,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Sum of k decoded wire blocks, inverse Hadamard once, first ``n`` values (final hop)."""
    acc = _sum_decoded(chunks, wire.hadamard_len(n) if hadamard else n, spec)
    if hadamard:
        acc = hadamard32(acc)[:, :n] * (1.0 / 32)
    return _write(acc, out, False)


def _write(x: torch.Tensor, out: Optional[torch.Tensor], accumulate: bool) -> torch.Tensor:
    if out is None:
        return x
    if accumulate:
        out.copy_(out.to(torch.float32) + x)
    else:
        out.copy_(x)
    return out

"""The torch implementation of the wire format (``wire.py``): the CPU path and the reference
the Triton kernels are tested against.

All functions take and return 2-D row blocks ``[rows, n]``; ``fsdp_qcomm.codec`` handles shapes
and dispatch. Arithmetic is fp32 and written op for op like the kernels (``floor(t + u)``, no
fused multiply-adds, sums over received chunks in order 0..k-1) so both give the same bytes.
"""

from __future__ import annotations

from typing import Callable, Iterator, NamedTuple, Optional, Sequence

import torch

from ..config import QuantSpec
from . import wire
from ._checks import BITS_DTYPE
from .rng import RngKey, add_uniform_, check_counter_range, row_starts, uniform_rows

_PACK_SHIFTS: dict[tuple[int, str], torch.Tensor] = {}


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
# Blocks of _HROWS 32-element rows are transposed into a [32, rows] scratch so that each
# butterfly stage is two contiguous, vectorized ops (rows i and i + h of the block) instead of
# ops on strided pairs; the per-element arithmetic (a + b, a - b per stage, h = 1..16) is the
# same, so the result is bit-identical. Two 512 KiB scratch buffers stay cache-resident.
_HROWS = 4096


def _butterfly(src: torch.Tensor, dst: torch.Tensor, h: int) -> None:
    s = src.view(32 // (2 * h), 2, -1)
    d = dst.view(32 // (2 * h), 2, -1)
    torch.add(s[:, 0], s[:, 1], out=d[:, 0])
    torch.sub(s[:, 0], s[:, 1], out=d[:, 1])


def _hadamard_rows(src: torch.Tensor, dst: torch.Tensor, a_buf: torch.Tensor,
                   b_buf: torch.Tensor) -> None:
    """``dst = H32 src`` for [rows, 32] views; a_buf / b_buf: flat scratch of >= 32 * min(rows,
    _HROWS) elements. ``dst`` may be ``src``."""
    rows = src.shape[0]
    for r0 in range(0, rows, _HROWS):
        r1 = min(rows, r0 + _HROWS)
        a = a_buf[:32 * (r1 - r0)].view(32, -1)
        b = b_buf[:32 * (r1 - r0)].view(32, -1)
        a.copy_(src[r0:r1].t())
        _butterfly(a, b, 1)
        _butterfly(b, a, 2)
        _butterfly(a, b, 4)
        _butterfly(b, a, 8)
        _butterfly(a, b, 16)
        dst[r0:r1].copy_(b.t())


def hadamard32(v: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Unnormalized Sylvester Hadamard on each 32-element block (butterflies, h = 1..16).

    The caller pads rows to a multiple of 32. ``hadamard32(hadamard32(x)) == 32 * x``.
    ``out`` (contiguous, ``v``'s shape; may be ``v`` itself) receives the result.
    """
    src = v.reshape(-1, 32)
    if out is None:
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    a_buf = torch.empty(32 * min(src.shape[0], _HROWS), dtype=v.dtype, device=v.device)
    _hadamard_rows(src, out.view(-1, 32), a_buf, torch.empty_like(a_buf))
    return out


def _pad_cols(v: torch.Tensor, width: int, mode: str) -> torch.Tensor:
    n = v.shape[1]
    if width == n:
        return v
    if mode == "zero":
        return torch.nn.functional.pad(v, (0, width - n))
    return torch.cat((v, v[:, -1:].expand(-1, width - n)), dim=1)


# ---- encode / decode ------------------------------------------------------------------------
# Both sides walk a row block in steps of whole groups, about _BLOCK elements each, so every
# intermediate lives in reused, cache-sized scratch: a step is ~10 passes over L2-resident
# buffers (~30 with stochastic rounding) instead of that many passes over main memory with a
# fresh allocation each. Rows are batched into one step while they fit, which keeps small calls
# (a few thousand elements) at a handful of torch ops. The partial last group of each row is a
# step of its own on an edge-padded copy.
_BLOCK = 1 << 16


class _Step(NamedTuple):
    r0: int
    r1: int
    g0: int
    g1: int  # groups [g0, g1) of rows [r0, r1); g1 == g0 + 1 == num_groups for the tail


def _steps(rows: int, n: int, gs: int) -> Iterator[_Step]:
    full = n // gs
    if full:
        if rows * full * gs <= _BLOCK:
            yield _Step(0, rows, 0, full)
        else:
            per = max(1, _BLOCK // gs)
            for r in range(rows):
                for g0 in range(0, full, per):
                    yield _Step(r, r + 1, g0, min(full, g0 + per))
    if n % gs:
        yield _Step(0, rows, full, full + 1)


class _Scratch:
    """Reused per-call buffers, grown on demand (views of the first ``numel`` elements)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._bufs: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        b = self._bufs.get((name, dtype))
        if b is None or b.numel() < numel:
            b = self._bufs[(name, dtype)] = torch.empty(numel, dtype=dtype, device=self.device)
        return b[:numel]


def _pack_into(codes: torch.Tensor, bits: int, dst: torch.Tensor) -> None:
    """``dst[...] = pack_codes(codes, bits)`` for uint8 codes [R, L], without temporaries for
    the common widths (codes < 2^bits, so the shifted sums never carry)."""
    if bits == 8:
        dst.copy_(codes)
    elif bits == 4:
        c = codes.view(codes.shape[0], -1, 2)
        torch.add(c[..., 0], c[..., 1], alpha=16, out=dst)
    elif bits == 2:
        c = codes.view(codes.shape[0], -1, 4)
        torch.add(c[..., 0], c[..., 1], alpha=4, out=dst)
        dst.add_(c[..., 2], alpha=16)
        dst.add_(c[..., 3], alpha=64)
    else:
        dst.copy_(pack_codes(codes, bits))


class _Source:
    """The rows an encode quantizes: ``x`` (fp32 [R, n0]), or ``x - ref``, zero-padded to ``n``
    columns and rotated by ``H32`` when ``hadamard``. Blocks are produced on demand into
    scratch, so the transformed rows never exist in full: the same per-element ops as
    subtracting, padding and rotating the whole row first."""

    def __init__(self, x: torch.Tensor, ref: Optional[torch.Tensor], hadamard: bool):
        self.x, self.ref, self.hadamard = x, ref, hadamard
        self.rows, self.n0 = x.shape
        self.n = wire.hadamard_len(self.n0) if hadamard else self.n0
        self.plain = ref is None and not hadamard

    def block(self, r0: int, r1: int, c0: int, c1: int, scratch: "_Scratch") -> torch.Tensor:
        """Columns [c0, c1) of rows [r0, r1) (c0, c1 multiples of 32 or c1 == n)."""
        if self.plain:
            return self.x[r0:r1, c0:c1]
        R, w = r1 - r0, c1 - c0
        buf = scratch.get("src", R * w, torch.float32).view(R, w)
        e = min(c1, self.n0)
        if e > c0:
            if self.ref is None:
                buf[:, :e - c0].copy_(self.x[r0:r1, c0:e])
            else:
                torch.sub(self.x[r0:r1, c0:e], self.ref[r0:r1, c0:e], out=buf[:, :e - c0])
        if e - c0 < w:
            buf[:, max(0, e - c0):].zero_()
        if self.hadamard:
            hr = 32 * min(R * w // 32, _HROWS)
            _hadamard_rows(buf.view(-1, 32), buf.view(-1, 32),
                           scratch.get("ha", hr, torch.float32),
                           scratch.get("hb", hr, torch.float32))
        return buf


class _SumSource(_Source):
    """The rows of ``reduce_requantize``: the in-order fp32 sum of k decoded wire blocks,
    decoded per encode step into scratch instead of in full (same ops per element)."""

    def __init__(self, chunks: Sequence[torch.Tensor], n: int, spec: QuantSpec):
        self.x = chunks[0]
        self.rows, self.n0, self.n = chunks[0].shape[0], n, n
        self.plain = False
        self.spec = spec
        self.ws = [_read_wire(c, n, spec) for c in chunks]

    def block(self, r0: int, r1: int, c0: int, c1: int, scratch: "_Scratch") -> torch.Tensor:
        gs, n = self.spec.group_size, self.n
        full = n // gs
        buf = scratch.get("sum_src", (r1 - r0) * (c1 - c0), torch.float32).view(r1 - r0, -1)
        g0, g1 = c0 // gs, min(full, c1 // gs)
        parts = [] if g1 <= g0 else [_Step(r0, r1, g0, g1)]
        if c1 == n and n % gs:
            parts.append(_Step(r0, r1, full, full + 1))
        for st in parts:
            dst = buf[:, st.g0 * gs - c0:min(n, st.g1 * gs) - c0]
            for j, w in enumerate(self.ws):
                _decode_step(w, n, self.spec, st, dst, j > 0, scratch)
        return buf


def encode(v: torch.Tensor, spec: QuantSpec, key: Optional[RngKey]) -> torch.Tensor:
    """fp32 [R, n] -> uint8 [R, wire_bytes(n)]."""
    return _encode(_Source(v.contiguous(), None, False), spec, key)


def _encode(src: _Source, spec: QuantSpec, key: Optional[RngKey]) -> torch.Tensor:
    rows, n = src.rows, src.n
    dev = src.x.device
    out = torch.empty(rows, wire.wire_bytes(n, spec), dtype=torch.uint8, device=dev)
    if n == 0:
        return out
    if spec.stochastic and key is None:
        raise ValueError("stochastic rounding needs an RngKey; pass key=RngKey(...)")
    if spec.stochastic:
        check_counter_range(rows, n)
    gs, bits = spec.group_size, spec.bits
    groups = wire.num_groups(n, spec)
    sdt = spec.torch_scale_dtype
    bdt = BITS_DTYPE[sdt]
    ss = sdt.itemsize
    code_off = wire.scale_section_bytes(n, spec)
    cb = wire.code_bytes(n, spec)
    out[:, code_off + cb:] = 0  # row alignment padding
    words = key.words() if spec.stochastic else None
    scratch = _Scratch(dev)
    full = n // gs
    for st in _steps(rows, n, gs):
        R, nb = st.r1 - st.r0, st.g1 - st.g0
        if st.g0 < full:
            g = src.block(st.r0, st.r1, st.g0 * gs, st.g1 * gs, scratch).view(R, nb, gs)
        else:  # the partial last group, padded with its last value (changes no min/max)
            g = _pad_cols(src.block(0, rows, full * gs, n, scratch), gs, "edge").view(R, 1, gs)
        starts = None
        if words is not None:
            starts = row_starts([r * n + st.g0 * gs for r in range(st.r0, st.r1)], dev)
        codes, scale, mins = _encode_groups(g, spec, starts, words, scratch)
        out[st.r0:st.r1, st.g0 * ss:st.g1 * ss].view(bdt).copy_(scale)
        if mins is not None:
            m0 = groups * ss
            out[st.r0:st.r1, m0 + st.g0 * ss:m0 + st.g1 * ss].view(bdt).copy_(mins)
        c0 = code_off + st.g0 * gs * bits // 8
        if st.g0 < full:
            _pack_into(codes, bits, out[st.r0:st.r1, c0:c0 + nb * gs * bits // 8])
        else:
            codes[:, n - full * gs:] = 0  # padding elements encode as 0
            packed = scratch.get("packed", R * gs * bits // 8, torch.uint8).view(R, -1)
            _pack_into(codes, bits, packed)
            out[:, c0:code_off + cb] = packed[:, :code_off + cb - c0]
    return out


def _group_reciprocal(scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(f, 1 / (scale * f)) of each group's nonzero scale: the encoders divide by it as
    ``t = (x * f) * r`` (``wire.py``, "Encoding"); f = ``TINY_PRESCALE`` below ``TINY_SCALE``
    (else 1) keeps the reciprocal finite."""
    f = torch.where(scale < wire.TINY_SCALE, wire.TINY_PRESCALE, 1.0)
    return f, 1.0 / (scale * f)


def stored_min(mn: torch.Tensor, sdt: torch.dtype) -> torch.Tensor:
    """An asymmetric group's minimum as stored (``wire.py``), in fp32: the largest value of the
    scale dtype at or below ``mn``, so no value of the group lies under the codes' origin (a
    minimum rounded up made them clamp to code 0, up to half a 16-bit spacing of |min| away:
    many steps for a tight group far from zero). Rounded to nearest, then one 16-bit pattern
    down where that went above, unless that is -inf (a float16 minimum just below -65504 keeps
    -65504: its group stays finite); a zero is stored as +0. The Triton kernels: ``round_min``."""
    if sdt == torch.float32:
        return mn + 0.0
    r = mn.to(sdt)
    y = r.to(torch.float32)
    b = r.view(torch.int16).to(torch.int32)
    down = torch.where(y > 0, b - 1, torch.where(y < 0, b + 1, torch.full_like(b, -32767)))
    finite = down.to(torch.int16).view(sdt).to(torch.float32) > float("-inf")
    b = torch.where((y > mn) & finite, down, b).to(torch.int16)
    return b.view(sdt).to(torch.float32) + 0.0


def _encode_groups(
    g: torch.Tensor, spec: QuantSpec, starts: Optional[torch.Tensor],
    words: Optional[tuple[int, int]], scratch: _Scratch,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Groups [R, nb, gs] -> (uint8 codes [R, nb*gs] in scratch, scale bits [R, nb], min bits
    [R, nb] or None). Op for op the arithmetic of the Triton kernels."""
    R, nb, gs = g.shape
    sdt = spec.torch_scale_dtype
    # Two single reductions: CPU aminmax over a short last dim is ~10x slower than amax + amin.
    # Same values (exact, NaN-propagating); a zero's sign cannot matter (zero scales become 1,
    # a zero min is stored as +0).
    mn, mx = torch.amin(g, dim=-1), torch.amax(g, dim=-1)
    if spec.symmetric:
        amax = torch.maximum(mx, mn.neg_())  # == |g|.amax(-1), NaN included
        bad = torch.isfinite(amax).logical_not_()
        scale = (amax / spec.qmax).to(sdt).to(torch.float32)
        mins = None
    else:
        bad = (torch.isfinite(mn) & torch.isfinite(mx)).logical_not_()
        mins = stored_min(mn, sdt)
        scale = ((mx - mins) / spec.qmax).to(sdt).to(torch.float32)
    scale.masked_fill_(scale == 0, 1.0)
    t = scratch.get("t", R * nb * gs, torch.float32).view(R, nb, gs)
    f, recip = _group_reciprocal(scale)  # t = (g * f) * recip
    num = g if mins is None else torch.sub(g, mins[..., None], out=t)
    if bool((f != 1.0).any()):  # else multiplying by f is exact: skip that pass
        num = torch.mul(num, f[..., None], out=t)
    torch.mul(num, recip[..., None], out=t)
    if starts is not None:
        x = scratch.get("x", t.numel(), torch.int32).view(R, -1)
        tmp = scratch.get("tmp", t.numel(), torch.int32).view(R, -1)
        add_uniform_(t.view(R, -1), starts, words, x, tmp)
    else:
        t.add_(0.5)
    t.floor_()
    codes = scratch.get("codes", t.numel(), torch.uint8).view(R, -1)
    any_bad = bool(bad.any())
    if spec.symmetric:
        t.clamp_(-spec.qmax, spec.qmax)
        if any_bad:
            t.masked_fill_(bad[..., None], 0.0)  # NaN codes would be undefined
        codes.view(torch.int8).copy_(t.view(R, -1))
        codes.add_(spec.qmax)  # two's complement + bias wraps to the unsigned code
    else:
        t.clamp_(0, spec.qmax)
        if any_bad:
            t.masked_fill_(bad[..., None], 0.0)
        codes.copy_(t.view(R, -1))
    bdt = BITS_DTYPE[sdt]

    def _bits(s: torch.Tensor) -> torch.Tensor:
        b = s.to(sdt).view(bdt)
        if any_bad:
            nan_bits = torch.tensor(wire.NAN_BITS[spec.scale_dtype], dtype=bdt, device=b.device)
            b = torch.where(bad, nan_bits, b)
        return b

    return codes, _bits(scale), (None if mins is None else _bits(mins))


_LUTS: dict[tuple[int, int, str], torch.Tensor] = {}


def _lut(bits: int, bias: int, device: torch.device) -> torch.Tensor:
    """[256, 8 // bits] fp32: the (code - bias) values of the codes packed in each byte."""
    k = (bits, bias, str(device))
    t = _LUTS.get(k)
    if t is None:
        b = torch.arange(256, dtype=torch.uint8, device=device)[:, None]
        t = _LUTS[k] = (unpack_codes(b, bits) - bias).to(torch.float32)
    return t


def _code_values(data: torch.Tensor, count: int, spec: QuantSpec, scratch: _Scratch,
                 name: str) -> torch.Tensor:
    """Code bytes [R, count*bits/8] -> fp32 [R, count] of (code - bias) (symmetric bias is
    qmax, asymmetric 0), exact: small integers."""
    R, bits = data.shape[0], spec.bits
    bias = spec.qmax if spec.symmetric else 0
    vals = scratch.get(name, R * count, torch.float32)
    if bits in (2, 4):
        idx = scratch.get("idx", data.numel(), torch.int32).view_as(data)
        idx.copy_(data)
        torch.index_select(_lut(bits, bias, data.device), 0, idx.view(-1),
                           out=vals.view(-1, 8 // bits))
    else:
        # 8 bits: a direct u8 -> f32 conversion beats a one-wide table gather.
        vals.view(R, -1).copy_(data if bits == 8 else unpack_codes(data, bits))
        if bias:
            vals.sub_(bias)
    return vals.view(R, count)


class _Wire(NamedTuple):
    """One wire block's per-row scales (and mins) as fp32 [R, G], read once per call."""

    data: torch.Tensor
    scale: torch.Tensor
    mins: Optional[torch.Tensor]


def _read_wire(data: torch.Tensor, n: int, spec: QuantSpec) -> _Wire:
    sdt = spec.torch_scale_dtype
    sb = wire.num_groups(n, spec) * sdt.itemsize
    scale = data[:, :sb].contiguous().view(sdt).to(torch.float32)
    mins = None
    if not spec.symmetric:
        mins = data[:, sb:2 * sb].contiguous().view(sdt).to(torch.float32)
    return _Wire(data, scale, mins)


def _decode_step(w: _Wire, n: int, spec: QuantSpec, st: _Step, dst: torch.Tensor, add: bool,
                 scratch: _Scratch) -> None:
    """Decode ``st`` of ``w`` into ``dst`` (fp32 [R, count], ``+=`` when ``add``)."""
    gs, bits = spec.group_size, spec.bits
    code_off = wire.scale_section_bytes(n, spec)
    c0 = code_off + st.g0 * gs * bits // 8
    full = n // gs
    R, nb = st.r1 - st.r0, st.g1 - st.g0
    count = nb * gs if st.g0 < full else -(-(n - full * gs) // 8) * 8
    vals = _code_values(w.data[st.r0:st.r1, c0:c0 + count * bits // 8], count, spec, scratch,
                        "vals")
    vals = vals[:, :dst.shape[1]].view(R, nb, -1)
    scale = w.scale[st.r0:st.r1, st.g0:st.g1, None]
    res = dst.view(R, nb, -1)
    if add:  # x = decoded value, then dst += x: the same two roundings as the reference
        x = scratch.get("sum", vals.numel(), torch.float32).view(R, nb, -1)
        torch.mul(vals, scale, out=x)
        if w.mins is not None:
            x.add_(w.mins[st.r0:st.r1, st.g0:st.g1, None])
        res.add_(x)
    else:
        torch.mul(vals, scale, out=res)
        if w.mins is not None:
            res.add_(w.mins[st.r0:st.r1, st.g0:st.g1, None])


def _decode_sum(
    chunks: Sequence[torch.Tensor], n: int, spec: QuantSpec, *, hadamard: bool = False,
    n_out: Optional[int] = None, out: Optional[torch.Tensor] = None, accumulate: bool = False,
) -> torch.Tensor:
    """Sum over chunks, in order, of their decoded fp32 [R, n] (one chunk: just decode).

    ``hadamard``: then apply ``H32 / 32`` and keep the first ``n_out`` values; done per step
    on a cache-sized block (needs 32-aligned groups, see ``_fused_ok``). ``out``: fp32
    [R, n_out] with contiguous rows to write (``accumulate``: add) into instead of a new tensor.
    The per-element ops are those of decoding everything, then rotating, then scaling, then
    adding.
    """
    n_out = n if n_out is None else n_out
    rows = chunks[0].shape[0]
    dev = chunks[0].device
    target = out if out is not None else torch.empty(rows, n_out, dtype=torch.float32, device=dev)
    if n == 0:
        return target
    ws = [_read_wire(c, n, spec) for c in chunks]
    scratch = _Scratch(dev)
    gs = spec.group_size
    for st in _steps(rows, n, gs):
        R, c0, c1 = st.r1 - st.r0, st.g0 * gs, min(n, st.g1 * gs)
        if not hadamard:
            dst = target[st.r0:st.r1, c0:c1]
            for j, w in enumerate(ws):
                _decode_step(w, n, spec, st, dst, accumulate or j > 0, scratch)
            continue
        blk = scratch.get("hblk", R * (c1 - c0), torch.float32).view(R, c1 - c0)
        for j, w in enumerate(ws):
            _decode_step(w, n, spec, st, blk, j > 0, scratch)
        hr = 32 * min(blk.numel() // 32, _HROWS)
        _hadamard_rows(blk.view(-1, 32), blk.view(-1, 32), scratch.get("ha", hr, torch.float32),
                       scratch.get("hb", hr, torch.float32))
        e = min(n_out, c1)
        if e <= c0:
            continue
        dst = target[st.r0:st.r1, c0:e]
        if accumulate:
            dst.add_(blk[:, :e - c0].mul_(1.0 / 32))
        else:
            torch.mul(blk[:, :e - c0], 1.0 / 32, out=dst)
    return target


def _fused_ok(spec: QuantSpec, hadamard: bool, out: Optional[torch.Tensor]) -> bool:
    """Whether ``_decode_sum`` can rotate per step and write straight into ``out``."""
    if hadamard and spec.group_size % wire.HADAMARD_BLOCK:
        return False
    return out is None or (out.dtype == torch.float32 and out.stride(-1) == 1)


def decode(data: torch.Tensor, n: int, spec: QuantSpec) -> torch.Tensor:
    """uint8 [R, wire_bytes(n)] -> fp32 [R, n]."""
    return _decode_sum([data], n, spec)


# ---- fused forms used by the collectives ----------------------------------------------------
def quantize(
    x: torch.Tensor,
    spec: QuantSpec,
    key: Optional[RngKey],
    ref: Optional[torch.Tensor] = None,
    hadamard: bool = False,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """[R, n] -> wire rows (written into ``out`` [R, W] when given). ``ref``: encode
    ``x - ref`` (qWD send). ``hadamard``: encode ``H32 x`` of the row zero-padded to
    ``hadamard_len(n)``."""
    res = _quantize(x, spec, key, ref, hadamard)
    if out is None:
        return res
    out.copy_(res)
    return out


def _quantize(x: torch.Tensor, spec: QuantSpec, key: Optional[RngKey],
              ref: Optional[torch.Tensor], hadamard: bool) -> torch.Tensor:
    v = x.to(torch.float32)
    r = None if ref is None else ref.to(torch.float32)
    if hadamard and spec.group_size % wire.HADAMARD_BLOCK:
        # Groups would cut 32-blocks, so rotate the whole padded row first.
        if r is not None:
            v = v - r
        v = hadamard32(_pad_cols(v, wire.hadamard_len(v.shape[1]), "zero"))
        r, hadamard = None, False
    if r is None and not hadamard:
        v = v.contiguous()
    return _encode(_Source(v, r, hadamard), spec, key)


def dequantize(
    data: torch.Tensor,
    n: int,
    spec: QuantSpec,
    hadamard: bool = False,
    out: Optional[torch.Tensor] = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """Wire rows -> [R, n]. ``accumulate`` adds into ``out`` (qWD receive: ``ref += d``)."""
    m = wire.hadamard_len(n) if hadamard else n
    if _fused_ok(spec, hadamard, out):
        return _decode_sum([data], m, spec, hadamard=hadamard, n_out=n, out=out,
                           accumulate=accumulate)
    x = decode(data, m, spec)
    if hadamard:
        x = hadamard32(x)[:, :n] * (1.0 / 32)
    return _write(x, out, accumulate)


def reduce_requantize(
    chunks: Sequence[torch.Tensor],
    n: int,
    spec_in: QuantSpec,
    spec_out: QuantSpec,
    key: Optional[RngKey],
) -> torch.Tensor:
    """Sum of k decoded wire blocks (in order) re-encoded with ``spec_out`` (hop 1 -> hop 2).
    ``n`` is the encoded row length (already Hadamard-padded where used)."""
    if spec_out.group_size % spec_in.group_size == 0:
        return _encode(_SumSource(chunks, n, spec_in), spec_out, key)
    return encode(_decode_sum(chunks, n, spec_in), spec_out, key)


def reduce_dequantize(
    chunks: Sequence[torch.Tensor],
    n: int,
    spec: QuantSpec,
    hadamard: bool = False,
    out: Optional[torch.Tensor] = None,
    divide: Optional[float] = None,
) -> torch.Tensor:
    """Sum of k decoded wire blocks, inverse Hadamard once, first ``n`` values (final hop),
    each divided by ``divide`` in fp32 when given (AVG's mean)."""
    m = wire.hadamard_len(n) if hadamard else n

    def reduce(o: Optional[torch.Tensor]) -> torch.Tensor:
        if _fused_ok(spec, hadamard, o):
            return _decode_sum(chunks, m, spec, hadamard=hadamard, n_out=n, out=o)
        acc = _decode_sum(chunks, m, spec)
        if hadamard:
            acc = hadamard32(acc)[:, :n] * (1.0 / 32)
        return _write(acc, o, False)

    return divided(reduce, out, divide)


def divided(reduce: Callable[[Optional[torch.Tensor]], torch.Tensor],
            out: Optional[torch.Tensor], divide: Optional[float]) -> torch.Tensor:
    """``reduce(out)`` (an fp32 sum, written into ``out`` when given), each value then divided
    by ``divide``: in place in fp32, or before the cast into an ``out`` of another dtype."""
    if divide is None:
        return reduce(out)
    if out is None or out.dtype == torch.float32:
        return reduce(out).div_(divide)
    out.copy_(reduce(None).div_(divide))
    return out


def _write(x: torch.Tensor, out: Optional[torch.Tensor], accumulate: bool) -> torch.Tensor:
    if out is None:
        return x
    if accumulate:
        out.copy_(out.to(torch.float32) + x)
    else:
        out.copy_(x)
    return out


# ---- learned levels (codec.levels) ------------------------------------------------------------
def _pad_edge(v: torch.Tensor, width: int) -> torch.Tensor:
    return _pad_cols(v, width, "edge")


def level_groups(v: torch.Tensor, spec: QuantSpec):
    """fp32 rows [R, n] -> per-group normalized values ``t`` [R, G, gs] (clamped to the table's
    domain, 0 in non-finite groups), the stored scale and min [R, G] (fp32, rounded to the
    scale dtype; min None for symmetric specs) and the non-finite mask [R, G].

    The scale is the group's absmax (symmetric) or max - min; a zero scale or min is stored as
    +0 (``+ 0.0``), so the bytes do not depend on which zero a reduction returns. ``t`` is
    ``(x * f) * (1 / (s * f))`` (``x - min`` for ``x`` if asymmetric; ``s`` the scale, 1 if
    zero): a reciprocal per group, as the uniform codes (``wire.py``, "Encoding")."""
    rows, n = v.shape
    gs = spec.group_size
    groups = wire.num_groups(n, spec)
    g = _pad_edge(v, groups * gs).view(rows, groups, gs)
    sdt = spec.torch_scale_dtype
    if spec.symmetric:
        amax = g.abs().amax(-1)
        bad = ~torch.isfinite(amax)
        scale = amax.to(sdt).to(torch.float32) + 0.0
        mins = None
        num = g
    else:
        mn, mx = g.amin(-1), g.amax(-1)
        bad = ~(torch.isfinite(mn) & torch.isfinite(mx))
        mins = stored_min(mn, sdt)
        scale = (mx - mins).to(sdt).to(torch.float32) + 0.0
        num = g - mins[..., None]
    f, recip = _group_reciprocal(torch.where(scale == 0, torch.ones_like(scale), scale))
    t = (num * f[..., None]) * recip[..., None]
    lo, hi = wire.levels_domain(spec)
    t = torch.where(bad[..., None], torch.zeros_like(t), t).clamp_(lo, hi)
    return t, scale, mins, bad


def quantize_levels(
    rows: torch.Tensor, spec: QuantSpec, levels: torch.Tensor, key: Optional[RngKey]
) -> torch.Tensor:
    """Float rows [R, n] -> learned-levels wire rows [R, levels_wire_bytes(n)] on the table
    ``levels`` (fp32 [2^b], on any device)."""
    v = rows.to(torch.float32)
    R, n = v.shape
    tb = wire.table_bytes(spec)
    out = torch.zeros(R, wire.levels_wire_bytes(n, spec), dtype=torch.uint8, device=v.device)
    if n == 0 or R == 0:
        return out
    if spec.stochastic and key is None:
        raise ValueError("stochastic rounding needs an RngKey; pass key=RngKey(...)")
    L = levels.to(device=v.device, dtype=wire.LEVELS_DTYPE)
    t, scale, mins, bad = level_groups(v, spec)
    k = torch.searchsorted(L, t.contiguous(), right=True).sub_(1)
    k.clamp_(0, wire.num_levels(spec) - 2)
    # code k + 1 with probability d / gap, compared without dividing: u * gap < d (nearest:
    # d + d >= gap, d / gap >= 1/2), which every implementation computes as written
    d, gap = t - L[k], L[k + 1] - L[k]
    if spec.stochastic:
        groups, gs = t.shape[1], t.shape[2]
        u = uniform_rows(R, groups * gs, n, key, v.device).view_as(t)
        q = k + (u * gap < d).to(k.dtype)
    else:
        q = k + (d + d >= gap).to(k.dtype)
    q = torch.where(bad[..., None], torch.zeros_like(q), q)
    n8 = -(-n // 8) * 8
    codes = q.view(R, -1)[:, :n8].clone()
    codes[:, n:] = 0
    sdt = spec.torch_scale_dtype
    bdt = BITS_DTYPE[sdt]
    nan = torch.tensor(wire.NAN_BITS[spec.scale_dtype], dtype=bdt, device=v.device)
    sbytes = wire.num_groups(n, spec) * sdt.itemsize

    def _scale_bytes(s: torch.Tensor) -> torch.Tensor:
        s = torch.where(bad, nan, s.to(sdt).view(bdt))
        return s.view(torch.uint8).view(R, sbytes)

    out[:, :tb] = L.view(torch.uint8)[None, :]
    off = tb
    out[:, off:off + sbytes] = _scale_bytes(scale)
    off += sbytes
    if mins is not None:
        out[:, off:off + sbytes] = _scale_bytes(mins)
        off += sbytes
    out[:, off:off + wire.code_bytes(n, spec)] = pack_codes(codes, spec.bits)
    return out


def _decode_levels(data: torch.Tensor, n: int, spec: QuantSpec) -> torch.Tensor:
    rows = data.shape[0]
    tb = wire.table_bytes(spec)
    L = data[:, :tb].contiguous().view(wire.LEVELS_DTYPE)  # [rows, 2^b]
    sdt = spec.torch_scale_dtype
    groups = wire.num_groups(n, spec)
    sbytes = groups * sdt.itemsize
    off = tb
    scale = data[:, off:off + sbytes].contiguous().view(sdt).to(torch.float32)
    off += sbytes
    mins = None
    if not spec.symmetric:
        mins = data[:, off:off + sbytes].contiguous().view(sdt).to(torch.float32)
        off += sbytes
    codes = unpack_codes(data[:, off:off + wire.code_bytes(n, spec)], spec.bits).to(torch.int64)
    gs = spec.group_size
    width = groups * gs
    if codes.shape[1] < width:
        codes = torch.nn.functional.pad(codes, (0, width - codes.shape[1]))
    codes = codes[:, :width]
    lv = torch.gather(L, 1, codes).view(rows, groups, gs)
    x = lv * scale[..., None]
    if mins is not None:
        x = x + mins[..., None]
    return x.view(rows, -1)[:, :n]


def dequantize_levels_sum(
    chunks: Sequence[torch.Tensor],
    n: int,
    spec: QuantSpec,
    out: Optional[torch.Tensor] = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """Sum over k learned-levels blocks [R, W] (in order) of their decoded fp32 [R, n]; written
    into (``accumulate``: added to) ``out`` when given."""
    rows = chunks[0].shape[0]
    if n == 0 or rows == 0:
        acc = torch.empty(rows, n, dtype=torch.float32, device=chunks[0].device)
    else:
        acc = _decode_levels(chunks[0], n, spec)
        for c in chunks[1:]:
            acc = acc + _decode_levels(c, n, spec)
    return _write(acc, out, accumulate)

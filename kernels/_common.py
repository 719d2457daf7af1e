"""Pieces shared by the codec kernels: row layout, RNG, bit packing, Hadamard, scales.

Every helper mirrors one step of ``fsdp_qcomm.codec.torch_codec`` op for op, so the kernels
write the same bytes (see ``fsdp_qcomm.codec.wire`` for the format). What keeps them
bit-identical on a GPU, where the Triton interpreter alone would not show a difference:

* divisions are ``tl.math.div_rn`` (IEEE round-to-nearest, like torch's ``/``); Triton's ``/``
  on fp32 may lower to an approximate division;
* kernels launch with ``enable_fp_fusion=False`` so ``a * b + c`` is not contracted into a
  fused multiply-add (torch rounds the product first). Where it matters: the asymmetric
  decode ``code * scale + min``, which feeds dequantized outputs and the sums that
  ``reduce_requantize`` re-encodes, and the encoder's ``t = (x * f) * r`` before ``t + u``
  (an ulp there can flip a code);
* kernels launch with ``enable_reflect_ftz=False``: libdevice's ``floor`` would otherwise flush
  subnormals to zero (``floor(-1e-40)`` is -1 in torch, -0 with FTZ);
* bfloat16 <-> float32 conversions are integer ops (round to nearest even), identical on GPUs
  and in the interpreter, whose own float32 -> bfloat16 cast truncates;
* NaN scales are written as the bit patterns ``wire.NAN_BITS`` (float casts of NaN give
  different payloads on CPUs and GPUs), and a -0 minimum as +0;
* the Hadamard transform is the same five butterfly stages with the same ``(a + b, a - b)``
  pairs, and sums over received chunks run in order 0..k-1 starting from chunk 0.

NaNs produced by arithmetic in decoded values can carry other payloads than torch's; they are
still NaN at the same places.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable

import torch
import triton
import triton.language as tl

from ..codec import wire
from ..config import QuantSpec

# Elements one program handles in the element-tiled kernels (the decoders, the reduce kernels):
# with 8 warps, 8 a thread. On an H100 (results/gpu_check/h100_2026-12-06, step "tiles") no
# other tile was faster for all of them: qWD's decode-and-add gained 0.09x of clone at 1024,
# the learned 4-bit decoder lost 0.08x at 4096.
TILE = 2048
# The same for the encoders, which hold whole groups (``group_tiling``; larger groups loop over
# sub-tiles): 16 elements a thread. On that H100 every ``quantize`` row ran 16-37% faster at 4096
# than at 2048 (4-bit g128 +H32 0.48 -> 0.56x clone, qWD's 0.66 -> 0.80x), the other encoders
# within 2% (QSDP's learned levels were 18% faster at 1024: one run, not acted on); the extra
# registers (58-71 against 40-44, ``benchmarks/kernel_sass.py``) spill nothing.
# ``benchmarks/gpu_kernels_bench.py --tile`` sets both tiles.
GROUP_TILE = 4096
# Scale dtypes by the code the kernels use as a constexpr.
_SCALE_KIND = {"float32": 0, "bfloat16": 1, "float16": 2}
_BITS_VIEW = {"float32": torch.int32, "bfloat16": torch.int16, "float16": torch.int16}
_NAN_F32 = tl.constexpr(wire.NAN_BITS["float32"])
_NAN_BF16 = tl.constexpr(wire.NAN_BITS["bfloat16"])
_NAN_F16 = tl.constexpr(wire.NAN_BITS["float16"])
_TINY_SCALE = tl.constexpr(wire.TINY_SCALE)
_TINY_PRESCALE = tl.constexpr(wire.TINY_PRESCALE)
_ROUNDER = tl.constexpr(12582912.0)  # 1.5 * 2^23
_ROUNDER_BITS = tl.constexpr(0x4B400000)  # its float32 bits
_INT_FLOAT = tl.constexpr(8388608.0)  # 2^23: an integer below 2^23 ORed into its bits is 2^23 + it
_INT_FLOAT_BITS = tl.constexpr(0x4B000000)
_POS_INF_BITS = tl.constexpr(0x7F800000)
_NEG_INF_BITS = tl.constexpr(-0x800000)  # -inf's float32 bits as an int32 (0xFF800000)


# ---- host side --------------------------------------------------------------------------------
@dataclass(frozen=True)
class RowLayout:
    """Where scales, mins and codes of one wire row of ``n`` values sit (``wire`` format)."""

    spec: QuantSpec
    width: int  # bytes per row
    groups: int
    scale_words: int  # row width in units of the scale dtype
    code_end: int  # byte offset just past the codes; zero padding follows

    @classmethod
    def of(cls, n: int, spec: QuantSpec) -> "RowLayout":
        """The layout of ``n`` values under ``spec``, cached: a launch asks for it each call."""
        return _row_layout(cls, n, spec)

    def constexprs(self, prefix: str = "") -> dict:
        """The spec as the constexpr kernel arguments ``BITS, QMAX, SYM, SKIND, GS``."""
        s = self.spec
        return {
            f"{prefix}BITS": s.bits, f"{prefix}QMAX": s.qmax, f"{prefix}SYM": s.symmetric,
            f"{prefix}SKIND": _SCALE_KIND[s.scale_dtype], f"{prefix}GS": s.group_size,
        }


@functools.lru_cache(maxsize=4096)
def _row_layout(cls, n: int, spec: QuantSpec) -> RowLayout:
    itemsize = spec.torch_scale_dtype.itemsize
    width = wire.wire_bytes(n, spec)
    off = wire.scale_section_bytes(n, spec)
    return cls(
        spec=spec, width=width, groups=wire.num_groups(n, spec),
        scale_words=width // itemsize, code_end=off + wire.code_bytes(n, spec),
    )


def scale_view(data: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """The same bytes as integers of the scale's width (rows are 4-byte multiples)."""
    return data.view(_BITS_VIEW[spec.scale_dtype])


def aligned_rows(data: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """``data`` as contiguous rows whose start allows the integer scale view."""
    itemsize = spec.torch_scale_dtype.itemsize
    if not data.is_contiguous() or data.storage_offset() % itemsize:
        data = data.clone(memory_format=torch.contiguous_format)
    return data


def key_words(key, stochastic: bool) -> tuple[int, int]:
    """RNG key words as signed int32 values (the kernels bitcast them back to uint32)."""
    if not stochastic:
        return 0, 0
    return tuple(w - (1 << 32) if w >= 1 << 31 else w for w in key.words())


def check_row_len(n: int, group_size: int) -> None:
    """Indices inside a row (including a tile's overhang past its end) are int32."""
    if n + 2 * max(group_size, TILE, GROUP_TILE) >= 1 << 31:
        raise ValueError(f"rows of {n} values are too long for the kernels' int32 indexing; "
                         "split them into more rows (shards) of fewer than 2^31 - 2^16 values")


def launch_opts(tile: int) -> dict:
    """Launch options: no FMA contraction, no flush-to-zero (see above); warps by tile size."""
    return {"enable_fp_fusion": False, "enable_reflect_ftz": False,
            "num_warps": max(1, min(8, tile // 256))}


def table_to(device: str, *tables: torch.Tensor):
    """Small host-built tables (a layout's segment offsets) on ``device``: copied from pinned
    memory without a host sync, with the event a launch on any stream must wait for
    (``wait_for``; None on the CPU)."""
    if device == "cpu":
        return (*tables, None)
    moved = tuple(t.pin_memory().to(device, non_blocking=True) for t in tables)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(moved[0].device))
    return (*moved, done)


def wait_for(done, device: torch.device, *tables: torch.Tensor) -> None:
    """The current stream of ``device`` waits (on the GPU) for a ``table_to`` copy, and its
    ``tables`` are marked as read by that stream. The caches that hold them evict on the host:
    an evicted table's memory would go back to the stream it was copied on at once, free for that
    stream to reuse while a kernel queued on this one still reads it (``record_stream`` keeps
    it until this stream's work queued before the free is done)."""
    if done is not None:
        stream = torch.cuda.current_stream(device)
        stream.wait_event(done)
        for t in tables:
            t.record_stream(stream)


def on_device(t: torch.Tensor):
    """Launch on the tensor's GPU, not whichever is current (a no-op for CPU tensors)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def aligned_segment(n: int, off: int, woff: int) -> bool:
    """Whether a segment of a grouped launch (``quantize_segments``, ``dequantize_segments``)
    may be read as the whole-row kernels read a row whose length and offsets Triton knows to be
    aligned (``segment_hints``): ``n`` values at value offset ``off``, multiples of 8, and its
    wire row at a multiple of 4 bytes (the format's row alignment)."""
    return n % 8 == 0 and off % 8 == 0 and woff % 4 == 0


def cdiv(a: int, b: int) -> int:
    """Ceiling division on the host. ``triton.cdiv`` is a ``ConstexprFunction`` since triton
    3.6, and called from Python it costs microseconds per call on every launch."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n >= 1, on the host, as ``triton.next_power_of_2``."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def group_tiling(group_size: int) -> tuple[int, int, int]:
    """(GS_P2, GPB, SUB) of an encoder: padded group width, groups per program, sub-tile of a
    group larger than ``GROUP_TILE``."""
    gs_p2 = next_power_of_2(group_size)
    if gs_p2 <= GROUP_TILE:
        return gs_p2, max(1, GROUP_TILE // gs_p2), gs_p2
    return gs_p2, 1, GROUP_TILE


# ---- device side: program layout ------------------------------------------------------------
@triton.jit
def row_block(nblk):
    """(row, block in the row, row as int64) of this program: programs are rows x nblk."""
    pid = tl.program_id(0)
    row = pid // nblk
    blk = pid - row * nblk
    return row, blk, row.to(tl.int64)


@triton.jit
def segment_sizes(t):
    """(first block, values, encoded length, groups) of the segment whose table row starts at
    ``t`` (columns 0, 1, 2 and 5 of the grouped kernels' int64 tables), as int32: they fit
    (``check_row_len``), and int64 values would make every per-element index and mask of the
    segment 64-bit (the grouped decode-and-add into fp32 on sm_90, triton 3.6: 22.0 -> 20.2
    instructions per element, 32 -> 26 registers, ``benchmarks/kernel_sass.py``). The value
    and wire offsets stay int64: they are added to the base pointers once."""
    return (tl.load(t).to(tl.int32), tl.load(t + 1).to(tl.int32), tl.load(t + 2).to(tl.int32),
            tl.load(t + 5).to(tl.int32))


@triton.jit
def segment_hints(n, m, off, woff, ALIGNED: tl.constexpr):
    """A segment's length n (encoded length m), value offset and wire offset, loaded from a
    table, with the alignment the host checked (``aligned_segment``) made visible to Triton
    (``tl.multiple_of`` drops its hint on scalars). A kernel argument that is a multiple of 16
    is specialized as one at launch; a loaded value is not, and without the hint every mask
    and address of the segment is taken per element: on sm_90 (triton 3.6) the grouped
    decode-and-add of qWD into bf16 counts 46.0 instructions per element with 20 loads and 8
    stores a thread, and 28.5 with 10 and 1 aligned (``benchmarks/kernel_sass.py``)."""
    if ALIGNED:  # x // 8 * 8 is x here, and Triton then knows it divides by 8
        n = n // 8 * 8
        m = m // 8 * 8
        off = off // 8 * 8
        woff = woff // 4 * 4
    return n, m, off, woff


@triton.jit
def group_tile(grp, gmask, s, n, GS: tl.constexpr, NB8: tl.constexpr):
    """Sub-tile ``s`` (NB8 8-blocks) of the groups ``grp`` [GPB] of a row of ``n`` values:
    (e8 [GPB, NB8] 8-block indices, e8_ok: blocks inside a group and the row, i [GPB, NB8, 8]
    element indices, valid: elements inside a group and the row). Whole groups: s = 0."""
    b8 = tl.arange(0, NB8)
    e8 = grp[:, None] * (GS // 8) + s * NB8 + b8[None, :]
    e8_ok = gmask[:, None] & ((s * NB8 + b8) < GS // 8)[None, :] & (e8 * 8 < n)
    i = e8[:, :, None] * 8 + tl.arange(0, 8)[None, None, :]
    valid = e8_ok[:, :, None] & (i < n)
    return e8, e8_ok, i, valid


@triton.jit
def _by8(lo, hi, A: tl.constexpr):
    """Halves [A * B, 4] -> [A, B * 8]: each 8-block is lo's 4 values, then hi's."""
    R: tl.constexpr = lo.shape[0]
    return tl.reshape(tl.permute(tl.join(lo, hi), [0, 2, 1]), [A, R // A * 8])


@triton.jit
def flat_group_tile(x_row, r_row, g0, G, n, m, GPB: tl.constexpr, GS: tl.constexpr,
                    SUB: tl.constexpr, BITS: tl.constexpr, HAS_REF: tl.constexpr):
    """The groups ``g0 + arange(GPB)`` of a row as one [GPB, SUB] tile, a group per row:
    (v: fp32 x - ref, loaded from the first ``n`` elements; i: element indices; valid:
    elements inside a group and the row of ``m``; inside: inside a group). Each group is one
    contiguous row of the tile, so Triton's coalescing gives it consecutive lanes of one warp
    whatever its version (``flat_tile``).

    How many consecutive values a thread holds follows from the kernel's widest memory access:
    8-bit codes are stored from the tile as it is, 8 bytes a thread, so the loads give each
    thread 8 values too. Packed 2- and 4-bit codes are stored a block's ``BITS`` bytes at a
    time (``store_codes_flat``), which alone would leave fp32 loads at 4 values a thread, two
    groups in each thread and the rotation's stages across more lanes; so each 8-block is
    loaded as two halves of 4, joined in the thread, and its masks are joined from the halves'.
    With the packed store that took the 4-bit g128 +H32 encoder on sm_90 from 67.0 / 66.0 to
    53.6 / 53.9 instructions per element on triton 3.6 / 3.9, one barrier instead of 3
    (``benchmarks/kernel_sass.py``; ``docs/gpu_path.md`` section 7)."""
    if BITS == 8:
        e = tl.arange(0, SUB)
        grp = g0 + tl.arange(0, GPB)
        i = grp[:, None] * GS + e[None, :]
        inside = (grp < G)[:, None] & (e < GS)[None, :]
        v = load_f32(x_row + i, inside & (i < n))
        if HAS_REF:
            v = v - load_f32(r_row + i, inside & (i < n))
        valid = inside & (i < m)
    else:
        B: tl.constexpr = SUB // 8
        h = tl.arange(0, GPB * B)[:, None]  # an 8-block of the tile
        e = (h % B) * 8 + tl.arange(0, 4)[None, :]  # its first half, in the group
        lo = (g0 + h // B) * GS + e
        # groups hold whole 8-blocks: the second half is inside a group if the first is
        in_lo = ((g0 + h // B) < G) & (e < GS)
        v_lo = load_f32(x_row + lo, in_lo & (lo < n))
        v_hi = load_f32(x_row + lo + 4, in_lo & (lo + 4 < n))
        if HAS_REF:
            v_lo = v_lo - load_f32(r_row + lo, in_lo & (lo < n))
            v_hi = v_hi - load_f32(r_row + lo + 4, in_lo & (lo + 4 < n))
        v = _by8(v_lo, v_hi, GPB)
        i = _by8(lo, lo + 4, GPB)
        inside = _by8(in_lo, in_lo, GPB)
        # joined from the halves, in which Triton sees 4 aligned consecutive indices and
        # compares once per half (the joined indices, once per element)
        valid = _by8(in_lo & (lo < m), in_lo & (lo + 4 < m), GPB)
    return v, i, valid, inside


@triton.jit
def write_values(out_ptr, row64, out_stride, e8, v, n, ACCUMULATE: tl.constexpr, base=None):
    """Write (``ACCUMULATE``: add) the values v [B, 8] of the 8-blocks e8 [B] into output row
    ``row64`` (any float dtype), the first ``n`` elements only. ``base`` (a row of the output's
    dtype; with ``ACCUMULATE``): the values are added to it instead of to the output row, and
    both take the sums. A thread holds whole 8-blocks (``load_codes8``); an fp32 block is 32
    bytes, twice what one store moves, so it goes out as two halves of 4 from the thread, where
    one [B, 8] store would have Triton convert the tile through shared memory, with a barrier,
    to give each thread 16 bytes."""
    o = out_ptr + row64 * out_stride
    b = o if base is None else base
    if out_ptr.dtype.element_ty == tl.float32:
        B: tl.constexpr = v.shape[0]
        lo, hi = tl.split(tl.permute(tl.reshape(v, [B, 2, 4]), [0, 2, 1]))
        i = e8[:, None] * 8 + tl.arange(0, 4)[None, :]
        _write_block(o + i, lo, i < n, ACCUMULATE, b + i, base is not None)
        _write_block(o + i + 4, hi, i + 4 < n, ACCUMULATE, b + i + 4, base is not None)
    else:
        i = e8[:, None] * 8 + tl.arange(0, 8)[None, :]
        _write_block(o + i, v, i < n, ACCUMULATE, b + i, base is not None)


@triton.jit
def _write_block(o, v, mask, ACCUMULATE: tl.constexpr, b, BOTH: tl.constexpr):
    """Store (or add into) one tile of output values; ``b``: where the values to add to are
    (``o`` itself, or with ``BOTH`` another row, which then takes the sums too)."""
    if ACCUMULATE:
        v = load_f32(b, mask) + v
    store_f32(o, v, mask)
    if BOTH:
        store_f32(b, v, mask)


# ---- device side: RNG -------------------------------------------------------------------------
@triton.jit
def _mix32_xor(x, w):
    """lowbias32 of ``x ^ w`` on uint32 (wrapping multiplies), as ``codec.rng._mix32``. The key
    word enters through its first xorshift, (x ^ w) ^ ((x ^ w) >> 16) = x ^ (x >> 16) ^ (w ^
    (w >> 16)), so the key's part is one value per program and the xors one 3-input op."""
    x = x ^ (x >> 16) ^ (w ^ (w >> 16))
    x = x * tl.full([], 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full([], 0x846CA68B, tl.uint32)
    x = x ^ (x >> 16)
    return x


@triton.jit
def _pair_uniform(bits):
    """``(16 bits + 1/2) * 2^-16`` for 16 bits at bits 22..7 of ``bits``, from its float bits."""
    one_u = ((bits & 0x7FFF80) | 0x3F800040).to(tl.float32, bitcast=True)  # 1 + u
    return one_u - 1.0  # exact


@triton.jit
def uniform(row, numel, i, k0, k1):
    """``codec.rng``'s u for element i [..., 2m] of row ``row``: one hash per pair (i, i + 1),
    i even, of counter ``(row * numel + i) mod 2^32``; k0, k1 are int32 key words. i's last
    axis holds whole pairs in order (tiles start at even indices: groups hold multiples of 8).
    """
    if len(i.shape) == 2:
        even, _ = tl.split(tl.reshape(i, [i.shape[0], i.shape[1] // 2, 2]))
    else:
        even, _ = tl.split(tl.reshape(i, [i.shape[0], i.shape[1], i.shape[2] // 2, 2]))
    c = tl.cast(row, tl.uint32) * tl.cast(numel, tl.uint32) + even.to(tl.uint32)
    w0 = tl.cast(k0, tl.uint32, bitcast=True)
    w1 = tl.cast(k1, tl.uint32, bitcast=True)
    x = _mix32_xor(_mix32_xor(c, w0), w1)
    tl.static_assert(x.dtype == tl.uint32)
    return tl.reshape(tl.join(_pair_uniform(x << 7), _pair_uniform(x >> 9)), i.shape)


# ---- device side: float conversions ----------------------------------------------------------
# bfloat16 <-> float32 go through integer ops: the result is then the same on GPUs and in the
# Triton interpreter (whose float32 -> bfloat16 cast truncates instead of rounding).
@triton.jit
def bf16_bits_to_f32(b):
    """bfloat16 bits (int16) -> float32, exact."""
    return (b.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def f32_to_bf16_bits(x):
    """float32 -> bfloat16 bits (int16), round to nearest even; NaN -> 0x7FC0."""
    u = x.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    r = tl.where(x != x, 0x7FC0, r)
    return r.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def load_f32(ptr, mask):
    """Load float32/bfloat16/float16 values as float32 (masked lanes 0)."""
    v = tl.load(ptr, mask=mask, other=0.0)
    if v.dtype == tl.bfloat16:
        y = bf16_bits_to_f32(v.to(tl.int16, bitcast=True))
    else:
        y = v.to(tl.float32)
    return y


@triton.jit
def store_f32(ptr, v, mask):
    """Store float32 values into a float tensor of any dtype (bfloat16 rounded as above)."""
    if ptr.dtype.element_ty == tl.bfloat16:
        tl.store(ptr, f32_to_bf16_bits(v).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(ptr, v.to(ptr.dtype.element_ty), mask=mask)


# ---- device side: scales ----------------------------------------------------------------------
@triton.jit
def round_scale(x, SKIND: tl.constexpr):
    """fp32 -> scale dtype -> fp32 (round to nearest even)."""
    if SKIND == 1:
        y = bf16_bits_to_f32(f32_to_bf16_bits(x))
    elif SKIND == 2:
        y = x.to(tl.float16).to(tl.float32)
    else:
        y = x
    return y


@triton.jit
def round_min(x, SKIND: tl.constexpr):
    """fp32 -> the largest scale-dtype value <= x, as fp32: an asymmetric group's stored
    minimum (``wire.py``). Rounded to nearest, then one step down where that went above x
    (a 16-bit pattern one down in magnitude order; below a zero, the smallest negative
    subnormal) unless that step gives -inf, so no value of the group lies under the codes'
    origin and clamps to code 0. Torch twin: ``torch_codec.stored_min``."""
    if SKIND == 0:
        y = x
    else:
        if SKIND == 1:
            b = f32_to_bf16_bits(x).to(tl.int32)
        else:
            b = x.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
        y = bits_to_scale(b.to(tl.int16), SKIND)
        down = tl.where(y > 0.0, b - 1, tl.where(y < 0.0, b + 1, -32767))
        below = bits_to_scale(down.to(tl.int16), SKIND)
        y = bits_to_scale(tl.where((y > x) & (below > -float("inf")), down, b).to(tl.int16),
                          SKIND)
    return y


@triton.jit
def scale_to_bits(x, bad, SKIND: tl.constexpr):
    """fp32 scale (already representable) -> integer bits; ``bad`` groups get the NaN bits."""
    if SKIND == 1:
        b = f32_to_bf16_bits(x)
        b = tl.where(bad != 0, tl.full(b.shape, _NAN_BF16, tl.int16), b)
    elif SKIND == 2:
        b = x.to(tl.float16).to(tl.int16, bitcast=True)
        b = tl.where(bad != 0, tl.full(b.shape, _NAN_F16, tl.int16), b)
    else:
        b = x.to(tl.int32, bitcast=True)
        b = tl.where(bad != 0, tl.full(b.shape, _NAN_F32, tl.int32), b)
    return b


@triton.jit
def bits_to_scale(b, SKIND: tl.constexpr):
    if SKIND == 1:
        y = bf16_bits_to_f32(b)
    elif SKIND == 2:
        y = b.to(tl.float16, bitcast=True).to(tl.float32)
    else:
        y = b.to(tl.float32, bitcast=True)
    return y


# ---- device side: bit packing -----------------------------------------------------------------
@triton.jit
def pack8(codes, BITS: tl.constexpr):
    """codes [A, B, 8] (int32, < 2^BITS) -> bytes [A, B, 8] of each 8-block's ``BITS`` bytes
    (LSB-first bit stream; bytes >= BITS come out 0)."""
    j = tl.arange(0, 8).to(tl.uint64)
    word = tl.sum(codes.to(tl.uint64) << (j * BITS)[None, None, :], axis=2)  # disjoint bits
    out = (word[:, :, None] >> (j * 8)[None, None, :]) & 0xFF
    return out.to(tl.uint8)


@triton.jit
def unpack8(byts, BITS: tl.constexpr):
    """bytes [B, 8] of each 8-block (bytes >= BITS loaded as 0) -> codes [B, 8] int32."""
    j = tl.arange(0, 8).to(tl.uint64)
    word = tl.sum(byts.to(tl.uint64) << (j * 8)[None, :], axis=1)
    codes = (word[:, None] >> (j * BITS)[None, :]) & ((1 << BITS) - 1)
    return codes.to(tl.int32)


# ---- device side: Hadamard --------------------------------------------------------------------
@triton.jit
def _butterfly_axis(x, bit, AX: tl.constexpr):
    """One stage on x [R, 2, 2, 2, 2, 2] (the bits of an index in a 32-block), pairing along
    the size-2 axis ``AX`` (``bit``: 0, 1 along it): each element takes its partner's value,
    as bits (the pair's wrapping integer sum less its own bits: exact for every value, NaNs
    included), then a + b at bit 0 and a - b at bit 1."""
    own = x.to(tl.int32, bitcast=True)
    y = (tl.sum(own, axis=AX, keep_dims=True) - own).to(tl.float32, bitcast=True)
    return tl.fma(x, tl.where(bit == 0, 1.0, -1.0), y)  # y +- x: the product is exact


@triton.jit
def hadamard_blocks(x, R: tl.constexpr):
    """``torch_codec.hadamard32`` (unnormalized Sylvester Hadamard on consecutive 32-blocks) on
    x of R * 32 elements in any shape, the same butterflies in the same order. Each stage pairs
    elements along one size-2 axis without reshaping the values between stages, so they stay
    in the layout the kernel loaded them in: partners in one thread cost no data movement,
    partners in two lanes one shuffle. Every kernel's rotation (sm_90, triton 3.6 / 3.9,
    instructions per element, ``benchmarks/kernel_sass.py``): against reshapes and joins, the
    4-bit g128 encoder 151.2 / 145.4 -> 116.6 / 93.9 (at 6d08913, sums over the pair); taking
    the partner's value instead of two sums, 95.5 / 93.1 -> 85.5 / 87.1, and the decoders
    27.9 -> 26.8 with 1 barrier instead of 5; y +- x as one fma by a +-1 per lane instead of a
    select and an add (exact: the product is), 75.5 / 75.2 -> 71.4 / 72.6."""
    shape: tl.constexpr = x.shape
    y = tl.reshape(x, [R, 2, 2, 2, 2, 2])
    b = tl.arange(0, 2)
    y = _butterfly_axis(y, b[None, None, None, None, None, :], 5)
    y = _butterfly_axis(y, b[None, None, None, None, :, None], 4)
    y = _butterfly_axis(y, b[None, None, None, :, None, None], 3)
    y = _butterfly_axis(y, b[None, None, :, None, None, None], 2)
    y = _butterfly_axis(y, b[None, :, None, None, None, None], 1)
    return tl.reshape(y, shape)


# ---- device side: decode and encode -----------------------------------------------------------
@triton.jit
def code_section(row_b, G, SYM: tl.constexpr, SKIND: tl.constexpr):
    """The first code byte of a wire row whose scale section starts at ``row_b`` (``G`` groups:
    their scales, and mins if asymmetric, come first)."""
    NSEC: tl.constexpr = 1 if SYM else 2
    SBYTES: tl.constexpr = 4 if SKIND == 0 else 2
    return row_b + G * (NSEC * SBYTES)


@triton.jit
def load_codes8(row_b, e8, ok, G, BITS: tl.constexpr, SYM: tl.constexpr, SKIND: tl.constexpr):
    """Codes of the 8-blocks ``e8`` [B] of one wire row -> int32 [B, 8] (``row_b``: the byte
    where the row's scale section starts; ok: [B] mask)."""
    base = code_section(row_b, G, SYM, SKIND)
    if 8 % BITS == 0 and BITS < 8:
        # Each code sits inside one byte: load the block's BITS bytes and shift them apart in
        # 32-bit registers (no 64-bit word, no reduction across the block's lanes). Whole
        # bytes (8 bits) take the general path, which compiles to byte permutes, one fewer
        # instruction per element on sm_90 (benchmarks/kernel_sass.py). The codes of a byte
        # are joined (a new axis in the same thread), not broadcast against shifts: a
        # broadcast gets a layout of its own, converted through shared memory, once per
        # received chunk in reduce_dequantize (its 4-bit case: 58.5 -> 44.6 instructions
        # per element on triton 3.9, 66.5 -> 47.4 on 3.6).
        B: tl.constexpr = e8.shape[0]
        M: tl.constexpr = (1 << BITS) - 1
        kb = tl.arange(0, BITS)
        byts = tl.load(base + e8[:, None] * BITS + kb[None, :], mask=ok[:, None], other=0)
        w = byts.to(tl.int32)
        if BITS == 4:
            codes = tl.join(w & M, w >> 4)
        else:  # 2 bits: [c0, c2] and [c1, c3] joined, which reads c0, c1, c2, c3 in order
            tl.static_assert(BITS == 2)
            codes = tl.join(tl.join(w & M, (w >> 4) & M), tl.join((w >> 2) & M, w >> 6))
        codes = tl.reshape(codes, [B, 8])
    else:
        k = tl.arange(0, 8)
        bmask = ok[:, None] & (k[None, :] < BITS)
        byts = tl.load(base + e8[:, None] * BITS + k[None, :], mask=bmask, other=0)
        codes = unpack8(byts, BITS)
    return codes


@triton.jit
def decode8(
    row_b, row_s, e8, ok, G,
    BITS: tl.constexpr, QMAX: tl.constexpr, SYM: tl.constexpr, SKIND: tl.constexpr,
    GS: tl.constexpr,
):
    """Values of the 8-blocks ``e8`` [B] of one wire row -> fp32 [B, 8].

    row_b: the row's first byte; row_s: the same row as scale-width integers; ok: [B] mask.
    """
    codes = load_codes8(row_b, e8, ok, G, BITS, SYM, SKIND)
    grp = (e8 * 8) // GS
    scale = bits_to_scale(tl.load(row_s + grp, mask=ok, other=0), SKIND)
    # code -> float without a conversion instruction: 2^23 + code as bits, minus 2^23 (exact)
    c = (codes | _INT_FLOAT_BITS).to(tl.float32, bitcast=True)
    if SYM:
        v = (c - (_INT_FLOAT + QMAX)) * scale[:, None]
    else:
        mins = bits_to_scale(tl.load(row_s + G + grp, mask=ok, other=0), SKIND)
        v = (c - _INT_FLOAT) * scale[:, None] + mins[:, None]
    return v


@triton.jit
def decode8_sum(row_b, row_s, chunk_b, chunk_s, e8, ok, G, K: tl.constexpr,
                BITS: tl.constexpr, QMAX: tl.constexpr, SYM: tl.constexpr, SKIND: tl.constexpr,
                GS: tl.constexpr):
    """``decode8`` of the same 8-blocks in K received chunks ``chunk_b`` bytes (``chunk_s``
    scale words) apart, summed in fp32 in order 0..K-1 from chunk 0, like the torch code. The
    loop is unrolled (K a constexpr), so every chunk's loads can be in flight at once."""
    v = decode8(row_b, row_s, e8, ok, G, BITS, QMAX, SYM, SKIND, GS)
    for c in tl.static_range(1, K):
        c64 = tl.cast(c, tl.int64)
        v = v + decode8(row_b + c64 * chunk_b, row_s + c64 * chunk_s, e8, ok, G,
                        BITS, QMAX, SYM, SKIND, GS)
    return v


@triton.jit
def _per_group(x, like):
    """Per-group values x [GPB] broadcastable against a tile ``like`` ([GPB, B, 8] or flat)."""
    if len(like.shape) == 3:
        y = x[:, None, None]
    else:
        y = x[:, None]
    return y


@triton.jit
def _group_max(x):
    """Max over all but the first axis of a tile ([GPB, B, 8] or flat [GPB, SUB])."""
    if len(x.shape) == 3:
        x = tl.max(x, axis=2)
    return tl.max(x, axis=1)


@triton.jit
def _group_min(x):
    if len(x.shape) == 3:
        x = tl.min(x, axis=2)
    return tl.min(x, axis=1)


@triton.jit
def _ordered(b):
    """int32 keys of float32 bits ``b`` that order as the floats do (-NaN < -inf < ... < -0 <
    +0 < ... < inf < NaN); the map is its own inverse."""
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def group_stats(v, valid, SYM: tl.constexpr):
    """Per-group (bad, lo, hi) over a tile v ([GPB, B, 8] or flat [GPB, SUB]): bad = any
    non-finite; symmetric: hi = max |v|; asymmetric: lo, hi = min, max. The reductions run on
    integer keys of the bits, in which infinities and NaNs are the extremes, so bad is read
    from lo and hi instead of testing each lane, and the interpreter's integer reductions match
    the GPU's bit for bit. lo and hi of a bad group are unused (codes 0, scale NaN). Against
    a finite test per lane (triton 3.6, instructions per element): the 4-bit g128 encoder
    59.4 -> 53.4, the 4-bit Hadamard one 71.4 -> 67.0, the asymmetric bf16 one 62.4 -> 58.6."""
    b = v.to(tl.int32, bitcast=True)
    if SYM:
        hb = _group_max(tl.where(valid, b & 0x7FFFFFFF, 0))  # the bits of |v|
        bad = (hb >= _POS_INF_BITS).to(tl.int32)
        hi = hb.to(tl.float32, bitcast=True)
        lo = tl.zeros_like(hi)
    else:
        k = _ordered(b)
        # no valid lane: lo = inf, hi = -inf (not NaNs, which a sub-tile loop's min would keep)
        lk = _group_min(tl.where(valid, k, _POS_INF_BITS))
        hk = _group_max(tl.where(valid, k, _ordered(_NEG_INF_BITS)))
        bad = ((lk <= _ordered(_NEG_INF_BITS)) | (hk >= _POS_INF_BITS)).to(tl.int32)
        lo = _ordered(lk).to(tl.float32, bitcast=True)
        hi = _ordered(hk).to(tl.float32, bitcast=True)
    return bad, lo, hi


@triton.jit
def group_scales(lo, hi, QMAX: tl.constexpr, SYM: tl.constexpr, SKIND: tl.constexpr):
    """(scale, mins) of each group as the decoder will see them (rounded to the scale dtype)."""
    if SYM:
        scale = round_scale(tl.math.div_rn(hi, tl.full(hi.shape, QMAX, tl.float32)), SKIND)
        mins = tl.zeros_like(scale)
    else:
        mins = round_min(lo, SKIND) + 0.0  # + 0.0: a -0 minimum is stored as +0
        scale = round_scale(tl.math.div_rn(hi - mins, tl.full(hi.shape, QMAX, tl.float32)),
                            SKIND)
    scale = tl.where(scale == 0.0, 1.0, scale)
    return scale, mins


@triton.jit
def store_scales(row_s, grp, gmask, G, scale, mins, bad, SYM: tl.constexpr,
                 SKIND: tl.constexpr):
    tl.store(row_s + grp, scale_to_bits(scale, bad, SKIND), mask=gmask)
    if not SYM:
        tl.store(row_s + G + grp, scale_to_bits(mins, bad, SKIND), mask=gmask)


@triton.jit
def floor_int(t, BIAS: tl.constexpr):
    """floor(t) + BIAS as int32 for |t| < 2^22 (callers clamp t first), in adds and integer ops:
    t + 1.5 * 2^23 rounds t to an integer held in the sum's low mantissa bits, and one
    comparison turns that rounding into floor. FRND and F2I, which it replaces, issue at an
    eighth of the rate of fp32 adds on compute capability 8.x-9.0. Outside that range (and for
    NaN) the result is unspecified."""
    y = t + _ROUNDER
    r = y - _ROUNDER  # t rounded to an integer, exact
    k = y.to(tl.int32, bitcast=True) - (_ROUNDER_BITS - BIAS)  # BIAS: free in the constant
    return k - (r > t).to(tl.int32)


@triton.jit
def group_reciprocal(scale, like):
    """(f, 1 / (scale * f)) of each group's nonzero ``scale`` [GPB], broadcast against the tile
    ``like``: an encoder's division by its scale as a multiplication, ``t = (v * f) * r``
    (``wire.py``, "Encoding"); f = 2^64 below a scale of 2^-64 keeps the reciprocal finite."""
    f = tl.where(scale < _TINY_SCALE, _TINY_PRESCALE, 1.0)
    r = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale * f)
    return _per_group(f, like), _per_group(r, like)


@triton.jit
def encode_codes(
    v, valid, i, e8, e8_ok, row, numel, row_b, G, scale, mins, bad, k0, k1,
    BITS: tl.constexpr, QMAX: tl.constexpr, SYM: tl.constexpr, SKIND: tl.constexpr,
    STOCH: tl.constexpr, GS: tl.constexpr,
):
    """Round v [GPB, B, 8] against per-group scale/mins/bad [GPB] and store the packed codes.

    i: element index in the row [GPB, B, 8]; e8: 8-block index [GPB, B]; e8_ok: which 8-blocks
    hold at least one element of the row (partial blocks store zero codes past ``numel``).
    A ``flat_group_tile`` passes v, valid, i [GPB, SUB], its ``inside`` as e8_ok and the tile's
    first 8-block as e8 (GS: the group size, for where the codes of its 8-blocks go).
    """
    f, r = group_reciprocal(scale, v)  # t = (v * f) * r
    if SYM:
        t = (v * f) * r
        lo = -QMAX
        bias = QMAX
    else:
        t = ((v - _per_group(mins, v)) * f) * r
        lo = 0
        bias = 0
    if STOCH:
        t = t + uniform(row, numel, i, k0, k1)
    else:
        t = t + 0.5
    # clamp(floor(t), lo, QMAX) as floor(clamp(t, lo, QMAX)): the same codes (floor is monotone
    # and the bounds are integers), and floor_int's argument stays in its exact range
    q = floor_int(tl.minimum(tl.maximum(t, lo), QMAX), bias)  # the code: q + bias
    q = tl.where(_per_group(bad, v) != 0, bias, q)  # a non-finite group sends the zero code
    codes = tl.where(valid, q, 0)  # padding past the row encodes as 0
    if len(codes.shape) == 2:
        store_codes_flat(codes, i, e8_ok, e8, numel, row_b, G, BITS, SYM, SKIND, GS)
    else:
        store_codes(codes, row_b, G, e8, e8_ok, BITS, SYM, SKIND)


@triton.jit
def store_codes(codes, row_b, G, e8, e8_ok, BITS: tl.constexpr, SYM: tl.constexpr,
                SKIND: tl.constexpr):
    """Pack codes [GPB, B, 8] (int32, < 2^BITS) into the code section of the row whose scale
    section starts at ``row_b``; e8 [GPB, B]: 8-block indices, e8_ok: which to store."""
    base = code_section(row_b, G, SYM, SKIND)
    if 8 % BITS == 0:
        # Each byte holds 8 // BITS whole codes: OR neighbours in 32-bit registers.
        PER: tl.constexpr = 8 // BITS
        A: tl.constexpr = codes.shape[0]
        B: tl.constexpr = codes.shape[1]
        if PER == 1:
            byts = codes
        else:
            sh = (tl.arange(0, PER) * BITS)[None, None, None, :]
            byts = tl.sum(tl.reshape(codes, [A, B, BITS, PER]) << sh, axis=3)  # disjoint bits
        kb = tl.arange(0, BITS)
        tl.store(base + e8[:, :, None] * BITS + kb[None, None, :], byts.to(tl.uint8),
                 mask=e8_ok[:, :, None])
    else:
        byts = pack8(codes, BITS)
        k = tl.arange(0, 8)
        off = e8[:, :, None] * BITS + k[None, None, :]
        tl.store(base + off, byts, mask=e8_ok[:, :, None] & (k[None, None, :] < BITS))


@triton.jit
def store_codes_flat(codes, i, inside, e80, numel, row_b, G, BITS: tl.constexpr,
                     SYM: tl.constexpr, SKIND: tl.constexpr, GS: tl.constexpr):
    """``store_codes`` of a flat tile: codes and element indices i [GPB, SUB]; inside: elements
    of a group; e80: the 8-block where the tile's first group starts. The 8-blocks that hold an
    element of the row are stored whole (zero codes past ``numel``). 8-bit codes are stored
    straight from the tile. 2- and 4-bit codes come from ``flat_group_tile``'s tile, in which
    each thread holds whole 8-blocks: each block's ``BITS`` bytes are packed in the thread and
    stored from a [blocks, BITS] tile whose offsets are computed, not reshaped, so that Triton
    keeps them where they are (no layout conversion through shared memory). A group narrower
    than its tile row (96 of 128) has padding blocks, masked here: they would write zero codes
    over the next group's, a race on a GPU that the interpreter, which stores in order, hides."""
    base = code_section(row_b, G, SYM, SKIND)
    if BITS == 8:
        keep = inside & ((i // 8) * 8 < numel)
        tl.store(base + i, codes.to(tl.uint8), mask=keep)
    else:
        A: tl.constexpr = codes.shape[0]
        NB: tl.constexpr = codes.shape[1] // 8  # 8-blocks per group of the tile (padded)
        PER: tl.constexpr = 8 // BITS  # codes per byte
        sh = (tl.arange(0, PER) * BITS)[None, None, :]
        byts = tl.sum(tl.reshape(codes, [A * NB, BITS, PER]) << sh, axis=2)  # disjoint bits
        h = tl.arange(0, A * NB)
        b = h % NB
        blk = e80 + (h // NB) * (GS // 8) + b
        ok = (b < GS // 8) & (blk * 8 < numel)  # inside a group, and a block of the row
        off = (blk * BITS)[:, None] + tl.arange(0, BITS)[None, :]
        tl.store(base + off, byts.to(tl.uint8), mask=ok[:, None])


def flat_tile(bits: int, hadamard: bool) -> bool:
    """Whether an encoder loads whole groups as ``flat_group_tile``'s rows rather than as
    ``group_tile``'s [GPB, B, 8] 8-blocks: for packed 2- and 4-bit codes, and for 8-bit codes
    with the Hadamard rotation. The 8-block tile ties Triton's coalescing order between groups
    and blocks; triton 3.6 breaks the tie by spreading a group's blocks over warps, so the
    statistics (and the rotation) cross warps through shared memory with barriers.
    Instructions per element on sm_90 (``benchmarks/kernel_sass.py``), 8-block -> flat tile,
    triton 3.6 / 3.9: 8-bit g128 +H32 85.0 / 69.6 -> 69.4 / 69.5 (barriers 14 -> 1 on 3.6),
    4-bit 96.9 / 83.2 -> 84.2 / 83.9 (13 -> 3); 3.7 and 3.8 count as 3.6 with the flat tile
    (``docs/gpu_path.md`` section 7). Without the rotation the flat tile counted more until
    packed codes got whole 8-blocks per thread (``flat_group_tile``); since, it counts fewer
    for them (4-bit g128 51.4 / 55.4 -> 44.6 / 44.4; qWD's g2048 against the reference
    52.5 / 50.2 -> 46.0 / 45.5), and about the same for 8-bit codes, which stay on 8-blocks
    (their asymmetric bf16 encoder took 9 barriers instead of 5 on 3.6 as a flat tile)."""
    return 8 % bits == 0 and (hadamard or bits < 8)


# ---- host side: received chunks ---------------------------------------------------------------
def chunk_stack(chunks, spec: QuantSpec, shape: tuple,
                layout: Callable[[], str]) -> tuple[torch.Tensor, int]:
    """(first chunk, byte stride between chunks) for k wire blocks of ``shape`` ([R, W]);
    ValueError naming ``layout()`` (what the rows hold) if one has another shape.

    Chunks that are evenly spaced views of one buffer (the rows of a [k, R, W] receive buffer)
    are read in place; anything else is stacked into one buffer first (a copy). One pass over
    the chunks checks both: in three, the k=8 reduce's wrapper spent a third of its host time
    on them (``docs/gpu_path.md`` section 7).
    """
    first = chunks[0]
    itemsize = spec.torch_scale_dtype.itemsize
    base = first.data_ptr()
    step = chunks[1].data_ptr() - base if len(chunks) > 1 else 0
    in_place = first.storage_offset() % itemsize == 0 and step % itemsize == 0
    storage = first.untyped_storage().data_ptr() if in_place else None
    for j, c in enumerate(chunks):
        if c.shape != shape:
            raise ValueError(f"chunk shape {tuple(c.shape)} is not {tuple(shape)}: {layout()}")
        in_place = in_place and c.is_contiguous() and c.data_ptr() - base == j * step \
            and (j == 0 or c.untyped_storage().data_ptr() == storage)
    if in_place:
        return first, step
    stacked = torch.stack([c.contiguous() for c in chunks])
    return stacked[0], stacked.stride(0)

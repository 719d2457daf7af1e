"""Counter-based random numbers for stochastic rounding, identical on CPU and GPU.

Elements ``i`` and ``i + 1`` of a row (``i`` even) share one hash
``h = mix32(mix32(c ^ k0) ^ k1)`` of the even one's counter ``c`` (its flat index in the call,
row * numel + i, mod 2^32); the even element takes the low 16 bits, the odd one the high 16,
as ``u = (bits + 1/2) * 2^-16``. ``(k0, k1)`` are two 32-bit words derived from
``(seed, step, rank, bucket)``; ``mix32`` is the "lowbias32" integer hash (two multiplies, three
xor-shifts). It is a pure function of its inputs, so the same run twice sends the same bits,
and the Triton kernels, the C loop and the torch code compute exactly the same ``u``: one wire
format, not three that agree in distribution only. Triton's Philox (``tl.rand``) has no
bit-exact torch twin on CPU, which is why it is not used.

Why pairs and 16 bits: the hash is about a quarter of a GPU encoder's instructions per element
(22 of 84 for the 4-bit Hadamard encoder), and sharing it halves that. 16 bits round within
2^-17 of a level of unbiased (the half-step offset centres the error; 24 bits without it were
within 2^-24, all below). Groups hold a multiple of 8 elements, so a pair never straddles a
group, a window of the C loop or a tile of a kernel.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

MASK32 = 0xFFFFFFFF
MIX_M1 = 0x7FEB352D
MIX_M2 = 0x846CA68B
MAX_COUNTER = 1 << 32


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


class RngKey(NamedTuple):
    """Identifies one quantization call; different fields give independent streams."""

    seed: int
    step: int
    rank: int
    bucket: int

    def words(self) -> tuple[int, int]:
        h = _splitmix64(self.prefix() ^ (int(self.bucket) & 0xFFFFFFFFFFFFFFFF))
        return h & MASK32, (h >> 32) & MASK32

    def prefix(self) -> int:
        """The hash state ``words`` reaches after seed, step and rank, before the bucket:
        what the grouped encoder needs to derive every folded key's words on the GPU."""
        h = 0
        for v in (self.seed, self.step, self.rank):
            h = _splitmix64(h ^ (int(v) & 0xFFFFFFFFFFFFFFFF))
        return h

    def fold(self, salt: int) -> "RngKey":
        """A derived key for a sub-call (for example a pipeline chunk or a second hop)."""
        return RngKey(self.seed, self.step, self.rank, _splitmix64(self.bucket ^ (salt << 20)))


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # int64 holds the uint32 state; products wrap modulo 2^64 and the mask keeps the low word.
    x = x ^ (x >> 16)
    x = (x * MIX_M1) & MASK32
    x = x ^ (x >> 15)
    x = (x * MIX_M2) & MASK32
    return x ^ (x >> 16)


def uniform(counter: torch.Tensor, odd: torch.Tensor, key: RngKey) -> torch.Tensor:
    """fp32 uniforms in (0, 1) for elements at int64 counters in [0, 2^32), ``odd`` (0 or 1)
    the parity of each one's index in its row: the pair's hash is that of ``counter - odd``.

    The reference formula, written for clarity in int64; the codec uses ``add_uniform_``.
    """
    k0, k1 = key.words()
    x = _mix32(_mix32(((counter - odd) & MASK32) ^ k0) ^ k1)
    bits = (x >> (16 * odd)) & 0xFFFF
    return (bits.to(torch.float32) + 0.5) * (1.0 / (1 << 16))


# int32 forms of the multipliers: an int32 product wraps modulo 2^32 like uint32 does.
_M1_I32 = MIX_M1
_M2_I32 = MIX_M2 - (1 << 32)


def _signed32(v: int) -> int:
    v &= MASK32
    return v - (1 << 32) if v >= (1 << 31) else v


_SCALARS: dict[tuple[int, str], torch.Tensor] = {}


def _c(v: int, device) -> torch.Tensor:
    """A cached 0-dim int32 tensor of ``v``: ops on it skip the per-call wrapping and dtype
    conversion of a Python int (a few microseconds each, ~20 per encode step); same values."""
    k = (v, str(device))
    t = _SCALARS.get(k)
    if t is None:
        t = _SCALARS[k] = torch.tensor(v, dtype=torch.int32, device=device)
    return t


def _lsr_xor_(x: torch.Tensor, s: int, tmp: torch.Tensor) -> None:
    """``x ^= x >>> s`` on int32 holding uint32 bits: arithmetic shift, then mask the sign fill."""
    torch.bitwise_right_shift(x, _c(s, x.device), out=tmp)
    tmp &= _c((1 << (32 - s)) - 1, x.device)
    x ^= tmp


def _mix32_(x: torch.Tensor, tmp: torch.Tensor) -> None:
    _lsr_xor_(x, 16, tmp)
    x *= _c(_M1_I32, x.device)
    _lsr_xor_(x, 15, tmp)
    x *= _c(_M2_I32, x.device)
    _lsr_xor_(x, 16, tmp)


_ARANGE32: dict[tuple, torch.Tensor] = {}


def _arange32(width: int, device, step: int = 1) -> torch.Tensor:
    k = (width, str(device), step)
    a = _ARANGE32.get(k)
    if a is None:
        a = _ARANGE32[k] = torch.arange(0, width * step, step, dtype=torch.int32, device=device)
    return a


def row_starts(first: Sequence[int], device) -> torch.Tensor:
    """[R, 1] int32 column: the counters of each row's first element, modulo 2^32."""
    return torch.tensor([[_signed32(c)] for c in first], dtype=torch.int32, device=device)


# u = (bits + 1/2) * 2^-16 from its float32 bits: 1 + u is exponent 0 with the 16 bits at the
# top of the mantissa and the half at bit 6, and (1 + u) - 1 is exact.
_ONE_HALF_BITS = 0x3F800040
_TOP16 = 0x7FFF80


def _add_half_(t: torch.Tensor, x: torch.Tensor, shift: int, tmp: torch.Tensor) -> None:
    """``t += u`` for the 16 bits of ``x`` at ``shift`` (0: low, 16: high); ``tmp`` as ``x``."""
    if shift:  # bits 31..16 down to 22..7; the arithmetic shift's sign fill is masked off
        torch.bitwise_right_shift(x, _c(9, x.device), out=tmp)
    else:  # bits 15..0 up to 22..7
        torch.bitwise_left_shift(x, _c(7, x.device), out=tmp)
    tmp &= _c(_TOP16, x.device)
    tmp |= _c(_ONE_HALF_BITS, x.device)
    u = tmp.view(torch.float32)
    u -= 1.0
    t += u  # u is exact, so t + u is rounded once


def add_uniform_(
    t: torch.Tensor, starts: torch.Tensor, words: tuple[int, int], x: torch.Tensor,
    tmp: torch.Tensor,
) -> None:
    """``t[r, i] += uniform(starts[r] + i, i % 2, key)`` in place, in int32 with reused buffers.

    ``t`` is fp32 [R, L] whose column 0 is an even index of its row; ``starts`` comes from
    ``row_starts``; ``words`` is ``key.words()``; ``x`` and ``tmp`` are int32 scratch of at
    least ``t``'s size. Same bits as ``uniform``: wrapping int32 arithmetic is uint32
    arithmetic on the same bits, and the logical shifts are arithmetic shifts with the sign fill
    masked off. One pass per operation, no allocations, one hash per two columns.
    """
    k0, k1 = words
    R, L = t.shape
    P = (L + 1) // 2
    x = x.view(-1)[:R * P].view(R, P)
    tmp = tmp.view(-1)[:R * P].view(R, P)
    torch.add(_arange32(P, t.device, 2), starts, out=x)  # even columns' counters; wraps past 2^32
    x ^= _signed32(k0)
    _mix32_(x, tmp)
    x ^= _signed32(k1)
    _mix32_(x, tmp)
    _add_half_(t[:, 0::2], x, 0, tmp)
    if L > 1:
        _add_half_(t[:, 1::2], x[:, :L // 2], 16, tmp[:, :L // 2])


def check_counter_range(rows: int, stride: int) -> None:
    """A call's counters (row * stride + i) must fit the 32-bit counter space."""
    if rows * stride > MAX_COUNTER:
        raise ValueError(
            f"one quantization call covers {rows * stride} elements; the RNG counter allows "
            f"{MAX_COUNTER}. Split the buffer into smaller calls (buckets)."
        )


def uniform_rows(rows: int, width: int, stride: int, key: RngKey, device) -> torch.Tensor:
    """Uniforms for a [rows, width] block whose element (r, i) has counter r * stride + i."""
    check_counter_range(rows, stride)
    u = torch.zeros(rows, width, dtype=torch.float32, device=device)
    x = torch.empty(rows, width, dtype=torch.int32, device=device)
    add_uniform_(u, row_starts([r * stride for r in range(rows)], device), key.words(), x,
                 torch.empty_like(x))
    return u

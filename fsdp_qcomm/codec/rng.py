"""Counter-based random numbers for stochastic rounding, identical on CPU and GPU.

Each element draws ``u = (mix32(mix32(c ^ k0) ^ k1) >> 8) * 2^-24`` where ``c`` is the element's
flat index in the call (row * numel + i) and ``(k0, k1)`` are two 32-bit words derived from
``(seed, step, rank, bucket)``. ``mix32`` is the "lowbias32" integer hash (two multiplies, three
xor-shifts). It is a pure function of its inputs, so the same run twice sends the same bits,
and the Triton kernels and the torch code compute exactly the same ``u``: one wire format, not
two that agree in distribution only. Triton's Philox (``tl.rand``) has no bit-exact torch twin
on CPU, which is why it is not used.
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


def uniform(counter: torch.Tensor, key: RngKey) -> torch.Tensor:
    """fp32 uniforms in [0, 1) for int64 counters in [0, 2^32).

    The reference formula, written for clarity in int64; the codec uses ``add_uniform_``.
    """
    k0, k1 = key.words()
    x = _mix32(_mix32(counter ^ k0) ^ k1)
    return (x >> 8).to(torch.float32) * (1.0 / (1 << 24))


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


_ARANGE32: dict[int, torch.Tensor] = {}


def _arange32(width: int, device) -> torch.Tensor:
    k = (width, str(device))
    a = _ARANGE32.get(k)
    if a is None:
        a = _ARANGE32[k] = torch.arange(width, dtype=torch.int32, device=device)
    return a


def row_starts(first: Sequence[int], device) -> torch.Tensor:
    """[R, 1] int32 column: the counters of each row's first element, modulo 2^32."""
    return torch.tensor([[_signed32(c)] for c in first], dtype=torch.int32, device=device)


def add_uniform_(
    t: torch.Tensor, starts: torch.Tensor, words: tuple[int, int], x: torch.Tensor,
    tmp: torch.Tensor,
) -> None:
    """``t[r, i] += uniform(starts[r] + i, key)`` in place, in int32 with reused buffers.

    ``t`` is fp32 [R, L]; ``starts`` comes from ``row_starts``; ``words`` is ``key.words()``;
    ``x`` and ``tmp`` are int32 scratch of ``t``'s shape. Same bits as ``uniform``: wrapping
    int32 arithmetic is uint32 arithmetic on the same bits, and the logical shifts are arithmetic
    shifts with the sign fill masked off. About five times faster than the int64 reference: one
    pass per operation, no allocations.
    """
    k0, k1 = words
    torch.add(_arange32(t.shape[1], t.device), starts, out=x)  # counters; wraps past 2^32
    x ^= _signed32(k0)
    _mix32_(x, tmp)
    x ^= _signed32(k1)
    _mix32_(x, tmp)
    torch.bitwise_right_shift(x, _c(8, x.device), out=tmp)
    tmp &= _c(0xFFFFFF, x.device)
    # tmp * 2^-24 is exact in fp32, so this is exactly t + u, rounded once.
    t.add_(tmp, alpha=1.0 / (1 << 24))


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

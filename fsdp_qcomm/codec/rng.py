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

from typing import NamedTuple

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
        h = 0
        for v in self:
            h = _splitmix64(h ^ (int(v) & 0xFFFFFFFFFFFFFFFF))
        return h & MASK32, (h >> 32) & MASK32

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
    """fp32 uniforms in [0, 1) for int64 counters in [0, 2^32)."""
    k0, k1 = key.words()
    x = _mix32(_mix32(counter ^ k0) ^ k1)
    return (x >> 8).to(torch.float32) * (1.0 / (1 << 24))


def uniform_rows(rows: int, width: int, stride: int, key: RngKey, device) -> torch.Tensor:
    """Uniforms for a [rows, width] block whose element (r, i) has counter r * stride + i."""
    if rows * stride > MAX_COUNTER:
        raise ValueError(
            f"one quantization call covers {rows * stride} elements; the RNG counter allows "
            f"{MAX_COUNTER}. Split the buffer into smaller calls (buckets)."
        )
    c = torch.arange(width, dtype=torch.int64, device=device)
    c = c + (torch.arange(rows, dtype=torch.int64, device=device) * stride)[:, None]
    # Padding lanes past the last row may run over 2^32; they wrap like uint32 does in Triton.
    return uniform(c & MASK32, key)

"""The wire format: how one row of ``n`` values is laid out as bytes.

Every quantized collective sends rows (one per destination rank or one per shard), each encoded
on its own, so a row is the unit of this format. For a row of ``n`` values under a
``QuantSpec`` with ``b`` bits and group size ``g``::

    G = ceil(n / g)                              groups; the last one may be partial
    [ scales : G x scale_dtype ]                 one per group, little-endian
    [ mins   : G x scale_dtype ]                 asymmetric (min-max) specs only
    [ codes  : ceil(n / 8) * b bytes ]           dense little-endian bit stream
    [ zero padding to a multiple of 4 bytes ]    keeps every row's scales aligned

Codes are unsigned: a symmetric code ``q`` in [-(2^(b-1)-1), 2^(b-1)-1] is stored as
``q + 2^(b-1) - 1``; an asymmetric code is stored as is (0 .. 2^b-1). Element ``i`` occupies
bits ``[b*i, b*i + b)`` of the bit stream, where bit ``k`` of the stream is bit ``k % 8`` of
byte ``k // 8``: for 4 bits, element 2j is the low nibble of byte j and element 2j+1 the high
nibble. Elements ``n .. ceil(n/8)*8 - 1`` are padding and encode as 0.

A group holding a NaN or an infinity is sent with a NaN scale (and min), so every value of that
group decodes as NaN: overflow stays visible to grad-norm checks instead of becoming finite
garbage. That NaN is the bit pattern ``NAN_BITS[scale_dtype]`` and a zero minimum is stored as
+0, so the bytes are a function of the input alone (float casts of NaN and the sign of a zero
minimum otherwise differ between CPU code paths and GPUs).

Decoding: symmetric ``x = (u - (2^(b-1)-1)) * scale``; asymmetric ``x = u * scale + min``.
The stored ``min`` is the largest value of the scale dtype at or below the group's minimum
(rounded down: exact in fp32), and ``scale`` is ``(max - min) / qmax`` with that ``min``, so
every value of the group lies at or above the codes' origin. Rounded to nearest, a 16-bit
minimum of a tight group far from zero went above values that then clamped to code 0, up to
half its spacing away (bf16: 2^-9 of |min|; a group of 1024 values around 0.3 spread over
0.001 decoded 199 steps off, 1.9 now: ``tests/test_codec.py``). float16 ends at 65504: a
minimum in (-65520, -65504) is kept at -65504 (values under it clamp to code 0), one further
below is -inf, and such a group, like one whose scale overflows (a range over 65504 x qmax),
decodes as non-finite values.

Encoding divides by the scale as a multiplication by its reciprocal, taken once per group:
``t = (x * f) * (1 / (scale * f))`` (asymmetric: ``x - min`` for ``x``), each operation rounded
to fp32, with ``f = TINY_PRESCALE`` for scales below ``TINY_SCALE`` (else 1) so the reciprocal
stays finite; then ``floor(t + u)`` (``u`` the stochastic uniform, or 1/2), clamped. A division
per element cost a GPU encoder 8-11 of its 74-151 instructions per element; ``t`` differs
from ``x / scale`` by at most about an ulp. Every implementation computes exactly this.

Learned-levels rows (``codec.levels``) put the ``2^b`` fp32 levels in front of the same
sections (``levels_wire_bytes``); their scale is the group's range, not range / qmax. They take
``t`` with the same reciprocal (a zero scale taken as 1), clamped to the table's domain, find
the last level ``L[k] <= t`` among ``L[0 .. 2^b - 2]``, and send ``k + 1`` with probability
``d / gap`` (``d = t - L[k]``, ``gap = L[k + 1] - L[k]``) without dividing: ``u * gap < d``, or
``d + d >= gap`` with nearest rounding.
"""

from __future__ import annotations

import torch

from ..config import QuantSpec

ROW_ALIGN = 4
HADAMARD_BLOCK = 32
# Quiet NaN bit patterns (as signed integers of the scale's width) of a non-finite group's scale.
NAN_BITS = {"float32": 0x7FC00000, "bfloat16": 0x7FC0, "float16": 0x7E00}
# Scales below TINY_SCALE are multiplied by TINY_PRESCALE (exact) before their reciprocal.
TINY_SCALE = 2.0 ** -64
TINY_PRESCALE = 2.0 ** 64


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def num_groups(numel: int, spec: QuantSpec) -> int:
    return _ceil_div(numel, spec.group_size)


def scale_section_bytes(numel: int, spec: QuantSpec) -> int:
    """Bytes of the scales (and mins, for asymmetric specs) at the start of a row."""
    per = spec.torch_scale_dtype.itemsize * (1 if spec.symmetric else 2)
    return num_groups(numel, spec) * per


def code_bytes(numel: int, spec: QuantSpec) -> int:
    return _ceil_div(numel, 8) * spec.bits


def wire_bytes(numel: int, spec: QuantSpec) -> int:
    """Exact bytes one encoded row of ``numel`` values occupies on the wire."""
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if numel == 0:
        return 0
    raw = scale_section_bytes(numel, spec) + code_bytes(numel, spec)
    return _ceil_div(raw, ROW_ALIGN) * ROW_ALIGN


def hadamard_len(numel: int) -> int:
    """Length a row has once padded with zeros to whole 32-element Hadamard blocks."""
    return _ceil_div(numel, HADAMARD_BLOCK) * HADAMARD_BLOCK


def bits_per_element(numel: int, spec: QuantSpec) -> float:
    return 8.0 * wire_bytes(numel, spec) / numel if numel else 0.0


# ---- learned-levels rows (codec.levels) -------------------------------------------------------
LEVELS_DTYPE = torch.float32


def num_levels(spec: QuantSpec) -> int:
    return 1 << spec.bits


def levels_domain(spec: QuantSpec) -> tuple[float, float]:
    """Normalized space of a level table: [-1, 1] for symmetric specs, [0, 1] for min-max."""
    return (-1.0, 1.0) if spec.symmetric else (0.0, 1.0)


def table_bytes(spec: QuantSpec) -> int:
    return num_levels(spec) * LEVELS_DTYPE.itemsize


def levels_wire_bytes(numel: int, spec: QuantSpec) -> int:
    """Exact bytes of one learned-levels row of ``numel`` values (table included)."""
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    return 0 if numel == 0 else table_bytes(spec) + wire_bytes(numel, spec)

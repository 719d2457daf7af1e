"""Test inputs and the bit-for-bit comparison shared by the codec implementation tests
(``test_kernels.py``: Triton vs torch; ``test_codec_native.py``: C vs torch)."""

from __future__ import annotations

import torch

NEG_NAN = torch.tensor([-0x400000], dtype=torch.int32).view(torch.float32).item()  # 0xFFC00000


def sample_rows(
    rows: int, n: int, seed: int, specials: bool = True, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Rows with per-region magnitudes (1e-3..1e2), exact zeros and a -0, from 1024 values on
    whole groups below ``wire.TINY_SCALE`` (1e-24) and of subnormals (1e-41), and (optionally)
    NaN (one with its sign bit set) and +-Inf, so groups of every kind occur."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.logspace(-3, 2, n)[torch.randperm(n, generator=g)]
    x = torch.randn(rows, n, generator=g) * mag
    x[:, 3:11] = 0.0
    x[:, 5] = -0.0
    if n >= 1024:
        x[:, 512:768] *= 1e-24
        x[:, 768:1024] *= 1e-41
    if specials and n > 40:
        x[0, n // 2] = float("nan")
        x[-1, 17] = float("inf")
        x[rows // 2, n - 1] = -float("inf")
        x[rows // 2, n // 3] = NEG_NAN  # a NaN with the sign bit set: kernels order raw bits
    return x.to(dtype)


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal dtype, shape and bits; NaNs only need to sit at the same places (payloads of
    NaNs made by arithmetic are not portable)."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    if not a.is_floating_point():
        assert torch.equal(a, b), f"{(a != b).sum().item()} of {a.numel()} bytes differ"
        return
    na, nb = torch.isnan(a), torch.isnan(b)
    assert torch.equal(na, nb), "NaNs at different places"
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    ia, ib = a.view(ints)[~na], b.view(ints)[~nb]
    assert torch.equal(ia, ib), f"{(ia != ib).sum().item()} of {ia.numel()} values differ"


def fitted_levels(spec, seed: int) -> torch.Tensor:
    """A learned (non-uniform) level table for ``spec``, fitted to heavy-tailed data, plus
    every uniform level's value hit exactly by some input in ``level_rows``."""
    from fsdp_qcomm.codec import levels as lv

    g = torch.Generator().manual_seed(seed)
    z = torch.randn(4, 4096, generator=g)
    heavy = z / torch.randn(4, 4096, 3, generator=g).pow(2).sum(-1).div(3).sqrt()
    return lv.fit_levels(lv.histogram(heavy, spec, bins=512), spec)


def level_rows(rows: int, n: int, seed: int, levels: torch.Tensor, dtype=torch.float32,
               group_size: int = 0):
    """``sample_rows`` with a few values placed exactly on levels (scaled by a group's range)
    so the search's ``<=`` boundary and ``p = 0`` occur. With ``group_size`` and two rows or
    more, the last row's groups from the first whole one after index 12 (up to index 512, where
    ``sample_rows``' tiny groups start) each hold the domain's ends, so that ``t = x`` exactly,
    and the midpoints of consecutive levels: nearest rounding's ties, ``d + d == gap``."""
    x = sample_rows(rows, n, seed, True, torch.float32)
    k = min(n - 12, len(levels))
    if k > 0:
        x[:, 12:12 + k] = levels[:k] * 2.0
    if group_size and rows >= 2:
        lo = -1.0 if levels[0] < 0 else 0.0
        mids = (levels[:-1] + levels[1:]) / 2
        per = group_size - 2
        g0 = -(-12 // group_size) * group_size
        for j, start in enumerate(range(g0, min(n, 512) - group_size + 1, group_size)):
            if per <= 0 or j * per >= len(mids):
                break
            m = mids[j * per:(j + 1) * per]
            x[-1, start:start + group_size] = 0.5 + lo / 2  # inside the domain
            x[-1, start] = lo
            x[-1, start + 1] = 1.0
            x[-1, start + 2:start + 2 + len(m)] = m
    return x.to(dtype)

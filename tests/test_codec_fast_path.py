"""The fast CPU codec path against its definitions: the int32 RNG against the int64 reference
formula, and the blocked encode/decode against the same code run in one step."""

import pytest
import torch

from fsdp_qcomm import QuantSpec
from fsdp_qcomm.codec import RngKey, rng, torch_codec

KEY = RngKey(seed=11, step=12, rank=13, bucket=14)


@pytest.mark.parametrize("starts", [[0], [2**31 - 300], [2**32 - 100], [7, 2**31 - 5, 2**32 - 1]])
def test_int32_rng_equals_reference_formula(starts):
    # Counters cross the int32 sign boundary and wrap past 2^32 inside the rows.
    width = 1001  # odd: the last column has no partner
    t = torch.randn(len(starts), width, generator=torch.Generator().manual_seed(len(starts)))
    x = torch.empty(len(starts), width, dtype=torch.int32)
    got = t.clone()
    rng.add_uniform_(got, rng.row_starts(starts, "cpu"), KEY.words(), x, torch.empty_like(x))
    c = (torch.tensor(starts)[:, None] + torch.arange(width)) & rng.MASK32
    assert torch.equal(got, t + rng.uniform(c, torch.arange(width) % 2, KEY))


def test_int32_rng_reference_values():
    # Pins the formula itself, scalar Python: columns 2j and 2j + 1 share h = mix32(mix32(c ^ k0)
    # ^ k1) of column 2j's counter c and take its low and high 16 bits as (bits + 1/2) * 2^-16.
    def mix(v):
        v ^= v >> 16
        v = (v * rng.MIX_M1) & rng.MASK32
        v ^= v >> 15
        v = (v * rng.MIX_M2) & rng.MASK32
        return v ^ (v >> 16)

    k0, k1 = KEY.words()
    cs = [0, 1, 2**31, 2**32 - 2, 123456789]
    want = []
    for c in cs:
        h = mix(mix(c ^ k0) ^ k1)
        want.append([((h & 0xFFFF) + 0.5) / 2**16, ((h >> 16) + 0.5) / 2**16])
    # Counters of one row are start + i, so run each as its own row of one pair.
    t = torch.zeros(len(cs), 2)
    x = torch.empty(len(cs), 2, dtype=torch.int32)
    rng.add_uniform_(t, rng.row_starts(cs, "cpu"), KEY.words(), x, torch.empty_like(x))
    assert t.tolist() == want


def test_rng_is_uniform_and_pairs_independent():
    # 2^20 draws: each 16-bit half is uniform over its 2^16 values (chi-square over 64 bins), the
    # two halves of a pair are uncorrelated, and so are neighbouring pairs.
    n = 1 << 20
    u = torch.zeros(1, n)
    x = torch.empty(1, n, dtype=torch.int32)
    rng.add_uniform_(u, rng.row_starts([5], "cpu"), KEY.words(), x, torch.empty_like(x))
    u = u.view(-1).double()
    assert float(u.min()) == 0.5 / 2**16 and float(u.max()) == 1 - 0.5 / 2**16
    for half in (u[0::2], u[1::2]):
        counts = torch.histc(half, bins=64, min=0, max=1)
        expect = half.numel() / 64
        chi2 = float(((counts - expect) ** 2 / expect).sum())
        assert chi2 < 120, chi2  # 63 degrees of freedom: p ~ 1e-5
        assert abs(float(half.mean()) - 0.5) < 4 * (1 / 12 / half.numel()) ** 0.5

    def corr(a, b):
        return float(torch.corrcoef(torch.stack([a, b]))[0, 1])

    assert abs(corr(u[0::2], u[1::2])) < 5 / (n / 2) ** 0.5
    assert abs(corr(u[0:-2:2], u[2::2])) < 5 / (n / 2) ** 0.5


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_blocked_steps_give_the_same_bytes(monkeypatch, bits, symmetric, rounding):
    spec = QuantSpec(bits=bits, group_size=16, symmetric=symmetric, rounding=rounding,
                     scale_dtype="bfloat16")
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(3, 250, generator=g)
    x[1, 40] = float("nan")
    x[2, 245] = float("inf")
    chunks = [torch_codec.quantize(torch.randn(3, 250, generator=g), spec, KEY, None, False)
              for _ in range(3)]
    out_spec = QuantSpec(bits=4, group_size=24, rounding=rounding)

    def run():
        q = torch_codec.quantize(x, spec, KEY)
        d = torch_codec.dequantize(q, 250, spec)
        rr = torch_codec.reduce_requantize(chunks, 250, spec, out_spec, KEY)
        rd = torch_codec.reduce_dequantize(chunks, 250, spec)
        return q, d, rr, rd

    one = run()  # 750 elements: every row block is a single step
    monkeypatch.setattr(torch_codec, "_BLOCK", 48)  # three groups per step, row by row
    many = run()
    assert torch.equal(one[0], many[0]) and torch.equal(one[2], many[2])
    for a, b in ((one[1], many[1]), (one[3], many[3])):
        assert torch.equal(a.isnan(), b.isnan())
        assert torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
    assert bool(one[1][1, 32:48].isnan().all()) and bool(one[1][2, 240:].isnan().all())


def test_counter_space_is_checked():
    with pytest.raises(ValueError, match="RNG counter"):
        rng.check_counter_range(2, 2**31 + 1)
    rng.check_counter_range(2, 2**31)

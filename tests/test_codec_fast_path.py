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
    width = 1000
    t = torch.randn(len(starts), width, generator=torch.Generator().manual_seed(len(starts)))
    x = torch.empty(len(starts), width, dtype=torch.int32)
    got = t.clone()
    rng.add_uniform_(got, rng.row_starts(starts, "cpu"), KEY.words(), x, torch.empty_like(x))
    c = (torch.tensor(starts)[:, None] + torch.arange(width)) & rng.MASK32
    assert torch.equal(got, t + rng.uniform(c, KEY))


def test_int32_rng_reference_values():
    # Pins the formula itself: u = (mix32(mix32(c ^ k0) ^ k1) >> 8) * 2^-24, scalar Python.
    def mix(v):
        v ^= v >> 16
        v = (v * rng.MIX_M1) & rng.MASK32
        v ^= v >> 15
        v = (v * rng.MIX_M2) & rng.MASK32
        return v ^ (v >> 16)

    k0, k1 = KEY.words()
    cs = [0, 1, 2**31, 2**32 - 1, 123456789]
    want = [(mix(mix(c ^ k0) ^ k1) >> 8) / 2**24 for c in cs]
    # Counters of one row are start + i, so run each as its own row of width 1.
    t = torch.zeros(len(cs), 1)
    x = torch.empty(len(cs), 1, dtype=torch.int32)
    rng.add_uniform_(t, rng.row_starts(cs, "cpu"), KEY.words(), x, torch.empty_like(x))
    assert t.view(-1).tolist() == want


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

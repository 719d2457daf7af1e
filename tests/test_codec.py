"""The torch codec against the wire format's definition and its error bounds."""

import math
import warnings

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fsdp_qcomm import QCommConfig, QuantSpec, codec
from fsdp_qcomm.codec import RngKey, torch_codec, wire

KEY = RngKey(seed=1, step=2, rank=3, bucket=4)


def _groups(x: torch.Tensor, gs: int) -> torch.Tensor:
    """[R, n] -> [R, G, gs] with the last group padded by its last value (like the encoder)."""
    n = x.shape[-1]
    G = -(-n // gs)
    pad = x[:, -1:].expand(-1, G * gs - n)
    return torch.cat((x, pad), 1).view(x.shape[0], G, gs)


def _scale(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Per-element scale implied by the spec, [R, n]."""
    g = _groups(x, spec.group_size)
    if spec.symmetric:
        s = g.abs().amax(-1) / spec.qmax
    else:
        s = (g.amax(-1) - g.amin(-1)) / spec.qmax
    s = s.to(spec.torch_scale_dtype).float()
    s = torch.where(s == 0, torch.ones_like(s), s)
    return s[..., None].expand_as(g).reshape(x.shape[0], -1)[:, : x.shape[1]]


def test_wire_size_formula():
    spec = QuantSpec(bits=4, group_size=2048)
    assert codec.wire_bytes(2048, spec) == 4 + 1024
    assert codec.wire_bytes(1, spec) == 4 + 4  # 1 scale + 4 code bytes (8 padded codes), aligned
    assert codec.wire_bytes(0, spec) == 0
    spec8 = QuantSpec(bits=8, group_size=128, symmetric=False, scale_dtype="bfloat16")
    assert codec.wire_bytes(1000, spec8) == 8 * 2 * 2 + 1000
    spec3 = QuantSpec(bits=3, group_size=64)
    assert codec.wire_bytes(100, spec3) == -(-(2 * 4 + 13 * 3) // 4) * 4
    assert abs(codec.bits_per_element(2048 * 64, spec) - (4 + 32 / 2048)) < 1e-9


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
def test_pack_unpack_every_width(bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (3, 8 * 37), generator=g)
    packed = torch_codec.pack_codes(codes, bits)
    assert packed.shape == (3, 37 * bits) and packed.dtype == torch.uint8
    assert torch.equal(torch_codec.unpack_codes(packed, bits).long(), codes)


def test_nibble_layout_is_documented_one():
    # Element 2j is the low nibble of byte j, element 2j+1 the high nibble.
    codes = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    assert torch_codec.pack_codes(codes, 4).tolist() == [[0x21, 0x43, 0x65, 0x87]]
    # 3 bits: LSB-first bit stream.
    codes = torch.tensor([[7, 0, 0, 0, 0, 0, 0, 1]])
    assert torch_codec.pack_codes(codes, 3).tolist() == [[0x07, 0x00, 0x20]]


def test_symmetric_levels_and_biased_storage():
    spec = QuantSpec(bits=4, group_size=8, rounding="nearest")
    x = torch.tensor([[-7.0, -3.0, 0.0, 1.0, 2.0, 3.0, 6.0, 7.0]])
    data = codec.quantize(x, spec)
    assert data[0, :4].view(torch.float32).item() == 1.0  # scale = absmax / 7
    codes = torch_codec.unpack_codes(data[:, 4:8], 4)
    assert codes.tolist() == [[0, 4, 7, 8, 9, 10, 13, 14]]
    assert torch.equal(codec.dequantize(data, 8, spec), x)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nearest_round_trip_within_half_scale(bits, symmetric, dtype):
    spec = QuantSpec(bits=bits, group_size=64, symmetric=symmetric, rounding="nearest")
    x = (torch.randn(3, 1001, generator=torch.Generator().manual_seed(bits)) * 3).to(dtype)
    y = codec.dequantize(codec.quantize(x, spec), 1001, spec)
    xf = x.float()
    err = (y - xf).abs()
    bound = _scale(xf, spec) * 0.5 * (1 + 1e-5) + 1e-6
    assert bool((err <= bound).all()), float((err - bound).max())


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("scale_dtype", ["float32", "bfloat16"])
def test_tiny_and_subnormal_groups_round_trip_within_half_scale(symmetric, scale_dtype):
    """Scales below ``wire.TINY_SCALE`` are prescaled before their reciprocal (else it would
    overflow): groups of ~1e-24, of subnormals (~1e-41) and around the threshold decode within
    half a step, and every decoded value is finite."""
    spec = QuantSpec(bits=4, group_size=64, symmetric=symmetric, rounding="nearest",
                     scale_dtype=scale_dtype)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(5))
    x[:, :128] *= 1e-24
    x[:, 128:256] *= 1e-41
    x[:, 256:384] *= wire.TINY_SCALE * spec.qmax / 3  # scales on both sides of the threshold
    y = codec.dequantize(codec.quantize(x, spec), 512, spec)
    assert bool(torch.isfinite(y).all())
    g = _groups(x, 64)
    rng = g.abs().amax(-1) if symmetric else g.amax(-1) - g.amin(-1)
    rng = rng[..., None].expand_as(g).reshape(3, -1)
    ulp = {"float32": 0.0, "bfloat16": 2**-8}[scale_dtype]
    bound = 0.5 * _scale(x, spec) * (1 + 1e-5) + ulp * rng * 2 + 2 * 2.0**-149
    assert bool(((y - x).abs() <= bound).all()), float(((y - x).abs() - bound).max())


@pytest.mark.parametrize("symmetric", [True, False])
def test_stochastic_error_below_one_scale(symmetric):
    spec = QuantSpec(bits=4, group_size=128, symmetric=symmetric)
    x = torch.randn(4, 777, generator=torch.Generator().manual_seed(0))
    y = codec.dequantize(codec.quantize(x, spec, KEY), 777, spec)
    assert bool(((y - x).abs() <= _scale(x, spec) * (1 + 1e-5)).all())


@pytest.mark.parametrize("symmetric", [True, False])
def test_stochastic_rounding_is_unbiased(symmetric):
    spec = QuantSpec(bits=2, group_size=64, symmetric=symmetric)
    x = torch.randn(1, 640, generator=torch.Generator().manual_seed(5))
    trials = 2000
    acc = torch.zeros_like(x)
    for s in range(trials):
        acc += codec.dequantize(codec.quantize(x, spec, RngKey(0, s, 0, 0)), 640, spec)
    mean_err = (acc / trials - x).abs()
    # Per-element sd of the rounding is <= scale/2, so the mean of 2000 draws is within
    # 5 sigma = 5 * scale / (2 * sqrt(2000)) ~= 0.056 scale; a biased rounder misses by ~0.25.
    assert bool((mean_err <= 0.06 * _scale(x, spec)).all())
    nearest = QuantSpec(bits=2, group_size=64, symmetric=symmetric, rounding="nearest")
    bias = (codec.dequantize(codec.quantize(x, nearest), 640, nearest) - x).abs().mean()
    assert mean_err.mean() < bias / 5


def test_stochastic_is_deterministic_per_key_and_independent_across_keys():
    spec = QuantSpec(bits=4, group_size=128)
    x = torch.randn(2, 4096, generator=torch.Generator().manual_seed(1))
    a = codec.quantize(x, spec, KEY)
    assert torch.equal(a, codec.quantize(x, spec, KEY))
    others = [KEY._replace(seed=9), KEY._replace(step=3), KEY._replace(rank=0),
              KEY._replace(bucket=5)]
    for k in others:
        b = codec.quantize(x, spec, k)
        assert not torch.equal(a, b)
    # Uniforms of different keys are uncorrelated and uniform.
    c = torch.arange(1 << 16, dtype=torch.int64)
    from fsdp_qcomm.codec.rng import uniform

    u1, u2 = uniform(c, c % 2, KEY), uniform(c, c % 2, KEY._replace(step=3))
    assert abs(u1.mean().item() - 0.5) < 0.01 and abs(u1.var().item() - 1 / 12) < 0.005
    assert abs(torch.corrcoef(torch.stack([u1, u2]))[0, 1].item()) < 0.02
    assert float(u1.min()) > 0.0 and float(u1.max()) < 1.0


def test_stochastic_needs_key():
    with pytest.raises(ValueError, match="RngKey"):
        codec.quantize(torch.ones(1, 8), QuantSpec())


def test_all_zero_groups_and_constant_groups():
    for sym in (True, False):
        spec = QuantSpec(bits=4, group_size=8, symmetric=sym, rounding="nearest")
        x = torch.zeros(2, 20)
        x[1, 8:16] = 3.5
        y = codec.dequantize(codec.quantize(x, spec), 20, spec)
        assert torch.equal(y, x)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_groups_decode_non_finite(symmetric, bad):
    spec = QuantSpec(bits=4, group_size=16, symmetric=symmetric)
    x = torch.randn(2, 50)
    x[1, 20] = bad
    y = codec.dequantize(codec.quantize(x, spec, KEY), 50, spec)
    assert bool(torch.isnan(y[1, 16:32]).all())  # the group holding it
    assert bool(torch.isfinite(y[0]).all()) and bool(torch.isfinite(y[1, :16]).all())
    assert bool(torch.isfinite(y[1, 32:]).all())


def test_hadamard_identity_and_orthogonality():
    x = torch.randn(5, 96, dtype=torch.float64)
    hx = torch_codec.hadamard32(x)
    assert torch.allclose(torch_codec.hadamard32(hx) / 32, x)
    # Against the Sylvester matrix.
    H = torch.ones(1, 1, dtype=torch.float64)
    while H.shape[0] < 32:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    assert torch.allclose(hx.view(-1, 32), x.view(-1, 32) @ H.T)


def test_hadamard_quantize_round_trip_and_smoothing():
    # Stochastic rounding, as the gradient hops use: an outlier inflates its group's scale and
    # the small values then round to +-scale at random; Hadamard spreads the outlier instead.
    spec = QuantSpec(bits=4, group_size=128)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 1000, generator=g) * 0.01
    x[:, ::97] = 5.0
    plain = codec.dequantize(codec.quantize(x, spec, KEY), 1000, spec)
    data = codec.quantize(x, spec, KEY, hadamard=True)
    assert data.shape[-1] == codec.wire_bytes(wire.hadamard_len(1000), spec)
    had = codec.dequantize(data, 1000, spec, hadamard=True)
    e_plain = (plain - x).norm() / x.norm()
    e_had = (had - x).norm() / x.norm()
    assert e_had < e_plain * 0.6


def test_difference_and_accumulate():
    spec = QuantSpec(bits=4, group_size=64, rounding="nearest")
    ref = torch.randn(3, 200)
    new = ref + 0.01 * torch.randn(3, 200)
    data = codec.quantize(new, spec, ref=ref)
    out = ref.clone()
    codec.dequantize(data, 200, spec, out=out, accumulate=True)
    d = new - ref
    assert bool(((out - new).abs() <= _scale(d, spec) * 0.5 + 1e-6).all())
    # Accumulating into a bf16 reference keeps its dtype.
    ref16 = ref.bfloat16()
    codec.dequantize(data, 200, spec, out=ref16, accumulate=True)
    assert ref16.dtype == torch.bfloat16


def test_reduce_requantize_and_reduce_dequantize_match_unfused():
    s8 = QuantSpec(bits=8, group_size=128)
    s4 = QuantSpec(bits=4, group_size=128)
    k, n = 3, 320
    xs = torch.randn(k, 2, n)
    hops = torch.stack([codec.quantize(xs[j], s8, KEY._replace(rank=j), hadamard=True)
                        for j in range(k)])
    m = wire.hadamard_len(n)
    fused = codec.reduce_requantize(hops, m, s8, s4, KEY)
    acc = codec.dequantize(hops[0], m, s8)
    for j in range(1, k):
        acc = acc + codec.dequantize(hops[j], m, s8)
    assert torch.equal(fused, codec.quantize(acc, s4, KEY))
    final = codec.reduce_dequantize(fused.unsqueeze(0), n, s4, hadamard=True)
    assert final.shape == (2, n)
    rel = (final - xs.sum(0)).norm() / xs.sum(0).norm()
    assert rel < 0.2


@pytest.mark.parametrize("hadamard", [False, True])
def test_quantize_into_out_writes_the_returned_bytes_and_nothing_else(hadamard):
    """``out=``: the bytes ``quantize`` returns, written into a slice of a larger buffer (the
    C loop and the torch code, through the public entry point and directly), the bytes around
    it untouched; a transposed ``out`` too (through a copy); a wrong width or shape refused."""
    spec = QuantSpec(bits=4, group_size=128)
    x, r = torch.randn(3, 1000), torch.randn(3, 1000)
    want = codec.quantize(x, spec, KEY, ref=r, hadamard=hadamard)
    W = want.shape[-1]
    for encode in (lambda o: codec.quantize(x, spec, KEY, ref=r, hadamard=hadamard, out=o),
                   lambda o: torch_codec.quantize(x, spec, KEY, r, hadamard, o)):
        buf = torch.full((3 * W + 8,), 7, dtype=torch.uint8)
        o = buf[4:4 + 3 * W].view(3, W)
        assert encode(o) is o and torch.equal(o, want)
        assert buf[:4].tolist() == [7] * 4 and buf[-4:].tolist() == [7] * 4
        t = torch.zeros(W, 3, dtype=torch.uint8).t()
        encode(t)
        assert torch.equal(t, want)
    one = torch.zeros(W, dtype=torch.uint8)  # one row: counters from 0, unlike want[1]
    codec.quantize(x[1], spec, KEY, ref=r[1], hadamard=hadamard, out=one)
    assert torch.equal(one, codec.quantize(x[1], spec, KEY, ref=r[1], hadamard=hadamard))
    with pytest.raises(ValueError, match="bytes but"):
        codec.quantize(x, spec, KEY, hadamard=hadamard, out=torch.empty(3, W + 4,
                                                                       dtype=torch.uint8))
    with pytest.raises(ValueError, match="leading shape"):
        codec.quantize(x, spec, KEY, hadamard=hadamard, out=torch.empty(2, W, dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8"):
        codec.quantize(x, spec, KEY, hadamard=hadamard, out=torch.empty(3, W))


def test_quantize_in_an_order_is_quantize_then_index_select():
    """``order=``: the rows' bytes in that order (a repeat and a subset too), each row with its
    own random numbers; refused with out=, for x that is not 2-D, for an index outside the
    rows."""
    spec = QuantSpec(bits=8, group_size=128)
    x = torch.randn(4, 300)
    want = codec.quantize(x, spec, KEY, hadamard=True)
    for order in ([2, 0, 3, 1], (3, 3), range(2), []):
        got = codec.quantize(x, spec, KEY, hadamard=True, order=order)
        assert torch.equal(got, want[list(order)])
    with pytest.raises(ValueError, match="out= cannot"):
        codec.quantize(x, spec, KEY, order=[0], out=torch.empty(1, want.shape[1],
                                                                 dtype=torch.uint8))
    with pytest.raises(ValueError, match="2-D x"):
        codec.quantize(x.view(2, 2, 300), spec, KEY, order=[0])
    with pytest.raises(ValueError, match=r"ints in \[0, 4\)"):
        codec.quantize(x, spec, KEY, order=[0, 4])


def test_quantize_segments_is_quantize_per_segment_with_folded_keys():
    """A flat tensor of back-to-back segments encodes as ``quantize`` of each segment alone
    with ``key.fold(key_salt + k)``, rows back to back (or into ``out``); empty segments send
    nothing; ``dequantize_segments`` decodes it; bad segment lists and buffers are refused."""
    spec = QuantSpec(bits=4, group_size=96)
    segs = (300, 0, 1001, 7)
    g = torch.Generator().manual_seed(11)
    x, r = torch.randn(sum(segs), generator=g), torch.randn(sum(segs), generator=g)
    for hadamard in (False, True):
        want, off = [], 0
        for k, n in enumerate(segs):
            if n:
                want.append(codec.quantize(x[off:off + n], spec, KEY.fold(77 + k),
                                           ref=r[off:off + n], hadamard=hadamard))
            off += n
        want = torch.cat(want)
        got = codec.quantize_segments(x, segs, spec, KEY, key_salt=77, ref=r, hadamard=hadamard)
        assert torch.equal(got, want)
        buf = torch.zeros(want.numel(), dtype=torch.uint8)
        assert codec.quantize_segments(x, segs, spec, KEY, key_salt=77, ref=r,
                                       hadamard=hadamard, out=buf) is buf
        assert torch.equal(buf, want)
        back = torch.zeros(1, sum(segs))
        codec.dequantize_segments(got.view(1, -1), segs, spec, out=back, hadamard=hadamard)
        # 4-bit stochastic rounding: relative L2 error about 0.16, with or without Hadamard
        assert (back[0] - (x - r)).norm() < 0.25 * (x - r).norm()
    empty = codec.quantize_segments(torch.zeros(0), (0, 0), spec, KEY)  # a rank with nothing
    assert empty.shape == (0,)
    codec.dequantize_segments(empty.view(2, 0), (0, 0), spec, out=torch.zeros(2, 0))
    with pytest.raises(ValueError, match="sum to"):
        codec.quantize_segments(x, (5, 5), spec, KEY)
    with pytest.raises(TypeError, match="float32"):
        codec.quantize_segments(x.to(torch.int32), segs, spec, KEY)
    with pytest.raises(ValueError, match="flat"):
        codec.quantize_segments(x.view(1, -1), segs, spec, KEY)
    with pytest.raises(ValueError, match="bytes but"):
        codec.quantize_segments(x, segs, spec, KEY, out=torch.empty(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="RngKey"):
        codec.quantize_segments(x, segs, spec)


def test_dequantize_segments_is_dequantize_per_segment():
    """Rows of back-to-back segment rows decode (or add) into their columns exactly as a
    ``dequantize`` per segment does, empty segments included; wrong widths are refused."""
    spec = QuantSpec(bits=4, group_size=96, symmetric=False, scale_dtype="bfloat16")
    segs = (300, 0, 1001, 7)
    for hadamard in (False, True):
        parts = [codec.quantize(torch.randn(3, n), spec, KEY.fold(k), hadamard=hadamard)
                 if n else torch.empty(3, 0, dtype=torch.uint8) for k, n in enumerate(segs)]
        data = torch.cat(parts, 1)
        for accumulate in (False, True):
            base = torch.randn(3, sum(segs)).to(torch.bfloat16)
            want, got = base.clone(), base.clone()
            off = 0
            for n, p in zip(segs, parts):
                if n:
                    codec.dequantize(p, n, spec, hadamard=hadamard, out=want[:, off:off + n],
                                     accumulate=accumulate)
                off += n
            assert codec.dequantize_segments(data, segs, spec, out=got, hadamard=hadamard,
                                             accumulate=accumulate) is got
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        # row_base: row 1 adds to a base of its own, which takes the sums too
        mine = torch.randn(sum(segs)).to(torch.bfloat16)
        got = base.clone()
        got[1] = torch.randn(sum(segs))  # what FSDP wrote over the slot: not read
        want = base.clone()
        want[1] = mine
        codec.dequantize_segments(data, segs, spec, out=want, hadamard=hadamard, accumulate=True)
        codec.dequantize_segments(data, segs, spec, out=got, hadamard=hadamard, accumulate=True,
                                  row_base=(1, mine))
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        assert torch.equal(mine.view(torch.int16), want[1].view(torch.int16))
    for bad, what in (((3, mine), "an int in"), ((0, mine[1:]), "flat"),
                      ((0, mine.float()), "flat")):
        with pytest.raises(ValueError, match=what):
            codec.dequantize_segments(data, segs, spec, out=got, hadamard=True, accumulate=True,
                                      row_base=bad)
    with pytest.raises(ValueError, match="accumulate=True"):
        codec.dequantize_segments(data, segs, spec, out=got, hadamard=True, row_base=(0, mine))
    with pytest.raises(ValueError, match="bytes but segments"):
        codec.dequantize_segments(data[:, 4:], segs, spec, out=got, hadamard=True)
    with pytest.raises(ValueError, match=">= 0"):
        codec.dequantize_segments(data, (-1, 2), spec, out=got)


def test_shapes_and_errors():
    spec = QuantSpec(bits=4, group_size=8, rounding="nearest")
    x = torch.randn(2, 3, 17)
    data = codec.quantize(x, spec)
    assert data.shape == (2, 3, codec.wire_bytes(17, spec))
    assert codec.dequantize(data, 17, spec).shape == (2, 3, 17)
    with pytest.raises(ValueError, match="bytes"):
        codec.dequantize(data, 25, spec)
    with pytest.raises(TypeError):
        codec.quantize(torch.ones(4, dtype=torch.int32), spec)
    with pytest.raises(ValueError, match="ref shape"):
        codec.quantize(x, spec, ref=torch.zeros(17))


def test_quantspec_and_config_validation_messages():
    with pytest.raises(ValueError, match=r"QuantSpec.bits=9 .*\[2, 8\]"):
        QuantSpec(bits=9)
    with pytest.raises(ValueError, match="multiple of 8"):
        QuantSpec(group_size=100)
    with pytest.raises(ValueError, match="rounding"):
        QuantSpec(rounding="up")
    with pytest.raises(ValueError, match="QCommConfig.weight_bits"):
        QCommConfig(weight_bits=1)
    with pytest.raises(ValueError, match="QCommConfig.grad_group_size"):
        QCommConfig(grad_group_size=12)
    with pytest.raises(ValueError, match="QCommConfig.weight_scheme"):
        QCommConfig(weight_scheme="fancy")
    with pytest.raises(ValueError, match="unknown QCommConfig preset"):
        QCommConfig.preset("nope")
    with pytest.raises(ValueError, match="unknown QCommConfig field"):
        QCommConfig.from_dict({"weight_bitz": 4})
    cfg = QCommConfig.preset("sdp4bit")
    assert cfg.weight_scheme == "qwd" and cfg.grad_hadamard and cfg.weight_spec().group_size == 2048
    assert cfg.grad_intra_spec().bits == 8 and cfg.grad_inter_spec().bits == 4


def test_float16_scales_underflow_and_the_config_warns():
    """A 4-bit min-max group with a range of 2e-7 needs a scale of 1.3e-8, below float16's
    smallest (2^-24): it decodes as a constant; bfloat16, the same 2 bytes, keeps it within half
    a step. A config that would quantize with float16 scales says so and names bfloat16."""
    x = torch.linspace(1e-7, 3e-7, 16)[None]
    err = {}
    for sdt in ("float16", "bfloat16"):
        spec = QuantSpec(bits=4, group_size=16, symmetric=False, rounding="nearest",
                         scale_dtype=sdt)
        y = codec.dequantize(codec.quantize(x, spec), 16, spec)
        err[sdt] = float((y - x).abs().max())
        if sdt == "float16":
            assert y.unique().numel() == 1, y
    assert err["float16"] > 0.4 * 2e-7 and err["bfloat16"] <= 0.5 * 2e-7 / 15 * (1 + 2**-7)
    with pytest.warns(UserWarning, match="scale_dtype='bfloat16' costs the same 2 bytes"):
        QCommConfig.preset("sdp4bit", scale_dtype="float16")
    with pytest.warns(UserWarning, match="float16 scales are subnormal"):
        QCommConfig(weight_scheme="none", grad_scheme="one_level", scale_dtype="float16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        QCommConfig.preset("sdp4bit", scale_dtype="bfloat16")
        QCommConfig(weight_scheme="bf16", grad_scheme="bf16", scale_dtype="float16")  # unused


@pytest.mark.parametrize("scale_dtype, center, spread", [
    ("bfloat16", 0.3, 1e-3), ("float16", 5.9985, 0.02)])
def test_a_16_bit_minimum_is_stored_at_or_below_the_group(scale_dtype, center, spread):
    """An asymmetric group's minimum is stored rounded down in a 16-bit scale dtype (wire.py):
    nothing clamps at the bottom, so a tight group far from zero decodes within half a step of
    its range widened by at most one spacing of the dtype. Rounded to nearest, these groups
    (8 x 128 values) decoded 199 (bfloat16) and 19 (float16) of their 8-bit steps off."""
    spec = QuantSpec(bits=8, group_size=128, symmetric=False, rounding="nearest",
                     scale_dtype=scale_dtype)
    x = center + spread * torch.rand(8, 128, generator=torch.Generator().manual_seed(0))
    data = codec.quantize(x, spec)
    y = codec.dequantize(data, 128, spec)
    dt = spec.torch_scale_dtype
    stored = data[:, 2:4].contiguous().view(dt)[:, 0].to(torch.float32)  # [scale | min | codes]
    up = (stored.to(dt).view(torch.int16) + 1).view(dt).to(torch.float32)  # next above (> 0)
    assert bool((stored <= x.amin(-1)).all()) and bool((up > x.amin(-1)).all())
    spacing = 2.0 ** (math.floor(math.log2(center)) - (7 if scale_dtype == "bfloat16" else 10))
    assert float((y - x).abs().max()) <= 0.5 * (spread + spacing) / 255 * (1 + 2**-7)


def test_a_float16_minimum_just_below_its_range_keeps_the_group_finite():
    """float16 ends at -65504: a group whose minimum lies in (-65520, -65504) keeps -65504 as
    its stored minimum (one step down is -inf) and decodes finite, its lowest values clamped
    up to it; rounded down to -inf the whole group would decode as NaN."""
    spec = QuantSpec(bits=8, group_size=16, symmetric=False, rounding="nearest",
                     scale_dtype="float16")
    x = (-65510.0 + torch.linspace(0, 40, 16))[None]
    y = codec.dequantize(codec.quantize(x, spec), 16, spec)
    assert bool(torch.isfinite(y).all()), y
    assert float((y - x).abs().max()) <= 6.0 + 0.5 * 46 / 255 * 1.01


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 700),
    rows=st.integers(1, 3),
    bits=st.integers(2, 8),
    gs=st.sampled_from([8, 16, 64, 128, 136]),
    symmetric=st.booleans(),
    scale_dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
    mag=st.floats(1e-3, 1e3),
    seed=st.integers(0, 2**31 - 1),
)
# a subnormal float16 scale (8-bit steps of ~1.6e-5): beyond the one-ulp-relative bound alone
@example(n=200, rows=2, bits=8, gs=8, symmetric=False, scale_dtype="float16", mag=1e-3, seed=1)
# a tight last group far from zero: its float16 minimum's rounding exceeds half a step
@example(n=306, rows=1, bits=5, gs=8, symmetric=False, scale_dtype="float16", mag=25.0, seed=306)
# a step near an ulp of the values: fp32's own rounding of x - min and of the decode
@example(n=618, rows=1, bits=8, gs=16, symmetric=False, scale_dtype="float32",
         mag=343.77112504092474, seed=214424937)
def test_property_round_trip(n, rows, bits, gs, symmetric, scale_dtype, mag, seed):
    spec = QuantSpec(bits=bits, group_size=gs, symmetric=symmetric, rounding="nearest",
                     scale_dtype=scale_dtype)
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(seed)) * mag
    data = codec.quantize(x, spec)
    assert data.shape == (rows, codec.wire_bytes(n, spec))
    y = codec.dequantize(data, n, spec)
    # Low-precision scales are rounded, which may clip the extreme value by up to one ulp of
    # the scale dtype relative to absmax (2^-8 for bf16): allow that on top of half a step.
    # A float16 scale below 2^-14 (6.1e-5) is subnormal, spaced 2^-24 apart whatever its size:
    # rounding it moves the top level by up to qmax * 2^-25 (mag=1e-3 with 8 bits gets there).
    # An asymmetric group's minimum is stored in the scale dtype too, rounded down (wire.py):
    # up to one spacing below (|min| * 2 ulp; 2^-24 when a float16 minimum is subnormal), which
    # widens the range the codes span by as much, and so half a step by half of it / qmax. A
    # tight group far from zero shows it (n=306, 5 bits, groups of 8, float16, mag=25: rounded
    # to nearest, its minimum went above values that clamped, 3 steps of its range away).
    s = _scale(x, spec)
    ulp = {"float32": 0.0, "bfloat16": 2**-8, "float16": 2**-11}[scale_dtype]
    subnormal = spec.qmax * 2**-25 if scale_dtype == "float16" else 0.0
    g = _groups(x, gs)
    rng = (g.abs().amax(-1) if symmetric else g.amax(-1) - g.amin(-1))
    rng = rng[..., None].expand_as(g).reshape(rows, -1)[:, :n]
    # fp32 itself rounds x - min and u * scale + min: an ulp of |x| + |min| or so, which a
    # group far from zero with a step near it shows (n=618, 8 bits, groups of 16, mag=344).
    lo_abs = g.amin(-1)[..., None].expand_as(g).reshape(rows, -1)[:, :n].abs()
    lo = 0.0 if symmetric else lo_abs * 2 * ulp + (2**-24 if scale_dtype == "float16" else 0.0)
    fp32 = 2**-23 * (x.abs() + (0.0 if symmetric else lo_abs))
    bound = (0.5 * s * (1 + 1e-5) + 0.5 * lo / spec.qmax * (1 + 2 * ulp)
             + ulp * (rng + lo) * 2 + subnormal + fp32 + 1e-30)
    assert bool(((y - x).abs() <= bound).all())
    assert math.isfinite(float(y.abs().max()))

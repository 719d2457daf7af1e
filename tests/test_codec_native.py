"""The fused C loops (``codec/cpu_native.c``) write exactly the bytes of ``torch_codec``.

CPU tensors go through ``cpu_native`` (see ``codec/__init__.py``), so every other codec and
collective test already runs on it; these tests pin it bit for bit to the torch reference over
widths, group sizes that are not powers of two, partial last groups, NaN/Inf/-0 groups, row
strides, both scalings and both roundings, and check the fallbacks.
"""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch
from _codec_cases import assert_same_bits as _same
from _codec_cases import fitted_levels, level_rows, sample_rows

from fsdp_qcomm.codec import RngKey, cpu_native, torch_codec, wire
from fsdp_qcomm.config import QuantSpec

KEY = RngKey(seed=7, step=3, rank=1, bucket=5)

needs_native = pytest.mark.skipif(not cpu_native.available(),
                                  reason="the C codec could not be built here (no C compiler)")


def _spec(bits, sym, rounding="stochastic", gs=128, sdt="float32"):
    return QuantSpec(bits=bits, group_size=gs, symmetric=sym, rounding=rounding, scale_dtype=sdt)


def _data(rows: int, n: int, seed: int, specials: bool = True) -> torch.Tensor:
    return sample_rows(rows, n, seed, specials)


def test_builds_where_a_compiler_exists():
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on this machine: the torch codec is used")
    assert cpu_native.available(), "cc exists but the C codec did not build (see the warning)"


@needs_native
@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_quantize_matches_torch(bits, sym, rounding):
    for gs, rows, n in [(8, 3, 61), (40, 2, 333), (128, 3, 1000), (2048, 1, 5000)]:
        spec = _spec(bits, sym, rounding, gs)
        x = _data(rows, n, seed=bits * 31 + gs + n)
        got = cpu_native.quantize(x, spec, KEY)
        _same(got, torch_codec.quantize(x, spec, KEY))
        assert got.shape == (rows, wire.wire_bytes(n, spec))


@needs_native
@pytest.mark.parametrize("gs", [32, 96, 24, 128])
@pytest.mark.parametrize("ref", [False, True])
@pytest.mark.parametrize("hadamard", [False, True])
def test_quantize_difference_and_hadamard(gs, ref, hadamard):
    for bits in (4, 8):
        spec = _spec(bits, True, "stochastic", gs)
        x = _data(2, 1037, seed=gs + bits)
        r = _data(2, 1037, seed=gs + 1, specials=False) if ref else None
        _same(cpu_native.quantize(x, spec, KEY, r, hadamard),
              torch_codec.quantize(x, spec, KEY, r, hadamard))


@needs_native
def test_quantize_strided_and_low_precision_inputs():
    spec = _spec(4, True)
    base = _data(3, 700, seed=3)
    x = base[:, 50:650]  # row stride 700, not the row length
    _same(cpu_native.quantize(x, spec, KEY), torch_codec.quantize(x, spec, KEY))
    xb = base.to(torch.bfloat16)
    _same(cpu_native.quantize(xb, spec, KEY, xb * 0.5, True),
          torch_codec.quantize(xb, spec, KEY, xb * 0.5, True))
    xt = _data(300, 16, seed=4).t()  # column stride 16: copied, same bytes
    _same(cpu_native.quantize(xt, spec, KEY), torch_codec.quantize(xt, spec, KEY))


@needs_native
def test_long_rows_span_many_windows_and_counters():
    # Several 8192-element windows per row and 3 rows: window, row and counter offsets.
    spec = _spec(4, True, "stochastic", 2048)
    x = _data(3, 3 * 8192 + 1000, seed=9)
    _same(cpu_native.quantize(x, spec, KEY), torch_codec.quantize(x, spec, KEY))
    spec8 = _spec(8, True, "stochastic", 128)
    _same(cpu_native.quantize(x, spec8, KEY, None, True),
          torch_codec.quantize(x, spec8, KEY, None, True))


@needs_native
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("hadamard", [False, True])
def test_dequantize_matches_torch(bits, sym, hadamard):
    for gs, n in [(32, 300), (40, 333), (128, 9000)]:
        spec = _spec(bits, sym, "stochastic", gs)
        m = wire.hadamard_len(n) if hadamard else n
        data = torch_codec.quantize(_data(3, m, seed=gs + bits), spec, KEY)
        _same(cpu_native.dequantize(data, n, spec, hadamard),
              torch_codec.dequantize(data, n, spec, hadamard))
        base = _data(3, n + 20, seed=1, specials=False)
        for dtype in (torch.float32, torch.bfloat16):
            for accumulate in (False, True):
                got, want = base.to(dtype), base.to(dtype)
                cpu_native.dequantize(data, n, spec, hadamard, got[:, 10:10 + n], accumulate)
                torch_codec.dequantize(data, n, spec, hadamard, want[:, 10:10 + n], accumulate)
                _same(got, want)


@needs_native
@pytest.mark.parametrize("gs_in,gs_out", [(128, 128), (32, 128), (128, 2048), (40, 128)])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_reduce_requantize_matches_torch(gs_in, gs_out, k):
    n = 4000 + gs_in
    for sym in (True, False):
        s_in, s_out = _spec(8, sym, "stochastic", gs_in), _spec(4, sym, "stochastic", gs_out)
        chunks = [torch_codec.quantize(_data(2, n, seed=j + gs_out, specials=j == 1), s_in,
                                       KEY.fold(j)) for j in range(k)]
        _same(cpu_native.reduce_requantize(chunks, n, s_in, s_out, KEY),
              torch_codec.reduce_requantize(chunks, n, s_in, s_out, KEY))


@needs_native
@pytest.mark.parametrize("hadamard", [False, True])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_reduce_dequantize_matches_torch(hadamard, k):
    n = 3001
    m = wire.hadamard_len(n) if hadamard else n
    spec = _spec(4, True, "stochastic", 128)
    recv = torch.stack([torch_codec.quantize(_data(2, m, seed=j, specials=j == 0), spec,
                                             KEY.fold(j)) for j in range(k)])
    chunks = list(recv.unbind(0))  # views into one receive buffer
    _same(cpu_native.reduce_dequantize(chunks, n, spec, hadamard),
          torch_codec.reduce_dequantize(chunks, n, spec, hadamard))
    got = torch.full((2, n + 7), 3.0)
    want = got.clone()
    cpu_native.reduce_dequantize(chunks, n, spec, hadamard, got[:, 7:])
    torch_codec.reduce_dequantize(chunks, n, spec, hadamard, want[:, 7:])
    _same(got, want)
    total = torch_codec.reduce_dequantize(chunks, n, spec, hadamard)
    for dtype in (torch.float32, torch.bfloat16):  # AVG: the sum's quotient, then the cast
        got = torch.empty(2, n + 7, dtype=dtype)
        cpu_native.reduce_dequantize(chunks, n, spec, hadamard, got[:, 7:], 3.0)
        _same(got[:, 7:], (total / 3.0).to(dtype))


@needs_native
def test_stochastic_rounding_is_unbiased_in_c():
    # Independent of the torch comparison: the C path itself is unbiased and in range.
    spec = _spec(4, True, "stochastic", 128)
    x = torch.rand(1, 128, generator=torch.Generator().manual_seed(5)) * 2 - 1
    x[0, 0] = 1.0  # absmax 1: scale 1/7
    xs = x.expand(400, -1).contiguous()
    deq = cpu_native.dequantize(cpu_native.quantize(xs, spec, KEY), 128, spec)
    assert deq.abs().max() <= 1.0 + 1e-6
    err = (deq.mean(0) - x[0]).abs().max().item()
    # a mean of 400 roundings of one step (1/7) has sd <= (1/7) * 0.5 / 20: this is 8 sd
    assert err < 4 * (1 / 7) / 400 ** 0.5, err


def test_unsupported_scale_dtype_uses_torch():
    spec = _spec(4, False, "stochastic", 64, "bfloat16")
    x = _data(2, 300, seed=2)
    _same(cpu_native.quantize(x, spec, KEY), torch_codec.quantize(x, spec, KEY))


def test_disabled_or_unbuildable_falls_back(monkeypatch, tmp_path):
    x = _data(2, 500, seed=5)
    spec = _spec(4, True)
    want = torch_codec.quantize(x, spec, KEY)
    saved = dict(cpu_native._state)
    try:
        cpu_native._state.clear()
        monkeypatch.setenv("FSDP_QCOMM_NATIVE", "0")
        assert not cpu_native.available()
        _same(cpu_native.quantize(x, spec, KEY), want)

        cpu_native._state.clear()
        monkeypatch.setenv("FSDP_QCOMM_NATIVE", "1")
        monkeypatch.setenv("FSDP_QCOMM_CACHE", str(tmp_path))
        monkeypatch.setenv("CC", "false")  # a compiler that always fails
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            assert not cpu_native.available()
        assert any("fused CPU codec is unavailable" in str(m.message) for m in w)
        _same(cpu_native.quantize(x, spec, KEY), want)
        assert list(tmp_path.iterdir()) == []  # no partial library left behind
    finally:
        cpu_native._state.clear()
        cpu_native._state.update(saved)


# ---- the change tracker's shard digest --------------------------------------------------------
@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                   torch.int16, torch.int32, torch.int64, torch.uint8])
def test_shard_digest_in_c_equals_the_torch_formula(dtype):
    """The one-pass C digest gives the torch formula's value: sign-extended raw bits, position
    weights that wrap at the prime across shard boundaries, the int64 sum modulo 2^64 (values
    near 2^62 make it wrap); dtypes the C loop does not read (uint8) take the torch formula."""
    from fsdp_qcomm.fsdp.change_tracker import _torch_digest, shard_digests

    def shard_digest(shards):
        return shard_digests([shards])[0]

    g = torch.Generator().manual_seed(11)
    shards = []
    for n in (70_000, 0, 131_071, 5):
        if dtype.is_floating_point:
            shards.append((torch.randn(n, generator=g) * 1e3).to(dtype))
        else:
            lo, hi = (0, 256) if dtype == torch.uint8 else (-2 ** 15, 2 ** 15)
            shards.append(torch.randint(lo, hi, (n,), generator=g).to(dtype))
    if dtype == torch.int64:
        shards[0][:16] = 2 ** 62
    got, want = shard_digest(shards), _torch_digest(shards)
    assert got.dtype == torch.int64 and got.shape == () and int(got) == int(want)
    strided = torch.randn(4000, 2, generator=g)[:, 0].to(dtype)  # not contiguous
    assert int(shard_digest([strided])) == int(_torch_digest([strided]))
    groups = [shards, [], shards[2:], [strided]]  # several groups at once: each from position 0
    assert shard_digests(groups).tolist() == [int(_torch_digest(g)) for g in groups]
    flipped = [s.clone() for s in shards]  # exchanging two values changes it
    a, b = flipped[0][3].clone(), flipped[0][4].clone()
    if not torch.equal(a, b):
        flipped[0][3], flipped[0][4] = b, a
        assert int(shard_digest(flipped)) != int(got)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_shard_digest_split_over_threads_is_the_same_value(dtype, monkeypatch):
    """Large host shards (FSDP's CPU offload) are digested in pieces on several threads: the
    same value as one pass and as the torch formula, for pieces that cut the prime's weight
    runs anywhere, an offset shard, and a piece count that does not divide the length."""
    from fsdp_qcomm.fsdp.change_tracker import _torch_digest

    g = torch.Generator().manual_seed(12)
    x = (torch.randn(200_003, generator=g) * 1e3).to(dtype)
    one = [cpu_native.digest(x, off) for off in (0, 65_520, 10 ** 9)]
    threads = torch.get_num_threads()
    monkeypatch.setattr(cpu_native, "DIGEST_PIECE", 1_000)
    try:
        for t in (2, 3, 7):
            torch.set_num_threads(t)
            assert [cpu_native.digest(x, off) for off in (0, 65_520, 10 ** 9)] == one, t
    finally:
        torch.set_num_threads(threads)
    want = int(_torch_digest([x])) & ((1 << 64) - 1)
    assert one[0] == want


# ---- learned levels (codec.levels) ------------------------------------------------------------
@needs_native
@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_levels_quantize_and_decode_match_torch(bits, sym, rounding):
    for gs, rows, n in [(8, 3, 61), (40, 2, 333), (128, 2, 1001), (2048, 1, 9000)]:
        spec = _spec(bits, sym, rounding, gs)
        table = fitted_levels(spec, seed=bits)
        x = level_rows(rows, n, bits * 7 + gs, table, group_size=gs)
        got = cpu_native.quantize_levels(x, spec, table, KEY)
        _same(got, torch_codec.quantize_levels(x, spec, table, KEY))
        assert got.shape == (rows, wire.levels_wire_bytes(n, spec))
        _same(cpu_native.dequantize_levels_sum([got], n, spec),
              torch_codec.dequantize_levels_sum([got], n, spec))


@needs_native
@pytest.mark.parametrize("k", [1, 2, 3])
def test_levels_decode_sums_and_outputs_match_torch(k):
    n = 777
    for sym in (True, False):
        spec = _spec(4, sym, "stochastic", 64)
        table = fitted_levels(spec, seed=k)
        recv = torch.stack([torch_codec.quantize_levels(_data(2, n, seed=j, specials=j == 0),
                                                        spec, table, KEY.fold(j))
                            for j in range(k)])
        chunks = list(recv.unbind(0))
        _same(cpu_native.dequantize_levels_sum(chunks, n, spec),
              torch_codec.dequantize_levels_sum(chunks, n, spec))
        base = _data(2, n + 9, seed=3, specials=False)
        for dtype in (torch.float32, torch.bfloat16):
            for accumulate in (False, True):
                got, want = base.to(dtype), base.to(dtype)
                cpu_native.dequantize_levels_sum(chunks, n, spec, got[:, 9:], accumulate)
                torch_codec.dequantize_levels_sum(chunks, n, spec, want[:, 9:], accumulate)
                _same(got, want)


@needs_native
def test_levels_strided_low_precision_and_zero_groups():
    spec = _spec(3, False, "stochastic", 16)
    table = fitted_levels(spec, seed=1)
    base = _data(3, 500, seed=8)
    base[:, 96:112] = -0.0  # a group of -0 only: zero range and min stored as +0
    base[1, 192:208] = 0.0
    base[1, 197] = -0.0
    for x in (base[:, 20:420], base.to(torch.bfloat16), base.to(torch.float16)):
        got = cpu_native.quantize_levels(x, spec, table, KEY)
        _same(got, torch_codec.quantize_levels(x, spec, table, KEY))
    got = cpu_native.quantize_levels(base, spec, table, KEY)
    sb = wire.scale_section_bytes(500, spec) // 2
    scales = got[:, wire.table_bytes(spec):wire.table_bytes(spec) + sb].view(torch.int32)
    assert (scales[:, 96 // 16] == 0).all() and scales[1, 192 // 16] == 0  # +0, not -0


@pytest.mark.parametrize("compiler", ["gcc", "clang"])
def test_every_compiler_builds_the_same_bytes(compiler, monkeypatch, tmp_path):
    """The C file needs no compiler-specific float flags (no fast-math attribute, which GCC
    documents as a debugging aid and clang ignores): built with each compiler found, it writes
    torch_codec's bytes, NaN/Inf and signed-zero groups included."""
    cc = shutil.which(compiler)
    if cc is None:
        pytest.skip(f"{compiler} is not installed")
    saved = dict(cpu_native._state)
    try:
        cpu_native._state.clear()
        monkeypatch.setenv("CC", cc)
        monkeypatch.setenv("FSDP_QCOMM_CACHE", str(tmp_path))
        monkeypatch.setenv("FSDP_QCOMM_NATIVE", "1")
        assert cpu_native.available(), f"{compiler} could not build the C codec"
        x = _data(3, 4133, seed=21)
        x[1, 64:96] = -0.0
        x[2, 256:288] = torch.tensor([0.0, -0.0] * 16)
        x[0, 1000:1010] = float("inf")
        for spec in (_spec(4, True, "stochastic", 32), _spec(8, False, "nearest", 32),
                     _spec(3, False, "stochastic", 40)):
            got = cpu_native.quantize(x, spec, KEY)
            _same(got, torch_codec.quantize(x, spec, KEY))
            _same(cpu_native.dequantize(got, 4133, spec), torch_codec.dequantize(got, 4133, spec))
            table = fitted_levels(spec, seed=spec.bits)
            got = cpu_native.quantize_levels(x, spec, table, KEY)
            _same(got, torch_codec.quantize_levels(x, spec, table, KEY))
        _same(cpu_native.quantize(x, spec, KEY, x * 0.5, True),
              torch_codec.quantize(x, spec, KEY, x * 0.5, True))
    finally:
        cpu_native._state.clear()
        cpu_native._state.update(saved)

"""The Triton kernels against the torch codec, bit for bit, under the Triton interpreter.

The interpreter runs the kernels on CPU tensors, so the module-level functions of
``fsdp_qcomm.kernels`` are called directly (the dispatcher only routes CUDA tensors there).
``TRITON_INTERPRET=1`` has to be set before triton itself is imported (triton.language's own
jitted helpers such as ``tl.max`` are decorated at import), and once set it would turn every
later ``@triton.jit`` of the process into interpreted code. So a normal pytest run collects two
tests here: one runs this file's other tests in a child pytest started with the variable set
(``test_kernels_under_the_interpreter``), the other compiles the kernels for a Hopper GPU
without one. Running this file with ``TRITON_INTERPRET=1`` already set runs the interpreted
tests directly.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _codec_cases import assert_same_bits as _assert_same_bits
from _codec_cases import sample_rows

import fsdp_qcomm
from fsdp_qcomm import QuantSpec
from fsdp_qcomm.codec import RngKey, torch_codec, wire

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed; the kernel tests need its interpreter",
                allow_module_level=True)

# NaN/Inf groups make numpy warn inside the interpreter; the results are checked bit for bit.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _in_child(fn):
    """Collect the test only in the interpreter process (``__test__`` is pytest's switch)."""
    fn.__test__ = INTERPRET
    return fn


def _in_parent(fn):
    fn.__test__ = not INTERPRET
    return fn


KEY = RngKey(seed=7, step=3, rank=1, bucket=2)
SCALE_DTYPES = ("float32", "bfloat16", "float16")
IN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@_in_parent
def test_kernels_under_the_interpreter():
    """Runs every test below in a child pytest with TRITON_INTERPRET=1 and reports its result."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    # The child must import the same fsdp_qcomm as this process.
    src = str(Path(fsdp_qcomm.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env=env, capture_output=True, text=True, timeout=900,
    )
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, (
        f"kernel tests failed under the interpreter:\n{proc.stdout[-10000:]}\n"
        f"{proc.stderr[-2000:]}")
    assert re.search(r"\d+ passed", summary), summary
    assert not re.search("failed|error|skipped", summary), summary


def _load_kernels():
    """``fsdp_qcomm.kernels`` (its sources are this checkout's ``kernels/`` folder)."""
    import fsdp_qcomm.kernels as kernels

    return kernels


@pytest.fixture(scope="module")
def K():
    if not INTERPRET:
        pytest.skip("runs in the TRITON_INTERPRET=1 child of test_kernels_under_the_interpreter")
    return _load_kernels()


@_in_parent
def test_kernels_compile_for_hopper_exactly():
    """What the interpreter cannot show: every kernel compiles to sm_90 code (no GPU needed),
    divisions are IEEE ``div.rn``, no multiply-add was contracted into an ``fma`` and nothing
    flushes subnormals to zero."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    _load_kernels()
    common = sys.modules["fsdp_qcomm.kernels._common"]
    opts = common.launch_opts(common.TILE)  # what the launches use
    mods = {n: sys.modules[f"fsdp_qcomm.kernels.{n}"]
            for n in ("quantize", "dequantize", "reduce_requantize", "reduce_dequantize")}
    gs_p2, gpb, sub = common.group_tiling(96)
    grp = dict(GS=96, GS_P2=gs_p2, GPB=gpb, SUB=sub)
    blk8 = common.TILE // 8
    q5 = dict(BITS=5, QMAX=31, SYM=False, SKIND=1)
    cases = [
        (mods["quantize"]._quantize_kernel, {"x_ptr": "*bf16", "r_ptr": "*bf16", "out_b": "*u8",
         "out_s": "*i16"}, dict(**q5, **grp, STOCH=True, HAS_REF=True, HADAMARD=True), True),
        (mods["quantize"]._hadamard_rows_kernel, {"x_ptr": "*fp16", "r_ptr": "*fp16",
         "y_ptr": "*fp32"}, dict(NB32=64, HAS_REF=True), False),
        (mods["dequantize"]._dequantize_kernel, {"data_b": "*u8", "data_s": "*i16",
         "out_ptr": "*bf16"}, dict(**q5, GS=96, BLK8=blk8, HADAMARD=True, ACCUMULATE=True), False),
        (mods["reduce_dequantize"]._reduce_dequantize_kernel, {"data_b": "*u8", "data_s": "*i16",
         "out_ptr": "*fp32"}, dict(**q5, GS=96, BLK8=blk8, HADAMARD=True), False),
        (mods["reduce_requantize"]._reduce_requantize_kernel, {"in_b": "*u8", "in_s": "*i16",
         "out_b": "*u8", "out_s": "*i32"}, dict(I_BITS=5, I_QMAX=31, I_SYM=False, I_SKIND=1,
         I_GS=40, BITS=3, QMAX=3, SYM=True, SKIND=0, **grp, STOCH=True), True),
    ]
    for fn, ptrs, const, divides in cases:
        sig = {a: ptrs.get(a, "constexpr" if a in const else "i32") for a in fn.arg_names}
        compiled = triton.compile(ASTSource(fn, sig, constexprs=const),
                                  target=GPUTarget("cuda", 90, 32), options=opts)
        ptx = compiled.asm["ptx"]
        assert not re.search(r"\bfma\.", ptx), fn.__name__
        assert ".ftz" not in ptx, fn.__name__
        assert not re.search(r"div\.(full|approx)", ptx), fn.__name__
        assert bool(re.search(r"div\.rn\.f32", ptx)) == divides, fn.__name__


def _data(rows: int, n: int, dtype: torch.dtype, seed: int, specials: bool = True) -> torch.Tensor:
    return sample_rows(rows, n, seed, specials, dtype)


def _spec(bits, sym, rounding, sdt, gs) -> QuantSpec:
    return QuantSpec(bits=bits, group_size=gs, symmetric=sym, rounding=rounding, scale_dtype=sdt)


# ---- quantize ---------------------------------------------------------------------------------
@_in_child
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_quantize_same_bytes(K, bits, sym, rounding):
    # Scale dtype, input dtype and group size rotate with the case so every pairing occurs.
    c = bits * 4 + sym * 2 + (rounding == "stochastic")
    sdt = SCALE_DTYPES[c % 3]
    dtype = IN_DTYPES[(c // 3) % 3]
    gs = (8, 24, 64, 40, 128)[c % 5]
    spec = _spec(bits, sym, rounding, sdt, gs)
    for rows, n in ((3, 203), (1, 7)):
        x = _data(rows, n, dtype, seed=c + n)
        got = K.quantize(x, spec, KEY, None, False)
        want = torch_codec.quantize(x, spec, KEY, None, False)
        _assert_same_bits(got, want)
        assert got.shape == (rows, wire.wire_bytes(n, spec))


@_in_child
@pytest.mark.parametrize("gs", [32, 96, 24])  # whole 32-blocks per group (pow2 or not), or not
@pytest.mark.parametrize("ref", [False, True])
@pytest.mark.parametrize("hadamard", [False, True])
def test_quantize_difference_and_hadamard(K, gs, ref, hadamard):
    dtype = IN_DTYPES[gs % 3]
    spec = _spec(4 if gs != 96 else 8, gs != 24, "stochastic", SCALE_DTYPES[gs % 3], gs)
    x = _data(2, 133, dtype, seed=gs)
    r = _data(2, 133, dtype, seed=gs + 1, specials=False) if ref else None
    got = K.quantize(x, spec, KEY, r, hadamard)
    want = torch_codec.quantize(x, spec, KEY, r, hadamard)
    _assert_same_bits(got, want)


@_in_child
@pytest.mark.parametrize("sym", [True, False])
def test_quantize_groups_larger_than_a_tile(K, sym):
    # 4104 > TILE (2048): each group is read in sub-tiles, statistics first, then codes.
    spec = _spec(4, sym, "stochastic", "bfloat16", 4104)
    x = _data(2, 9001, torch.float32, seed=11)
    for hadamard in (False, True):
        got = K.quantize(x, spec, KEY, None, hadamard)
        _assert_same_bits(got, torch_codec.quantize(x, spec, KEY, None, hadamard))


@_in_child
def test_quantize_scale_edge_cases(K):
    # fp16 scales: amax / qmax overflows to inf (codes 0) or underflows to 0 (scale 1).
    spec = _spec(2, True, "nearest", "float16", 8)
    x = torch.tensor([[1e6, -3e5, 2.0, 0, 0, 0, 0, 0, 1e-9, -2e-9, 0, 0, 0, 0, 0, 3e-9]])
    _assert_same_bits(K.quantize(x, spec, None, None, False),
                      torch_codec.quantize(x, spec, None, None, False))
    # A group whose minimum is -0 stores +0 (wire.py), whichever zero a min-reduction picks.
    spec = _spec(4, False, "nearest", "float32", 8)
    x = torch.tensor([[1.0, -0.0, 2.0, 0.5, 3.0, 1.5, 2.5, 0.25]])
    got = K.quantize(x, spec, None, None, False)
    _assert_same_bits(got, torch_codec.quantize(x, spec, None, None, False))
    assert got[0, 4:8].view(torch.int32).item() == 0


@_in_child
def test_quantize_needs_key_for_stochastic(K):
    with pytest.raises(ValueError, match="needs key"):
        K.quantize(torch.ones(1, 8), _spec(4, True, "stochastic", "float32", 8), None)


@_in_child
def test_nan_scale_bit_patterns(K):
    x = torch.full((1, 16), float("nan"))
    for sdt, bits, ints in (("float32", 0x7FC00000, torch.int32), ("bfloat16", 0x7FC0, torch.int16),
                            ("float16", 0x7E00, torch.int16)):
        spec = _spec(4, False, "nearest", sdt, 8)
        got = K.quantize(x, spec, None, None, False)
        _assert_same_bits(got, torch_codec.quantize(x, spec, None, None, False))
        sb = wire.scale_section_bytes(16, spec)
        assert (got[0, :sb].view(ints) == bits).all()


# ---- dequantize -------------------------------------------------------------------------------
@_in_child
@pytest.mark.parametrize("bits,sym,sdt,gs", [
    (4, True, "float32", 128), (3, False, "bfloat16", 24), (8, False, "float16", 40),
    (2, True, "bfloat16", 8), (5, False, "float32", 64), (7, True, "float16", 32),
])
@pytest.mark.parametrize("hadamard", [False, True])
def test_dequantize_same_values(K, bits, sym, sdt, gs, hadamard):
    spec = _spec(bits, sym, "stochastic", sdt, gs)
    n = 157
    data = torch_codec.quantize(_data(3, n, torch.float32, seed=bits), spec, KEY, None, hadamard)
    _assert_same_bits(K.dequantize(data, n, spec, hadamard, None, False),
                      torch_codec.dequantize(data, n, spec, hadamard, None, False))
    for dtype, accumulate in ((torch.float32, True), (torch.bfloat16, True),
                              (torch.float16, False), (torch.bfloat16, False)):
        base = _data(3, n, dtype, seed=bits + 1, specials=False)
        got, want = base.clone(), base.clone()
        K.dequantize(data, n, spec, hadamard, got, accumulate)
        torch_codec.dequantize(data, n, spec, hadamard, want, accumulate)
        _assert_same_bits(got, want)


@_in_child
def test_dequantize_into_strided_out(K):
    spec = _spec(4, True, "nearest", "float32", 16)
    data = torch_codec.quantize(_data(2, 50, torch.float32, seed=5), spec, None)
    big = torch.zeros(2, 60, dtype=torch.bfloat16)
    want = big.clone()
    K.dequantize(data, 50, spec, False, big[:, 5:55], True)
    torch_codec.dequantize(data, 50, spec, False, want[:, 5:55], True)
    _assert_same_bits(big, want)


# ---- reductions -------------------------------------------------------------------------------
def _chunks(k: int, rows: int, n: int, spec: QuantSpec, hadamard: bool, seed: int):
    """k wire blocks as one [k, R, W] receive buffer (read in place by the kernels)."""
    blocks = [
        torch_codec.quantize(_data(rows, n, torch.float32, seed=seed + j, specials=j == 1),
                             spec, KEY.fold(j), None, hadamard)
        for j in range(k)
    ]
    return torch.stack(blocks)


@_in_child
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("spec_in,spec_out", [
    (_spec(8, True, "stochastic", "float32", 128), _spec(4, True, "stochastic", "float32", 128)),
    (_spec(6, False, "nearest", "bfloat16", 24), _spec(3, False, "stochastic", "float16", 40)),
    (_spec(4, True, "stochastic", "float16", 64), _spec(2, True, "nearest", "bfloat16", 16)),
])
def test_reduce_requantize_same_bytes(K, k, spec_in, spec_out):
    n = 213
    buf = _chunks(k, 2, n, spec_in, False, seed=k)
    want = torch_codec.reduce_requantize(list(buf.unbind(0)), n, spec_in, spec_out, KEY)
    _assert_same_bits(K.reduce_requantize(list(buf.unbind(0)), n, spec_in, spec_out, KEY), want)
    # Separate allocations take the stacking path.
    _assert_same_bits(
        K.reduce_requantize([c.clone() for c in buf.unbind(0)], n, spec_in, spec_out, KEY), want)


@_in_child
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("hadamard", [False, True])
def test_reduce_dequantize_same_values(K, k, hadamard):
    spec = _spec(4 + k, k != 2, "stochastic", SCALE_DTYPES[k - 1], 32 if hadamard else 40)
    n = 150
    buf = _chunks(k, 3, n, spec, hadamard, seed=10 * k)
    chunks = list(buf.unbind(0))
    _assert_same_bits(K.reduce_dequantize(chunks, n, spec, hadamard, None),
                      torch_codec.reduce_dequantize(chunks, n, spec, hadamard, None))
    for dtype in (torch.float32, torch.bfloat16):
        got = torch.empty(3, n, dtype=dtype)
        want = torch.empty(3, n, dtype=dtype)
        K.reduce_dequantize([c.clone() for c in chunks], n, spec, hadamard, got)
        torch_codec.reduce_dequantize(chunks, n, spec, hadamard, want)
        _assert_same_bits(got, want)


@_in_child
def test_two_level_pipeline_round_trip(K):
    # The TLq-HS chain (Hadamard + 8 bit, reduce, 4 bit, reduce + inverse Hadamard) end to end.
    s8 = _spec(8, True, "stochastic", "float32", 128)
    s4 = _spec(4, True, "stochastic", "float32", 128)
    n, m = 300, wire.hadamard_len(300)
    xs = [_data(2, n, torch.float32, seed=40 + j, specials=False) for j in range(2)]
    hop1 = [K.quantize(x, s8, KEY.fold(j), None, True) for j, x in enumerate(xs)]
    hop2 = K.reduce_requantize(hop1, m, s8, s4, KEY)
    got = K.reduce_dequantize([hop2, hop2], n, s4, True, None)
    t1 = [torch_codec.quantize(x, s8, KEY.fold(j), None, True) for j, x in enumerate(xs)]
    t2 = torch_codec.reduce_requantize(t1, m, s8, s4, KEY)
    _assert_same_bits(got, torch_codec.reduce_dequantize([t2, t2], n, s4, True, None))
    exact = 2 * (xs[0] + xs[1])
    assert (got - exact).abs().max().item() < 0.2 * exact.abs().max().item()

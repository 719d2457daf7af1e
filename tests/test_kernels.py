"""The Triton kernels against the torch codec, bit for bit: on a GPU when there is one, else
under the Triton interpreter; and compiled ahead of time for sm_80, sm_90 and sm_100 without one.

The module-level functions of ``fsdp_qcomm.kernels`` are called directly (the dispatcher only
routes CUDA tensors there). On a machine with CUDA the bit-exact tests below run in this process
on CUDA tensors (``scripts/gpu_check.sh``). Without CUDA they run on CPU tensors under the
interpreter; ``TRITON_INTERPRET=1`` has to be set before triton itself is imported
(triton.language's own jitted helpers such as ``tl.max`` are decorated at import), and once set
it would turn every later ``@triton.jit`` of the process into interpreted code. So a normal
pytest run without CUDA collects a test that runs this file's exactness tests in child pytests
started with the variable set (``test_kernels_under_the_interpreter``), and the ahead-of-time
compile tests. Running this file with ``TRITON_INTERPRET=1`` already set runs the interpreted
tests directly.

Under the interpreter every launch is also audited (``_interp_audit``): a race between its
programs or threads, or an access outside its tensors, fails the test. The interpreter runs
programs one after another, so those races give the right bytes there and would show only on a
GPU.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch
from _codec_cases import assert_same_bits, fitted_levels, level_rows, sample_rows
from conftest import ALL_ENV, SHARD_ENV

import fsdp_qcomm
from fsdp_qcomm import QuantSpec
from fsdp_qcomm.codec import RngKey, torch_codec, wire

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed; the kernel tests need it", allow_module_level=True)
if INTERPRET:
    # Every launch below is also audited for races and stray addresses, which the interpreter
    # alone would not show (``_interp_audit``).
    import _interp_audit

    _interp_audit.install()
CUDA = not INTERPRET and torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"

# NaN/Inf groups make numpy warn inside the interpreter; the results are checked bit for bit.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _exact(fn):
    """A bit-exactness test: runs on CUDA, or in the interpreter child (``__test__`` is
    pytest's switch)."""
    fn.__test__ = INTERPRET or CUDA
    return fn


def _compile(fn):
    fn.__test__ = not INTERPRET
    return fn


KEY = RngKey(seed=7, step=3, rank=1, bucket=2)
SCALE_DTYPES = ("float32", "bfloat16", "float16")
IN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TARGETS = {"sm_80": 80, "sm_90": 90, "sm_100": 100}
#: every code width; the quick tier runs the packing cases that differ (2: four per byte, 4: two,
#: 8: one) and the long tier the widths whose codes straddle bytes
BITS = [b if b in (2, 4, 8) else pytest.param(b, marks=pytest.mark.long) for b in range(2, 9)]


def _in_interpreter_children(tier: str) -> None:
    """This file's exactness tests of one tier (a ``-m`` expression) in child pytests with
    TRITON_INTERPRET=1: two at once, each half of them (``conftest.SHARD_ENV``), since the
    interpreter keeps one core busy."""
    # ALL_ENV: ``tier`` alone chooses
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", **{ALL_ENV: "1"})
    # The child must import the same fsdp_qcomm as this process.
    src = str(Path(fsdp_qcomm.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    shards = 2
    procs = [subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", tier, __file__],
        env={**env, SHARD_ENV: f"{i}/{shards}"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(shards)]
    try:
        outs = [p.communicate(timeout=900) for p in procs]
    finally:
        for p in procs:
            p.kill()
    counts = []
    for i, (p, (out, err)) in enumerate(zip(procs, outs)):
        summary = out.strip().splitlines()[-1] if out.strip() else ""
        assert p.returncode == 0, (
            f"kernel tests ({tier}, slice {i}/{shards}) failed under the interpreter:\n"
            f"{out[-10000:]}\n{err[-2000:]}")
        assert not re.search("failed|error|skipped", summary), summary
        ran = re.search(r"(\d+) passed(?:, (\d+) deselected)?", summary)
        assert ran, summary
        counts.append((int(ran[1]), int(ran[2] or 0)))
    # the slices split one collection: each left out (at least) what the other ran
    assert counts[0][1] >= counts[1][0] and counts[1][1] >= counts[0][0], counts
    assert sum(counts[0]) == sum(counts[1]) and 0 <= counts[0][0] - counts[1][0] <= 1, counts


def test_kernels_under_the_interpreter():
    """The quick tier's exactness tests, interpreted."""
    _in_interpreter_children("not long")


@pytest.mark.long
def test_kernels_under_the_interpreter_every_width():
    """The long tier's (the code widths whose codes straddle bytes), interpreted: a test of
    its own, so that a run of the long tier alone (``-m long``, .ci/run) runs them too."""
    _in_interpreter_children("long")


test_kernels_under_the_interpreter.__test__ = not INTERPRET and not CUDA
test_kernels_under_the_interpreter_every_width.__test__ = not INTERPRET and not CUDA


def test_host_integer_helpers_match_tritons():
    """The launch arithmetic the wrappers do in plain Python (``triton.cdiv`` and
    ``triton.next_power_of_2`` are slow to call from Python since triton 3.6)."""
    import triton

    common = importlib.import_module("fsdp_qcomm.kernels._common")
    for n in list(range(1, 5000)) + [2**k + d for k in range(12, 31) for d in (-1, 0, 1)]:
        assert common.next_power_of_2(n) == triton.next_power_of_2(n), n
        for b in (1, 7, 8, 32, 256, 4096):
            assert common.cdiv(n, b) == triton.cdiv(n, b), (n, b)
    assert common.cdiv(0, 8) == 0


@pytest.fixture(scope="module")
def K():
    import fsdp_qcomm.kernels as kernels

    return kernels


def _through_table(tensors):
    """A launch reads these through a table of their addresses (the audit's ``reachable``)."""
    return _interp_audit.reachable(tensors) if INTERPRET else contextlib.nullcontext()


def _d(t):
    """A test input on the kernels' device (a list element-wise; None stays None)."""
    if isinstance(t, (list, tuple)):
        return [c.to(DEV) for c in t]
    return None if t is None else t.to(DEV)


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.device.type == DEV
    assert_same_bits(got.cpu(), want)


# ---- the interpreter's audit of every launch ----------------------------------------------------
def _audit_cases():
    """(kernel launch, what the audit must say, or None) for hazards a GPU would show and the
    interpreter alone would not."""
    import triton
    import triton.language as tl

    @triton.jit
    def programs_race(out):  # every program writes its own value, in every byte, to one word
        tl.store(out, (tl.program_id(0) + 1) * 0x01010101)

    @triton.jit
    def lanes_race(out):  # lanes 0, 1 write byte 0 and lanes 2, 3 byte 1, each a different value
        tl.store(out + tl.arange(0, 4) // 2, tl.arange(0, 4).to(tl.uint8))

    @triton.jit
    def reads_neighbour(x):  # program 1 reads the word program 0 writes
        if tl.program_id(0) == 0:
            tl.store(x, 5.0)
        else:
            tl.store(x + 1, tl.load(x))

    @triton.jit
    def past(x, y, n, m):  # reads n and writes m values of 4-value tensors
        i = tl.arange(0, 8)
        tl.store(y + i, tl.load(x + i, mask=i < n), mask=i < m)

    @triton.jit
    def reads_own_write(x):  # reads back the block it wrote
        i = tl.arange(0, 4)
        tl.store(x + i, 1.0)
        tl.store(x + 4 + i, tl.load(x + 3 - i))

    @triton.jit
    def fine(x, y):  # in place in its own block; one value written twice; a shared read
        i = tl.program_id(0) * 4 + tl.arange(0, 4)
        v = tl.load(x + i) + tl.load(y)
        tl.store(x + i, v)
        tl.store(x + i, v)
        tl.store(y + 1 + tl.arange(0, 4) * 0, 7.0)

    z = lambda n, dt=torch.float32: torch.zeros(n, dtype=dt)  # noqa: E731
    return [
        (lambda: programs_race[(2,)](z(1, torch.int32)), "4 bytes written with different values"),
        (lambda: lanes_race[(1,)](z(2, torch.uint8)), "2 bytes written with different values"),
        (lambda: reads_neighbour[(2,)](z(2)), "4 bytes read by a program that did not write"),
        (lambda: reads_own_write[(1,)](z(8)), "16 bytes read after the same program wrote them"),
        (lambda: past[(1,)](z(4), z(4), 8, 4), "load outside every tensor argument: 16 bytes"),
        (lambda: past[(1,)](z(8)[:4], z(8)[:4], 4, 6), "store outside every tensor argument: 8"),
        (lambda: past[(1,)](z(8)[:4], z(4), 8, 4), None),  # a read past a view, in its buffer
        (lambda: past[(1,)](z(4), z(4), 4, 4), None),
        (lambda: fine[(3,)](z(12), z(2)), None),
    ]


def _interpreted(fn):
    fn.__test__ = INTERPRET
    return fn


@_interpreted
def test_the_audit_finds_what_only_a_gpu_would_show():
    """Each hazard kind raises with its count of bytes; masked lanes, a read past a view inside
    its buffer, a program's own in-place update (read, then write) and equal values written
    twice do not."""
    for launch, says in _audit_cases():
        if says is None:
            launch()
        else:
            with pytest.raises(_interp_audit.KernelHazard, match=re.escape(says)):
                launch()


# ---- ahead-of-time compilation ------------------------------------------------------------------
def _compile_cases():
    """(kernel, pointer types, constexprs, divides) for every kernel and each tiling branch."""
    m = {n: importlib.import_module(f"fsdp_qcomm.kernels.{n}") for n in
         ("_common", "quantize", "dequantize", "reduce_requantize", "reduce_dequantize", "levels",
          "digest")}
    common = m["_common"]

    def grp(gs):
        gs_p2, gpb, sub = common.group_tiling(gs)
        return dict(GS=gs, GS_P2=gs_p2, GPB=gpb, SUB=sub)

    blk8 = common.TILE // 8
    q5 = dict(BITS=5, QMAX=31, SYM=False, SKIND=1)
    q4 = dict(BITS=4, QMAX=7, SYM=True, SKIND=0)
    u8s16 = {"out_b": "*u8", "out_s": "*i16"}
    return [
        (m["quantize"]._quantize_kernel, {"x_ptr": "*bf16", "r_ptr": "*bf16", **u8s16},
         dict(**q5, **grp(96), STOCH=True, HAS_REF=True, HADAMARD=True, FLAT=False,
              ORDERED=False), True),
        (m["quantize"]._quantize_kernel, {"x_ptr": "*bf16", "r_ptr": "*bf16", **u8s16,
         "src_rows": "*i32"}, dict(**q4, **grp(96), STOCH=True, HAS_REF=True, HADAMARD=True,
                                   FLAT=True, ORDERED=True), True),
        (m["quantize"]._quantize_kernel, {"x_ptr": "*fp32", "r_ptr": "*fp32", "out_b": "*u8",
         "out_s": "*i32"}, dict(**q4, **grp(4104), STOCH=True, HAS_REF=True, HADAMARD=False,
                               FLAT=False, ORDERED=False), True),
        (m["quantize"]._quantize_segments_kernel, {"x_ptr": "*fp32", "r_ptr": "*fp32",
         "out_b": "*u8", "out_s": "*i32", "seg_tab": "*i64", "blk_seg": "*i32", "h3": "i64",
         "bucket": "i64", "salt": "i64"},
         dict(**q4, **grp(2048), STOCH=True, HAS_REF=True, HADAMARD=False, FLAT=True,
              ALIGNED=True), True),
        (m["quantize"]._quantize_segments_kernel, {"x_ptr": "*fp32", "r_ptr": "*fp32",
         "out_b": "*u8", "out_s": "*i32", "seg_tab": "*i64", "blk_seg": "*i32", "h3": "i64",
         "bucket": "i64", "salt": "i64"},
         dict(BITS=8, QMAX=127, SYM=True, SKIND=0, **grp(128), STOCH=True, HAS_REF=False,
              HADAMARD=True, FLAT=True, ALIGNED=False), True),
        (m["quantize"]._hadamard_rows_kernel, {"x_ptr": "*fp16", "r_ptr": "*fp16",
         "y_ptr": "*fp32"}, dict(NB32=64, HAS_REF=True), False),
        (m["dequantize"]._dequantize_kernel, {"data_b": "*u8", "data_s": "*i16",
         "out_ptr": "*bf16"}, dict(**q5, GS=96, BLK8=blk8, HADAMARD=True, ACCUMULATE=True), False),
        (m["dequantize"]._dequantize_segments_kernel, {"data_b": "*u8", "data_s": "*i32",
         "out_ptr": "*bf16", "seg_tab": "*i64", "blk_seg": "*i32", "base_ptr": "*bf16"},
         dict(**q4, GS=2048, BLK8=blk8, HADAMARD=False, ACCUMULATE=True, ALIGNED=True,
              BASE=True), False),
        (m["dequantize"]._dequantize_segments_kernel, {"data_b": "*u8", "data_s": "*i16",
         "out_ptr": "*fp32", "seg_tab": "*i64", "blk_seg": "*i32", "base_ptr": "*fp32"},
         dict(**q5, GS=96, BLK8=blk8, HADAMARD=True, ACCUMULATE=False, ALIGNED=False,
              BASE=False), False),
        (m["reduce_dequantize"]._reduce_dequantize_kernel, {"data_b": "*u8", "data_s": "*i16",
         "out_ptr": "*fp32", "divisor": "fp32"},
         dict(**q5, GS=96, BLK8=blk8, HADAMARD=True, K=3, DIVIDE=0), False),
        (m["reduce_dequantize"]._reduce_dequantize_kernel, {"data_b": "*u8", "data_s": "*i32",
         "out_ptr": "*bf16", "divisor": "fp32"},
         dict(**q4, GS=128, BLK8=blk8, HADAMARD=False, K=2, DIVIDE=2), True),
        (m["reduce_dequantize"]._reduce_dequantize_kernel, {"data_b": "*u8", "data_s": "*i16",
         "out_ptr": "*fp32", "divisor": "fp32"},
         dict(**q5, GS=96, BLK8=blk8, HADAMARD=True, K=3, DIVIDE=1), False),
        (m["reduce_requantize"]._reduce_requantize_kernel, {"in_b": "*u8", "in_s": "*i16",
         "out_b": "*u8", "out_s": "*i32"}, dict(I_BITS=5, I_QMAX=31, I_SYM=False, I_SKIND=1,
         I_GS=40, BITS=3, QMAX=3, SYM=True, SKIND=0, **grp(96), STOCH=True, K=3), True),
        (m["reduce_requantize"]._reduce_requantize_kernel, {"in_b": "*u8", "in_s": "*i32",
         "out_b": "*u8", "out_s": "*i16"}, dict(I_BITS=8, I_QMAX=127, I_SYM=True, I_SKIND=0,
         I_GS=128, BITS=4, QMAX=15, SYM=False, SKIND=2, **grp(4096), STOCH=False, K=2), True),
        (m["levels"]._quantize_levels_kernel, {"x_ptr": "*bf16", "lv_ptr": "*fp32", **u8s16,
         "out_l": "*fp32"}, dict(BITS=8, SYM=False, SKIND=1, **grp(1024), STOCH=True), True),
        (m["levels"]._quantize_levels_kernel, {"x_ptr": "*fp32", "lv_ptr": "*fp32", **u8s16,
         "out_l": "*fp32"}, dict(BITS=4, SYM=True, SKIND=2, **grp(4104), STOCH=False), True),
        (m["levels"]._decode_levels_kernel, {"data_b": "*u8", "data_s": "*i16",
         "data_l": "*fp32", "out_ptr": "*bf16"},
         dict(BITS=6, SYM=False, SKIND=1, GS=1024, BLK8=blk8, ACCUMULATE=True), False),
        (m["digest"]._digest_many_kernel, {"tab": "*i64", "blk_shard": "*i32",
         "out_ptr": "*i64"}, dict(IBITS=16, BLOCK=m["digest"].BLOCK, P=m["digest"].PRIME),
         False),
        (m["digest"]._digest_many_kernel, {"tab": "*i64", "blk_shard": "*i32",
         "out_ptr": "*i64"}, dict(IBITS=64, BLOCK=m["digest"].BLOCK, P=m["digest"].PRIME),
         False),
    ]


def _jit_kernels() -> set[str]:
    """Names of every launchable ``@triton.jit`` kernel (``*_kernel``) in fsdp_qcomm.kernels."""
    import triton

    import fsdp_qcomm.kernels as kernels

    names = set()
    for path in kernels.__path__:
        for f in Path(path).glob("*.py"):
            if f.stem == "__init__":
                continue
            mod = importlib.import_module(f"fsdp_qcomm.kernels.{f.stem}")
            for k, v in vars(mod).items():
                if isinstance(v, triton.runtime.JITFunction) and k.endswith("_kernel"):
                    names.add(f"{f.stem}.{k}")
    return names


def _sass_resources(cubin: bytes, tmp: Path) -> dict[str, int]:
    """``REG``, ``STACK``, ``LOCAL`` of a cubin from triton's bundled ``cuobjdump``."""
    from triton.backends.nvidia import compiler

    tool = Path(compiler.__file__).parent / "bin" / "cuobjdump"
    if not tool.is_file():
        return {}
    f = tmp / "k.cubin"
    f.write_bytes(cubin)
    out = subprocess.run([str(tool), "--dump-resource-usage", str(f)], capture_output=True,
                         text=True, check=True).stdout
    return {k: int(v) for k, v in re.findall(r"\b(REG|STACK|LOCAL):(\d+)", out)}


@_compile
# the quick tier compiles for the machine this project's GPU check runs on (an H200, sm_90)
@pytest.mark.parametrize("target", [t if t == "sm_90" else pytest.param(t, marks=pytest.mark.long)
                                    for t in TARGETS])
def test_every_kernel_compiles_ahead_of_time_exactly(target, tmp_path):
    """What the interpreter cannot show, for each GPU generation and without a GPU: every
    kernel goes through Triton's whole pipeline down to a cubin (ptxas included) for the target,
    divisions are IEEE ``div.rn``, no multiply-add was contracted into an ``fma`` (the rotation's
    explicit ones multiply by +-1), nothing flushes subnormals to zero, and nothing spills
    registers to local memory."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    common = importlib.import_module("fsdp_qcomm.kernels._common")
    cases = _compile_cases()
    covered = {f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__}" for fn, *_ in cases}
    assert covered == _jit_kernels(), "a kernel is missing from _compile_cases"
    cap = TARGETS[target]
    for fn, ptrs, const, divides in cases:
        name = f"{fn.__name__} {const}"
        sig = {a: ptrs.get(a, "constexpr" if a in const else "i32") for a in fn.arg_names}
        opts = common.launch_opts(const.get("GPB", 1) * const.get("SUB", common.TILE))
        compiled = triton.compile(ASTSource(fn, sig, constexprs=const),
                                  target=GPUTarget("cuda", cap, 32), options=opts)
        ptx = compiled.asm["ptx"]
        arch = re.search(r"^\.target (sm_\d+)a?\b", ptx, re.M)
        assert arch and arch.group(1) == target, (name, arch and arch.group(0))
        assert len(compiled.asm["cubin"]) > 0, name
        # the one fma allowed is the rotation's y +- x, whose factor is a selected +-1 (exact);
        # sm_100 pairs fp32 operations (f32x2) on two such registers moved into 64 bits
        pm1 = r"0f(?:3F800000, 0fBF800000|BF800000, 0f3F800000)"
        signs = set(re.findall(rf"selp\.f32\s+(%\w+), {pm1}, %\w+;", ptx))
        signs |= {d for d, a, b in re.findall(r"mov\.b64\s+(%\w+), \{(%\w+), (%\w+)\};", ptx)
                  if a in signs and b in signs}
        for fma in re.findall(r"\bfma\.[^\n]*", ptx):
            ops = re.fullmatch(r"fma\.rn\.f32(?:x2)?\s+%\w+, (%\w+), (%\w+), %\w+;",
                               fma.strip())
            assert ops and signs & set(ops.groups()), (name, fma)
        assert ".ftz" not in ptx, name
        assert not re.search(r"div\.(full|approx)", ptx), name
        assert bool(re.search(r"div\.rn\.f32", ptx)) == divides, name
        res = _sass_resources(compiled.asm["cubin"], tmp_path)
        assert res.get("LOCAL", 0) == 0, (name, res)  # no register spills


# ---- quantize ---------------------------------------------------------------------------------
def _data(rows: int, n: int, dtype: torch.dtype, seed: int, specials: bool = True) -> torch.Tensor:
    return sample_rows(rows, n, seed, specials, dtype)


def _spec(bits, sym, rounding, sdt, gs) -> QuantSpec:
    return QuantSpec(bits=bits, group_size=gs, symmetric=sym, rounding=rounding, scale_dtype=sdt)


@_exact
@pytest.mark.parametrize("bits", BITS)
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
        got = K.quantize(_d(x), spec, KEY, None, False)
        _same(got, torch_codec.quantize(x, spec, KEY, None, False))
        assert got.shape == (rows, wire.wire_bytes(n, spec))


@_exact
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_quantize_rounds_halves_and_integers_as_torch_floor(K, bits, sym, rounding):
    """Values on and next to the code boundaries, where the kernels' floor (adds and integer
    ops, ``_common.floor_int``) could differ from torch's: power-of-two scales make x / scale
    exact, so t + 1/2 lands on integers and halves, and one ulp either side; signed zeros and
    subnormals too."""
    spec = _spec(bits, sym, rounding, "float32", 64)
    q = spec.qmax
    steps = torch.arange(-2 * q, 2 * q + 1, dtype=torch.float32) / 2  # halves of a step
    rows = []
    for e in (-3, 0, 5):
        g = torch.cat([steps, steps.nextafter(torch.tensor(float("inf"))),
                       steps.nextafter(torch.tensor(-float("inf")))])
        g = torch.cat([g, torch.tensor([0.0, -0.0, 1e-40, -1e-40])]) * 2.0 ** e
        g = g[:64 * (g.numel() // 64)].view(-1, 64)
        g[:, 0] = q * 2.0 ** e  # the group's absmax: scale 2^e (symmetric)
        g[:, 1] = -q * 2.0 ** e if sym else 0.0
        rows.append(g.reshape(-1))
    x = torch.stack([r[:min(map(len, rows))] for r in rows])
    want = torch_codec.quantize(x, spec, KEY, None, False)
    _same(K.quantize(_d(x), spec, KEY, None, False), want)


@_exact
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_quantize_a_minimum_stored_a_whole_spacing_down_as_torch(K, rounding):
    """A minimum whose nearest bfloat16 is the group's maximum (2^33, whose lower neighbour is
    2^25 below) is stored at that neighbour (``round_min``): the scale is 2^25 / 255, not 0, and
    no x - min is negative. Rounded to nearest it made the scale 0, hence 1, and left x - min
    down to -1.6e7, where codes clamped to 0."""
    spec = _spec(8, False, rounding, "bfloat16", 64)
    top = 2.0 ** 33  # a bfloat16 value; its lower neighbour is 2^25 below
    x = (top - torch.linspace(0, 1.6e7, 64)).repeat(2, 3)
    want = torch_codec.quantize(x, spec, KEY, None, False)
    _same(K.quantize(_d(x), spec, KEY, None, False), want)
    mins = want[:, 6:12].contiguous().view(torch.bfloat16).float()  # 3 groups' mins
    assert bool((mins == top - 2.0 ** 25).all()), mins


@_exact
def test_quantize_a_float16_minimum_at_the_end_of_its_range_as_torch(K):
    """Minima around float16's end (-65504; -65520 rounds to -inf): one step down from -65504
    would be -inf, so it stays, and its group stays finite; further below, -inf as in torch."""
    spec = _spec(8, False, "nearest", "float16", 16)
    lows = torch.tensor([-65510.0, -65519.0, -65530.0, -65504.0, -65503.0, 65510.0])
    x = lows[:, None] + torch.linspace(0, 40, 16)[None, :]
    want = torch_codec.quantize(x, spec, KEY, None, False)
    _same(K.quantize(_d(x), spec, KEY, None, False), want)


@_exact
@pytest.mark.parametrize("gs", [32, 96, 24])  # whole 32-blocks per group (pow2 or not), or not
@pytest.mark.parametrize("ref", [False, True])
@pytest.mark.parametrize("hadamard", [False, True])
def test_quantize_difference_and_hadamard(K, gs, ref, hadamard):
    dtype = IN_DTYPES[gs % 3]
    spec = _spec(4 if gs != 96 else 8, gs != 24, "stochastic", SCALE_DTYPES[gs % 3], gs)
    x = _data(2, 133, dtype, seed=gs)
    r = _data(2, 133, dtype, seed=gs + 1, specials=False) if ref else None
    got = K.quantize(_d(x), spec, KEY, _d(r), hadamard)
    _same(got, torch_codec.quantize(x, spec, KEY, r, hadamard))


@_exact
@pytest.mark.parametrize("gs,hadamard", [(128, True), (24, True), (40, False)])
def test_quantize_ordered_is_quantize_then_index_select(K, gs, hadamard):
    # Rows in another order (the gradient's first hop), a subset, repeats, none; a column slice
    # of a wider buffer, as the hop encodes a span of it. Each row keeps its own random numbers.
    # Its input in training is FSDP's bf16 gradients (``reduce_scatter._input_dtype``).
    spec = _spec(8 if hadamard else 4, True, "stochastic", SCALE_DTYPES[gs % 3], gs)
    dtype = torch.bfloat16 if hadamard else torch.float32
    x = _data(6, 230, dtype, seed=gs)[:, 11:211]
    r = _data(6, 230, dtype, seed=gs + 1, specials=False)[:, 11:211]
    for ref in (None, r):
        want = torch_codec.quantize(x, spec, KEY, ref, hadamard)
        for order in ((0, 3, 1, 4, 2, 5), (5, 5, 0), ()):
            got = K.quantize_ordered(_d(x), spec, KEY, _d(ref), hadamard, order)
            _same(got, want[list(order)])


@_exact
@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("sym", [True, False])
def test_quantize_flat_and_8_block_tiles_same_bytes(K, monkeypatch, flat, bits, sym):
    """Both ways the encoders can hold whole groups (``_common.flat_tile``: one row per group,
    or 8-blocks) write the torch codec's bytes, each forced on every case it could take:
    rotated or not, groups filling their power-of-two tile or not (96 of 128), rows ending
    inside a group and inside an 8-block, and through ``quantize_segments``."""
    monkeypatch.setattr(K._common, "flat_tile", lambda b, h: flat and 8 % b == 0)
    for gs, n, hadamard in ((96, 203, True), (64, 203, False), (32, 45, True)):
        spec = _spec(bits, sym, "stochastic" if gs != 64 else "nearest", SCALE_DTYPES[bits % 3],
                     gs)
        x = _data(3, n, IN_DTYPES[gs % 3], seed=bits + gs)
        r = _data(3, n, IN_DTYPES[gs % 3], seed=bits + gs + 1, specials=False)
        _same(K.quantize(_d(x), spec, KEY, _d(r), hadamard),
              torch_codec.quantize(x, spec, KEY, r, hadamard))
        segs = (n, 0, 2 * n)
        flat_x = _data(1, 3 * n, torch.float32, seed=gs).view(-1)
        want = torch.cat([torch_codec.quantize(p[None], spec, KEY.fold(5 + k), None,
                                               hadamard).view(-1)
                          for k, p in enumerate(flat_x.split(segs)) if p.numel()])
        _same(K.quantize_segments(_d(flat_x), segs, spec, KEY, 5, None, hadamard), want)


@_exact
@pytest.mark.parametrize("sym", [True, False])
def test_quantize_groups_larger_than_a_tile(K, sym):
    # 4104 > GROUP_TILE (4096): each group is read in sub-tiles, statistics first, then codes.
    spec = _spec(4, sym, "stochastic", "bfloat16", 4104)
    x = _data(2, 9001, torch.float32, seed=11)
    for hadamard in (False, True):
        got = K.quantize(_d(x), spec, KEY, None, hadamard)
        _same(got, torch_codec.quantize(x, spec, KEY, None, hadamard))


@_exact
def test_quantize_scale_edge_cases(K):
    # fp16 scales: amax / qmax overflows to inf (codes 0) or underflows to 0 (scale 1).
    spec = _spec(2, True, "nearest", "float16", 8)
    x = torch.tensor([[1e6, -3e5, 2.0, 0, 0, 0, 0, 0, 1e-9, -2e-9, 0, 0, 0, 0, 0, 3e-9]])
    _same(K.quantize(_d(x), spec, None, None, False),
          torch_codec.quantize(x, spec, None, None, False))
    # A group whose minimum is -0 stores +0 (wire.py), whichever zero a min-reduction picks.
    spec = _spec(4, False, "nearest", "float32", 8)
    x = torch.tensor([[1.0, -0.0, 2.0, 0.5, 3.0, 1.5, 2.5, 0.25]])
    got = K.quantize(_d(x), spec, None, None, False).cpu()
    assert_same_bits(got, torch_codec.quantize(x, spec, None, None, False))
    assert got[0, 4:8].view(torch.int32).item() == 0


@_exact
@pytest.mark.parametrize("hadamard", [False, True])
def test_quantize_into_out(K, hadamard):
    """``out=`` slices of one wire buffer: written in place where the scales can be written
    directly (a start aligned to them), through a copy where not (an odd start), the same bytes
    as the torch codec either way and nothing outside the slice touched."""
    spec = QuantSpec(bits=4, group_size=96)  # 32-blocks cut by groups: the two-pass Hadamard
    x = _data(3, 1001, torch.float32, seed=4)
    want = torch_codec.quantize(x, spec, KEY, None, hadamard)
    W = want.shape[-1]
    for start in (4, 1):
        buf = torch.full((3 * W + 8,), 7, dtype=torch.uint8, device=DEV)
        o = buf[start:start + 3 * W].view(3, W)
        assert K.quantize(_d(x), spec, KEY, None, hadamard, o) is o
        _same(o, want)
        rest = torch.cat((buf[:start], buf[start + 3 * W:])).cpu()
        assert rest.tolist() == [7] * (8)


@_exact
@pytest.mark.parametrize("spec", [
    _spec(4, True, "stochastic", "float32", 2048),  # qWD's weights
    _spec(5, False, "stochastic", "bfloat16", 96),  # groups cutting 32-blocks
    _spec(3, True, "stochastic", "float16", 4104),  # groups larger than a tile
    _spec(8, False, "nearest", "float32", 64),
], ids=["4b-g2048", "5b-g96-asym", "3b-g4104", "8b-nearest"])
@pytest.mark.parametrize("segs", [(1000, 0, 4096, 7, 2049, 300), (1024, 0, 4096, 8, 2048, 296)],
                         ids=["odd", "aligned"])
def test_quantize_segments_same_bytes(K, spec, segs):
    """One launch over a flat shard of segments: each segment's bytes as the torch codec's
    ``quantize`` of it alone with ``key.fold(salt + k)``, the per-segment keys derived in the
    kernel (keys with negative, large and 64-bit-wrapping fields), NaN groups, empty and odd
    segments, with and without a reference and the Hadamard rotation; segments whose lengths
    and offsets are multiples of 8 take the kernel's aligned variant (``_common.segment_hints``)."""
    aligned = all(n % 8 == 0 for n in segs)
    table = importlib.import_module("fsdp_qcomm.kernels.quantize")._segment_table
    gpb = importlib.import_module("fsdp_qcomm.kernels._common").group_tiling(spec.group_size)[1]
    assert table(segs, spec, False, "cpu", gpb)[5] is aligned
    N = sum(segs)
    x = _data(1, N, torch.float32, seed=3)[0]
    r = _data(1, N, torch.float32, seed=4, specials=False)[0]
    salt = 1 << 40
    for key in (KEY, RngKey(seed=-5, step=123456789, rank=7, bucket=(1 << 64) - 3)):
        for ref in (None, r):
            for hadamard in (False, True):
                want, off = [], 0
                for k, n in enumerate(segs):
                    if n:
                        want.append(torch_codec.quantize(
                            x[off:off + n].view(1, n), spec, key.fold(salt + k),
                            None if ref is None else ref[off:off + n].view(1, n),
                            hadamard).view(-1))
                    off += n
                got = K.quantize_segments(_d(x), segs, spec, key, salt, _d(ref), hadamard)
                _same(got, torch.cat(want))


@_exact
def test_quantize_needs_key_for_stochastic(K):
    with pytest.raises(ValueError, match="needs key"):
        K.quantize(_d(torch.ones(1, 8)), _spec(4, True, "stochastic", "float32", 8), None)


@_exact
def test_nan_scale_bit_patterns(K):
    x = torch.full((1, 16), float("nan"))
    for sdt, bits, ints in (("float32", 0x7FC00000, torch.int32), ("bfloat16", 0x7FC0, torch.int16),
                            ("float16", 0x7E00, torch.int16)):
        spec = _spec(4, False, "nearest", sdt, 8)
        got = K.quantize(_d(x), spec, None, None, False).cpu()
        assert_same_bits(got, torch_codec.quantize(x, spec, None, None, False))
        sb = wire.scale_section_bytes(16, spec)
        assert (got[0, :sb].view(ints) == bits).all()


# ---- dequantize -------------------------------------------------------------------------------
@_exact
@pytest.mark.parametrize("bits,sym,sdt,gs", [
    (4, True, "float32", 128), (3, False, "bfloat16", 24), (8, False, "float16", 40),
    (2, True, "bfloat16", 8), (5, False, "float32", 64), (7, True, "float16", 32),
])
@pytest.mark.parametrize("hadamard", [False, True])
def test_dequantize_same_values(K, bits, sym, sdt, gs, hadamard):
    spec = _spec(bits, sym, "stochastic", sdt, gs)
    n = 157
    data = torch_codec.quantize(_data(3, n, torch.float32, seed=bits), spec, KEY, None, hadamard)
    _same(K.dequantize(_d(data), n, spec, hadamard, None, False),
          torch_codec.dequantize(data, n, spec, hadamard, None, False))
    for dtype, accumulate in ((torch.float32, True), (torch.bfloat16, True),
                              (torch.float16, False), (torch.bfloat16, False)):
        base = _data(3, n, dtype, seed=bits + 1, specials=False)
        got, want = _d(base.clone()), base.clone()
        K.dequantize(_d(data), n, spec, hadamard, got, accumulate)
        torch_codec.dequantize(data, n, spec, hadamard, want, accumulate)
        _same(got, want)


@_exact
@pytest.mark.parametrize("hadamard", [False, True])
@pytest.mark.parametrize("segs", [(1000, 0, 4096, 7, 2049, 300), (1024, 0, 4096, 8, 2048, 296)],
                         ids=["odd", "aligned"])
def test_dequantize_segments_same_values(K, hadamard, segs):
    """One launch over back-to-back segment rows (a weight shard's parameters): the torch
    codec's values per segment, with NaN/Inf groups, empty and odd segments, groups that cut
    32-blocks, bf16 and fp32 outputs, written, added, and into strided rows; segments whose
    lengths and offsets are multiples of 8 take the kernel's aligned variant."""
    spec = _spec(5, False, "stochastic", "bfloat16", 96)
    aligned = all(n % 8 == 0 for n in segs)
    table = importlib.import_module("fsdp_qcomm.kernels.dequantize")._segment_table
    assert table(segs, spec, hadamard, 256, "cpu")[4] is aligned
    parts = [torch_codec.quantize(_data(3, n, torch.float32, seed=k), spec, KEY.fold(k), None,
                                  hadamard) if n else torch.empty(3, 0, dtype=torch.uint8)
             for k, n in enumerate(segs)]
    data = torch.cat(parts, 1)
    N = sum(segs)

    def reference(out, accumulate):  # the torch codec, segment by segment
        off = 0
        for n, p in zip(segs, parts):
            if n:
                torch_codec.dequantize(p, n, spec, hadamard, out[:, off:off + n], accumulate)
            off += n

    for dtype in (torch.float32, torch.bfloat16):
        for accumulate in (False, True):
            base = _data(3, N + 5, dtype, seed=9, specials=False)
            want, got = base.clone(), _d(base.clone())
            reference(want[:, 5:], accumulate)
            K.dequantize_segments(_d(data), segs, spec, hadamard, got[:, 5:], accumulate)
            _same(got, want)
        # row_base: row 1 adds to a base row of its own (not to what its slot holds), and both
        # take the sums, as the codec's copies before and after give them
        mine = _data(1, N, dtype, seed=10, specials=False)[0]
        want = base.clone()
        want[1, 5:] = mine
        reference(want[:, 5:], True)
        got, own = _d(base.clone()), _d(mine.clone())
        K.dequantize_segments(_d(data), segs, spec, hadamard, got[:, 5:], True, (1, own))
        _same(got, want)
        _same(own, want[1, 5:])
    wide = torch.zeros(N, 3)
    strided = _d(wide).t()  # columns of a transposed buffer: not unit-stride rows
    K.dequantize_segments(_d(data), segs, spec, hadamard, strided, False)
    want = torch.zeros(3, N)
    off = 0
    for n, p in zip(segs, parts):
        if n:
            torch_codec.dequantize(p, n, spec, hadamard, want[:, off:off + n])
        off += n
    _same(strided.contiguous(), want)


@_exact
def test_dequantize_into_strided_out(K):
    spec = _spec(4, True, "nearest", "float32", 16)
    data = torch_codec.quantize(_data(2, 50, torch.float32, seed=5), spec, None)
    big = torch.zeros(2, 60, dtype=torch.bfloat16)
    got = _d(big.clone())
    K.dequantize(_d(data), 50, spec, False, got[:, 5:55], True)
    torch_codec.dequantize(data, 50, spec, False, big[:, 5:55], True)
    _same(got, big)


# ---- reductions -------------------------------------------------------------------------------
def _chunks(k: int, rows: int, n: int, spec: QuantSpec, hadamard: bool, seed: int):
    """k wire blocks as one [k, R, W] receive buffer (read in place by the kernels)."""
    blocks = [
        torch_codec.quantize(_data(rows, n, torch.float32, seed=seed + j, specials=j == 1),
                             spec, KEY.fold(j), None, hadamard)
        for j in range(k)
    ]
    return torch.stack(blocks)


@_exact
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
    dev = _d(buf)
    _same(K.reduce_requantize(list(dev.unbind(0)), n, spec_in, spec_out, KEY), want)
    # Separate allocations take the stacking path.
    _same(K.reduce_requantize([c.clone() for c in dev.unbind(0)], n, spec_in, spec_out, KEY),
          want)


@_exact
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("hadamard", [False, True])
def test_reduce_dequantize_same_values(K, k, hadamard):
    spec = _spec(4 + k, k != 2, "stochastic", SCALE_DTYPES[k - 1], 32 if hadamard else 40)
    n = 150
    buf = _chunks(k, 3, n, spec, hadamard, seed=10 * k)
    chunks = list(buf.unbind(0))
    dev = list(_d(buf).unbind(0))
    _same(K.reduce_dequantize(dev, n, spec, hadamard, None),
          torch_codec.reduce_dequantize(chunks, n, spec, hadamard, None))
    for dtype in (torch.float32, torch.bfloat16):
        got = torch.empty(3, n, dtype=dtype, device=DEV)
        want = torch.empty(3, n, dtype=dtype)
        K.reduce_dequantize([c.clone() for c in dev], n, spec, hadamard, got)
        torch_codec.reduce_dequantize(chunks, n, spec, hadamard, want)
        _same(got, want)
    # AVG in the same pass: the sum's IEEE quotient (a group of 3 or 24 has no exact
    # reciprocal), then the cast, as FSDP's reduced_shard.div_(size) and a copy give it
    total = torch_codec.reduce_dequantize(chunks, n, spec, hadamard, None)
    for divide in (3.0, 8.0, 24.0, 0.25, 2.0 ** -126, 2.0 ** 127):
        _same(K.reduce_dequantize(dev, n, spec, hadamard, None, divide), total / divide)
        for dtype in (torch.float32, torch.bfloat16):
            got = torch.empty(3, n, dtype=dtype, device=DEV)
            K.reduce_dequantize(dev, n, spec, hadamard, got, divide)
            _same(got, (total / divide).to(dtype))
            want = torch.empty(3, n, dtype=dtype)
            _same(got, torch_codec.reduce_dequantize(chunks, n, spec, hadamard, want, divide))


@_exact
def test_reduce_takes_chunks_in_their_order_and_refuses_a_misshapen_one(K):
    # Views of one buffer out of its order (not evenly spaced: stacked), in reverse order
    # (evenly spaced backwards: read in place), and a block of another shape.
    s8 = _spec(8, True, "stochastic", "float32", 128)
    s4 = _spec(4, True, "stochastic", "float32", 128)
    n = 213
    buf = _chunks(3, 2, n, s8, False, seed=5)
    dev = _d(buf)
    for order in ([2, 0, 1], [2, 1, 0]):
        _same(K.reduce_requantize([dev[j] for j in order], n, s8, s4, KEY),
              torch_codec.reduce_requantize([buf[j] for j in order], n, s8, s4, KEY))
        _same(K.reduce_dequantize([dev[j] for j in order], n, s8, False, None),
              torch_codec.reduce_dequantize([buf[j] for j in order], n, s8, False, None))
    with pytest.raises(ValueError, match=r"chunk shape \(1, \d+\) is not \(2, \d+\): 213 values"):
        K.reduce_requantize([dev[0], dev[1][:1]], n, s8, s4, KEY)
    with pytest.raises(ValueError, match=r"chunk shape \(1, \d+\) is not \(2, \d+\): 213 values"):
        K.reduce_dequantize([dev[0], dev[1][:1]], n, s8, False, None)


@_exact
def test_two_level_pipeline_round_trip(K):
    # The TLq-HS chain (Hadamard + 8 bit, reduce, 4 bit, reduce + inverse Hadamard) end to end.
    s8 = _spec(8, True, "stochastic", "float32", 128)
    s4 = _spec(4, True, "stochastic", "float32", 128)
    n, m = 300, wire.hadamard_len(300)
    xs = [_data(2, n, torch.float32, seed=40 + j, specials=False) for j in range(2)]
    hop1 = [K.quantize(_d(x), s8, KEY.fold(j), None, True) for j, x in enumerate(xs)]
    hop2 = K.reduce_requantize(hop1, m, s8, s4, KEY)
    got = K.reduce_dequantize([hop2, hop2], n, s4, True, None)
    t1 = [torch_codec.quantize(x, s8, KEY.fold(j), None, True) for j, x in enumerate(xs)]
    t2 = torch_codec.reduce_requantize(t1, m, s8, s4, KEY)
    _same(got, torch_codec.reduce_dequantize([t2, t2], n, s4, True, None))
    exact = 2 * (xs[0] + xs[1])
    assert (got.cpu() - exact).abs().max().item() < 0.2 * exact.abs().max().item()


# ---- learned levels ---------------------------------------------------------------------------
@_exact
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_levels_same_bytes_and_values(K, bits, sym, rounding):
    c = bits * 4 + sym * 2 + (rounding == "stochastic")
    spec = _spec(bits, sym, rounding, SCALE_DTYPES[c % 3], (8, 24, 64, 40, 128)[c % 5])
    table = fitted_levels(spec, seed=bits)
    # 1100: whole groups below wire.TINY_SCALE and of subnormals (the reciprocal's prescale)
    for rows, n in ((3, 203), (1, 7), (2, 1100)):
        x = level_rows(rows, n, seed=c + n, levels=table, dtype=IN_DTYPES[(c // 3) % 3],
                       group_size=spec.group_size)
        got = K.quantize_levels(_d(x), spec, _d(table), KEY)
        want = torch_codec.quantize_levels(x, spec, table, KEY)
        _same(got, want)
        _same(K.dequantize_levels_sum([got], n, spec),
              torch_codec.dequantize_levels_sum([want], n, spec))


@_exact
@pytest.mark.parametrize("sym", [True, False])
def test_levels_large_groups_sums_and_outputs(K, sym):
    spec = _spec(4, sym, "stochastic", "bfloat16", 4104)  # sub-tiled groups
    table = fitted_levels(spec, seed=3)
    x = level_rows(2, 9001, seed=5, levels=table)
    _same(K.quantize_levels(_d(x), spec, _d(table), KEY),
          torch_codec.quantize_levels(x, spec, table, KEY))
    spec = _spec(5, sym, "stochastic", "float32", 40)
    table = fitted_levels(spec, seed=4)
    n = 333
    recv = torch.stack([torch_codec.quantize_levels(_data(2, n, torch.float32, seed=j), spec,
                                                    table, KEY.fold(j)) for j in range(3)])
    chunks = list(recv.unbind(0))
    dev = list(_d(recv).unbind(0))
    _same(K.dequantize_levels_sum(dev, n, spec),
          torch_codec.dequantize_levels_sum(chunks, n, spec))
    _same(K.dequantize_levels_sum([c.clone() for c in dev], n, spec),
          torch_codec.dequantize_levels_sum(chunks, n, spec))
    base = _data(2, n + 5, torch.float32, seed=9, specials=False)
    for dtype in (torch.float32, torch.bfloat16):
        for accumulate in (False, True):
            got, want = _d(base.to(dtype)), base.to(dtype)
            K.dequantize_levels_sum(dev[:1], n, spec, got[:, 5:], accumulate)
            torch_codec.dequantize_levels_sum(chunks[:1], n, spec, want[:, 5:], accumulate)
            _same(got, want)


# ---- the change tracker's shard digest --------------------------------------------------------
@_exact
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                   torch.int16, torch.int32, torch.int64])
def test_digest_equals_the_torch_formula(dtype):
    """One pass, atomically summed blocks: the torch formula's exact value, with position
    weights that wrap at the prime inside a block and across shards, offsets past 2^32, and sums
    that wrap modulo 2^64 (values near 2^62); bit flips and exchanges change it."""
    from fsdp_qcomm.fsdp.change_tracker import _torch_digest
    kd = importlib.import_module("fsdp_qcomm.kernels.digest")  # the module, not its function

    g = torch.Generator().manual_seed(11)
    sizes = (70_000, 0, 131_071, 5)
    if dtype.is_floating_point:
        shards = [(torch.randn(n, generator=g) * 1e3).to(dtype) for n in sizes]
    else:
        shards = [torch.randint(-2 ** 15, 2 ** 15, (n,), generator=g).to(dtype) for n in sizes]
    if dtype == torch.int64:
        shards[0][:16] = 2 ** 62
    dev = _d(shards)
    lead = (1 << 33) + 65_000  # an offset past 2^32, 521 values before the prime wraps
    for start in (0, lead):
        for _ in range(2):  # the second call reuses the layout's table
            out = torch.zeros((), dtype=torch.int64, device=DEV)
            positions = [start + sum(sizes[:i]) for i in range(len(sizes))]
            with _through_table(dev):
                kd.digest_many(dev, out, positions)
            # the torch formula from ``start``: ``start`` leading zeros weigh nothing
            want = _torch_digest([torch.zeros(start % 65521, dtype=dtype), *shards])
            assert out.device.type == DEV and int(out) == int(want), (dtype, start)
    # slots: each shard into its own value of a vector, from its own position, in one launch
    out = torch.zeros(3, dtype=torch.int64, device=DEV)
    with _through_table(dev):
        kd.digest_many(dev, out, [lead, 7, 0, 65_519], [2, 0, 0, 0])

    def at(x, position):  # x's digest from ``position``: the weights depend on it mod the prime
        return _torch_digest([torch.zeros(position % 65521, dtype=dtype), x])

    want = torch.stack([at(shards[1], 7) + at(shards[2], 0) + at(shards[3], 65_519),
                        torch.tensor(0), at(shards[0], lead)])  # int64 sums wrap alike
    assert out.cpu().tolist() == want.tolist(), dtype
    with pytest.raises(ValueError, match="one position and one slot"):
        kd.digest_many(dev[:1], out, [0], [3])
    flipped = shards[0].clone()
    assert flipped[100] != flipped[101]
    flipped[100], flipped[101] = shards[0][101], shards[0][100]
    out = torch.zeros((), dtype=torch.int64, device=DEV)
    flipped = _d(flipped)
    with _through_table([flipped]):
        kd.digest_many([flipped], out)
    assert int(out) != int(_torch_digest(shards[:1]))
    with pytest.raises(ValueError, match="contiguous"):
        kd.digest_many([_d(torch.zeros(8, 2, dtype=dtype))[:, 0]], out)
    other = torch.int32 if dtype.itemsize == 2 else torch.int16
    with pytest.raises(ValueError, match="one element width"):
        kd.digest_many([_d(shards[0]), _d(torch.zeros(4, dtype=other))], out)


@_exact
def test_digests_of_many_groups_take_one_launch_per_element_width():
    """The agreement's digests (``change_tracker.shard_digests`` on CUDA): every group of one
    element width in one launch, each group from position 0 into its own value; groups that
    mix widths, hold empty tensors or a tensor the kernel does not read (the torch formula from
    its position) too. Each value is the group's torch formula."""
    from fsdp_qcomm.fsdp import change_tracker as ct

    g = torch.Generator().manual_seed(12)
    f32 = [torch.randn(n, generator=g) * 1e3 for n in (70_000, 5, 0, 4_100)]
    b16 = [(torch.randn(n, generator=g) * 1e3).to(torch.bfloat16) for n in (9_000, 66_000)]
    strided = (torch.randn(900, 2, generator=g) * 1e3)[:, 0]  # the kernel does not read it
    groups = [[f32[0], f32[1]], [], [f32[2], f32[3]], [b16[0], f32[1], b16[1]], [f32[1]],
              [f32[1], strided, f32[3]]]
    dev = [_d(grp) for grp in groups]
    plan, rest = ct._kernel_plan(dev)
    assert [len(tensors) for tensors, _, _ in plan] == [7, 2]  # fp32 once, bf16 once
    assert [(position, slot) for _, position, slot in rest] == [(5, 5)]  # the torch formula
    for _ in range(2):  # the second round reuses the layouts' tables
        with _through_table([x for tensors, _, _ in plan for x in tensors]):
            got = ct._kernel_digests(len(groups), plan, rest, torch.device(DEV))
        assert got.cpu().tolist() == [int(ct._torch_digest(grp)) for grp in groups]


def _cuda_only(fn):
    """A test of CUDA streams: it runs only where there is a GPU (``scripts/gpu_check.sh``)."""
    fn.__test__ = CUDA
    return fn


def _table_launch(K, kind: str):
    """A launch of ``kind`` that reads one of the kernels' cached layout tables."""
    spec = _spec(4, True, "stochastic", "float32", 64)
    x = _d(_data(4, 640, torch.float32, seed=1, specials=False))
    if kind == "quantize_segments":
        return lambda: K.quantize_segments(x[0], (256, 384), spec, KEY, 0, None, False)
    if kind == "quantize_ordered":
        return lambda: K.quantize_ordered(x, spec, KEY, None, False, (3, 1, 2, 0))
    if kind == "dequantize_segments":
        wire_rows = K.quantize_segments(x[0], (256, 384), spec, KEY, 0, None, False).view(1, -1)
        out = torch.empty(1, 640, device=DEV)
        return lambda: K.dequantize_segments(wire_rows, (256, 384), spec, False, out, False)
    digest = importlib.import_module("fsdp_qcomm.kernels.digest")
    out = torch.zeros((), dtype=torch.int64, device=DEV)
    return lambda: digest.digest_many([x[0], x[1]], out, [0, 640])


def _block_state(ptr: int) -> Optional[str]:
    """The caching allocator's state of the block holding device address ``ptr``: "inactive"
    once it is free for reuse (``torch.cuda.memory_snapshot``)."""
    for seg in torch.cuda.memory_snapshot():
        start = seg["address"]
        for block in seg["blocks"]:
            start = block.get("address", start)
            if start <= ptr < start + block["size"]:
                return block["state"]
            start += block["size"]
    return None


@_cuda_only
@pytest.mark.parametrize("kind", ["quantize_segments", "quantize_ordered",
                                  "dequantize_segments", "digest"])
def test_an_evicted_table_waits_for_the_streams_that_read_it(K, kind, monkeypatch):
    """The layout tables live in host caches that evict. A table copied on one stream and read
    by a kernel queued on another must not return to the first stream's free memory when it is
    evicted before that kernel ran (``_common.wait_for`` marks it with ``record_stream``). Here
    the reading stream sleeps before its launch, and the cache is cleared meanwhile: the
    allocator must hold every table's block back (not "inactive") until that stream passes."""
    common = importlib.import_module("fsdp_qcomm.kernels._common")
    caches = [importlib.import_module("fsdp_qcomm.kernels.quantize")._segment_table,
              importlib.import_module("fsdp_qcomm.kernels.quantize")._order_table,
              importlib.import_module("fsdp_qcomm.kernels.dequantize")._segment_table,
              importlib.import_module("fsdp_qcomm.kernels.digest")._table]
    made: list[int] = []
    real = common.table_to

    def spy(device, *tables):
        moved = real(device, *tables)
        made.extend(t.data_ptr() for t in moved[:-1])
        return moved

    monkeypatch.setattr(common, "table_to", spy)
    for cache in caches:
        cache.cache_clear()
    launch = _table_launch(K, kind)
    made.clear()  # the tables of its inputs' making are not read on the other stream
    launch()  # builds its tables on the default stream
    torch.cuda.synchronize()
    assert made, f"{kind} read no cached table"
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(2_000_000_000)  # about a second of this stream's time
        launch()  # the cached tables, read on ``side`` after the sleep
    for cache in caches:
        cache.cache_clear()  # the tables' last references
    states = [_block_state(p) for p in made]
    busy = not side.query()
    torch.cuda.synchronize()
    assert busy, "the side stream finished before the check: lengthen its sleep"
    assert None not in states and "inactive" not in states, (
        f"{kind}: an evicted table's memory was free for reuse while a kernel read it: {states}")

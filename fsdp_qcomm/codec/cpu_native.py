"""The CPU codec's fused loops (``cpu_native.c``), built with the system C compiler on first use.

``torch_codec`` spends ~10 torch ops (~30 with stochastic rounding) per element, each a pass
over memory; on a CPU-only cluster that codec time, not the link, set the step time. The C file
does the same float operations per element in one pass over a cache-resident window, ~4-8x
faster (``benchmarks/codec_bench.py``, ``benchmarks/hook_profile.py``) and bit-identical
(``tests/test_codec_native.py``): still one wire format.

Same entry points as ``torch_codec`` (learned levels included); cases the C code does not
cover (bf16/fp16 scales, an ``out`` that is not fp32 with unit stride) and machines without a
working C compiler use ``torch_codec``. ``FSDP_QCOMM_NATIVE=0`` turns the C path off;
``FSDP_QCOMM_CACHE`` sets where the built library is kept (default ``~/.cache/fsdp_qcomm``);
``FSDP_QCOMM_NATIVE_CFLAGS`` adds compiler flags (``-fsanitize=address,undefined`` for the
sanitizer run of ``tests/test_codec_sanitizers.py``; the build is cached under its own name).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from ..config import QuantSpec
from . import torch_codec, wire
from ._checks import raw_memory_ok, require_key
from .rng import RngKey, check_counter_range

_SOURCE = Path(__file__).with_name("cpu_native.c")
# -ffp-contract=off: no fused multiply-adds (the torch code rounds every product). Nothing here
# lets the compiler reorder or approximate float math; -fno-trapping-math only lets it
# vectorize floorf (it changes no result).
_CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-trapping-math", "-std=c11",
           "-fPIC", "-shared"]

_lock = threading.Lock()
_state: dict[str, object] = {}


def _cpu_id() -> str:
    """What ``-march=native`` depends on, so a shared cache never serves another CPU's build."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        return next((ln for ln in text.splitlines() if ln.startswith("flags")), "") + text[:200]
    except OSError:
        return platform.processor()


def c_compiler() -> Optional[str]:
    """The C compiler the codec is built with: ``$CC``, else ``cc``, else ``gcc`` (None if
    there is none)."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build() -> Path:
    cc = c_compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    src = _SOURCE.read_bytes()
    flags = [*_CFLAGS, *shlex.split(os.environ.get("FSDP_QCOMM_NATIVE_CFLAGS", ""))]
    tag = hashlib.sha256(
        src + " ".join([cc, *flags, platform.machine(), _cpu_id()]).encode()
    ).hexdigest()[:16]
    root = Path(os.environ.get("FSDP_QCOMM_CACHE") or Path.home() / ".cache" / "fsdp_qcomm")
    lib = root / f"cpu_native-{tag}.so"
    if lib.exists():
        return lib
    root.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: ranks starting together never load a partial file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=root)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *flags, str(_SOURCE), "-o", tmp, "-lm"],
                              capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"{cc} failed:\n{proc.stderr[-2000:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32, u32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_uint32
    lib.fq_encode.argtypes = [p, i64, p, i64, i64, i64, i64, i32, i64, i32, i32, i32, u32, u32,
                              p, i64]
    lib.fq_reduce_requantize.argtypes = [p, p, i32, i64, i64, i32, i64, i32, i32, i64, i32, i32,
                                         u32, u32, p, i64]
    lib.fq_decode_sum.argtypes = [p, p, i32, i64, i64, i64, i32, i64, i32, i32, i32, p, i64]
    lib.fq_encode_levels.argtypes = [p, i64, i64, i64, i32, i64, i32, i32, u32, u32, p, p, i64]
    lib.fq_decode_levels_sum.argtypes = [p, p, i32, i64, i64, i32, i64, i32, i32, p, i64]
    for f in (lib.fq_encode, lib.fq_reduce_requantize, lib.fq_decode_sum, lib.fq_encode_levels,
              lib.fq_decode_levels_sum):
        f.restype = ctypes.c_int
    lib.fq_digest.argtypes = [p, i32, i64, i64]
    lib.fq_digest.restype = ctypes.c_uint64


def library() -> Optional[ctypes.CDLL]:
    """The loaded C library, building it on first use; None when disabled or unbuildable (a
    warning says why, once)."""
    with _lock:
        if "lib" in _state:
            return _state["lib"]  # type: ignore[return-value]
        lib = None
        # The wire format is little-endian and the C code writes native byte order.
        if os.environ.get("FSDP_QCOMM_NATIVE", "1") != "0" and sys.byteorder == "little":
            try:
                lib = ctypes.CDLL(str(_build()))
                _declare(lib)
            except (OSError, RuntimeError) as e:
                warnings.warn(f"fsdp_qcomm: the fused CPU codec is unavailable ({e}); using the "
                              f"slower torch implementation (same bytes)", stacklevel=2)
                lib = None
        _state["lib"] = lib
        return lib


def available() -> bool:
    """Whether CPU tensors use the C loops (``FSDP_QCOMM_NATIVE``, a C compiler)."""
    return library() is not None


#: dtypes whose raw bits the digest reads as signed integers (what the torch formula does)
_SIGNED = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int16,
           torch.int32, torch.int64)


def plain(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether C may take these CPU tensors' memory (``_checks.raw_memory_ok``); every entry
    point below checks its tensors with this and otherwise takes the torch path."""
    return raw_memory_ok("cpu", *tensors)


#: elements per piece of a digest split over threads (below two pieces: one call)
DIGEST_PIECE = 1 << 22
_pool: dict[tuple[int, int], Any] = {}


def digest(x: torch.Tensor, offset: int) -> Optional[int]:
    """``fsdp.change_tracker.shard_digests``' sum for one flat CPU tensor whose values start at
    position ``offset``, modulo 2^64 as an unsigned int, in one pass (the torch formula makes
    six passes with int64 temporaries: 37 ms per step of a 10.9M-parameter model on 4 ranks,
    results/step_profile). None when the C loops are off or ``x`` is not a contiguous CPU
    tensor of 2, 4 or 8-byte elements (``plain``): then the torch formula runs (the same
    value).

    A tensor of several ``DIGEST_PIECE`` elements is split over ``torch.get_num_threads()``
    threads (ctypes releases the GIL; the sum of the pieces' sums is the same modulo 2^64):
    with FSDP's ``CPUOffloadPolicy`` every shard is a host tensor, digested at each root
    forward, and one thread reads a few GB/s where the host's optimizer uses all of them."""
    lib = library()
    if lib is None or not plain(x) or not x.is_contiguous() or x.dtype not in _SIGNED:
        return None
    n, es, base = x.numel(), x.element_size(), x.data_ptr()
    threads = min(torch.get_num_threads(), n // DIGEST_PIECE)
    if threads < 2:
        return int(lib.fq_digest(base, es, n, offset))
    step = -(-n // threads)
    key = (os.getpid(), threads)  # a forked child has the dict but not the parent's threads
    pool = _pool.get(key)
    if pool is None:
        from concurrent.futures import ThreadPoolExecutor

        pool = _pool[key] = ThreadPoolExecutor(threads, thread_name_prefix="fq_digest")
    parts = pool.map(lambda a: int(lib.fq_digest(base + a * es, es, min(step, n - a),
                                                 offset + a)), range(0, n, step))
    return sum(parts) & ((1 << 64) - 1)


def _covers(spec: QuantSpec) -> bool:
    return spec.scale_dtype == "float32"


def _rows_f32(x: torch.Tensor) -> torch.Tensor:
    """fp32 [R, n] with unit column stride (a copy only when needed)."""
    x = x.to(torch.float32)
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def _words(spec: QuantSpec, key: Optional[RngKey]) -> tuple[int, int]:
    require_key(spec, key)
    return key.words() if spec.stochastic else (0, 0)


def _check(rc: int) -> None:
    if rc:
        raise MemoryError("fsdp_qcomm's CPU codec could not allocate its window buffers")


def _chunk_args(chunks: Sequence[torch.Tensor]):
    cs = [c if c.stride(-1) == 1 else c.contiguous() for c in chunks]
    ptrs = (ctypes.c_void_p * len(cs))(*[c.data_ptr() for c in cs])
    strides = (ctypes.c_int64 * len(cs))(*[c.stride(0) if c.dim() > 1 else 0 for c in cs])
    return cs, ptrs, strides


def quantize(
    x: torch.Tensor,
    spec: QuantSpec,
    key: Optional[RngKey],
    ref: Optional[torch.Tensor] = None,
    hadamard: bool = False,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """As ``torch_codec.quantize``; writes into ``out`` directly when its rows have unit
    stride."""
    lib = library()
    if lib is None or not _covers(spec) or not plain(x, ref, out):
        return torch_codec.quantize(x, spec, key, ref, hadamard, out)
    if out is not None and out.numel() and out.stride(-1) != 1:
        res = quantize(x, spec, key, ref, hadamard)
        out.copy_(res)
        return out
    k0, k1 = _words(spec, key)
    v = _rows_f32(x)
    r = None if ref is None else _rows_f32(ref)
    rows, n0 = v.shape
    n = wire.hadamard_len(n0) if hadamard else n0
    if out is None:
        out = torch.empty(rows, wire.wire_bytes(n, spec), dtype=torch.uint8)
    if n == 0 or rows == 0:
        return out
    if spec.stochastic:
        check_counter_range(rows, n)
    _check(lib.fq_encode(v.data_ptr(), v.stride(0), None if r is None else r.data_ptr(),
                         0 if r is None else r.stride(0), rows, n0, n, spec.bits,
                         spec.group_size, int(spec.symmetric), int(hadamard),
                         int(spec.stochastic), k0, k1, out.data_ptr(), out.stride(0)))
    return out


def _decode_into(decode, rows: int, n: int, n_out: int, out: Optional[torch.Tensor],
                 accumulate: bool) -> torch.Tensor:
    """Run ``decode(target, accumulate)`` (a C decode-sum writing fp32 rows) into ``out`` when it
    is fp32 with unit stride, else into a fresh buffer that is then written into ``out``."""
    direct = out is not None and out.dtype == torch.float32 and out.stride(-1) == 1 and \
        plain(out) and (out.dim() < 2 or out.shape[0] <= 1 or out.stride(0) >= n_out)
    target = out if direct else torch.empty(rows, n_out, dtype=torch.float32)
    if rows and n:
        _check(decode(target, int(accumulate and direct)))
    if out is None or direct:
        return target
    return torch_codec._write(target, out, accumulate)


def _decode_sum(chunks: Sequence[torch.Tensor], n: int, n_out: int, spec: QuantSpec,
                hadamard: bool, out: Optional[torch.Tensor], accumulate: bool) -> torch.Tensor:
    lib = library()
    cs, ptrs, strides = _chunk_args(chunks)

    def decode(target: torch.Tensor, acc: int) -> int:
        return lib.fq_decode_sum(ptrs, strides, len(cs), target.shape[0], n, n_out, spec.bits,
                                 spec.group_size, int(spec.symmetric), int(hadamard), acc,
                                 target.data_ptr(), target.stride(0))

    return _decode_into(decode, chunks[0].shape[0], n, n_out, out, accumulate)


def dequantize(
    data: torch.Tensor,
    n: int,
    spec: QuantSpec,
    hadamard: bool = False,
    out: Optional[torch.Tensor] = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """As ``torch_codec.dequantize``."""
    if library() is None or not _covers(spec) or not plain(data):
        return torch_codec.dequantize(data, n, spec, hadamard, out, accumulate)
    m = wire.hadamard_len(n) if hadamard else n
    return _decode_sum([data], m, n, spec, hadamard, out, accumulate)


def reduce_requantize(
    chunks: Sequence[torch.Tensor],
    n: int,
    spec_in: QuantSpec,
    spec_out: QuantSpec,
    key: Optional[RngKey],
) -> torch.Tensor:
    """As ``torch_codec.reduce_requantize``."""
    lib = library()
    if lib is None or not (_covers(spec_in) and _covers(spec_out)) or not plain(*chunks):
        return torch_codec.reduce_requantize(chunks, n, spec_in, spec_out, key)
    k0, k1 = _words(spec_out, key)
    rows = chunks[0].shape[0]
    out = torch.empty(rows, wire.wire_bytes(n, spec_out), dtype=torch.uint8)
    if n == 0 or rows == 0:
        return out
    if spec_out.stochastic:
        check_counter_range(rows, n)
    cs, ptrs, strides = _chunk_args(chunks)
    _check(lib.fq_reduce_requantize(ptrs, strides, len(cs), rows, n, spec_in.bits,
                                    spec_in.group_size, int(spec_in.symmetric), spec_out.bits,
                                    spec_out.group_size, int(spec_out.symmetric),
                                    int(spec_out.stochastic), k0, k1, out.data_ptr(),
                                    out.stride(0)))
    return out


def reduce_dequantize(
    chunks: Sequence[torch.Tensor],
    n: int,
    spec: QuantSpec,
    hadamard: bool = False,
    out: Optional[torch.Tensor] = None,
    divide: Optional[float] = None,
) -> torch.Tensor:
    """As ``torch_codec.reduce_dequantize``."""
    if library() is None or not _covers(spec) or not plain(*chunks):
        return torch_codec.reduce_dequantize(chunks, n, spec, hadamard, out, divide)
    m = wire.hadamard_len(n) if hadamard else n
    return torch_codec.divided(lambda o: _decode_sum(chunks, m, n, spec, hadamard, o, False),
                               out, divide)



# ---- learned levels (codec.levels) ------------------------------------------------------------
def quantize_levels(
    rows: torch.Tensor, spec: QuantSpec, levels: torch.Tensor, key: Optional[RngKey]
) -> torch.Tensor:
    """As ``torch_codec.quantize_levels``."""
    lib = library()
    if lib is None or not _covers(spec):
        return torch_codec.quantize_levels(rows, spec, levels, key)
    if not plain(rows, levels if levels.device.type == "cpu" else None):
        return torch_codec.quantize_levels(rows, spec, levels, key)
    k0, k1 = _words(spec, key)
    v = _rows_f32(rows)
    R, n = v.shape
    out = torch.empty(R, wire.levels_wire_bytes(n, spec), dtype=torch.uint8)
    if n == 0 or R == 0:
        return out
    if spec.stochastic:
        check_counter_range(R, n)
    lv = levels.to("cpu", wire.LEVELS_DTYPE).contiguous()
    _check(lib.fq_encode_levels(v.data_ptr(), v.stride(0), R, n, spec.bits, spec.group_size,
                                int(spec.symmetric), int(spec.stochastic), k0, k1,
                                lv.data_ptr(), out.data_ptr(), out.stride(0)))
    return out


def dequantize_levels_sum(
    chunks: Sequence[torch.Tensor],
    n: int,
    spec: QuantSpec,
    out: Optional[torch.Tensor] = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """As ``torch_codec.dequantize_levels_sum``."""
    lib = library()
    if lib is None or not _covers(spec) or not plain(*chunks):
        return torch_codec.dequantize_levels_sum(chunks, n, spec, out, accumulate)
    cs, ptrs, strides = _chunk_args(chunks)

    def decode(target: torch.Tensor, acc: int) -> int:
        return lib.fq_decode_levels_sum(ptrs, strides, len(cs), target.shape[0], n, spec.bits,
                                        spec.group_size, int(spec.symmetric), acc,
                                        target.data_ptr(), target.stride(0))

    return _decode_into(decode, chunks[0].shape[0], n, n, out, accumulate)

"""The C codec (``fsdp_qcomm/codec/cpu_native.c``) built with AddressSanitizer and
UndefinedBehaviorSanitizer, under its own exactness tests and a short FSDP2 training: an
out-of-bounds read or write into a tensor's buffer, a use after free, or undefined arithmetic
in the C loops fails this test with the sanitizer's report, where a plain build would corrupt
memory silently or crash later in someone else's frame.

The interpreter is not instrumented: the ASan runtime is preloaded (``LD_PRELOAD``) so that
every ``malloc`` (torch's CPU tensors included) gets redzones, and only the C file's own
accesses are checked. Leak checking is off (the interpreter keeps its allocations)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
REPORTS = ("ERROR: AddressSanitizer", "runtime error:", "ERROR: LeakSanitizer")


def _runtime(cc: str, name: str) -> str:
    out = subprocess.run([cc, f"-print-file-name={name}"], capture_output=True, text=True)
    path = out.stdout.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else ""


def _sanitized_run(tmp_path, modules: list[str], extra: list[str]) -> None:
    cc = os.environ.get("CC") or shutil.which("gcc")
    asan = _runtime(cc, "libasan.so") if cc else ""
    if not asan:
        pytest.skip("gcc with its AddressSanitizer runtime (libasan) is not installed")
    env = dict(
        os.environ,
        FSDP_QCOMM_NATIVE="1",
        FSDP_QCOMM_NATIVE_CFLAGS="-fsanitize=address,undefined -fno-sanitize-recover=all "
                                 "-fno-omit-frame-pointer -g -O1",
        FSDP_QCOMM_CACHE=str(tmp_path / "cache"),
        LD_PRELOAD=asan,
        ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:allocator_may_return_null=1",
        UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1",
        OMP_NUM_THREADS="1",
    )
    src = str(TESTS.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
         *[str(TESTS / m) for m in modules], *extra],
        env=env, capture_output=True, text=True, timeout=1800, cwd=src,
    )
    text = proc.stdout + proc.stderr
    found = [r for r in REPORTS if r in text]
    assert proc.returncode == 0 and not found, (
        f"sanitizer run failed (exit {proc.returncode}, reports {found}):\n"
        f"{proc.stdout[-8000:]}\n{proc.stderr[-6000:]}")
    assert " passed" in proc.stdout, proc.stdout[-2000:]
    # the instrumented library was the one the tests used
    built = list((tmp_path / "cache").glob("cpu_native-*.so"))
    assert built, "the sanitizer build of the C codec was not made"
    nm = subprocess.run(["nm", "-D", str(built[0])], capture_output=True, text=True).stdout
    assert "__asan_" in nm and "__ubsan_" in nm, "the C codec was built without the sanitizers"


def test_extra_compiler_flags_get_a_build_of_their_own(tmp_path, monkeypatch):
    """``FSDP_QCOMM_NATIVE_CFLAGS`` reaches the compiler and names its own cached library, so
    a sanitizer build never serves a plain run (or the reverse)."""
    from fsdp_qcomm.codec import cpu_native

    monkeypatch.setenv("FSDP_QCOMM_CACHE", str(tmp_path))
    plain = cpu_native._build()
    monkeypatch.setenv("FSDP_QCOMM_NATIVE_CFLAGS", "-DFQ_EXTRA_FLAG_TEST=1 -O2")
    flagged = cpu_native._build()
    assert plain != flagged and plain.exists() and flagged.exists()
    monkeypatch.setenv("FSDP_QCOMM_NATIVE_CFLAGS", "-fno-such-flag-xyz")
    with pytest.raises(RuntimeError, match="failed"):
        cpu_native._build()  # a flag the compiler refuses: its error, not a silent plain build


@pytest.mark.long
def test_codec_is_clean_under_asan_and_ubsan(tmp_path):
    """The C codec's exactness tests (every width, group size, Hadamard, learned levels,
    NaN/Inf and signed-zero groups, strided and bf16 inputs) under both sanitizers."""
    _sanitized_run(tmp_path, ["test_codec_native.py", "test_codec_fast_path.py"],
                   ["-k", "not every_compiler"])


@pytest.mark.long
def test_training_is_clean_under_asan_and_ubsan(tmp_path):
    """FSDP2 trainings through the C codec under both sanitizers: every way of writing weights
    under every scheme (the module whose torch 2.15 run once died with SIGSEGV) and the
    quantized reduce-scatter and HSDP all-reduce against exact collectives."""
    _sanitized_run(tmp_path, ["test_weight_writes.py", "test_grad_reduce.py", "test_hsdp.py"],
                   [])

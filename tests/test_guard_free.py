"""scripts/guard_free.c, the debugging shim for writes into freed heap memory: a write into a
freed guarded block (a tensor storage, or a malloc in the chosen size range) or past a guarded
storage's end faults in the writer; live blocks work as before."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_qcomm.codec.cpu_native import c_compiler

ROOT = Path(__file__).resolve().parents[1]

_SMALL = """
import ctypes, sys, torch
t = torch.arange(3, dtype=torch.float32)
addr = t.data_ptr()
print(addr % 4096, float((t * 2).sum()), float(torch.ones(64, 64).sum() * 0), flush=True)
if sys.argv[1] == "after_free":
    del t
ctypes.memset(addr, 0, 4)
print("written", flush=True)
"""

_LARGE = """
import ctypes, sys, torch
t = torch.arange(25_000, dtype=torch.float32)  # 100,000 bytes: 25 pages with the header
end = t.data_ptr() + 100_032  # rounded up to c10's 64-byte alignment
print(end % 4096, int(t.sum(dtype=torch.float64)), flush=True)
ctypes.memset(end - 32, 0, 32 if sys.argv[1] == "inside" else 33)  # 33: one byte past the end
print("written", flush=True)
"""

_MALLOC = """
import ctypes, sys
libc = ctypes.CDLL(None)
libc.malloc.restype = libc.realloc.restype = ctypes.c_void_p
libc.malloc.argtypes, libc.free.argtypes = [ctypes.c_size_t], [ctypes.c_void_p]
libc.realloc.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
p = libc.malloc(20)
ctypes.memmove(p, b"0123456789abcdefghi", 20)
q = libc.realloc(p, 24)  # a new guarded block; the old one is freed
print(ctypes.string_at(q, 19).decode(), q % 4096, flush=True)
libc.free(q)
ctypes.memset(q if sys.argv[1] == "after_free" else libc.malloc(24), 0, 1)
print("written", flush=True)
"""


@pytest.fixture(scope="module")
def shim(tmp_path_factory) -> Path:
    cc = c_compiler()
    if cc is None:
        pytest.skip("no C compiler")
    out = tmp_path_factory.mktemp("guard") / "libguard_free.so"
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(out),
                    str(ROOT / "scripts" / "guard_free.c")], check=True)
    return out


def _run(shim: Path, mode: str, prog: str = _SMALL, **guard: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, LD_PRELOAD=str(shim), OMP_NUM_THREADS="1", **guard)
    return subprocess.run([sys.executable, "-c", prog, mode], env=env, capture_output=True,
                          text=True, timeout=120)


def test_a_live_small_storage_ends_at_its_page_end_and_works(shim):
    r = _run(shim, "live")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["4032", "6.0", "0.0", "written"], r.stdout  # 4096 - 64


def test_a_write_into_a_freed_small_storage_faults_in_the_writer(shim):
    r = _run(shim, "after_free")
    assert r.returncode == -11, (r.returncode, r.stdout, r.stderr)
    assert "written" not in r.stdout


def test_guard_max_guards_a_large_storage_up_to_its_end(shim):
    """GUARD_MAX raised: a 100,000-byte storage spans pages of its own and ends at a page end;
    a write one byte past its (64-byte-rounded) end faults."""
    ok = _run(shim, "inside", _LARGE, GUARD_MAX="1000000")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.split() == ["0", "312487500", "written"], ok.stdout
    over = _run(shim, "past", _LARGE, GUARD_MAX="1000000")
    assert over.returncode == -11 and "written" not in over.stdout, (over.returncode,
                                                                      over.stdout)
    # default GUARD_MAX: the storage is glibc's; the overrun passes unseen (glibc may abort
    # later, in another free: the crash that names no writer; its exit code is glibc's). Its
    # end offset is not asserted: a 64-byte-aligned glibc block ends at a page end by chance
    # once in 64 runs.
    plain = _run(shim, "past", _LARGE)
    assert "written" in plain.stdout, (plain.returncode, plain.stdout)


def test_the_malloc_range_guards_small_mallocs(shim):
    """GUARD_MALLOC_MIN/MAX: a malloc in the range keeps its bytes through realloc, ends at a
    page end (16-byte rounding), and a write after its free faults."""
    guard = dict(GUARD_MALLOC_MIN="17", GUARD_MALLOC_MAX="24")
    ok = _run(shim, "live", _MALLOC, **guard)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.split() == ["0123456789abcdefghi", "4064", "written"], ok.stdout
    after = _run(shim, "after_free", _MALLOC, **guard)
    assert after.returncode == -11 and "written" not in after.stdout, (after.returncode,
                                                                        after.stdout)
    # default: mallocs are glibc's, nothing faults (the address is not asserted: a glibc block
    # lands 32 bytes before a page end by chance once in 256 runs)
    off = _run(shim, "after_free", _MALLOC)
    assert off.returncode == 0 and "written" in off.stdout, (off.returncode, off.stdout)

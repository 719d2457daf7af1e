"""scripts/free_quarantine.c, the cheap debugging shim for double frees and writes into freed
small blocks: a block freed twice (from two threads, which glibc's per-thread check misses) or
written after its free is reported with the bytes written and the stacks of its frees; live
blocks and clean programs are untouched."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_qcomm.codec.cpu_native import c_compiler

ROOT = Path(__file__).resolve().parents[1]

_PROG = """
import ctypes, os, struct, sys, threading
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes, libc.free.argtypes = [ctypes.c_size_t], [ctypes.c_void_p]
mode = sys.argv[1]
keep = libc.malloc(20)
ctypes.memmove(keep, b"live-block-contents!", 20)
p = libc.malloc(20)
libc.free(p)
if mode.startswith("write_after_free"):
    ctypes.memmove(p, struct.pack("<ff", 1.5, -2.0), 8)
elif mode == "double_free_other_thread":
    t = threading.Thread(target=libc.free, args=(p,))
    t.start()
    t.join()
for _ in range(int(os.environ.get("MORE_FREES", "0"))):
    libc.free(libc.malloc(16))
print(ctypes.string_at(keep, 20).decode(), flush=True)
if mode.endswith("os_exit"):
    os._exit(0)
"""


@pytest.fixture(scope="module")
def shim(tmp_path_factory) -> Path:
    cc = c_compiler()
    if cc is None:
        pytest.skip("no C compiler")
    out = tmp_path_factory.mktemp("quarantine") / "libfree_quarantine.so"
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(out),
                    str(ROOT / "scripts" / "free_quarantine.c")], check=True)
    return out


def _run(shim: Path, mode: str, **env: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, LD_PRELOAD=str(shim), OMP_NUM_THREADS="1", **env)
    return subprocess.run([sys.executable, "-c", _PROG, mode], env=env, capture_output=True,
                          text=True, timeout=120)


def test_a_clean_program_runs_unchanged_and_its_frees_are_held(shim, tmp_path):
    r = _run(shim, "clean", MORE_FREES="100", QUARANTINE_STATS="1",
             QUARANTINE_DIR=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["live-block-contents!"], r.stdout
    assert "free_quarantine" not in r.stderr, r.stderr
    (stats,) = tmp_path.glob("stats.*.txt")
    held = re.search(r"held back (\d+) frees of <= 24 bytes, 0 reports", stats.read_text())
    assert held and int(held.group(1)) >= 101, stats.read_text()  # p and the 100 more
    assert not list(tmp_path.glob("quarantine.*.txt"))


def test_a_write_after_free_is_reported_with_its_bytes_and_the_free_stack(shim):
    """Found at exit (the block is still held): the bytes read back as the floats written, the
    rest still the canary; the process aborts."""
    r = _run(shim, "write_after_free")
    assert r.returncode == -6, (r.returncode, r.stderr)
    assert "live-block-contents!" in r.stdout  # found after the program ran
    assert "write after free of a 24-byte block" in r.stderr, r.stderr
    assert "bytes now: 0000c03f000000c0 fbfbfbfbfbfbfbfb fbfbfbfbfbfbfbfb" in r.stderr
    assert "as float32: 1.5 -2 " in r.stderr, r.stderr
    assert re.search(r"freed by thread \d+:\n.*\(free\+0x", r.stderr), r.stderr


def test_a_write_after_free_is_found_when_the_block_leaves_the_fifo(shim):
    """Four slots: the fifth small free evicts the written block and reports it mid-run."""
    r = _run(shim, "write_after_free", QUARANTINE_SLOTS="4", MORE_FREES="50")
    assert r.returncode == -6, (r.returncode, r.stderr)
    assert r.stdout == "", r.stdout
    assert "write after free of a 24-byte block" in r.stderr, r.stderr


def test_os_exit_still_scans_the_held_blocks(shim):
    """Forkserver and multiprocessing children leave through os._exit, past destructors."""
    r = _run(shim, "write_after_free_os_exit")
    assert r.returncode == -6, (r.returncode, r.stderr)
    assert "write after free" in r.stderr, r.stderr


def test_a_double_free_from_another_thread_names_both_frees(shim):
    """glibc would put the block in both threads' tcache lists without a word (its check reads
    the freeing thread's list only)."""
    r = _run(shim, "double_free_other_thread")
    assert r.returncode == -6, (r.returncode, r.stderr)
    assert r.stdout == "", r.stdout
    m = re.search(r"double free of a 24-byte block at \S+ \(pid \d+, seen by thread (\d+)\)\n"
                  r"  freed by thread (\d+):\n", r.stderr)
    assert m and m.group(1) != m.group(2), r.stderr
    assert f"freed again by thread {m.group(1)}:" in r.stderr, r.stderr


def test_without_abort_reports_are_counted_and_written_to_the_folder(shim, tmp_path):
    r = _run(shim, "double_free_other_thread", QUARANTINE_ABORT="0", QUARANTINE_STATS="1",
             QUARANTINE_DIR=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["live-block-contents!"], r.stdout
    (report,) = tmp_path.glob("quarantine.*.txt")
    assert report.read_text().startswith("free_quarantine: double free of a 24-byte block")
    (stats,) = tmp_path.glob("stats.*.txt")
    assert ", 1 reports" in stats.read_text(), stats.read_text()


def test_quarantine_max_zero_holds_nothing_back(shim, tmp_path):
    r = _run(shim, "clean", QUARANTINE_MAX="0", MORE_FREES="100", QUARANTINE_STATS="1",
             QUARANTINE_DIR=str(tmp_path))
    assert r.returncode == 0 and "free_quarantine" not in r.stderr, (r.returncode, r.stderr)
    assert r.stdout.split() == ["live-block-contents!"], r.stdout
    (stats,) = tmp_path.glob("stats.*.txt")
    assert "held back 0 frees of <= 0 bytes, 0 reports" in stats.read_text()

"""scripts/guard_free.c, the debugging shim for writes into freed tensor memory: a write into a
freed small storage faults in the writer; live storages work as before."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_qcomm.codec.cpu_native import c_compiler

ROOT = Path(__file__).resolve().parents[1]

_PROG = """
import ctypes, sys, torch
t = torch.arange(3, dtype=torch.float32)
addr = t.data_ptr()
print(addr % 4096, float((t * 2).sum()), float(torch.ones(64, 64).sum() * 0), flush=True)
if sys.argv[1] == "after_free":
    del t
ctypes.memset(addr, 0, 4)
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


def _run(shim: Path, mode: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, LD_PRELOAD=str(shim), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", _PROG, mode], env=env, capture_output=True,
                          text=True, timeout=120)


def test_a_live_small_storage_ends_at_its_page_end_and_works(shim):
    r = _run(shim, "live")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["4032", "6.0", "0.0", "written"], r.stdout  # 4096 - 64


def test_a_write_into_a_freed_small_storage_faults_in_the_writer(shim):
    r = _run(shim, "after_free")
    assert r.returncode == -11, (r.returncode, r.stdout, r.stderr)
    assert "written" not in r.stdout

"""fsdp_qcomm.testing.run_ranks: a rank that crashes in native code is reported with its stack."""

from __future__ import annotations

import ctypes

import pytest

from fsdp_qcomm.testing import run_ranks


def _crash_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        ctypes.string_at(0)  # a segfault: no Python exception, no traceback of its own
    return rank


def test_a_segfault_names_the_rank_and_its_stack():
    with pytest.raises(AssertionError) as e:
        run_ranks(_crash_on_rank_1, 2, timeout=120)
    msg = str(e.value)
    assert "failed on rank(s) [1]" in msg and "exited with code -11" in msg, msg
    assert "Fatal Python error: Segmentation fault" in msg, msg
    assert "in _crash_on_rank_1" in msg, msg  # the crashing frame, from faulthandler

"""fsdp_qcomm.testing.run_ranks: a rank that crashes in native code is reported with its stack."""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import pytest

from fsdp_qcomm import testing
from fsdp_qcomm.testing import GLOO_HANG_FRAME, NativeCrash, crash_note, run_ranks

ROOT = Path(__file__).resolve().parents[1]


def _crash_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        ctypes.string_at(0)  # a segfault: no Python exception, no traceback of its own
    return rank


def test_a_segfault_names_the_rank_and_its_stack():
    with pytest.raises(AssertionError) as e:
        run_ranks(_crash_on_rank_1, 2, timeout=120, native_crash_reruns=0)
    msg = str(e.value)
    assert "failed on rank(s) [1]" in msg and "exited with code -11 (SIGSEGV)" in msg, msg
    assert "Fatal Python error: Segmentation fault" in msg, msg
    assert "in _crash_on_rank_1" in msg, msg  # the crashing frame, from faulthandler


def _crash_in_second_case(rank: int, world: int) -> int:
    for case in ("first case", "second case"):
        crash_note(case)
        if rank == 1 and case == "second case":
            ctypes.string_at(0)
    return rank


def test_a_crash_report_names_the_case_the_rank_was_running():
    """A loop of cases in one rank (tests/test_weight_writes.py's _all_cases) crashes in one of
    them: the report carries the latest note only, ahead of faulthandler's stacks."""
    with pytest.raises(AssertionError) as e:
        run_ranks(_crash_in_second_case, 2, timeout=120, native_crash_reruns=0)
    msg = str(e.value)
    assert "failed on rank(s) [1]" in msg and "exited with code -11 (SIGSEGV)" in msg, msg
    assert "last crash_note: second case\nFatal Python error: Segmentation fault" in msg, msg
    assert "first case" not in msg, msg
    crash_note("outside a rank: does nothing")


def _abort_on_rank_0(rank: int, world: int) -> int:
    import os

    import torch.distributed as dist

    dist.barrier()
    if rank == 0:
        os.abort()  # what glibc does on a corrupted heap ("malloc(): ... detected")
    dist.barrier()  # rank 1: "Connection reset by peer", reported through the queue
    return rank


def test_a_rank_killed_by_a_signal_is_reported_beside_the_peer_error_it_caused():
    """The peer's error (its connection reset) may reach the launcher first; the rank that died
    of the signal must still be reported, with its signal and faulthandler's stack: without it
    the cause of a crash is lost (a CI run once showed only the peer's gloo error)."""
    with pytest.raises(AssertionError) as e:
        run_ranks(_abort_on_rank_0, 2, timeout=180, pg_timeout=120, native_crash_reruns=0)
    msg = str(e.value)
    assert "failed on rank(s) [0" in msg, msg
    assert "exited with code -6 (SIGABRT)" in msg, msg
    assert "Fatal Python error: Aborted" in msg and "in _abort_on_rank_0" in msg, msg


def _pid_and_modules(rank: int, world: int) -> tuple:
    import os
    import sys

    # what the forkserver preloaded: present before this function imported anything
    return os.getppid(), all(m in sys.modules for m in ("torch.distributed.fsdp",
                                                        "torch._dynamo", "fsdp_qcomm"))


def _fails_in_case(rank: int, world: int, case: str) -> str:
    import torch.distributed as dist

    if case == "bad" and rank == 0:
        raise ValueError(f"case {case} fails on purpose")
    dist.barrier()  # the peers block here until the launcher stops them
    return case


def test_groups_share_one_preloaded_server_and_a_failure_names_its_case_only():
    """Every run_ranks call forks its ranks from one forkserver that imported FSDP2, DTensor,
    torch._dynamo and fsdp_qcomm once (what makes a group of ranks start in ~0.3 s); a
    failing case is reported with its own name and error, and the next case on the same
    server runs clean: nothing of the failed group survives into it."""
    first = run_ranks(_pid_and_modules, 2, timeout=120)
    assert all(preloaded for _, preloaded in first), first
    with pytest.raises(AssertionError) as e:
        run_ranks(_fails_in_case, 2, "bad", timeout=120)
    msg = str(e.value)
    # rank 0's error first; its peer, whose barrier broke, may report too
    assert "_fails_in_case failed on rank(s) [0" in msg and "case bad fails" in msg, msg
    assert msg.index("--- rank 0 ---") < msg.index("case bad fails"), msg
    assert run_ranks(_fails_in_case, 2, "good", timeout=120) == ["good", "good"]
    again = run_ranks(_pid_and_modules, 2, timeout=120)
    assert {p for p, _ in again} == {p for p, _ in first}  # the same server forked them


def _crash_once(rank: int, world: int, marker: str) -> int:
    import os

    if rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        ctypes.string_at(0)
    return rank


def _count_and_fail(rank: int, world: int, counter: str) -> int:
    if rank == 1:
        with open(counter, "a") as f:
            f.write("x")
        raise ValueError("a Python error")
    return rank


def test_a_native_crash_is_rerun_once_warned_and_logged(tmp_path, monkeypatch):
    """CI's setting (FSDP_QCOMM_NATIVE_CRASH_RERUNS=1): a crash that does not repeat passes on
    the rerun, with a warning and the crash's full report in FSDP_QCOMM_RERUN_LOG."""
    log = tmp_path / "reruns.txt"
    monkeypatch.setenv("FSDP_QCOMM_NATIVE_CRASH_RERUNS", "1")
    monkeypatch.setenv("FSDP_QCOMM_RERUN_LOG", str(log))
    with pytest.warns(RuntimeWarning, match="died of a native crash; rerun 1 of 1"):
        assert run_ranks(_crash_once, 2, str(tmp_path / "crashed"), timeout=120) == [0, 1]
    text = log.read_text()
    assert text.count("=== ") == 1 and "_crash_once): a rank died of a native crash" in text
    assert "exited with code -11 (SIGSEGV)" in text and "in _crash_once" in text, text


def test_a_crash_that_repeats_or_a_python_error_is_never_hidden(tmp_path, monkeypatch):
    monkeypatch.setenv("FSDP_QCOMM_NATIVE_CRASH_RERUNS", "1")
    # its own log: CI's (.ci/run) must list real reruns only, not this deliberate one
    monkeypatch.setenv("FSDP_QCOMM_RERUN_LOG", str(tmp_path / "reruns.txt"))
    with pytest.warns(RuntimeWarning), pytest.raises(NativeCrash, match="SIGSEGV"):
        run_ranks(_crash_on_rank_1, 2, timeout=120)  # crashes on the rerun too
    assert (tmp_path / "reruns.txt").read_text().count("=== ") == 1  # the one rerun
    counter = tmp_path / "attempts"
    with pytest.raises(AssertionError, match="a Python error") as e:
        run_ranks(_count_and_fail, 2, str(counter), timeout=120)
    assert not isinstance(e.value, NativeCrash) and counter.read_text() == "x"  # no rerun
    with pytest.raises(NativeCrash):  # off by default (and by argument)
        monkeypatch.delenv("FSDP_QCOMM_NATIVE_CRASH_RERUNS")
        run_ranks(_crash_once, 2, str(tmp_path / "crashed"), timeout=120)
    monkeypatch.setenv("FSDP_QCOMM_NATIVE_CRASH_RERUNS", "once")
    with pytest.raises(ValueError, match="FSDP_QCOMM_NATIVE_CRASH_RERUNS='once'"):
        run_ranks(_crash_once, 2, "unused", timeout=120)


# ---- a run that stalls: examined before its ranks are killed ---------------------------------
_RECORDED_HANG = (ROOT / "results" / "gloo_stress_pair" / "hang_B1" /
                  "gdb_threads_rank1_pid32099.txt")


def _stall_on_rank_1(rank: int, world: int, spin: bool) -> int:
    """Rank 1 never arrives at the barrier; with ``spin`` a thread named like gloo's worker
    spins in it meanwhile (issue 30's hang as /proc shows it: a busy gloo worker thread)."""
    import threading
    import time

    import torch.distributed as dist

    if rank == 1:
        if spin:
            def busy() -> None:
                ctypes.CDLL(None).prctl(15, b"pt_gloo_runloop", 0, 0, 0)  # PR_SET_NAME
                while True:
                    pass

            threading.Thread(target=busy, daemon=True).start()
        time.sleep(3600)
    dist.barrier()
    return rank


def test_a_deadlock_fails_once_with_the_stalled_ranks_native_state(monkeypatch):
    """An ordinary deadlock (a rank that never arrives): not rerun, and the report says what
    each stalled rank was doing (native stacks when gdb is here)."""
    with pytest.raises(AssertionError) as e:
        run_ranks(_stall_on_rank_1, 2, False, timeout=6, native_crash_reruns=1)
    assert not isinstance(e.value, NativeCrash), str(e.value)
    msg = str(e.value)
    assert "did not finish within 6 s" in msg and "rank 1 (pid" in msg, msg
    assert "gloo hang" not in msg, msg
    if shutil.which("gdb"):
        assert "Thread " in msg and "#0 " in msg, msg


def test_issue_30s_gloo_hang_is_rerun_like_a_native_crash(monkeypatch, tmp_path):
    """A stalled rank in gloo's UnboundBuffer destructor (the frame recorded in
    results/gloo_stress_pair) makes the run a NativeCrash, rerun once and warned about; without
    gdb, a gloo worker thread spinning in a stalled rank is that hang."""
    recorded = _RECORDED_HANG.read_text()
    assert GLOO_HANG_FRAME in recorded
    monkeypatch.setattr(testing, "_native_stacks", lambda pid: recorded)
    log = tmp_path / "reruns.txt"  # not CI's own log: these reruns are staged
    monkeypatch.setenv("FSDP_QCOMM_RERUN_LOG", str(log))
    with pytest.warns(RuntimeWarning, match="a rank hung in issue 30's gloo hang; rerun 1 of 1"):
        with pytest.raises(NativeCrash, match="issue 30's gloo hang"):
            run_ranks(_stall_on_rank_1, 2, False, timeout=6, native_crash_reruns=1)
    text = log.read_text()
    assert text.count("=== ") == 1 and GLOO_HANG_FRAME in text, text
    monkeypatch.setattr(testing, "_native_stacks", lambda pid: "")  # no gdb
    with pytest.raises(NativeCrash, match="issue 30's gloo hang") as e:
        run_ranks(_stall_on_rank_1, 2, True, timeout=6, native_crash_reruns=0)
    assert "no native stacks" in str(e.value), str(e.value)
    with pytest.raises(AssertionError) as e:  # nothing spins: an ordinary deadlock
        run_ranks(_stall_on_rank_1, 2, False, timeout=6, native_crash_reruns=0)
    assert not isinstance(e.value, NativeCrash), str(e.value)

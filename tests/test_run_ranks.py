"""fsdp_qcomm.testing.run_ranks: results and errors come back, a rank that dies (in native code
too) is reported with its signal and stack, a hang ends in a timeout error, and every gloo group
of a rank runs one worker thread."""

from __future__ import annotations

import ctypes

import pytest

from fsdp_qcomm.testing import GLOO_THREADS, crash_note, gloo_threads, run_ranks


def _crash_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        ctypes.string_at(0)  # a segfault: no Python exception, no traceback of its own
    return rank


def test_a_segfault_names_the_rank_and_its_stack():
    with pytest.raises(AssertionError) as e:
        run_ranks(_crash_on_rank_1, 2, timeout=120)
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
        run_ranks(_crash_in_second_case, 2, timeout=120)
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
        run_ranks(_abort_on_rank_0, 2, timeout=180, pg_timeout=120)
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


def test_spawned_ranks_are_started_by_the_caller_not_the_forkserver():
    """``spawn=True`` (ranks that use CUDA): each rank is started by the caller itself, not
    forked from the forkserver (whose imports may have touched the CUDA driver)."""
    import os

    assert {ppid for ppid, _ in run_ranks(_pid_and_modules, 2, timeout=120, spawn=True)} == {
        os.getpid()}


def _stall_on_rank_1(rank: int, world: int) -> int:
    """Rank 1 never arrives at the barrier."""
    import time

    import torch.distributed as dist

    if rank == 1:
        time.sleep(3600)
    dist.barrier()
    return rank


def _never_runs(rank: int, world: int, arg) -> int:
    return rank


def test_a_rank_that_cannot_start_leaves_no_crash_folder(tmp_path, monkeypatch):
    """An argument that does not pickle fails in ``Process.start``, after the first rank may
    have started: the started ranks are stopped and the crash folder removed (it used to stay
    in the temporary folder)."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(TypeError, match="run_ranks: argument 0 does not pickle"):
        run_ranks(_never_runs, 2, lambda: None, timeout=60)
    assert list(tmp_path.iterdir()) == []


def test_a_deadlock_fails_with_a_timeout_naming_the_ranks_that_never_finished():
    """Rank 1 never arrives, so rank 0 waits in the barrier too: both are named."""
    with pytest.raises(AssertionError) as e:
        run_ranks(_stall_on_rank_1, 2, timeout=6)
    msg = str(e.value)
    assert "_stall_on_rank_1: rank(s) [0, 1] did not finish within 6 s" in msg, msg


def _gloo_groups(rank: int, world: int) -> dict:
    import warnings
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_qcomm.fsdp import internals

    groups = {
        "world": dist.group.WORLD,
        "new_group": dist.new_group(list(range(world))),
        "new_group(gloo)": dist.new_group(list(range(world)), backend="gloo"),
        "new_group(local)": dist.new_group([rank], use_local_synchronization=True),
        "mesh": init_device_mesh("cpu", (world,)).get_group(),
    }
    t = torch.ones(1)
    for g in groups.values():
        dist.all_reduce(t, group=g)
    with warnings.catch_warnings():
        # a gloo backend that torch's isinstance checks missed would be skipped with a warning
        warnings.simplefilter("error")
        # torch 2.15 deprecates the function itself (set_timeout replaces it): not the point
        warnings.filterwarnings("ignore", message=".*_set_pg_timeout. is deprecated",
                                category=FutureWarning)
        c10d._set_pg_timeout(timedelta(seconds=77))
    cpu = torch.device("cpu")
    return {name: (gloo_threads(g), dist.get_backend(g), internals.sequence_number(g),
                   isinstance(g._get_backend(cpu), dist.ProcessGroupGloo),
                   isinstance(g._get_backend(cpu), c10d.ProcessGroupGloo))
            for name, g in groups.items()} | {"timeout": _timeout_s(dist.group.WORLD)}


def _timeout_s(group) -> float:
    import torch

    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def test_every_gloo_group_of_a_rank_runs_one_worker_thread():
    """ProcessGroupGloo's two worker threads race on a shared status string and now and then
    free it twice (docs/known_issues.md): run_ranks gives every gloo group one worker, the
    default group, new_group subgroups (with backend="gloo" named too) and DeviceMesh groups
    alike, and they stay plain gloo groups: the backend is called "gloo", sequence numbers
    count, torch's isinstance checks hold (its _set_pg_timeout reaches them)."""
    assert GLOO_THREADS == 1
    for got in run_ranks(_gloo_groups, 2, timeout=120):
        assert got.pop("timeout") == 77.0, got
        for name, (threads, backend, seq, is_gloo, is_patched) in got.items():
            assert (threads, backend, is_gloo, is_patched) == (1, "gloo", True, True), (name, got)
            assert seq >= 1, (name, got)


def test_digest_tells_tensors_apart_bit_for_bit_in_any_shape():
    """``testing.digest``: 0-dim tensors (a step-counter buffer) included; the sign of a zero
    counts; the layout does not."""
    import torch

    from fsdp_qcomm.testing import digest

    assert digest(torch.tensor(1.0)) == digest(torch.tensor([1.0]))  # the same bytes
    assert digest(torch.tensor(1.0)) != digest(torch.tensor(2.0))
    assert digest(torch.tensor(3, dtype=torch.int64)) != digest(torch.tensor(4))
    assert digest(torch.tensor(0.0)) != digest(torch.tensor(-0.0))
    assert digest(torch.ones(2, 3).t()) == digest(torch.ones(3, 2))

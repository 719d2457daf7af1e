"""scripts/gloo_stress.py, issue 30's crash path in plain torch: it counts what it ran, and a
rank that dies in native code is reported by its signal, never as a pass."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gloo_stress.py"
PARAMS = 27  # TinyLM's distinct parameters: the tied head is the embedding's


def _run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([sys.executable, str(SCRIPT), "--seconds", "0.01", "--extra", "3",
                           "--out", str(tmp_path), *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)
    lines = (tmp_path / "gloo_stress.jsonl").read_text().splitlines()
    return proc, json.loads(lines[-1])


def test_a_run_counts_its_iterations_and_gathers_and_imports_nothing_of_ours(tmp_path):
    proc, line = _run(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert line["exitcodes"] == [0, 0] and line["signals"] == [None, None]
    assert line["iterations"] == 1  # stops after the first iteration past --seconds
    assert line["gathers_per_rank"] == line["iterations"] * (PARAMS + 3)
    assert line["fsdp_qcomm_loaded"] is False  # what crashes here is torch's or gloo's
    assert line["gloo_threads"] == 2  # torch's default


@pytest.mark.long  # another 2-rank start-up: the A/B arm, not the hunt
def test_one_gloo_worker_thread_runs_the_same_iterations(tmp_path):
    """--gloo-threads 1: gloo built with one worker (the ranks check the group they got)."""
    proc, line = _run(tmp_path, "--gloo-threads", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert line["gloo_threads"] == 1 and line["iterations"] == 1
    assert line["gathers_per_rank"] == PARAMS + 3 and line["fsdp_qcomm_loaded"] is False


@pytest.mark.long  # a second 2-rank start-up (~12 s): the report path, not the hunt
def test_a_rank_that_dies_of_a_signal_fails_the_run_and_is_named(tmp_path):
    proc, line = _run(tmp_path, "--crash-rank", "1", "--seconds", "600")
    assert proc.returncode == 1
    assert line["signals"][1] == "SIGSEGV" and line["exitcodes"][1] == -11
    # rank 0 fails in its next collective (the peer closed) or is ended by the launcher
    assert line["exitcodes"][0] != 0 and line["killed_after_a_rank_died"] in ([], [0])
    assert "iterations" not in line
    assert "Fatal Python error: Segmentation fault" in proc.stderr


def test_a_stopped_launcher_takes_its_ranks_with_it(tmp_path):
    """SIGTERM to the launcher (a loop stopped by hand) ends its ranks too: none keeps running
    its collectives for the rest of --seconds."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--seconds", "600", "--report", "1"],
                            stdout=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    assert proc.stdout.readline().startswith("iteration 1:")  # ranks are up and gathering
    children = _children(proc.pid)
    assert len(children) >= 2
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 30
    while any(_alive(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [c for c in children if _alive(c)]


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                         text=True).stdout
    return [int(x) for x in out.split()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.long  # a 2-rank start-up and a 4 s stall: the report path, not the hunt
def test_a_run_that_stalls_is_reported_with_each_ranks_native_state(tmp_path):
    """A rank stops after its first iteration: the launcher sees no progress for --stall-seconds,
    writes each live rank's threads (gdb) beside the log and ends the run as failed; an ordinary
    stall is not issue 30's gloo hang."""
    proc, line = _run(tmp_path, "--stall-rank", "1", "--stall-seconds", "4", "--seconds", "600")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert line["stalled_after_s"] >= 4 and line["stalled_at_iterations"] == [1, 1]
    assert line["gloo_hang"] is False and sorted(line["killed_after_the_stall"]) == [0, 1]
    assert line["signals"] == ["SIGKILL", "SIGKILL"] and "iterations" not in line
    reports = sorted(tmp_path.glob("stall_*_rank*.txt"))
    assert [r.name[-9:] for r in reports] == ["rank0.txt", "rank1.txt"], reports
    if shutil.which("gdb"):
        assert "Thread " in reports[1].read_text()


@pytest.mark.long  # two 2-rank start-ups: the reproducer's report, not the hunt
@pytest.mark.parametrize("threads", [2, 1])
def test_the_status_race_reproducer_counts_its_collectives(tmp_path, threads):
    """scripts/gloo_status_race.py: rounds of in-flight all-gathers on gloo's default two
    workers or on one, counted."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gloo_status_race.py"),
                           "--seconds", "0.01", "--inflight", "3", "--gloo-threads",
                           str(threads), "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = json.loads((tmp_path / "gloo_status_race.jsonl").read_text().splitlines()[-1])
    assert line["exitcodes"] == [0, 0] and line["gloo_threads"] == threads
    assert line["rounds"] == 200  # the first stop check comes after 200 rounds
    assert line["collectives_per_rank"] == 600

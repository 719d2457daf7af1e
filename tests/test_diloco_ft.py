"""DiLoCo over torchft (``fsdp_qcomm.diloco.ft``): replica processes, an in-process lighthouse.

Each replica group is its own process (or processes: ``group_size``) running
``tests/_ft_worker.py``: a torchft ``Manager`` on fsdp-qcomm's ``ProcessGroupGloo`` and
``DiLoCo(replicas=manager)`` (2 fragments, one all-reduce overlapping one inner step, 4-bit
outer gradients with error feedback). What is checked, from the JSON lines each rank writes
at every merge:

* two healthy replicas commit the same manager steps with bit-identical start-of-round
  weights and, after each merge, bit-identical parameters of the merged fragment;
* a replica that dies inside an all-reduce: the survivor's commit fails (its local progress is
  kept, not reset), it goes on alone, and the restarted replica heals at the survivor's next
  sync point, contributes weight 0 to that sync (it holds the survivor's state), and from
  then on both hold bit-identical weights at every commit.

Skipped without torchft (``pip install fsdp-qcomm[ft]``). The kill/restart test costs two
Python start-ups; ``FSDP_QCOMM_FT_FSDP=1`` adds the same test with FSDP2 groups of 2 ranks.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torchft")
from torchft.coordination import LighthouseServer  # noqa: E402

from fsdp_qcomm.testing import free_port  # noqa: E402

WORKER = Path(__file__).with_name("_ft_worker.py")
ROOT = WORKER.parents[1]


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            pass
    return out


class _Replica:
    """The processes of one replica group (``group_size`` ranks sharing a fresh store)."""

    def __init__(self, tmp: Path, index: int, lighthouse: str, group_size: int,
                 tag: str, **args) -> None:
        self.index = index
        self.port = free_port()
        self.outs = [tmp / f"r{index}g{g}.jsonl" for g in range(group_size)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1",
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in args.items()]
        self.procs = [
            subprocess.Popen(
                [sys.executable, str(WORKER), f"--replica={index}", f"--group-rank={g}",
                 f"--group-size={group_size}", f"--lighthouse={lighthouse}",
                 f"--port={self.port}", f"--out={self.outs[g]}", *flags],
                stdout=open(tmp / f"r{index}g{g}_{tag}.log", "w"), stderr=subprocess.STDOUT,
                env=env)
            for g in range(group_size)]

    def events(self, g: int = 0, kind: str = "") -> list[dict]:
        return [e for e in _read(self.outs[g]) if not kind or e["event"] == kind]

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
            p.wait()

    def wait(self, deadline: float) -> list[int]:
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(-999)
        return codes


def _logs(tmp: Path) -> str:
    return "\n".join(f"--- {p.name}\n" + p.read_text()[-3000:] for p in sorted(tmp.glob("*.log")))


def _commits(events: list[dict]) -> dict[int, dict]:
    return {e["step"]: e for e in events if e["event"] == "commit"}


def test_two_replicas_commit_identical_weights(tmp_path):
    lh = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=100)
    try:
        reps = [_Replica(tmp_path, i, lh.address(), 1, "a", stop_step=7) for i in (0, 1)]
        deadline = time.monotonic() + 300
        codes = [c for r in reps for c in r.wait(deadline)]
    finally:
        lh.shutdown()
    assert codes == [0, 0], _logs(tmp_path)
    c0, c1 = (_commits(r.events()) for r in reps)
    # the start-up commit is step 1; 6 outer steps (3 per fragment) follow
    assert sorted(c0) == sorted(c1) == list(range(2, 8))
    for s in c0:
        a, b = c0[s], c1[s]
        assert a["n"] == b["n"] == 2 and a["fragment"] == b["fragment"] == (s - 2) % 2
        assert a["weight"] == b["weight"] == 1 and a["total_weight"] == 2
        assert a["globals"] == b["globals"] and a["params"] == b["params"]
        assert a["params_are_global"] and b["params_are_global"]
        assert a["loss"] != b["loss"]  # each replica trains on its own data
    done = [r.events(kind="done")[0]["stats"] for r in reps]
    for s in done:
        assert s["outer_steps"] == 6 and s["failed_commits"] == 0
        assert s["outer_cross_node_bytes_per_inner_step"] > 0
    started = [r.events(kind="started")[0] for r in reps]
    assert sum(e["healed"] for e in started) <= 1  # torchft's init_sync: one heals from the other


def _kill_and_rejoin(tmp_path: Path, group_size: int) -> None:
    """Replica 1 exits inside its 3rd all-reduce; it is restarted 1 s later."""
    lh = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=200,
                          heartbeat_timeout_ms=1500)
    stop = tmp_path / "stop"
    go = tmp_path / "go"
    common = dict(stop_step=10_000, stop_file=stop, go_file=go, sleep=0.05)
    t0 = time.monotonic()
    try:
        r0 = _Replica(tmp_path, 0, lh.address(), group_size, "a", **common)
        r1 = _Replica(tmp_path, 1, lh.address(), group_size, "a", die_at_sync=3, **common)
        while not all(r.events(g, "manager_ready") for r in (r0, r1) for g in range(group_size)):
            assert time.monotonic() - t0 < 240, _logs(tmp_path)
            time.sleep(0.1)
        go.touch()  # both Managers heartbeat before either asks for a quorum
        r1.wait(time.monotonic() + 240)
        died = time.monotonic()
        assert r1.procs[0].returncode == 17, _logs(tmp_path)
        time.sleep(1.0)
        old = {g: len(r1.events(g)) for g in range(group_size)}
        restarted = time.time()
        r1 = _Replica(tmp_path, 1, lh.address(), group_size, "b", **common)
        while True:  # stop 4 commits after the restarted replica's first one
            new = r1.events(0)[old[0]:]
            first = [e for e in new if e["event"] == "commit"]
            if first:
                stop.write_text(str(first[0]["step"] + 4))
                break
            assert time.monotonic() - died < 300, _logs(tmp_path)
            time.sleep(0.05)
        deadline = time.monotonic() + 300
        codes = r0.wait(deadline) + r1.wait(deadline)
    finally:
        for r in ("r0", "r1"):
            if r in locals():
                locals()[r].kill()
        lh.shutdown()
    assert codes == [0] * (2 * group_size), _logs(tmp_path)
    for g in range(group_size):
        ev0 = r0.events(g)
        ev1 = r1.events(g)[old[g]:]  # the restarted process
        fails = [e for e in ev0 if e["event"] == "failed"]
        # the survivor's all-reduce failed with its peer: no commit, local progress kept
        assert len(fails) == 1 and not fails[0]["params_are_global"]
        alone = [e for e in ev0 if e["event"] == "commit" and e["n"] == 1]
        assert alone, "the survivor went on alone while its peer restarted"
        start = [e for e in ev1 if e["event"] == "started"][0]
        assert start["healed"] and start["step"] > 1
        c0, c1 = _commits(ev0), _commits(ev1)
        assert c1 and set(c1) <= set(c0)
        assert sorted(c1) == list(range(min(c1), max(c0) + 1))  # every commit since rejoining
        for s, b in c1.items():
            a = c0[s]
            assert a["n"] == b["n"] == 2 and a["globals"] == b["globals"]
            assert a["params"] == b["params"] and a["quorum"] == b["quorum"]
        # the sync it joined counts the survivor's pseudo-gradient once: the healed replica
        # holds the survivor's state and contributes weight 0
        join = c1[min(c1)]
        assert join["weight"] == 0 and join["total_weight"] == 1 == c0[min(c1)]["total_weight"]
        assert all(e["weight"] == 1 and e["total_weight"] == 2
                   for s, e in c1.items() if s > min(c1))
        # nothing committed by the survivor was lost: its steps run on without a gap
        assert sorted(c0) == list(range(2, max(c0) + 1))
        done0 = r0.events(g, "done")[0]["stats"]
        assert done0["failed_commits"] == 1
        at = {e["event"]: e["t_wall"] - restarted for e in ev1 if e["event"] != "commit"}
        solo = [e for e in ev0 if e["event"] == "commit" and e["n"] == 1]
        print(f"\n[group rank {g}] survivor: failed commit at manager step {fails[0]['step']} "
              f"(inner step {fails[0]['t']}), first commit alone "
              f"{solo[0]['t_wall'] - fails[0]['t_wall']:.2f} s later, {len(solo)} commits "
              f"alone; restarted replica: python started {at['imported_python']:.1f} s after "
              f"the restart, torch/torchft/fsdp_qcomm imported {at['imported']:.1f} s, Manager "
              f"ready {at['manager_ready']:.1f} s, healed at manager step {start['step']} "
              f"(inner step {start['t']}) {at['started']:.1f} s, first commit "
              f"{join['t_wall'] - restarted:.1f} s (weight {join['weight']}, total "
              f"{join['total_weight']}); {len(c1)} commits identical to the survivor's")


@pytest.mark.long
def test_replica_dies_in_allreduce_and_rejoins(tmp_path):
    _kill_and_rejoin(tmp_path, 1)


@pytest.mark.skipif(os.environ.get("FSDP_QCOMM_FT_FSDP") != "1",
                    reason="set FSDP_QCOMM_FT_FSDP=1 (FSDP2 replica groups of 2 ranks: 4 "
                           "processes, then 2 restarted)")
def test_fsdp_replica_group_dies_and_rejoins(tmp_path):
    _kill_and_rejoin(tmp_path, 2)

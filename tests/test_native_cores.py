"""scripts/native_cores.sh and scripts/repeat_module.sh, the crash-hunting scripts: collectors
that run at the same time each get their own processes' cores, the last one to leave restores
the kernel's core_pattern, and a repeat loop resumes where its log stopped."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATTERN = Path("/proc/sys/kernel/core_pattern")

_COLLECT = """
source "$ROOT/scripts/native_cores.sh"
cores_start "$DIR" || exit 3
touch "$DIR.started"
while [[ ! -e "$GO" ]]; do sleep 0.1; done  # both collectors are in before either crashes
"$PY" -c "import os; print(os.getpid(), flush=True); os.kill(os.getpid(), 11)" > "$DIR.pid"
for _ in $(seq 50); do compgen -G "$DIR/core.*" > /dev/null && break; sleep 0.1; done
ls "$DIR" > "$DIR.cores"
touch "$DIR.done"
while [[ ! -e "$STOP" ]]; do sleep 0.1; done  # both have their cores before either leaves
cores_stop
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("gdb") is None or
                    shutil.which("flock") is None, reason="needs root, gdb and flock")
def test_two_collectors_at_once_each_get_their_own_cores(tmp_path):
    before = PATTERN.read_text()
    go, stop = tmp_path / "go", tmp_path / "stop"
    procs, dirs = [], [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        env = dict(os.environ, ROOT=str(ROOT), DIR=str(d), GO=str(go), STOP=str(stop),
                   PY=sys.executable)
        procs.append(subprocess.Popen(["bash", "-c", _COLLECT], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    try:
        _wait_for([Path(f"{d}.started") for d in dirs], procs)
        assert "core_route.sh" in PATTERN.read_text()
        go.touch()
        _wait_for([Path(f"{d}.done") for d in dirs], procs)
        for d in dirs:
            pid = Path(f"{d}.pid").read_text().split()[0]
            assert re.fullmatch(rf"core\.{pid}\.\S+python\S*",
                                Path(f"{d}.cores").read_text().strip()), (
                d, pid, Path(f"{d}.cores").read_text())
        stop.touch()
        for p in procs:
            out, _ = p.communicate(timeout=60)
            assert p.returncode == 0, out
    finally:
        stop.touch()
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert PATTERN.read_text() == before  # the last to leave restored it


_HOLD = """
source "$SCRIPTS/native_cores.sh"
cores_start "$DIR" || exit 3
cat /proc/sys/kernel/core_pattern > "$DIR.tmp" && mv "$DIR.tmp" "$DIR.pattern"
while [[ ! -e "$STOP" ]]; do sleep 0.1; done
cores_stop
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("gdb") is None or
                    shutil.which("flock") is None, reason="needs root, gdb and flock")
def test_a_live_collector_from_another_checkout_keeps_its_handler(tmp_path):
    """A loop collecting from another checkout (a clone in /tmp) is live: a collector from this
    one neither replaces its handler nor leaves its own behind; the last to leave restores."""
    before = PATTERN.read_text()
    other = tmp_path / "clone" / "scripts"
    other.mkdir(parents=True)
    for name in ("native_cores.sh", "core_route.sh"):
        shutil.copy2(ROOT / "scripts" / name, other / name)
    stop, held = tmp_path / "stop", tmp_path / "held"
    env = dict(os.environ, SCRIPTS=str(other), DIR=str(held), STOP=str(stop))
    proc = subprocess.Popen(["bash", "-c", _HOLD], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for([Path(f"{held}.pattern")], [proc])
        handler = Path(f"{held}.pattern").read_text()
        # the clone's handler, or one that was live before the test (a hunt loop's): kept
        assert "core_route.sh" in handler and PATTERN.read_text() == handler
        ours = subprocess.run(
            ["bash", "-c", f'source "{ROOT}/scripts/native_cores.sh"; cores_start '
             f'"{tmp_path}/ours" || exit 3; cat {PATTERN}; cores_stop; cat {PATTERN}'],
            capture_output=True, text=True, timeout=60)
        assert ours.returncode == 0, ours.stdout + ours.stderr
        assert ours.stdout == handler * 2, (ours.stdout, handler)
        stop.touch()
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
    finally:
        stop.touch()
        if proc.poll() is None:
            proc.kill()
    assert PATTERN.read_text() == before


def _wait_for(paths: list[Path], procs: list[subprocess.Popen], timeout: float = 60) -> None:
    t0 = time.monotonic()
    while not all(p.exists() for p in paths):
        dead = [p for p in procs if p.poll() is not None]
        assert not dead, dead[0].communicate()[0]
        assert time.monotonic() - t0 < timeout, [p for p in paths if not p.exists()]
        time.sleep(0.1)


def test_repeat_module_resumes_where_its_log_stopped(tmp_path):
    module = tmp_path / "test_trivial.py"
    module.write_text("def test_ok():\n    assert 1 + 1 == 2\n")
    out = tmp_path / "out"

    def loop(n: int) -> str:
        r = subprocess.run(["bash", str(ROOT / "scripts" / "repeat_module.sh"), sys.executable,
                            str(module), str(n), str(out)], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr
        return (out / "test_trivial.log").read_text()

    loop(2)
    log = loop(3).splitlines()
    runs = [ln.split(":")[0] for ln in log if ln.startswith("run ")]
    assert runs == ["run 1", "run 2", "run 3"], log
    assert "resuming at run 3 of 3 (2 of 2 passed)" in log
    assert log[-1] == "3 of 3 runs passed"
    assert not (out / ".run.txt").exists()

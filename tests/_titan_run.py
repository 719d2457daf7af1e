"""What the torchtitan 0.2.2 and 0.3 tests share: skipping a module whose torchtitan is not
installed, running stock ``torchtitan.train`` under torchrun on CPU, and reading what the run
left (the summary file, TensorBoard scalars)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # this checkout's fsdp_qcomm
    sys.path.insert(0, str(REPO_ROOT))


def require_adapter(adapter: str) -> None:
    """Skip the calling test module unless the torchtitan ``adapter`` is made for (and
    tokenizers) is installed."""
    pytest.importorskip("torchtitan")
    pytest.importorskip("tokenizers")
    from fsdp_qcomm.titan_common.version import TorchtitanVersionError, require_torchtitan

    try:
        require_torchtitan(adapter)
    except TorchtitanVersionError as e:
        pytest.skip(f"{adapter} tests: {e}", allow_module_level=True)


def import_error(module: str) -> str:
    """The error importing ``module`` raises in a fresh interpreter (asserts that it fails)."""
    proc = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True,
                          text=True, cwd=str(REPO_ROOT))
    assert proc.returncode != 0, f"importing {module} did not fail"
    return proc.stderr.strip().splitlines()[-1]


def run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run a torchrun command on CPU with this checkout first on the ranks' path; raise with
    the log on failure."""
    from fsdp_qcomm.titan_common.launch import child_env

    env = child_env()
    env["FSDP_QCOMM_DEVICE"] = "cpu"  # CPU even where a GPU exists: the tests are about wiring
    proc = subprocess.run(
        cmd, env=env, cwd=str(REPO_ROOT), capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0 and not _aborted_at_exit(proc):
        raise AssertionError(
            f"torchrun failed ({proc.returncode}): {' '.join(cmd)}\n"
            f"--- stdout (tail)\n{proc.stdout[-6000:]}\n--- stderr (tail)\n{proc.stderr[-6000:]}"
        )
    return proc


#: torchtitan's last log line, after ``destroy_process_group`` (rank 0 logs it)
_FINISHED = "Process group destroyed"
#: the gloo abort at interpreter exit (docs/known_issues.md, "gloo aborts a process at exit")
_EXIT_ABORT = "terminate called without an active exception"


def _aborted_at_exit(proc: subprocess.CompletedProcess) -> bool:
    """Whether the only failure is torch's known gloo abort at interpreter exit: rank 0 logged
    the end of training and of the process group (so every rank ran every collective), and a
    rank then died with that abort. Stock ``torchtitan.train`` keeps its model alive through
    ``destroy_process_group``, so the example's workaround cannot apply; the callers check
    what the run wrote as usual."""
    out = proc.stdout + proc.stderr
    return _FINISHED in out and _EXIT_ABORT in proc.stderr


def read_summary(dump: Path) -> dict:
    from fsdp_qcomm.titan_common.comm_stats import SUMMARY_FILE

    path = dump / SUMMARY_FILE
    assert path.exists(), f"no {path}"
    return json.loads(path.read_text())


def tensorboard_scalars(dump: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = sorted(dump.rglob("events.out.tfevents.*"))
    assert events, f"no TensorBoard events under {dump}"
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}

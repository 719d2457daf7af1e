"""torchrun helper of the torchtitan 0.3 tests; importing it skips the module unless
torchtitan 0.3.x (and tokenizers) are installed."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

pytest.importorskip("torchtitan")
pytest.importorskip("tokenizers")

from fsdp_qcomm.titan_common.version import (  # noqa: E402
    TorchtitanVersionError,
    require_torchtitan,
)

try:
    require_torchtitan("fsdp_qcomm.titan03")
except TorchtitanVersionError as e:
    pytest.skip(f"torchtitan 0.3 tests: {e}", allow_module_level=True)


def torchrun(config: str, dump: Path, *extra: str, nproc: int = 2, replicas: int = 1,
             timeout: float = 300) -> subprocess.CompletedProcess:
    """Run stock ``torchtitan.train --module fsdp_qcomm.titan03`` under torchrun on CPU; raise
    with the log on failure."""
    from fsdp_qcomm.titan03.main import torchrun_command
    from fsdp_qcomm.titan_common.launch import child_env

    env = child_env()
    env["FSDP_QCOMM_DEVICE"] = "cpu"  # CPU even where a GPU exists: the test is about wiring
    cmd = torchrun_command(config, nproc, dump, list(extra), replicas=replicas, all_ranks=True)
    proc = subprocess.run(
        cmd, env=env, cwd=str(REPO_ROOT), capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"torchrun failed ({proc.returncode}): {' '.join(cmd)}\n"
            f"--- stdout (tail)\n{proc.stdout[-6000:]}\n--- stderr (tail)\n{proc.stderr[-6000:]}"
        )
    return proc

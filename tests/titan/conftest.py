import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

pytest.importorskip("torchtitan")
pytest.importorskip("tokenizers")


def torchrun(
    recipe: Path, dump: Path, *extra: str, nproc: int = 2, timeout: float = 150
) -> subprocess.CompletedProcess:
    """Run stock ``torchtitan.train`` under torchrun on CPU; raise with the log on failure."""
    from fsdp_qcomm.titan.main import child_env, torchrun_command

    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env["PYTHONPATH"]])
    env["FSDP_QCOMM_DEVICE"] = "cpu"  # CPU even where a GPU exists: the test is about wiring
    cmd = torchrun_command(recipe, nproc, None, dump, list(extra), all_ranks=True)
    proc = subprocess.run(
        cmd, env=env, cwd=str(REPO_ROOT), capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"torchrun failed ({proc.returncode}): {' '.join(cmd)}\n"
            f"--- stdout (tail)\n{proc.stdout[-6000:]}\n--- stderr (tail)\n{proc.stderr[-6000:]}"
        )
    return proc

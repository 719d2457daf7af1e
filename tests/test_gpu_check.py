"""``scripts/gpu_check.sh --dry-run``: the GPU check's every step without CUDA (interpreter,
gloo, torch's fake process group), so the script is known to work before a GPU runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _dry_run(tmp_path, *extra: str):
    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--out",
                           str(out), *extra], env=env, capture_output=True, text=True,
                          timeout=900)
    return proc, out


def test_gpu_check_dry_run_of_the_fsdp_steps(tmp_path):
    """The quick tier: the script's environment step and its FSDP2 runs with enable() for
    each preset (the steps that exercise the package's hooks end to end)."""
    proc, out = _dry_run(tmp_path, "--only", "environment,fsdp_hooks")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    steps = json.loads(out.read_text())["steps"]
    assert list(steps) == ["environment", "fsdp_hooks"]
    assert all(s["status"] == "ok" for s in steps.values()), steps
    hooks = steps["fsdp_hooks"]["result"]["presets"]
    assert hooks["sdp4bit"]["modes"]["qwd_diff"] > 0
    assert hooks["baseline"]["kinds"]["weight_allgather"]["bits_per_element"] == 32.0


@pytest.mark.long
def test_gpu_check_dry_run(tmp_path):
    proc, out = _dry_run(tmp_path)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    steps = res["steps"]
    assert list(steps) == ["environment", "kernel_tests", "exactness_sweep", "bandwidth",
                           "fsdp_one_rank", "fsdp_hooks"]
    assert all(s["status"] == "ok" for s in steps.values()), steps
    assert res["dry_run"] is True
    assert steps["kernel_tests"]["result"]["summary"].startswith("3 passed")
    assert steps["exactness_sweep"]["result"]["comparisons"] == 12
    bench = steps["bandwidth"]["result"]
    assert bench["interpret"] and bench["cases"][0]["check"] == "ok"
    one = steps["fsdp_one_rank"]["result"]["presets"]
    assert len(one) == 9 and all(p["weights_equal_unhooked"] for p in one.values())
    hooks = steps["fsdp_hooks"]["result"]["presets"]
    assert hooks["sdp4bit"]["modes"]["qwd_diff"] > 0
    assert hooks["qsdp"]["kinds"]["grad_inter"]["calls"] > 0
    assert "levels_sync" in hooks["W4G4-learned"]["kinds"]
    assert hooks["baseline"]["kinds"]["weight_allgather"]["bits_per_element"] == 32.0
    summary = proc.stdout[proc.stdout.index("step "):]
    for name in steps:
        assert f"{name}" in summary

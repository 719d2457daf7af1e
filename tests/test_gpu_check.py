"""``scripts/gpu_check.sh --dry-run``: the GPU check's every step without CUDA (interpreter,
gloo, torch's fake process group), so the script is known to work before a GPU runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from fsdp_qcomm import QCommConfig

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["environment", "step_cost", "step_profile", "exactness_sweep", "bandwidth", "fsdp_hooks",
         "fsdp_one_rank", "layouts", "four_ranks", "kernel_tests", "tiles"]


def _dry_run(out: Path, *extra: str, env_out: str = "", tmp: Path = None):
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    env.pop("OUT", None)
    if tmp is not None:
        env["TMPDIR"] = str(tmp)
    if env_out:
        env["OUT"] = env_out
    args = ["--out", str(out)] if out else []
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", *args,
                           *extra], env=env, capture_output=True, text=True, timeout=900)


def test_gpu_check_dry_run(tmp_path):
    out, tmp = tmp_path / "out", tmp_path / "tmp"
    tmp.mkdir()
    proc = _dry_run(out, tmp=tmp)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == [
        "COMMANDS.md", "gpu_check.json", "log.txt", "provenance.json", "summary.md"]
    # the steps' scratch folders are gone (they used to stay, one per step and run)
    assert not [p.name for p in tmp.iterdir() if p.name.startswith("gpu_check_")]
    prov = json.loads((out / "provenance.json").read_text())["invocations"]
    assert len(prov) == 1 and "gpu_check" in prov[0]["command"]
    res = json.loads((out / "gpu_check.json").read_text())
    steps = res["steps"]
    assert list(steps) == STEPS  # in order of value
    assert all(s["status"] == "ok" for s in steps.values()), steps
    assert res["dry_run"] is True and res["seconds"] < res["budget"]
    cost = steps["step_cost"]["result"]["rows"]
    assert [(r["world"], r["ranks_per_node"]) for r in cost] == [(8, 1), (64, 8)]
    for r in cost:
        b = r["cross_node_bytes_per_step"]
        # FSDP2's least node-crossing traffic against what the hooks counted: 4-bit weights
        # gathered once (qWD reuses them in backward), 4-bit gradients across nodes
        assert 6 < r["bytes_ratio"] == b["fsdp2"] / b["sdp4bit"] < 12, r["bytes_ratio"]
        for link in r["implied_step_s"]["fsdp2"].values():
            assert link["overlap_s"] <= link["serial_s"]
        # the same step without the change agreement: timed, and its share computed alike
        u = r["unverified"]
        assert u["ms"] > 0 and u["codec_share"] == (u["ms"] - r["fsdp2"]["ms"]) / u["ms"]
    prof = steps["step_profile"]["result"]
    # one rank per node, then 8 (the two-hop paths)
    assert list(prof) == ["fsdp2", "sdp4bit", "fsdp2 tiny W=64", "sdp4bit tiny W=64"]
    for off, on in (("fsdp2", "sdp4bit"), ("fsdp2 tiny W=64", "sdp4bit tiny W=64")):
        assert prof[off]["profile"]["python_top"] == []  # nothing of ours runs without enable
        assert any("weight" in f["function"] or "grad" in f["function"]
                   for f in prof[on]["profile"]["python_top"])
    assert steps["kernel_tests"]["result"]["summary"].startswith("3 passed")
    assert steps["exactness_sweep"]["result"]["comparisons"] == 12
    bench = steps["bandwidth"]["result"]
    assert bench["interpret"] and all(c["check"] == "ok" for c in bench["cases"])
    # the diagnostic row of the dry run's kernels: the 4-bit encoder without random numbers,
    # held against the encoder, with no goal of its own
    diag = [c for c in bench["cases"] if "diagnostic" in c]
    assert [c["case"] for c in diag] == ["quantize 4b g128 sym nearest"]
    assert "goal_met" not in diag[0]
    (d,) = bench["diagnostics"]
    assert d["against"] == "quantize 4b g128 sym stoch"
    assert d["share"] == 1 - d["ms"] / d["against_ms"]
    tiles = steps["tiles"]["result"]["x_clone"]
    assert list(tiles) == ["1024", "2048", "4096"]
    # the dry run's kernels: the 4-bit encoder, without and with the Hadamard rotation, and
    # with it on bf16 gradients (what the hooks hand it with bf16 parameters)
    want = ["quantize 4b g128 sym stoch", "quantize 4b g128 sym stoch +H32",
            "quantize 4b g128 sym stoch +H32 bf16 in"]
    assert all(list(t) == want for t in tiles.values()), tiles
    one = steps["fsdp_one_rank"]["result"]["presets"]
    # every named preset, QSDP's learned levels and sdp4bit on CPU-offloaded shards
    assert list(one) == [*QCommConfig.PRESETS, "W4G4-learned", "sdp4bit offload"]
    assert all(p["weights_equal_unhooked"] for p in one.values())
    hooks = steps["fsdp_hooks"]["result"]["presets"]
    assert hooks["sdp4bit"]["modes"]["qwd_diff"] > 0
    assert hooks["bf16"]["kinds"]["weight_allgather"]["bits_per_element"] == 16.0
    assert "levels_sync" in hooks["lowbit"]["kinds"]
    # CPU-offloaded shards: the agreement ran, on FSDP's device (the GPU's, on a GPU)
    assert hooks["sdp4bit offload"]["modes"]["qwd_diff"] > 0
    assert hooks["sdp4bit offload"]["agreement_on"] == ["cpu"]
    assert hooks["qsdp"]["kinds"]["grad_inter"]["calls"] > 0
    assert "levels_sync" in hooks["W4G4-learned"]["kinds"]
    assert hooks["baseline"]["kinds"]["weight_allgather"]["bits_per_element"] == 32.0
    lay = steps["layouts"]["result"]["layouts"]
    assert lay["hsdp 2x2"]["kinds"]["grad_replica"] > 0
    # the fake backend counts no sequence numbers: HSDP runs, and enable says what it skips
    assert any("counts no sequence numbers" in n for n in lay["hsdp 2x2"]["notes"])
    tp = lay["fsdp x tp 2x2"]["kinds"]
    assert tp["tp_peer_sync"] > 0 and tp["grad_inter"] > 0 and tp["weight_allgather"] > 0
    assert lay["diloco overlap"]["equal_to_in_line"]
    assert lay["diloco overlap"]["outer_allreduce_calls"] == 4
    assert lay["compiled blocks"]["kinds"]["grad_inter"] > 0
    four = steps["four_ranks"]["result"]
    # the Triton kernels (the interpreter, standing in for CUDA) against the C loops, through
    # real collectives between 4 ranks as 2 nodes x 2: the same bits and bytes on every rank
    assert four["collectives"] == {name: {"bits_equal": True, "bytes_equal": True} for name in (
        "grad reduce-scatter float32", "grad reduce-scatter bfloat16",
        "qwd weight gather, node-sharded reference", "replica all-reduce")}
    assert list(four["training"]) == ["sdp4bit", "qsdp", "sdp4bit hsdp 2x2", "fsdp2",
                                      "fsdp2 hsdp 2x2"]
    for name in ("sdp4bit", "qsdp", "sdp4bit hsdp 2x2"):
        row = four["training"][name]
        assert row["same_weights_every_step"] and row["cross_node_bytes"] > 0, row
        assert abs(row["final_loss_gap"]) < 0.02, row
    assert four["training"]["sdp4bit"]["kinds"]["weight_allgather_intra"] > 0  # hop 2
    assert four["training"]["sdp4bit hsdp 2x2"]["kinds"]["grad_replica"] > 0
    assert four["gloo_coalesced_all_gather"] == "the gathered values"  # CPU tensors: fine
    assert four["diloco overlap 2x2"]["equal_to_in_line"]
    assert four["diloco overlap 2x2"]["outer_allreduce_calls"] == 4
    summary = (out / "summary.md").read_text()
    assert all(name in summary for name in STEPS) and "## Step cost" in summary
    assert "| quantize 4b g128 sym nearest |" in summary.split("## Where slow kernels' time")[1]
    assert ("| kernel | TILE 1024 | TILE 2048 | TILE 4096 | own (encoders 4096, others 2048) |"
            in summary)
    assert "== step_cost" in (out / "log.txt").read_text()


def test_gpu_check_keeps_to_its_budget_and_writes_to_out(tmp_path):
    """Steps that no longer fit are recorded as skipped, not started; ``$OUT`` is the
    default destination (the device tool brings that folder back)."""
    # 20.2 s: the first step may start (a step needs 20 s left), and once it has taken a
    # fifth of a second (starting Python and importing torch take more), no other step can
    proc = _dry_run(None, "--budget", "20.2", "--only", "environment,fsdp_hooks,kernel_tests",
                    env_out=str(tmp_path))
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    steps = res["steps"]
    assert list(steps) == ["environment", "fsdp_hooks", "kernel_tests"], steps
    assert steps["environment"]["status"] in ("ok", "timeout"), steps
    skipped = [n for n, s in steps.items() if s["status"] == "skipped"]
    assert skipped == ["fsdp_hooks", "kernel_tests"], steps
    assert all("budget" in steps[n]["error"] for n in skipped)
    assert proc.returncode == 1  # a skipped step is not a passed one

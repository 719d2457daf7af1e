"""torchtitan 0.2.2 integration: [qcomm] TOML section, recipes, and 2-process CPU runs.

Torchrun runs of ~25-45 s each on a 2-core CPU (sdp4bit with a checkpoint, its resume,
a resume without the qcomm entry, baseline with gradient accumulation, validation and
TensorBoard, QSDP with learned levels, sdp4bit as HSDP 2 x 2 on 4 ranks, DiLoCo 2 x 2, DiLoCo
2 x 2 with a mid-round checkpoint, its resume and a resume without the diloco entry; all
marked long); everything else is fast, including the "diloco" checkpoint entry in one process
(a one-rank gloo group, torchtitan's CheckpointManager). The version-free pieces
(figures, data, section generator) are tested in tests/titan_common.
"""

import dataclasses
import math
import re
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared helpers
from _titan_run import (  # noqa: E402
    REPO_ROOT,
    import_error,
    read_summary,
    require_adapter,
    run,
    tensorboard_scalars,
)

require_adapter("fsdp_qcomm.titan")

from _hsdp_run import (  # noqa: E402
    HSDP_FLAGS,
    check_diloco_summary,
    check_hsdp_sdp4bit_summary,
)
from _qcomm_fields import cli_value, field_variants, toml_literal  # noqa: E402

from fsdp_qcomm.config import QCommConfig  # noqa: E402
from fsdp_qcomm.titan import config as qconfig  # noqa: E402
from fsdp_qcomm.titan import recipes  # noqa: E402
from fsdp_qcomm.titan.main import torchrun_command  # noqa: E402

CUSTOM = 'custom_config_module = "fsdp_qcomm.titan.config"'


def parse(tmp_path: Path, toml: str, *cli: str):
    from torchtitan.config import ConfigManager

    path = tmp_path / "job.toml"
    path.write_text(textwrap.dedent(toml))
    return ConfigManager().parse_args(["--job.config_file", str(path), *cli])


# --------------------------------------------------------------------------- [qcomm] section
def test_every_field_parses_from_toml(tmp_path):
    source = qconfig.qcomm_config_class()
    defaults = {
        f.name: f.default for f in dataclasses.fields(source)
        if f.default is not dataclasses.MISSING and f.default is not None
    }
    assert defaults, "the source dataclass has no fields with defaults?"
    body = "\n".join(f"{k} = {toml_literal(v)}" for k, v in defaults.items())
    cfg = parse(tmp_path, f'[job]\n{CUSTOM}\n[qcomm]\npreset = "baseline"\n{body}\n')
    for k, v in defaults.items():
        assert getattr(cfg.qcomm, k) == v, k
    resolved = cfg.qcomm.resolve()
    assert isinstance(resolved, source)
    for k, v in defaults.items():
        assert getattr(resolved, k) == v, k


VARIANTS = field_variants()


# quick tier: every preset (each field's default already parses in the test above); the long
# tier adds every field at each other value
@pytest.mark.parametrize("variant", [
    pytest.param(v, id=v[0], marks=() if v[0].startswith("preset-") else pytest.mark.long)
    for v in VARIANTS])
def test_every_preset_and_field_value_parses_from_toml_and_cli(tmp_path, variant):
    """Each preset, and each QCommConfig field at each other value, through torchtitan
    0.2.2's TOML parser and through its CLI flags: the section resolves to the same config."""
    _, preset, overrides = variant
    expect = QCommConfig.preset(preset, **overrides)
    body = "\n".join(f"{k} = {toml_literal(v)}" for k, v in overrides.items())
    cfg = parse(tmp_path, f'[job]\n{CUSTOM}\n[qcomm]\npreset = "{preset}"\n{body}\n')
    assert cfg.qcomm.resolve() == expect
    flags = [a for k, v in overrides.items() for a in (f"--qcomm.{k}", cli_value(v))]
    cfg = parse(tmp_path, f"[job]\n{CUSTOM}\n", "--qcomm.preset", preset, *flags)
    assert cfg.qcomm.resolve() == expect


def test_cli_overrides_win_over_toml(tmp_path):
    toml = f'[job]\n{CUSTOM}\n[qcomm]\npreset = "baseline"\nseed = 3\n'
    cfg = parse(tmp_path, toml, "--qcomm.seed", "7", "--qcomm.preset", "sdp4bit")
    assert cfg.qcomm.seed == 7 and cfg.qcomm.preset == "sdp4bit"
    assert cfg.qcomm.resolve().seed == 7
    assert parse(tmp_path, toml).qcomm.seed == 3
    # dashes work as well as underscores
    assert parse(tmp_path, toml, "--qcomm.ranks-per-node", "2").qcomm.ranks_per_node == 2


def test_unset_fields_take_the_preset_value(tmp_path):
    cfg = parse(tmp_path, f'[job]\n{CUSTOM}\n[qcomm]\npreset = "sdp4bit"\n')
    assert cfg.qcomm.overrides() == {}
    assert cfg.qcomm.resolve() == qconfig.qcomm_config_class().preset("sdp4bit")


def test_absent_section_defaults_to_baseline(tmp_path):
    cfg = parse(tmp_path, f"[job]\n{CUSTOM}\n")
    assert cfg.qcomm.preset == "baseline"
    assert qconfig.resolve(cfg) == qconfig.qcomm_config_class().preset("baseline")


def test_rejects_unknown_toml_field(tmp_path):
    with pytest.raises(ValueError, match="bogus"):
        parse(tmp_path, f"[job]\n{CUSTOM}\n[qcomm]\nbogus = 1\n")


def test_rejects_unknown_cli_field(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse(tmp_path, f"[job]\n{CUSTOM}\n", "--qcomm.bogus", "1")
    err = capsys.readouterr()
    assert "bogus" in err.out + err.err


def test_rejects_unknown_preset_naming_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match=r"\[qcomm\] preset='nope'.*sdp4bit"):
        parse(tmp_path, f'[job]\n{CUSTOM}\n[qcomm]\npreset = "nope"\n')


def test_rejects_wrong_type_from_toml(tmp_path):
    with pytest.raises(ValueError, match=r"\[qcomm\] seed='3'.*expected int"):
        parse(tmp_path, f'[job]\n{CUSTOM}\n[qcomm]\nseed = "3"\n')
    with pytest.raises(ValueError, match=r"\[qcomm\] grad_hadamard=1.*expected bool"):
        parse(tmp_path, f"[job]\n{CUSTOM}\n[qcomm]\ngrad_hadamard = 1\n")


def test_rejects_out_of_range_value_toml_and_cli(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"\[qcomm\].*weight_bits=99"):
        parse(tmp_path, f"[job]\n{CUSTOM}\n[qcomm]\nweight_bits = 99\n")
    with pytest.raises(SystemExit):
        parse(tmp_path, f"[job]\n{CUSTOM}\n", "--qcomm.weight_bits", "99")
    err = capsys.readouterr()
    assert "weight_bits=99" in err.out + err.err


def test_wrong_adapter_fails_at_import_naming_the_right_one():
    err = import_error("fsdp_qcomm.titan03.config_registry")
    assert err.startswith("fsdp_qcomm.titan_common.version.TorchtitanVersionError: "), err
    assert "fsdp_qcomm.titan03 is the integration for torchtitan >=0.3.0,<0.4, " \
        "but torchtitan 0.2.2 is installed: use fsdp_qcomm.titan instead" in err


def test_debug_job_without_recipes_says_where_they_are(tmp_path, monkeypatch, capsys):
    """An installed package carries no recipes/: the debug job stops before torchrun, saying
    what to do."""
    import fsdp_qcomm.titan.main as job

    monkeypatch.setattr(job, "RECIPES_DIR", tmp_path / "absent")
    assert job.main(["--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert f"no recipe at {tmp_path / 'absent' / 'debug_sdp4bit.toml'}" in err
    assert "pass --recipe PATH" in err


# --------------------------------------------------------------------------- recipes
RECIPE_FILES = sorted((REPO_ROOT / "recipes").glob("*.toml"))


def test_recipes_are_generated_and_up_to_date():
    assert recipes.main(["--check", str(REPO_ROOT / "recipes")]) == 0
    assert len(RECIPE_FILES) == len(recipes.all_recipes())


@pytest.mark.parametrize("path", RECIPE_FILES, ids=lambda p: p.name)
def test_every_recipe_parses_and_resolves(path):
    from torchtitan.config import ConfigManager
    from torchtitan.protocols.train_spec import get_train_spec

    import fsdp_qcomm.titan.register  # noqa: F401  (registers gpt_qcomm)

    cfg = ConfigManager().parse_args(["--job.config_file", str(path)])
    assert cfg.experimental.custom_import == "fsdp_qcomm.titan.register"
    assert cfg.model.name == "gpt_qcomm"
    assert cfg.model.flavor in get_train_spec("gpt_qcomm").model_args
    assert cfg.qcomm.preset in qconfig.preset_names()
    assert cfg.qcomm.resolve() is not None
    flavor, scheme = path.stem.split("_")[-2:] if path.stem.startswith("gpt_") else (
        "debug", path.stem.split("_", 1)[1]
    )
    assert (cfg.model.flavor, cfg.qcomm.preset) == (flavor, scheme)
    # sanity of the batch arithmetic torchtitan asserts at startup (for 8 ranks)
    if cfg.training.global_batch_size > 0:
        assert cfg.training.global_batch_size % (cfg.training.local_batch_size * 8) == 0


# --------------------------------------------------------------------------- torchrun runs
def torchrun(recipe: Path, dump: Path, *extra: str, nproc: int = 2, timeout: float = 150):
    """Stock ``torchtitan.train`` on a TOML recipe under torchrun, on CPU."""
    cmd = torchrun_command(recipe, nproc, None, dump, list(extra), all_ranks=True)
    return run(cmd, timeout)


def short_run(steps: int, validate: bool = False) -> tuple:
    return (
        "--model.flavor", "debug", "--training.steps", str(steps), "--training.seq_len", "64",
        "--training.local_batch_size", "4", "--metrics.log_freq", "1",
        "--lr_scheduler.warmup_steps", "2",
    ) + (
        # validation at seq_len 128 (the recipe's) > training's 64: exercises the RoPE sizing
        ("--validation.freq", "2", "--validation.steps", "2") if validate
        else ("--validation.no-enable",)
    )


#: 2 "nodes" of 1 rank each, so that the gather and the reduce-scatter cross nodes (one node
#: would leave them to FSDP2: only what crosses nodes is quantized)
TWO_NODES = ("--qcomm.ranks_per_node", "1")
SDP4BIT_RUN = (*TWO_NODES,  # the 4-bit inter hop
               "--checkpoint.enable", "--checkpoint.interval", "4", "--checkpoint.folder", "ckpt")
#: what the notes say of that run: which hops are quantized and why, nothing else
SDP4BIT_PLAN = [
    "gradient reduce-scatter: two-level, 8-bit inside then 4-bit across nodes: 2 nodes of 1 "
    "rank(s)",
    "weight all-gather: qwd 4-bit, full reference (one rank per node): 2 nodes of 1 rank(s)",
]


def plan_notes(s: dict) -> list[str]:
    """The run's notes without their module lists, after checking each names every hooked
    module."""
    n = s["hooked_modules"]
    assert all(f" [{n} module(s): " in line for line in s["notes"]), s["notes"]
    return sorted(line.split(" [", 1)[0] for line in s["notes"])


@pytest.fixture(scope="module")
def sdp4bit_run(tmp_path_factory) -> Path:
    """8 steps of recipes/debug_sdp4bit.toml on 2 CPU ranks, checkpointing at step 4."""
    dump = tmp_path_factory.mktemp("sdp4bit") / "out"
    torchrun(REPO_ROOT / "recipes" / "debug_sdp4bit.toml", dump, *short_run(8), *SDP4BIT_RUN)
    return dump


def test_torchrun_two_processes_through_recipe(sdp4bit_run):
    """Stock torchtitan.train with the hooks of the sdp4bit preset: FSDP calls them, the first
    gather of every module (after torchtitan's init on the meta device) is full precision, the
    logged figures match the library's wire formats, and the loss falls."""
    s = read_summary(sdp4bit_run)
    assert s["world_size"] == 2 and s["last_step"] == 8 and s["preset"] == "sdp4bit"
    assert s["installed"] and plan_notes(s) == SDP4BIT_PLAN and s["training_steps"] == 8
    n = s["hooked_modules"]
    assert 0 < n <= s["fsdp_modules"]
    loss = s["loss"]
    assert len(loss) == 8 and all(math.isfinite(x) for x in loss)
    assert sum(loss[-3:]) / 3 < loss[0] - 0.3, loss
    modes = s["gather_modes"]
    assert modes["qwd_full"] == n and modes["qwd_diff"] >= 7 * n and modes["qwd_reuse"] > 0
    assert set(modes) == {"qwd_full", "qwd_diff", "qwd_reuse"}
    cum = s["measured_cumulative"]
    assert cum["weight_calls"] == sum(modes.values())
    assert cum["grad_calls"] == 8 * n  # one reduce-scatter per module and step
    assert cum["weight_sent"] > 0 and cum["grad_sent"] > 0
    assert "grad_intra_sent" not in cum  # one rank per node: the inter-node hop only
    for h in s["history"]:
        # the library's baselines (bytes FSDP would have been handed) equal the reference
        # computed independently from the FSDP parameter groups
        assert h["qcomm/weight_baseline_bytes_per_step"] == h["qcomm/ref_weight_bytes_per_step"]
        assert h["qcomm/grad_baseline_bytes_per_step"] == h["qcomm/ref_grad_bytes_per_step"]
        # 4-bit codes + one fp32 scale per 128 values, on whole Hadamard blocks
        assert 4.25 <= h["qcomm/grad_inter_bits_per_elem"] < 4.26
        assert h["qcomm/grad_bits_per_elem"] == pytest.approx(h["qcomm/grad_inter_bits_per_elem"])
        for kind in ("weight", "grad"):
            assert h[f"qcomm/{kind}_ratio_vs_unquantized"] == pytest.approx(
                h[f"qcomm/{kind}_bits_per_elem"] / 32, rel=1e-12)
    first, late = s["history"][0], s["history"][1:]
    assert first["qcomm/weight_bits_per_elem"] > 16  # full-precision first gathers
    for h in late:
        # 4-bit differences + one fp32 scale per 2048 in forward; backward re-gathers of
        # unchanged weights send nothing, so the average lies between 2 and 4.02 bits
        assert 2.0 <= h["qcomm/weight_bits_per_elem"] < 4.02
        assert h["qcomm/weight_bytes_per_step"] == late[0]["qcomm/weight_bytes_per_step"]
        assert h["qcomm/total_ratio_vs_unquantized"] < 0.15


@pytest.mark.long
def test_checkpoint_resume_is_bit_identical(sdp4bit_run, tmp_path):
    """Resume the sdp4bit run from its step-4 checkpoint: steps 5-8 repeat the uninterrupted
    run exactly. The checkpoint carries the handles' state (``titan/checkpoint.py``): the RNG
    counters continue, and each module's first gather after the load re-assembles the saved
    qWD reference with one full-precision all-gather ("qwd_restore"), then sends differences
    against it as the uninterrupted run did."""
    a = read_summary(sdp4bit_run)
    assert (sdp4bit_run / "ckpt" / "step-4").is_dir()
    dump = tmp_path / "resumed"
    (dump / "ckpt").mkdir(parents=True)
    shutil.copytree(sdp4bit_run / "ckpt" / "step-4", dump / "ckpt" / "step-4")
    torchrun(REPO_ROOT / "recipes" / "debug_sdp4bit.toml", dump, *short_run(8), *SDP4BIT_RUN,
             "--checkpoint.load_step", "4")
    b = read_summary(dump)
    n = b["hooked_modules"]
    assert b["steps_logged"] == [5, 6, 7, 8] and b["training_steps"] == 4
    assert b["gather_modes"].get("qwd_restore") == n and not b["gather_modes"].get("qwd_full")
    assert plan_notes(b) == SDP4BIT_PLAN and b["notes"] == a["notes"]  # nothing added
    la = dict(zip(a["steps_logged"], a["loss"]))
    lb = dict(zip(b["steps_logged"], b["loss"]))
    assert all(lb[s] == la[s] for s in (5, 6, 7, 8)), (la, lb)
    ha = {h["step"]: h for h in a["history"]}
    hb = {h["step"]: h for h in b["history"]}
    for step in (5, 6, 7, 8):
        assert hb[step]["qcomm/grad_bytes_per_step"] == ha[step]["qcomm/grad_bytes_per_step"]
    # step 5 adds the one full-precision re-assembly of the reference
    assert hb[5]["qcomm/weight_bytes_per_step"] > ha[5]["qcomm/weight_bytes_per_step"]
    for step in (6, 7, 8):
        assert hb[step]["qcomm/weight_bytes_per_step"] == ha[step]["qcomm/weight_bytes_per_step"]


@pytest.mark.long
def test_checkpoint_without_qcomm_state_loads_with_exclude(sdp4bit_run, tmp_path):
    """A checkpoint lacking the "qcomm" entry (written before it existed) still loads with
    --checkpoint.exclude_from_loading qcomm: the hooks start fresh, the first gathers send full
    precision, and training continues close to the uninterrupted run."""
    a = read_summary(sdp4bit_run)
    dump = tmp_path / "fresh"
    (dump / "ckpt").mkdir(parents=True)
    shutil.copytree(sdp4bit_run / "ckpt" / "step-4", dump / "ckpt" / "step-4")
    torchrun(REPO_ROOT / "recipes" / "debug_sdp4bit.toml", dump, *short_run(8), *SDP4BIT_RUN,
             "--checkpoint.load_step", "4", "--checkpoint.exclude_from_loading", "qcomm")
    b = read_summary(dump)
    n = b["hooked_modules"]
    assert b["steps_logged"] == [5, 6, 7, 8]
    assert b["gather_modes"]["qwd_full"] == n and not b["gather_modes"].get("qwd_restore")
    la = dict(zip(a["steps_logged"], a["loss"]))
    lb = dict(zip(b["steps_logged"], b["loss"]))
    for step in (5, 6, 7, 8):
        assert abs(lb[step] - la[step]) < 2e-3 * la[step], (la, lb)


@pytest.mark.long
def test_baseline_preset_counts_exactly_with_accumulation_validation_tensorboard(tmp_path):
    """The baseline preset runs the library's plain gather (measured) and FSDP's own
    reduce-scatter (gloo needs enable's SUM switch for it): weights read exactly 1.0 / 32 bits
    with 2 microbatches and held-out passes in between, and TensorBoard gets the figures."""
    dump = tmp_path / "out"
    torchrun(
        REPO_ROOT / "recipes" / "debug_baseline.toml", dump, *short_run(4, validate=True),
        # 16 = 2 microbatches x 4 sequences x 2 ranks: the reference must count both
        "--training.global_batch_size", "16", "--metrics.enable_tensorboard",
    )
    s = read_summary(dump)
    assert s["installed"] and s["world_size"] == 2 and s["microbatches"] == 2
    assert s["gather_modes"] == {"plain": s["measured_cumulative"]["weight_calls"]}
    assert s["training_steps"] == 4
    for h in s["history"]:
        assert h["qcomm/installed"] == 1.0
        assert h["qcomm/weight_bytes_per_step"] == h["qcomm/ref_weight_bytes_per_step"] > 0
        assert h["qcomm/weight_baseline_bytes_per_step"] == h["qcomm/ref_weight_bytes_per_step"]
        assert h["qcomm/weight_ratio_vs_unquantized"] == 1.0
        assert h["qcomm/weight_bits_per_elem"] == 32.0
        assert "qcomm/grad_bytes_per_step" not in h  # FSDP's own reduce-scatter
        assert h["qcomm/total_ratio_vs_unquantized"] == 1.0
    assert all(math.isfinite(x) for x in s["loss"])
    # validation gathered weights too, yet the per-step figures above stayed exact
    assert [v["step"] for v in s["validation"]] == [1, 2, 4]
    tb = tensorboard_scalars(dump)
    for tag in ("qcomm/weight_bytes_per_step", "qcomm/weight_bits_per_elem",
                "qcomm/weight_ratio_vs_unquantized", "qcomm/total_ratio_vs_unquantized"):
        assert {h["step"]: h[tag] for h in s["history"]} == pytest.approx(tb[tag]), tag


@pytest.mark.long
def test_gradient_accumulation_sends_one_weight_exchange_per_step(tmp_path):
    """sdp4bit with 2 microbatches per optimizer step (global batch 16 = 2 x 4 sequences x 2
    ranks; torchtitan reduce-scatters every microbatch; 2 one-rank "nodes"): the first
    gathers send full precision, then qWD sends one difference per module and optimizer step
    (the weights change only in the optimizer step, which every rank agrees on before the
    next forward), the other gathers reuse the reference, and the qcomm: line says so."""
    dump = tmp_path / "out"
    proc = torchrun(REPO_ROOT / "recipes" / "debug_sdp4bit.toml", dump, *short_run(4),
                    *TWO_NODES, "--training.global_batch_size", "16")
    s = read_summary(dump)
    n = s["hooked_modules"]
    assert s["microbatches"] == 2 and s["training_steps"] == 4
    modes = s["gather_modes"]
    assert modes["qwd_full"] == n and modes["qwd_diff"] == 3 * n, modes
    assert modes["qwd_reuse"] >= 4 * n  # the second microbatch's forward, every step
    for h in s["history"][1:]:  # after the full-precision first step
        assert h["qcomm/microbatches"] == 2.0
        assert 4.0 < h["qcomm/weight_sending_bits_per_elem"] < 4.2
        assert h["qcomm/weight_bits_per_elem"] < h["qcomm/weight_sending_bits_per_elem"] / 2
    out = proc.stdout + proc.stderr
    assert "qcomm: [2 microbatches/step] W " in out and "per exchange that sent" in out


@pytest.mark.long
def test_learned_levels_log_their_table_exchange(tmp_path):
    """QSDP with learned levels on both sides (the ``levels_sync`` stats kind, which once
    crashed the first metrics log): the run logs every step, the table refreshes show up as
    overhead in the figures and the total, and the other figures stay exact."""
    dump = tmp_path / "out"
    proc = torchrun(
        REPO_ROOT / "recipes" / "debug_qsdp.toml", dump, *short_run(3), *TWO_NODES,
        "--qcomm.weight_levels", "learned", "--qcomm.grad_levels", "learned",
    )
    s = read_summary(dump)
    assert s["steps_logged"] == [1, 2, 3] and s["qcomm_config"]["weight_levels"] == "learned"
    assert all(math.isfinite(x) for x in s["loss"])
    stats = s["handle_stats"][0]
    assert stats["levels_sync"]["sent_bytes"] == s["measured_cumulative"]["levels_sent"] > 0
    first = s["history"][0]
    assert first["qcomm/levels_bytes_per_step"] > 0
    assert first["qcomm/agreement_bytes_per_step"] > 0  # the change codes, before forwards
    sent = sum(first[f"qcomm/{c}_bytes_per_step"]
               for c in ("weight", "grad", "levels", "agreement"))
    base = first["qcomm/weight_baseline_bytes_per_step"] + \
        first["qcomm/grad_baseline_bytes_per_step"]
    assert first["qcomm/total_ratio_vs_unquantized"] == pytest.approx(sent / base, rel=1e-12)
    for h in s["history"]:
        assert h["qcomm/weight_baseline_bytes_per_step"] == h["qcomm/ref_weight_bytes_per_step"]
        # 8-bit codes, min/scale per 1024, and each row's 256-entry level table
        assert 8.0 < h["qcomm/weight_bits_per_elem"] < 9.0
    assert "  L " in proc.stdout + proc.stderr and "(overhead)" in proc.stdout + proc.stderr


@pytest.mark.long
def test_hsdp_two_replicas_of_two_shards(tmp_path):
    """recipes/debug_sdp4bit.toml as HSDP, 2 replicas x 2 shards on 4 CPU ranks counting as 2
    nodes x 2, with 2 micro-batches per optimizer step (global batch 32 = 2 x 4 sequences x 4
    ranks): the replica all-reduce is quantized and counted (``grad_replica``) once per module
    and optimizer step (the train spec skips it on the first micro-batch), every baseline
    equals the FSDP reference, only the replica hop crosses nodes, the loss falls, and the
    ``qcomm:`` line shows the node-crossing bytes per step."""
    dump = tmp_path / "out"
    proc = torchrun(REPO_ROOT / "recipes" / "debug_sdp4bit.toml", dump,
                    *short_run(6), *HSDP_FLAGS, "--training.global_batch_size", "32",
                    nproc=4, timeout=600)
    check_hsdp_sdp4bit_summary(read_summary(dump), steps=6, microbatches=2)
    out = proc.stdout + proc.stderr
    assert "qcomm: HSDP all-reduce across 2 replicas: once per optimizer step, at the last " \
        "of 2 micro-batches" in out
    assert re.search(r"qcomm: \[2 microbatches/step\] .*  X-node [0-9.]+KiB/step  total x", out)


@pytest.mark.long
def test_tensor_parallel_two_by_two(tmp_path):
    """recipes/debug_sdp4bit.toml with tensor parallelism 2 inside each of 2 nodes (4 CPU
    ranks: FSDP over the 2 data-parallel ranks, torchtitan's TP plan): it trains under sdp4bit,
    and the TP-replicated parameters' reduced gradients are averaged over their TP peers
    (``fsdp.tp_peers``; bit-identity itself: tests/test_tensor_parallel.py)."""
    dump = tmp_path / "out"
    torchrun(REPO_ROOT / "recipes" / "debug_sdp4bit.toml", dump, *short_run(4),
             "--parallelism.tensor_parallel_degree", "2", "--qcomm.ranks_per_node", "2",
             nproc=4, timeout=600)
    s = read_summary(dump)
    assert any("tensor-parallel peers" in n for n in s["notes"]), s["notes"]
    stats = s["handle_stats"][0]  # one handle (one model part)
    assert stats["tp_peer_sync"]["calls"] > 0
    assert stats["grad_inter"]["calls"] > 0  # the data-parallel hop, quantized
    assert s["loss"] and all(math.isfinite(v) for v in s["loss"]), s["loss"]


@pytest.mark.long
def test_pipeline_two_stages_of_two_shards(tmp_path):
    """torchtitan's pipeline parallelism (2 stages, 1F1B, FSDP over 2 ranks per stage, each
    rank its own node): the stages' gathers and reductions are quantized, and the summary
    holds the loss, which only the last stage computes (rank 0's is a placeholder)."""
    dump = tmp_path / "out"
    torchrun(REPO_ROOT / "recipes" / "debug_sdp4bit.toml", dump, *short_run(4, validate=True),
             "--parallelism.pipeline_parallel_degree", "2", *TWO_NODES, nproc=4, timeout=600)
    s = read_summary(dump)
    assert len(s["loss"]) == 4 and all(8 < v < 10 for v in s["loss"]), s["loss"]
    assert s["validation"] and all(8 < v["loss"] < 10 for v in s["validation"]), s["validation"]
    stats = s["handle_stats"][0]
    assert stats["grad_inter"]["calls"] > 0 and stats["weight_allgather"]["calls"] > 0
    assert s["gather_modes"].get("qwd_diff", 0) > 0, s["gather_modes"]


# --------------------------------------------------------------------------- [diloco] section
def test_diloco_section_parses_from_toml_and_cli(tmp_path):
    """[diloco] mirrors DiLoCoConfig: TOML values, CLI flags win, bits = 32 is fp32, off by
    default, and a bad combination is refused naming the section."""
    from fsdp_qcomm.diloco import DiLoCoConfig

    assert parse(tmp_path, f"[job]\n{CUSTOM}\n").diloco.resolve() is None
    cfg = parse(tmp_path, f"""
        [job]
        {CUSTOM}
        [diloco]
        enable = true
        sync_every = 8
        fragments = 2
        bits = 2
        error_feedback = true
        """, "--diloco.outer_lr", "0.5")
    assert cfg.diloco.resolve() == DiLoCoConfig(sync_every=8, fragments=2, bits=2,
                                                error_feedback=True, outer_lr=0.5)
    fp32 = parse(tmp_path, f"[job]\n{CUSTOM}\n[diloco]\nenable = true\nbits = 32\n"
                 "hadamard = false\n").diloco.resolve()
    assert fp32.bits is None
    with pytest.raises(ValueError, match=r"\[diloco\].*multiple of.*fragments"):
        parse(tmp_path, f"[job]\n{CUSTOM}\n[diloco]\nsync_every = 6\nfragments = 4\n")
    with pytest.raises(ValueError, match=r"\[diloco\] bits='4' has type str"):
        parse(tmp_path, f"[job]\n{CUSTOM}\n[diloco]\nbits = '4'\n")


@pytest.mark.long
def test_diloco_two_replicas_of_two_shards(tmp_path):
    """recipes/debug_sdp4bit.toml on 4 CPU ranks as 2 replica groups x 2 shards with
    ``--diloco.enable``: FSDP inside each group only (no per-step replica all-reduce), an
    outer 4-bit all-reduce every 2 steps, its node-crossing bytes on the qcomm line and in
    the summary's history."""
    dump = tmp_path / "out"
    proc = torchrun(REPO_ROOT / "recipes" / "debug_sdp4bit.toml", dump, *short_run(6),
                    *HSDP_FLAGS, "--diloco.enable", "--diloco.sync_every", "2", nproc=4,
                    timeout=300)
    check_diloco_summary(read_summary(dump), proc.stdout + proc.stderr, steps=6, outer_steps=3)


@pytest.mark.long
def test_diloco_counts_no_node_crossing_when_the_replicas_share_a_node(tmp_path):
    """The same layout with all 4 ranks on one node (``--qcomm.ranks_per_node 4``): the outer
    all-reduce still runs, and the driver counts its bytes as staying inside the node, from
    the placement the qcomm handle resolved (it used to count every replica peer as remote)."""
    dump = tmp_path / "out"
    flags = [*HSDP_FLAGS[:-1], "4"]
    assert HSDP_FLAGS[-2] == "--qcomm.ranks_per_node"
    torchrun(REPO_ROOT / "recipes" / "debug_sdp4bit.toml", dump, *short_run(4), *flags,
             "--diloco.enable", "--diloco.sync_every", "2", nproc=4, timeout=300)
    last = read_summary(dump)["history"][-1]
    assert last["diloco/outer_steps"] == 2 and last["diloco/outer_sent_bytes_per_inner_step"] > 0
    assert last["diloco/outer_cross_node_bytes_per_inner_step"] == 0


#: 2 replica groups x 2 shards, an outer sync every 3 steps, a checkpoint every 4: the step-4
#: checkpoint falls mid-round (one inner step after the merge at 3)
DILOCO_CKPT_RUN = (*HSDP_FLAGS, "--diloco.enable", "--diloco.sync_every", "3",
                   "--checkpoint.enable", "--checkpoint.interval", "4",
                   "--checkpoint.folder", "ckpt")


@pytest.fixture(scope="module")
def diloco_ckpt_run(tmp_path_factory) -> tuple[Path, str]:
    """8 steps of DiLoCo 2 x 2 on 4 CPU ranks (sync_every 3), checkpointing at step 4."""
    dump = tmp_path_factory.mktemp("diloco") / "out"
    proc = torchrun(REPO_ROOT / "recipes" / "debug_sdp4bit.toml", dump, *short_run(8),
                    *DILOCO_CKPT_RUN, nproc=4, timeout=600)
    return dump, proc.stdout + proc.stderr


def _resume_diloco(run: Path, dump: Path, *extra: str) -> tuple[dict, str]:
    (dump / "ckpt").mkdir(parents=True)
    shutil.copytree(run / "ckpt" / "step-4", dump / "ckpt" / "step-4")
    proc = torchrun(REPO_ROOT / "recipes" / "debug_sdp4bit.toml", dump, *short_run(8),
                    *DILOCO_CKPT_RUN, "--checkpoint.load_step", "4", *extra, nproc=4,
                    timeout=600)
    return read_summary(dump), proc.stdout + proc.stderr


@pytest.mark.long
def test_diloco_checkpoint_resume_is_bit_identical(diloco_ckpt_run, tmp_path):
    """Resume DiLoCo 2 x 2 from its step-4 checkpoint, mid-round: the "diloco" entry
    (``titan_common.checkpoint.DiLoCoState``) restores the round position, the start-of-round
    weights, the outer momentum and each replica group's own weights and Adam moments (which
    torchtitan's "model" and "optimizer" entries keep one replica's copy of), so steps 5-8
    repeat the uninterrupted run's losses exactly and the outer step count continues (the
    merge at step 6 is the second)."""
    run, out_a = diloco_ckpt_run
    a = read_summary(run)
    check_diloco_summary(a, out_a, steps=8, outer_steps=2)
    assert (run / "ckpt" / "step-4").is_dir()
    b, out_b = _resume_diloco(run, tmp_path / "resumed")
    assert "(built for a checkpoint load)" in out_b
    assert b["steps_logged"] == [5, 6, 7, 8] and b["training_steps"] == 4
    la = dict(zip(a["steps_logged"], a["loss"]))
    lb = dict(zip(b["steps_logged"], b["loss"]))
    assert all(lb[s] == la[s] for s in (5, 6, 7, 8)), (la, lb)
    ha = {h["step"]: h for h in a["history"]}
    hb = {h["step"]: h for h in b["history"]}
    for step, outer in ((5, 1), (6, 2), (7, 2), (8, 2)):
        for h in (ha[step], hb[step]):
            assert (h["diloco/inner_steps"], h["diloco/outer_steps"]) == (step, outer), step


@pytest.mark.long
def test_diloco_checkpoint_loads_without_its_entry_with_exclude(diloco_ckpt_run, tmp_path):
    """``--checkpoint.exclude_from_loading diloco`` (how a checkpoint written before the
    entry existed loads): the outer state starts fresh at the first step, a new round from the
    loaded weights (inner steps count from the resume, the first merge 3 steps later), and
    training goes on."""
    run, _ = diloco_ckpt_run
    b, out_b = _resume_diloco(run, tmp_path / "fresh", "--checkpoint.exclude_from_loading",
                              "diloco")
    assert "(built for a checkpoint load)" not in out_b
    assert b["steps_logged"] == [5, 6, 7, 8] and all(math.isfinite(x) for x in b["loss"])
    hb = {h["step"]: h for h in b["history"]}
    assert [(hb[s]["diloco/inner_steps"], hb[s]["diloco/outer_steps"])
            for s in (5, 6, 7, 8)] == [(1, 0), (2, 0), (3, 1), (4, 1)]


@pytest.mark.long
def test_diloco_with_tensor_parallelism_resumes_bit_identically(tmp_path):
    """2 replica groups x TP 2 (one rank per replica per TP coordinate: no FSDP), an outer
    4-bit all-reduce every 3 steps, a checkpoint at step 4: the run trains, and a resume from
    step 4 repeats steps 5-8 exactly (each TP coordinate's outer state under its own
    ``group_rank`` key, ``diloco.layout``)."""
    tp = ("--parallelism.data_parallel_replicate_degree", "2",
          "--parallelism.tensor_parallel_degree", "2", "--qcomm.ranks_per_node", "2",
          "--diloco.enable", "--diloco.sync_every", "3", "--checkpoint.enable",
          "--checkpoint.interval", "4", "--checkpoint.folder", "ckpt")
    recipe = REPO_ROOT / "recipes" / "debug_sdp4bit.toml"
    run = tmp_path / "run"
    proc = torchrun(recipe, run, *short_run(8), *tp, nproc=4, timeout=600)
    a = read_summary(run)
    check_diloco_summary(a, proc.stdout + proc.stderr, steps=8, outer_steps=2)
    resumed = tmp_path / "resumed"
    (resumed / "ckpt").mkdir(parents=True)
    shutil.copytree(run / "ckpt" / "step-4", resumed / "ckpt" / "step-4")
    proc = torchrun(recipe, resumed, *short_run(8), *tp, "--checkpoint.load_step", "4",
                    nproc=4, timeout=600)
    assert "(built for a checkpoint load)" in proc.stdout + proc.stderr
    b = read_summary(resumed)
    assert b["steps_logged"] == [5, 6, 7, 8]
    assert b["loss"] == a["loss"][4:], (a["loss"], b["loss"])


# --------------------------------------------------------------------------- "diloco" entry
@pytest.fixture
def one_rank_gloo():
    """A one-rank gloo process group in this process (no torchrun): what DiLoCo's replica group
    and DCP need, torn down after the test."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _diloco_trainer(folder: Path, *exclude: str):
    """A plain module with torchtitan's optimizers container and LR schedulers, DiLoCo over a
    one-rank replica group every 3 steps (``install_diloco``), and a torchtitan
    ``CheckpointManager`` (patched by ``fsdp_qcomm.titan.register``) saving every 4 steps."""
    import torch
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.lr_scheduler import build_lr_schedulers
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.config import Checkpoint, LRScheduler

    import fsdp_qcomm.titan.register  # noqa: F401  (patches CheckpointManager)
    from fsdp_qcomm.diloco import DiLoCoConfig
    from fsdp_qcomm.titan_common.diloco import install_diloco

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opts = OptimizersContainer([model], torch.optim.AdamW, {"lr": 3e-2, "weight_decay": 0.1})
    lrs = build_lr_schedulers(opts, LRScheduler(warmup_steps=2), 8)
    dims = type("Dims", (), {"dp_replicate": 1, "pp": 1, "tp": 1, "cp": 1, "ep": 1})()
    driver = install_diloco([model], opts, dims, DiLoCoConfig(
        sync_every=3, bits=None, hadamard=False, outer_lr=0.7, outer_momentum=0.9))
    ckpt = CheckpointManager(
        dataloader=None, model_parts=[model], optimizers=opts, lr_schedulers=lrs, states={},
        checkpoint_config=Checkpoint(enable=True, folder="ckpt", interval=4, keep_latest_k=0,
                                     exclude_from_loading=list(exclude)),
        sd_adapter=None, base_folder=str(folder))
    return model, opts, lrs, driver, ckpt


def _diloco_steps(model, opts, lrs, steps) -> list[float]:
    import torch

    losses = []
    for t in steps:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(t))
        opts.zero_grad()
        loss = (model(x) - x.sum(1, keepdim=True).sin()).pow(2).mean()
        loss.backward()
        opts.step()
        lrs.step()
        losses.append(loss.item())
    return losses


def _outer_state(driver) -> dict:
    e = driver.engine
    f = e.fragments[0]
    momentum = f.optimizer.state.get(f.global_, {}).get("momentum_buffer")
    return {"counters": (e.inner_steps, e.outer_steps), "global": f.global_.clone(),
            "momentum": None if momentum is None else momentum.clone()}


def test_diloco_checkpoint_entry_resumes_mid_round(one_rank_gloo, tmp_path):
    """The "diloco" entry in a torchtitan CheckpointManager (one process, one replica): a
    checkpoint at step 4, mid-round (sync_every 3), loads into a fresh trainer before its first
    step (the engine is built for the load), and steps 5-8 repeat the uninterrupted run's
    losses, counters, start-of-round weights and outer momentum exactly. A checkpoint without
    the entry is refused naming --checkpoint.exclude_from_loading diloco, and loads with it
    (the outer state starts fresh at the first step)."""
    import torch

    from fsdp_qcomm.titan_common.checkpoint import DILOCO_KEY, DiLoCoState

    model, opts, lrs, driver, ckpt = _diloco_trainer(tmp_path / "a")
    assert isinstance(ckpt.states[DILOCO_KEY], DiLoCoState)
    losses = _diloco_steps(model, opts, lrs, range(1, 5))
    ckpt.save(4)
    at4 = _outer_state(driver)
    assert at4["counters"] == (4, 1)
    losses += _diloco_steps(model, opts, lrs, range(5, 9))
    ref = _outer_state(driver)
    ckpt.close()

    model, opts, lrs, driver, ckpt = _diloco_trainer(tmp_path / "a")
    assert ckpt.load() and driver.engine is not None  # built for the load, before any step
    got = _outer_state(driver)
    assert got["counters"] == (4, 1)
    assert torch.equal(got["global"], at4["global"])
    assert torch.equal(got["momentum"], at4["momentum"])
    assert _diloco_steps(model, opts, lrs, range(5, 9)) == losses[4:]
    end = _outer_state(driver)
    assert end["counters"] == ref["counters"] == (8, 2)
    assert torch.equal(end["global"], ref["global"])
    assert torch.equal(end["momentum"], ref["momentum"])
    ckpt.close()

    # a checkpoint without the entry (its step-4 copy with the entry dropped)
    import torch.distributed.checkpoint as dcp

    old = tmp_path / "old" / "ckpt" / "step-4"
    sd = {k: v for k, v in ckpt._flattened_model_states_sd().items() if k != DILOCO_KEY}
    dcp.load(sd, checkpoint_id=str(tmp_path / "a" / "ckpt" / "step-4"))
    dcp.save(sd, checkpoint_id=str(old))
    model, opts, lrs, driver, ckpt = _diloco_trainer(tmp_path / "old")
    with pytest.raises(ValueError, match="--checkpoint.exclude_from_loading diloco"):
        ckpt.load()
    ckpt.close()
    model, opts, lrs, driver, ckpt = _diloco_trainer(tmp_path / "old", DILOCO_KEY)
    assert ckpt.load() and driver.engine is None  # the outer state starts at the first step
    _diloco_steps(model, opts, lrs, range(5, 6))
    fresh = _outer_state(driver)
    assert fresh["counters"] == (1, 0) and fresh["momentum"] is None
    ckpt.close()

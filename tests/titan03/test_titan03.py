"""torchtitan 0.3 integration: the ``qcomm`` section through torchtitan's config manager, the
recipe functions against the TOML recipes they mirror, the CPU attention, and CPU runs under
torchrun: the debug recipe as HSDP, 2 replicas x 2 shards on 4 ranks (with a checkpoint and
its bit-identical resume), QSDP with learned levels on 2 ranks, and DiLoCo over 2 replica
groups x 2 shards (the replicas' weights after every step, a mid-round resume, a resume without
the diloco entry; marked long)."""

import dataclasses
import math
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared helpers
from _titan_run import (  # noqa: E402
    REPO_ROOT,
    import_error,
    read_summary,
    require_adapter,
    run,
    tensorboard_scalars,
)

require_adapter("fsdp_qcomm.titan03")

from _hsdp_run import (  # noqa: E402
    HSDP_FLAGS,
    check_diloco_summary,
    check_hsdp_sdp4bit_summary,
)
from _qcomm_fields import cli_value, field_variants  # noqa: E402

from fsdp_qcomm.config import QCommConfig  # noqa: E402
from fsdp_qcomm.titan03 import config_registry  # noqa: E402
from fsdp_qcomm.titan03.attention import (  # noqa: E402
    DenseMaskAttention,
    eager_block_masks,
    use_dense_attention,
)
from fsdp_qcomm.titan03.main import torchrun_command  # noqa: E402
from fsdp_qcomm.titan03.trainer import QCommTrainer  # noqa: E402
from fsdp_qcomm.titan_common import shapes  # noqa: E402

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

MODULE = "fsdp_qcomm.titan03"


def parse(config: str, *cli: str):
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(["--module", MODULE, "--config", config, *cli])


# --------------------------------------------------------------------------- qcomm section
VARIANTS = field_variants()


@pytest.mark.parametrize("variant", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_every_preset_and_field_value_parses_from_cli(variant):
    """Each preset, and each QCommConfig field at each other value, through torchtitan 0.3's
    config manager (tyro flags on the trainer's Config): the section resolves to the config."""
    _, preset, overrides = variant
    flags = [a for k, v in overrides.items() for a in (f"--qcomm.{k}", cli_value(v))]
    cfg = parse("debug_baseline", "--qcomm.preset", preset, "--qcomm.ranks_per_node", "2",
                *flags)
    assert isinstance(cfg, QCommTrainer.Config)
    expect = QCommConfig.preset(preset, **{"ranks_per_node": 2, **overrides})
    assert cfg.qcomm.resolve() == expect


def test_section_errors_name_the_field(capsys):
    for args, text in (
        (["--qcomm.weight_bits", "99"], "weight_bits=99"),
        (["--qcomm.preset", "nope"], "preset='nope' is not a known preset; known presets: "
                                     "baseline, bf16, sdp4bit, qwd"),
        (["--qcomm.bogus", "1"], "Unrecognized options: --qcomm.bogus"),
        (["--qcomm.preset", "baseline", "--qcomm.grad_hadamard", "True"],
         "grad_hadamard=True needs a quantized gradient scheme"),
        (["--training.no-disable-cuda-graphs"], "set --training.disable_cuda_graphs"),
    ):
        with pytest.raises(SystemExit):
            parse("debug_baseline", *args)
        err = capsys.readouterr()
        # tyro draws the message in a box whose borders split wrapped lines
        flat = re.sub(r"[\u2500-\u257f]", " ", err.out + err.err)
        assert text in " ".join(flat.split()), (args, err.out + err.err)


def test_cli_overrides_win_over_the_recipe():
    cfg = parse("debug_sdp4bit", "--qcomm.seed", "7", "--qcomm.ranks-per-node", "1")
    assert cfg.qcomm.preset == "sdp4bit"
    assert cfg.qcomm.overrides() == {"grad_overlap": True, "ranks_per_node": 1, "seed": 7}
    assert parse("debug_sdp4bit").qcomm.overrides() == {"grad_overlap": True,
                                                        "ranks_per_node": 2}


def test_any_torchtitan_recipe_gets_the_hooks():
    """torchtitan's own llama3 debug recipe as a QCommTrainer.Config: same settings, the qcomm
    section, CUDA graphs off, the qcomm metrics processor with the same logging settings."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from fsdp_qcomm.titan03.metrics import QCommMetricsProcessor

    base = llama3_debugmodel()
    cfg = QCommTrainer.Config.from_trainer_config(base, "sdp4bit", seed=3)
    assert cfg.qcomm.resolve() == QCommConfig.preset("sdp4bit", seed=3)
    assert cfg.model_spec is base.model_spec and cfg.optimizer is base.optimizer
    assert cfg.training.disable_cuda_graphs and cfg.training.steps == base.training.steps
    assert type(cfg.metrics) is QCommMetricsProcessor.Config
    assert cfg.metrics.log_freq == base.metrics.log_freq
    assert type(cfg)._owner is QCommTrainer  # config.build() makes a QCommTrainer


def test_wrong_adapter_fails_at_import_naming_the_right_one():
    err = import_error("fsdp_qcomm.titan.register")
    assert err.startswith("fsdp_qcomm.titan_common.version.TorchtitanVersionError: "), err
    assert "fsdp_qcomm.titan is the integration for torchtitan >=0.2.2,<0.3, " \
        "but torchtitan 0.3.0 is installed: use fsdp_qcomm.titan03 instead" in err


# --------------------------------------------------------------------------- recipes
TOML_RECIPES = sorted((REPO_ROOT / "recipes").glob("*.toml"))


def test_every_toml_recipe_has_a_recipe_function_and_back():
    mapping = config_registry.TOML_COUNTERPARTS
    assert sorted(mapping) == [p.name for p in TOML_RECIPES] and len(mapping) == 29
    # torchtitan's list of the module's configs: the public lower-case callables
    functions = {n for n in dir(config_registry) if not n.startswith("_") and n[0].islower()
                 and callable(getattr(config_registry, n))}
    assert functions == set(mapping.values()) | set(config_registry.ONLY_03)
    readme = (REPO_ROOT / "recipes" / "README.md").read_text()
    for toml, fn in mapping.items():  # the mapping table of recipes/README.md
        assert f"| `{toml}` | `{fn}` |" in readme, toml


def _ac_mode(ac) -> str:
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    return {type(None): "none", SelectiveAC.Config: "selective", FullAC.Config: "full"}[type(ac)]


@pytest.mark.parametrize("path", TOML_RECIPES, ids=lambda p: p.name)
def test_recipe_function_mirrors_its_toml_recipe(path):
    """Same model, scheme, batch, schedule, optimizer, data, validation, logging and seed as the
    torchtitan 0.2.2 TOML file, and it parses through torchtitan 0.3's config manager."""
    t = tomllib.loads(path.read_text())
    cfg = parse(config_registry.TOML_COUNTERPARTS[path.name])
    tr, val = t["training"], t["validation"]
    assert cfg.model_spec.name == "gpt_qcomm" and cfg.model_spec.flavor == t["model"]["flavor"]
    assert cfg.hf_assets_path == t["model"]["hf_assets_path"]
    assert cfg.dump_folder == t["job"]["dump_folder"]
    q = dict(t["qcomm"])
    assert cfg.qcomm.preset == q.pop("preset") and cfg.qcomm.overrides() == q
    assert (cfg.training.local_batch_size, cfg.training.global_batch_size, cfg.training.seq_len,
            cfg.training.steps, cfg.training.max_norm) == (
        tr["local_batch_size"], tr.get("global_batch_size", -1), tr["seq_len"], tr["steps"],
        tr["max_norm"])
    assert cfg.training.mixed_precision_param == tr["mixed_precision_param"]
    assert cfg.training.mixed_precision_reduce == tr["mixed_precision_reduce"]
    assert cfg.training.disable_cuda_graphs
    assert cfg.dataloader.dataset == tr["dataset"]
    (group,) = cfg.optimizer.param_groups
    assert group.optimizer_name == t["optimizer"]["name"]
    for k in ("lr", "eps", "weight_decay"):
        assert group.optimizer_kwargs[k] == t["optimizer"][k], k
    for k in ("warmup_steps", "decay_type", "min_lr_factor"):
        assert getattr(cfg.lr_scheduler, k) == t["lr_scheduler"][k], k
    assert _ac_mode(cfg.activation_checkpoint) == t["activation_checkpoint"]["mode"]
    assert cfg.parallelism.data_parallel_shard_degree == \
        t["parallelism"]["data_parallel_shard_degree"]
    assert cfg.metrics.log_freq == t["metrics"]["log_freq"]
    assert cfg.metrics.enable_tensorboard == t["metrics"]["enable_tensorboard"]
    assert (cfg.validator.enable, cfg.validator.freq, cfg.validator.steps) == (
        val["enable"], val["freq"], val["steps"])
    assert cfg.validator.dataloader.dataset == val["dataset"]
    assert val["seq_len"] == tr["seq_len"] and val["local_batch_size"] == tr["local_batch_size"]
    assert cfg.checkpoint.enable == t["checkpoint"]["enable"]
    assert cfg.checkpoint.interval == t["checkpoint"].get("interval", 500)
    assert cfg.debug.seed == t.get("debug", {}).get("seed")


def test_gpt_model_configs_have_the_paper_shapes():
    from fsdp_qcomm.titan03.models import gpt_model_spec

    for flavor, shape in shapes.GPT_SHAPES.items():
        model = gpt_model_spec(flavor).model
        assert model.dim == shape.dim and model.vocab_size == shape.vocab_size
        assert len(model.layers) == shape.n_layers
        attn = model.layers[0].attention
        assert attn.n_heads == shape.n_heads and attn.rope.theta == shape.rope_theta
        assert model.layers[0].feed_forward.w1.out_features == shape.ffn_hidden
    with torch.device("meta"):
        debug = gpt_model_spec("debug").model.build()
    assert sum(p.numel() for p in debug.parameters()) == shapes.GPT_SHAPES["debug"].param_count()


# --------------------------------------------------------------------------- CPU attention
def _reference_attention(q, k, v, mask, scale):
    s = (q.transpose(1, 2) @ k.transpose(1, 2).transpose(-2, -1)) * scale
    s = s.masked_fill(~mask, float("-inf")).softmax(-1)
    return (s @ v.transpose(1, 2)).transpose(1, 2)


def test_dense_mask_attention_matches_flex_and_trains():
    """Packed documents (positions restart at 0): the dense-mask attention equals FlexAttention
    forward and an explicit masked softmax forward and backward, with and without GQA, and
    returns the log-sum-exp when the caller asks for it."""
    from torch.nn.attention.flex_attention import and_masks, create_block_mask, flex_attention
    from torchtitan.models.common.attention import (
        get_causal_mask_mod,
        get_efficient_causal_mask_mod_for_packed_document,
    )

    torch.manual_seed(0)
    B, L, N, H = 2, 48, 4, 8
    positions = torch.stack([torch.cat([torch.arange(17), torch.arange(31)]),
                             torch.arange(48)])
    mod = and_masks(get_causal_mask_mod(),
                    get_efficient_causal_mask_mod_for_packed_document(positions))
    bm = create_block_mask(mod, B, None, L, L, device="cpu")
    attn = DenseMaskAttention(DenseMaskAttention.Config())
    dense = DenseMaskAttention.dense_mask(bm, L, L, torch.device("cpu"))
    assert dense.shape == (B, 1, L, L)
    assert not dense[0, 0, 20, 5] and dense[0, 0, 20, 17] and dense[1, 0, 20, 5]
    for kv_heads in (N, 2):
        q = torch.randn(B, L, N, H, requires_grad=True)
        k = torch.randn(B, L, kv_heads, H, requires_grad=True)
        v = torch.randn(B, L, kv_heads, H, requires_grad=True)
        gqa = kv_heads != N
        out = attn(q, k, v, attention_masks=bm, enable_gqa=gqa)
        rep = N // kv_heads
        kr, vr = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
        ref = _reference_attention(q, kr, vr, dense, H**-0.5)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        qd, kd, vd = (t.detach().transpose(1, 2) for t in (q, k, v))
        flex = flex_attention(qd, kd, vd, block_mask=bm, enable_gqa=gqa).transpose(1, 2)
        torch.testing.assert_close(out, flex, rtol=1e-5, atol=1e-5)
        g = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), g)
        ref_grads = torch.autograd.grad(ref, (q, k, v), g)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    lse_out = attn(q, k, v, attention_masks=bm, enable_gqa=True,
                   out_transform=lambda o, lse: (o, lse))
    torch.testing.assert_close(lse_out[0], out, rtol=1e-5, atol=1e-5)
    assert lse_out[1].shape == (B, L, N) and torch.isfinite(lse_out[1]).all()


def test_dense_attention_swaps_every_flex_module():
    from torchtitan.models.common import decoder
    from torchtitan.models.common.attention import FlexAttention

    cfg = config_registry.debug_baseline().model_spec.model
    assert use_dense_attention(cfg) == shapes.GPT_SHAPES["debug"].n_layers
    inner = [layer.attention.inner_attention for layer in cfg.layers]
    assert all(type(a) is DenseMaskAttention.Config for a in inner)
    assert all(isinstance(a, FlexAttention.Config) for a in inner)  # masks still get built
    assert use_dense_attention(cfg) == 0
    eager_block_masks()
    assert not eager_block_masks()
    assert decoder.create_attention_mask.__name__ == "_eager_create_attention_mask"


# --------------------------------------------------------------------------- torchrun runs
def torchrun(config: str, dump: Path, *extra: str, nproc: int = 2, timeout: float = 300):
    """Stock ``torchtitan.train --module fsdp_qcomm.titan03`` under torchrun, on CPU."""
    return run(torchrun_command(config, nproc, dump, list(extra), all_ranks=True), timeout)


def short_run(steps: int, *extra: str) -> tuple:
    return ("--training.steps", str(steps), "--training.seq_len", "64",
            "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "2", *extra)


# torchtitan saves the step-3 checkpoint before that step's held-out pass: the resume must
# still be exact (qWD exchanges weights once per optimizer step, held-out pass included)
HSDP_RUN = ("--validator.freq", "3", "--validator.steps", "2", "--metrics.enable_tensorboard",
            "--checkpoint.enable", "--checkpoint.interval", "3", "--checkpoint.folder", "ckpt",
            "--checkpoint.no-last-save-model-only",
            # 2 micro-batches per optimizer step: 2 x 4 sequences x 4 ranks
            "--training.global_batch_size", "32")


@pytest.fixture(scope="module")
def hsdp_run(tmp_path_factory) -> tuple[Path, str]:
    """6 steps of debug_sdp4bit on 4 CPU ranks as 2 replicas x 2 shards (HSDP), the 4 ranks
    being 2 "nodes" x 2 (the recipe's ranks_per_node=2): each shard group lies inside a node,
    the replica all-reduce crosses nodes. 2 micro-batches per step, checkpoint at step 3,
    held-out loss at 1, 3 and 6. Returns the dump folder and the log."""
    dump = tmp_path_factory.mktemp("hsdp") / "out"
    proc = torchrun("debug_sdp4bit", dump, *short_run(6), *HSDP_RUN, *HSDP_FLAGS, nproc=4,
                    timeout=600)
    return dump, proc.stdout + proc.stderr


def test_hsdp_two_replicas_of_two_shards(hsdp_run):
    """The 0.3 debug recipe as HSDP 2 x 2 with 2 micro-batches per step: only the replica
    all-reduce, the hop that crosses nodes, is quantized (4-bit), and QCommTrainer runs it once
    per optimizer step; the weight all-gather and the reduce-scatter stay inside the node,
    unquantized; every figure matches the library's wire formats and the FSDP reference, the
    loss falls, the ``qcomm:`` line shows the node-crossing bytes per step, and the figures
    reach TensorBoard."""
    dump, log = hsdp_run
    s = read_summary(dump)
    check_hsdp_sdp4bit_summary(s, steps=6, microbatches=2)
    assert s["model"] == "gpt_qcomm" and s["flavor"] == "debug"
    assert [v["step"] for v in s["validation"]] == [1, 3, 6]
    assert "qcomm: HSDP all-reduce across 2 replicas: once per optimizer step, at the last " \
        "of 2 micro-batches" in log
    assert re.search(r"qcomm: \[2 microbatches/step\] .*  X-node [0-9.]+KiB/step  total x", log)
    tb = tensorboard_scalars(dump)
    for tag in ("qcomm/weight_bytes_per_step", "qcomm/grad_bits_per_elem",
                "qcomm/replica_bytes_per_step", "qcomm/total_cross_node_bytes_per_step",
                "qcomm/total_ratio_vs_unquantized"):
        assert {h["step"]: h[tag] for h in s["history"]} == pytest.approx(tb[tag]), tag


def test_hsdp_checkpoint_resume_is_bit_identical(hsdp_run, tmp_path):
    """Resume the HSDP run from its step-3 checkpoint, which carries the handles' state under
    "qcomm" (QCommTrainer adds it to the checkpointer's states): steps 4-6 repeat the
    uninterrupted run exactly, losses and bytes, although the uninterrupted run validated at
    step 3 after saving and the resumed one did not."""
    first, _ = hsdp_run
    a = read_summary(first)
    assert (first / "ckpt" / "step-3").is_dir()
    dump = tmp_path / "resumed"
    (dump / "ckpt").mkdir(parents=True)
    shutil.copytree(first / "ckpt" / "step-3", dump / "ckpt" / "step-3")
    torchrun("debug_sdp4bit", dump, *short_run(6), *HSDP_RUN, *HSDP_FLAGS,
             "--checkpoint.load_step", "3", nproc=4, timeout=600)
    b = read_summary(dump)
    assert b["steps_logged"] == [4, 5, 6] and b["training_steps"] == 3
    assert set(b["gather_modes"]) == {"plain"}  # no qWD reference inside a node
    la = dict(zip(a["steps_logged"], a["loss"]))
    lb = dict(zip(b["steps_logged"], b["loss"]))
    assert all(lb[s] == la[s] for s in (4, 5, 6)), (la, lb)
    ha = {h["step"]: h for h in a["history"]}
    hb = {h["step"]: h for h in b["history"]}
    for step in (4, 5, 6):
        for c in ("grad", "replica"):
            assert hb[step][f"qcomm/{c}_bytes_per_step"] == ha[step][f"qcomm/{c}_bytes_per_step"]
    for step in (5, 6):
        assert hb[step]["qcomm/weight_bytes_per_step"] == ha[step]["qcomm/weight_bytes_per_step"]


def test_learned_levels_log_their_table_exchange(tmp_path):
    """QSDP with learned levels on both sides (the ``levels_sync`` stats kind) on 2 ranks: the
    table refreshes show up as overhead in the figures and the total."""
    dump = tmp_path / "out"
    proc = torchrun("debug_qsdp", dump, *short_run(3), "--validator.no-enable",
                    "--qcomm.ranks_per_node", "1",  # 2 one-rank "nodes": the hops cross nodes
                    "--qcomm.weight_levels", "learned", "--qcomm.grad_levels", "learned")
    s = read_summary(dump)
    assert s["steps_logged"] == [1, 2, 3] and s["qcomm_config"]["grad_levels"] == "learned"
    assert all(math.isfinite(x) for x in s["loss"])
    assert s["handle_stats"][0]["levels_sync"]["sent_bytes"] == \
        s["measured_cumulative"]["levels_sent"] > 0
    first = s["history"][0]
    assert first["qcomm/agreement_bytes_per_step"] > 0  # the change codes, before forwards
    sent = sum(first[f"qcomm/{c}_bytes_per_step"]
               for c in ("weight", "grad", "levels", "agreement"))
    base = first["qcomm/weight_baseline_bytes_per_step"] + \
        first["qcomm/grad_baseline_bytes_per_step"]
    assert first["qcomm/levels_bytes_per_step"] > 0
    assert first["qcomm/total_ratio_vs_unquantized"] == pytest.approx(sent / base, rel=1e-12)
    assert "  L " in proc.stdout + proc.stderr and "(overhead)" in proc.stdout + proc.stderr


def test_config_dataclass_fields_are_torchtitans_plus_qcomm_and_diloco():
    from torchtitan.trainer import Trainer

    mine = {f.name for f in dataclasses.fields(QCommTrainer.Config)}
    assert mine == {f.name for f in dataclasses.fields(Trainer.Config)} | {"qcomm", "diloco"}


# --------------------------------------------------------------------------- diloco section
def test_diloco_section_parses_from_cli():
    """The ``diloco`` field mirrors DiLoCoConfig: off by default, CLI flags, bits 32 = fp32,
    and a bad combination is refused naming the section."""
    from fsdp_qcomm.diloco import DiLoCoConfig

    assert parse("debug_sdp4bit").diloco.resolve() is None
    cfg = parse("debug_sdp4bit", "--diloco.sync_every", "8",
                "--diloco.fragments", "2", "--diloco.bits", "2", "--diloco.error_feedback",
                "True", "--diloco.outer_lr", "0.5")
    on = dataclasses.replace(cfg.diloco, enable=True)
    assert on.resolve() == DiLoCoConfig(sync_every=8, fragments=2, bits=2,
                                                error_feedback=True, outer_lr=0.5)
    fp32 = dataclasses.replace(parse("debug_sdp4bit", "--diloco.bits", "32", "--diloco.hadamard",
                                     "False").diloco, enable=True).resolve()
    assert fp32.bits is None
    with pytest.raises((ValueError, SystemExit)):
        parse("debug_sdp4bit", "--diloco.sync_every", "6", "--diloco.fragments", "4")


def test_diloco_enable_parses_and_pipeline_parallelism_is_refused(capsys):
    """``--diloco.enable`` resolves to the DiLoCoConfig the run uses; with pipeline
    parallelism it stops at configuration (tyro prints the error and exits), naming why."""
    from fsdp_qcomm.diloco import DiLoCoConfig

    cfg = parse("debug_sdp4bit", "--diloco.enable", "--diloco.sync_every", "2")
    assert cfg.diloco.resolve() == DiLoCoConfig(sync_every=2)
    with pytest.raises(SystemExit):
        parse("debug_sdp4bit", "--diloco.enable", "--parallelism.pipeline_parallel_degree", "2")
    err = " ".join(capsys.readouterr().err.replace("│", " ").split())
    assert "DiLoCo is wired for data and tensor parallelism only" in err, err


#: DiLoCo over 2 replica groups x TP 2 (each replica group one "node")
TP_DILOCO = ("--parallelism.data_parallel_replicate_degree", "2",
             "--parallelism.tensor_parallel_degree", "2", "--qcomm.ranks_per_node", "2",
             "--diloco.enable", "--diloco.sync_every", "2", "--validator.no-enable")

#: DiLoCo over 2 replica groups x 2 shards (the 4 ranks being 2 "nodes" x 2), an outer 4-bit
#: all-reduce every 2 steps (merges after steps 2, 4, 6), a full checkpoint after every step
DILOCO_RUN = (*HSDP_FLAGS, "--diloco.enable", "--diloco.sync_every", "2",
              "--validator.no-enable", "--checkpoint.enable", "--checkpoint.interval", "1",
              "--checkpoint.folder", "ckpt", "--checkpoint.keep_latest_k", "0",
              "--checkpoint.no-last-save-model-only")


@pytest.fixture(scope="module")
def diloco_run(tmp_path_factory) -> tuple[Path, str]:
    """6 steps of debug_sdp4bit with ``DILOCO_RUN`` on 4 CPU ranks."""
    dump = tmp_path_factory.mktemp("diloco") / "out"
    proc = torchrun("debug_sdp4bit", dump, *short_run(6), *DILOCO_RUN, nproc=4, timeout=600)
    return dump, proc.stdout + proc.stderr


@pytest.mark.long
def test_diloco_two_replicas_of_two_shards(diloco_run):
    """``--diloco.enable`` on 2 replica groups x 2 shards: torchtitan builds its HSDP model and
    the trainer isolates the replica groups (no all-reduce across them at each step, no replica
    figures), an outer 4-bit all-reduce every 2 steps with its node-crossing bytes on the qcomm
    line and in the summary's history, the outer step count after each step, a falling loss."""
    dump, log = diloco_run
    s = read_summary(dump)
    check_diloco_summary(s, log, steps=6, outer_steps=3)
    assert "[diloco] HSDP with its all-reduce across 2 replicas isolated" in log
    assert "DiLoCo: the replica groups train by themselves" in log  # ReplicaSync stays off
    assert [(h["diloco/inner_steps"], h["diloco/outer_steps"]) for h in s["history"]] == \
        [(1, 0), (2, 1), (3, 1), (4, 2), (5, 2), (6, 3)]
    assert all(not h.get("qcomm/replica_bytes_per_step") for h in s["history"])


@pytest.mark.long
def test_diloco_with_tensor_parallelism(tmp_path):
    """``--diloco.enable`` on 2 replica groups x TP 2: torchtitan 0.3 builds HSDP over
    ``dp_replicate`` (one shard rank) with TP inside, the trainer isolates the replicas (3-D
    parameter meshes), DiLoCo places each rank by its TP coordinate (``diloco.layout``) and
    merges after steps 2, 4, 6."""
    dump = tmp_path / "out"
    proc = torchrun("debug_sdp4bit", dump, *short_run(6), *TP_DILOCO, nproc=4, timeout=600)
    log = proc.stdout + proc.stderr
    check_diloco_summary(read_summary(dump), log, steps=6, outer_steps=3)
    assert "[diloco] HSDP with its all-reduce across 2 replicas isolated" in log


def _replica_weights(checkpoint: Path) -> tuple[dict, dict]:
    """Replica groups 0's and 1's own weights in a DCP checkpoint's "diloco" entry
    (``DiLoCoState``: ``diloco.replica{r}.model.<name>``), read whole in this process (what
    ``dcp_to_torch_save`` does, for these keys only)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    heads = [f"diloco.replica{r}.model" for r in (0, 1)]
    sd: dict = {}
    _load_state_dict(sd, storage_reader=FileSystemReader(str(checkpoint)),
                     planner=_EmptyStateDictLoadPlanner(keys=heads), no_dist=True)
    flat: dict = {}

    def walk(prefix: str, tree) -> None:
        if isinstance(tree, dict):
            for k, v in tree.items():
                walk(f"{prefix}{k}.", v)
        else:
            flat[prefix[:-1]] = tree

    walk("", sd)
    return tuple({k[len(h) + 1:]: v for k, v in flat.items() if k.startswith(h + ".")}
                 for h in heads)


@pytest.mark.long
def test_diloco_replicas_identical_after_each_outer_step(diloco_run):
    """The checkpoint after every step holds each replica group's own weights: after the
    steps that end with an outer step (2, 4, 6) the two groups' weights are identical, after
    the others (1, 3, 5) they differ (each group trained on its own data since the merge)."""
    dump, _ = diloco_run
    for step in range(1, 7):
        a, b = _replica_weights(dump / "ckpt" / f"step-{step}")
        assert a and a.keys() == b.keys(), (step, sorted(a)[:3], sorted(b)[:3])
        same = all(torch.equal(a[k], b[k]) for k in a)
        assert same == (step % 2 == 0), step


def _resume_diloco(run: Path, dump: Path, *extra: str) -> tuple[dict, str]:
    (dump / "ckpt").mkdir(parents=True)
    shutil.copytree(run / "ckpt" / "step-3", dump / "ckpt" / "step-3")
    proc = torchrun("debug_sdp4bit", dump, *short_run(6), *DILOCO_RUN,
                    "--checkpoint.load_step", "3", *extra, nproc=4, timeout=600)
    return read_summary(dump), proc.stdout + proc.stderr


@pytest.mark.long
def test_diloco_checkpoint_resume_is_bit_identical(diloco_run, tmp_path):
    """Resume from the step-3 checkpoint, mid-round (one inner step after the merge at 2): the
    "diloco" entry restores the round position, the start-of-round weights, the outer momentum
    and each replica group's own weights and Adam moments (torchtitan's "model" and
    "optimizer" entries keep one replica's copy of each shard), so steps 4-6 repeat the
    uninterrupted run's losses exactly and the outer step count continues."""
    run, _ = diloco_run
    a = read_summary(run)
    b, out_b = _resume_diloco(run, tmp_path / "resumed")
    assert "(built for a checkpoint load)" in out_b
    assert b["steps_logged"] == [4, 5, 6] and b["training_steps"] == 3
    la = dict(zip(a["steps_logged"], a["loss"]))
    lb = dict(zip(b["steps_logged"], b["loss"]))
    assert all(lb[s] == la[s] for s in (4, 5, 6)), (la, lb)
    hb = {h["step"]: h for h in b["history"]}
    assert [(hb[s]["diloco/inner_steps"], hb[s]["diloco/outer_steps"]) for s in (4, 5, 6)] == \
        [(4, 2), (5, 2), (6, 3)]


@pytest.mark.long
def test_diloco_checkpoint_loads_without_its_entry_with_exclude(diloco_run, tmp_path):
    """``--checkpoint.exclude_from_loading diloco``: the outer state starts fresh at the first
    step, a new round from the loaded weights (inner steps count from the resume, the first
    merge 2 steps later), and training goes on."""
    run, _ = diloco_run
    b, out_b = _resume_diloco(run, tmp_path / "fresh", "--checkpoint.exclude_from_loading",
                              "diloco")
    assert "(built for a checkpoint load)" not in out_b
    assert b["steps_logged"] == [4, 5, 6] and all(math.isfinite(x) for x in b["loss"])
    hb = {h["step"]: h for h in b["history"]}
    assert [(hb[s]["diloco/inner_steps"], hb[s]["diloco/outer_steps"]) for s in (4, 5, 6)] == \
        [(1, 0), (2, 1), (3, 1)]


@pytest.mark.long
def test_tensor_parallel_two_by_two(tmp_path):
    """The 0.3 debug recipe with tensor parallelism 2 inside each of 2 "nodes" (4 CPU ranks,
    the recipe's ranks_per_node=2): FSDP over the 2 data-parallel ranks, torchtitan's TP plan;
    it trains under sdp4bit with the TP-replicated parameters' reduced gradients averaged over
    their TP peers (``fsdp.tp_peers``; bit-identity itself: tests/test_tensor_parallel.py)."""
    dump = tmp_path / "out"
    torchrun("debug_sdp4bit", dump, *short_run(4), "--parallelism.tensor_parallel_degree", "2",
             nproc=4, timeout=900)
    s = read_summary(dump)
    assert s["installed"] and s["steps_logged"] == [1, 2, 3, 4]
    assert s["world_size"] == 2  # the data-parallel ranks FSDP shards over
    assert all(math.isfinite(v) for v in s["loss"]), s["loss"]
    assert any("tensor-parallel peers" in n for n in s["notes"]), s["notes"]
    assert s["handle_stats"][0]["tp_peer_sync"]["calls"] > 0


@pytest.mark.long
def test_pipeline_two_stages_of_two_shards(tmp_path):
    """torchtitan 0.3's pipeline parallelism (2 stages, FSDP over 2 ranks per stage, each rank
    its own node): quantized gathers and reductions, and a summary holding the last stage's
    loss and held-out loss (rank 0's are placeholders); the FSDP reference counts one FSDP pass
    per optimizer step, as the schedule reduces once per step (it counted one per pipeline
    microbatch)."""
    dump = tmp_path / "out"
    torchrun("debug_sdp4bit", dump, *short_run(4, "--validator.freq", "2", "--validator.steps",
                                                "2"),
             "--parallelism.pipeline_parallel_degree", "2", "--qcomm.ranks_per_node", "1",
             nproc=4, timeout=900)
    s = read_summary(dump)
    assert len(s["loss"]) == 4 and all(8 < v < 10 for v in s["loss"]), s["loss"]
    assert s["validation"] and all(8 < v["loss"] < 10 for v in s["validation"]), s["validation"]
    stats = s["handle_stats"][0]
    assert stats["grad_inter"]["calls"] > 0 and stats["weight_allgather"]["calls"] > 0
    assert s["microbatches"] == 1


def test_moe_with_expert_parallelism_trains_through_sdp4bit(tmp_path):
    """torchtitan's DeepSeek-V3 debug model with expert parallelism 2 on 4 CPU ranks (2 "nodes"
    x 2), sdp4bit: its parallelize gives each MoE block's experts their own mesh (two parameter
    groups per block), enable quantizes both groups' node-crossing hops, the ``qcomm:`` line
    shows the expert traffic apart (``W:<mesh>``, ``G:<mesh>``), and the loss falls. The token
    dispatch's uneven all-to-all runs through ``titan_common.cpu.uneven_all_to_all`` (gloo's
    list all-to-all takes equal tensors only)."""
    dump = tmp_path / "out"
    proc = torchrun("debug_moe_sdp4bit", dump, "--training.steps", "4", "--metrics.log_freq",
                    "1", nproc=4, timeout=900)
    s = read_summary(dump)
    assert s["installed"] and s["world_size"] == 4 and s["steps_logged"] == [1, 2, 3, 4]
    assert s["loss"][-1] < s["loss"][0], s["loss"]
    notes = " | ".join(s["notes"])
    assert "[group 2/2: 3 params on 2 ranks]" in notes, notes  # the experts' groups
    assert "weight all-gather: qwd 4-bit, full reference (one rank per node): 2 nodes of 1" in \
        notes and "node-sharded reference" in notes, notes  # experts; dense weights
    last = s["history"][-1]
    tagged = sorted(k for k in last if k.startswith("qcomm/weight:") and k.endswith(
        "_bytes_per_step") and "baseline" not in k)
    assert tagged and last[tagged[0]] > 0, sorted(last)
    assert last["qcomm/weight_bytes_per_step"] > 0 and last["qcomm/grad_bytes_per_step"] > 0
    out = proc.stdout + proc.stderr
    assert " W:" in out and " G:" in out, out[-3000:]

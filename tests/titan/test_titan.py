"""torchtitan integration: [qcomm] section, recipes, offline data, and 2-process CPU runs.

Three torchrun runs of ~25-40 s each on a 2-core CPU (sdp4bit with a checkpoint, its resume,
baseline with gradient accumulation, validation and TensorBoard); everything else is fast.
"""

import dataclasses
import json
import math
import shutil
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import pytest
import torch
from conftest import REPO_ROOT, torchrun

from fsdp_qcomm.config import QCommConfig
from fsdp_qcomm.titan import comm_stats, data, recipes
from fsdp_qcomm.titan import config as qconfig
from fsdp_qcomm.titan.models import GPT_FLAVORS, count_params

CUSTOM = 'custom_config_module = "fsdp_qcomm.titan.config"'


def parse(tmp_path: Path, toml: str, *cli: str):
    from torchtitan.config import ConfigManager

    path = tmp_path / "job.toml"
    path.write_text(textwrap.dedent(toml))
    return ConfigManager().parse_args(["--job.config_file", str(path), *cli])


def toml_literal(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


# --------------------------------------------------------------------------- [qcomm] section
def test_section_mirrors_qcomm_config_fields():
    source = qconfig.qcomm_config_class()
    section = {f.name for f in dataclasses.fields(qconfig.QComm)}
    assert section == {"preset"} | {f.name for f in dataclasses.fields(source)}
    assert all(
        f.default is None for f in dataclasses.fields(qconfig.QComm) if f.name != "preset"
    )


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


@pytest.mark.parametrize("preset", qconfig.preset_names())
def test_every_preset_resolves(tmp_path, preset):
    cfg = parse(tmp_path, f'[job]\n{CUSTOM}\n[qcomm]\npreset = "{preset}"\n')
    assert cfg.qcomm.resolve() == qconfig.qcomm_config_class().preset(preset)


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


@dataclass(frozen=True)
class _Toy:
    mode: Literal["a", "b"] = "a"
    bits: int = 4
    frac: float = 0.5
    name: str = "x"
    flag: bool = False
    nodes: Optional[int] = None
    PRESETS = {"p": {}, "q": {"mode": "b"}}

    def __post_init__(self):
        if self.bits > 8:
            raise ValueError("bits too large")

    @classmethod
    def preset(cls, name, **overrides):  # a field is also called "name": resolve must cope
        return cls(**{**cls.PRESETS[name], **overrides})


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(preset="q"), None),
        (dict(preset="p", mode="b", bits=8, frac=1, name="y", flag=True, nodes=2), None),
        (dict(preset="r"), "preset='r' is not a known preset; known presets: p, q"),
        (dict(mode="c"), "mode='c' has type str; expected one of 'a', 'b'"),
        (dict(bits=True), "bits=True has type bool; expected int"),
        (dict(frac="0.5"), "expected float"),
        (dict(flag="yes"), "expected bool"),
        (dict(nodes=1.5), "expected int"),
        (dict(bits=9), "bits too large"),
    ],
)
def test_section_generator_on_a_toy_dataclass(kwargs, error):
    section = qconfig.make_section_class(_Toy)
    kwargs = {"preset": "p", **kwargs}  # the toy has no "baseline" preset
    if error is None:
        s = section(**kwargs)
        expect = dataclasses.replace(_Toy.preset(kwargs["preset"]), **s.overrides())
        assert s.resolve() == expect
    else:
        with pytest.raises(ValueError, match=__import__("re").escape(error)):
            section(**kwargs)


def test_section_is_generated_from_the_library_config():
    assert qconfig.qcomm_config_class() is QCommConfig
    assert qconfig.preset_names() == list(QCommConfig.PRESETS)
    s = qconfig.QComm(preset="qsdp", weight_bits=6, grad_scheme="two_level")
    assert s.resolve() == QCommConfig.preset("qsdp", weight_bits=6, grad_scheme="two_level")
    with pytest.raises(ValueError, match=r"\[qcomm\] preset='baseline' with weight_bits=1.*"
                       r"QCommConfig.weight_bits=1"):
        qconfig.QComm(weight_bits=1)
    with pytest.raises(ValueError, match="grad_hadamard=True needs a quantized gradient"):
        qconfig.QComm(grad_hadamard=True)
    with pytest.raises(ValueError, match=r"weight_scheme='qqq'.*expected one of 'none'"):
        qconfig.QComm(weight_scheme="qqq")


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


def test_paper_flavor_sizes():
    # weights excluding the untied output layer must be near the GPT-3 names
    expect = {"125M": 125e6, "350M": 355e6, "1.3B": 1.3e9, "2.7B": 2.7e9, "6.7B": 6.7e9,
              "13B": 13e9}
    for name, n in expect.items():
        a = GPT_FLAVORS[name]
        tied = count_params(a) - a.vocab_size * a.dim
        assert abs(tied - n) / n < 0.06, (name, tied)
    assert 1e6 <= count_params(GPT_FLAVORS["debug"]) <= 10e6


# --------------------------------------------------------------------------- data
def test_builtin_tokenizer_and_corpus():
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    path = data.resolve_hf_assets_path("fsdp_qcomm:pystdlib_bpe8192")
    tok = HuggingFaceTokenizer(path)
    assert tok.get_vocab_size() == 8192 and tok.bos_id is not None and tok.eos_id is not None
    ids = tok.encode("Return the absolute value.", add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids[1:-1]) == "Return the absolute value."
    meta = json.loads((data.corpus_dir() / "meta.json").read_text())
    assert meta["characters"]["train"] > 500_000 and meta["documents"]["val"] > 20
    with pytest.raises(ValueError, match="unknown built-in tokenizer"):
        data.resolve_hf_assets_path("fsdp_qcomm:nope")
    assert data.resolve_hf_assets_path("/some/dir") == "/some/dir"


def test_pieces_split_at_paragraphs():
    text = "\n\n".join(["a" * 900] * 5)
    pieces = list(data._pieces(text, limit=2048))
    assert "\n\n".join(pieces) == text
    assert all(len(p) <= 2048 for p in pieces) and len(pieces) == 3


def test_local_text_and_jsonl_datasets(tmp_path, monkeypatch):
    monkeypatch.setenv("FSDP_QCOMM_CACHE", str(tmp_path / "cache"))
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.txt").write_text("First para.\nstill first.\n\nSecond para.\n")
    (tmp_path / "t" / "b.txt").write_text("Third.\n")
    ds = data.load_text(str(tmp_path / "t"))
    texts = [r["text"].strip() for r in ds]  # the HF text builder keeps trailing newlines
    assert texts == ["First para.\nstill first.", "Second para.", "Third."]
    (tmp_path / "d.jsonl").write_text('{"text": "x"}\n{"text": "y", "meta": 1}\n')
    assert [r["text"] for r in data.load_jsonl(str(tmp_path / "*.jsonl"))] == ["x", "y"]
    with pytest.raises(FileNotFoundError):
        data.load_text(str(tmp_path / "missing"))
    # registered in torchtitan's table
    from torchtitan.hf_datasets.text_datasets import DATASETS

    data.register_datasets()
    assert {"pystdlib", "pystdlib_val", "text", "jsonl"} <= set(DATASETS)
    with pytest.raises(ValueError, match="needs training.dataset_path"):
        DATASETS["text"].loader("")


# --------------------------------------------------------------------------- stats parsing
def _kind(calls, sent, recv, elements, baseline):
    return {"calls": calls, "sent_bytes": sent, "recv_bytes": recv, "elements": elements,
            "baseline_bytes": baseline, "bits_per_element": 8.0 * sent / elements,
            "ratio_vs_baseline": sent / baseline}


def test_split_stats_real_format_counts_the_grad_baseline_once():
    stats = {
        "weight_allgather": _kind(4, 1000, 4000, 2000, 8000),
        "grad_intra": _kind(2, 300, 300, 400, 1600),
        "grad_inter": _kind(2, 100, 100, 200, 1600),
        "notes": ["something"],
    }
    assert comm_stats.split_stats(stats) == {
        "weight_calls": 4, "weight_sent": 1000, "weight_recv": 4000, "weight_elements": 2000,
        "weight_baseline": 8000,
        "grad_calls": 2, "grad_sent": 400, "grad_recv": 400, "grad_baseline": 1600,
        "grad_intra_sent": 300, "grad_intra_elements": 400,
        "grad_inter_sent": 100, "grad_inter_elements": 200,
    }
    # one level (or one hop of a degenerate layout): that hop alone
    one = comm_stats.split_stats({"grad_inter": _kind(1, 50, 50, 100, 400), "notes": []})
    assert (one["grad_sent"], one["grad_baseline"]) == (50, 400) and "weight_sent" not in one
    assert comm_stats.split_stats({"notes": []}) == {}
    with pytest.raises(ValueError, match=r"kinds \['all_reduce'\].*extend split_stats"):
        comm_stats.split_stats({"all_reduce": _kind(1, 1, 1, 1, 1), "notes": []})


class _Handle:
    def __init__(self):
        self.s = {"notes": []}

    def stats(self):
        return self.s


def test_tracker_figures_per_step_and_total():
    """Counters over 2 steps -> per-step bytes, bits, ratios; an unmeasured kind is FSDP's own."""
    part = torch.nn.Linear(2, 2)
    h = _Handle()
    setattr(part, comm_stats.ATTACHMENT_ATTR, comm_stats.QCommAttachment(None, "x", handle=h))
    t = comm_stats.CommTracker()
    t.reference = comm_stats.Reference(weight_bytes=8000, weight_elements=2000,
                                       grad_bytes=16000, grad_elements=4000)
    h.s = {"weight_allgather": _kind(2, 500, 1000, 2000, 8000), "notes": []}
    t.figures(1, 1, [part], 1)
    h.s = {"weight_allgather": _kind(6, 1500, 3000, 6000, 24000), "notes": []}
    f = t.figures(3, 3, [part], 1)  # 2 steps later: 1000 bytes sent, 16000 baseline
    assert f["qcomm/weight_bytes_per_step"] == 500
    assert f["qcomm/weight_baseline_bytes_per_step"] == 8000
    assert f["qcomm/weight_bits_per_elem"] == 2.0
    assert f["qcomm/weight_ratio_vs_unquantized"] == 500 / 8000
    assert "qcomm/grad_bytes_per_step" not in f  # FSDP's own reduce-scatter: not measured
    assert f["qcomm/total_ratio_vs_unquantized"] == (500 + 16000) / (8000 + 16000)
    assert "W 500B/step of 7.8KiB 2.00b/el x0.062  G FSDP's own" in comm_stats.format_figures(f)


# --------------------------------------------------------------------------- torchrun runs
def _summary(dump: Path) -> dict:
    path = dump / comm_stats.SUMMARY_FILE
    assert path.exists(), f"no {path}"
    return json.loads(path.read_text())


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


SDP4BIT_RUN = ("--qcomm.ranks_per_node", "1",  # 2 "nodes" of 1 rank: the 4-bit inter hop
               "--checkpoint.enable", "--checkpoint.interval", "4", "--checkpoint.folder", "ckpt")


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
    s = _summary(sdp4bit_run)
    assert s["world_size"] == 2 and s["last_step"] == 8 and s["preset"] == "sdp4bit"
    assert s["installed"] and s["notes"] == [] and s["optimizer_steps"] == 8
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


def test_checkpoint_resume_is_bit_identical(sdp4bit_run, tmp_path):
    """Resume the sdp4bit run from its step-4 checkpoint: steps 5-8 repeat the uninterrupted
    run exactly. The checkpoint carries the handles' state (``titan/checkpoint.py``): the RNG
    counters continue, and each module's first gather after the load re-assembles the saved
    qWD reference with one full-precision all-gather ("qwd_restore"), then sends differences
    against it as the uninterrupted run did."""
    a = _summary(sdp4bit_run)
    assert (sdp4bit_run / "ckpt" / "step-4").is_dir()
    dump = tmp_path / "resumed"
    (dump / "ckpt").mkdir(parents=True)
    shutil.copytree(sdp4bit_run / "ckpt" / "step-4", dump / "ckpt" / "step-4")
    torchrun(REPO_ROOT / "recipes" / "debug_sdp4bit.toml", dump, *short_run(8), *SDP4BIT_RUN,
             "--checkpoint.load_step", "4")
    b = _summary(dump)
    n = b["hooked_modules"]
    assert b["steps_logged"] == [5, 6, 7, 8] and b["optimizer_steps"] == 4
    assert b["gather_modes"].get("qwd_restore") == n and not b["gather_modes"].get("qwd_full")
    assert b["notes"] == []
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


def test_checkpoint_without_qcomm_state_loads_with_exclude(sdp4bit_run, tmp_path):
    """A checkpoint lacking the "qcomm" entry (written before it existed) still loads with
    --checkpoint.exclude_from_loading qcomm: the hooks start fresh, the first gathers send full
    precision, and training continues close to the uninterrupted run."""
    a = _summary(sdp4bit_run)
    dump = tmp_path / "fresh"
    (dump / "ckpt").mkdir(parents=True)
    shutil.copytree(sdp4bit_run / "ckpt" / "step-4", dump / "ckpt" / "step-4")
    torchrun(REPO_ROOT / "recipes" / "debug_sdp4bit.toml", dump, *short_run(8), *SDP4BIT_RUN,
             "--checkpoint.load_step", "4", "--checkpoint.exclude_from_loading", "qcomm")
    b = _summary(dump)
    n = b["hooked_modules"]
    assert b["steps_logged"] == [5, 6, 7, 8]
    assert b["gather_modes"]["qwd_full"] == n and not b["gather_modes"].get("qwd_restore")
    la = dict(zip(a["steps_logged"], a["loss"]))
    lb = dict(zip(b["steps_logged"], b["loss"]))
    for step in (5, 6, 7, 8):
        assert abs(lb[step] - la[step]) < 2e-3 * la[step], (la, lb)


def _tensorboard_scalars(dump: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = sorted(dump.rglob("events.out.tfevents.*"))
    assert events, f"no TensorBoard events under {dump}"
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


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
    s = _summary(dump)
    assert s["installed"] and s["world_size"] == 2 and s["microbatches"] == 2
    assert s["gather_modes"] == {"plain": s["measured_cumulative"]["weight_calls"]}
    assert s["optimizer_steps"] == 4
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
    tb = _tensorboard_scalars(dump)
    for tag in ("qcomm/weight_bytes_per_step", "qcomm/weight_bits_per_elem",
                "qcomm/weight_ratio_vs_unquantized", "qcomm/total_ratio_vs_unquantized"):
        assert {h["step"]: h[tag] for h in s["history"]} == pytest.approx(tb[tag]), tag

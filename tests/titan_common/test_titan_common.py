"""The version-free pieces both torchtitan adapters share: the ``qcomm`` section generator, the
figures and console line for every stats kind the library records (and kinds or fields it may
record later), the offline data, the GPT shapes and the version check. Fast; runs with either
torchtitan installed (or none, where the torchtitan-bound tests skip)."""

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Literal, Optional

import pytest
import torch

from fsdp_qcomm.config import QCommConfig
from fsdp_qcomm.titan_common import comm_stats, data, shapes, version

section = pytest.importorskip("fsdp_qcomm.titan_common.section")  # needs tyro


# --------------------------------------------------------------------------- qcomm section
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
    cls = section.make_section_class(_Toy)
    kwargs = {"preset": "p", **kwargs}  # the toy has no "baseline" preset
    if error is None:
        s = cls(**kwargs)
        expect = dataclasses.replace(_Toy.preset(kwargs["preset"]), **s.overrides())
        assert s.resolve() == expect
    else:
        with pytest.raises(ValueError, match=re.escape(error)):
            cls(**kwargs)


def test_section_is_generated_from_the_library_config():
    assert section.qcomm_config_class() is QCommConfig
    assert section.preset_names() == list(QCommConfig.PRESETS)
    fields = {f.name for f in dataclasses.fields(section.QComm)}
    assert fields == {"preset", *section.MODULE_FIELDS} | {
        f.name for f in dataclasses.fields(QCommConfig)}
    assert all(f.default is None for f in dataclasses.fields(section.QComm) if f.name != "preset")
    s = section.QComm(preset="qsdp", weight_bits=6, grad_scheme="two_level")
    assert s.resolve() == QCommConfig.preset("qsdp", weight_bits=6, grad_scheme="two_level")
    with pytest.raises(ValueError, match=r"\[qcomm\] preset='baseline' with weight_bits=1.*"
                       r"QCommConfig.weight_bits=1"):
        section.QComm(weight_bits=1)
    with pytest.raises(ValueError, match="grad_hadamard=True needs a quantized gradient"):
        section.QComm(grad_hadamard=True)
    with pytest.raises(ValueError, match=r"grad_inter_bits=4 cannot be set while "
                                         r"QCommConfig.bit_budget=3.0 is set"):
        section.QComm(preset="lowbit", bit_budget=3.0, grad_inter_bits=4)
    with pytest.raises(ValueError, match=r"weight_scheme='qqq'.*expected one of 'none'"):
        section.QComm(weight_scheme="qqq")


# --------------------------------------------------------------------------- stats -> figures
def _kind(calls, sent, recv, elements, baseline, **extra):
    return {"calls": calls, "sent_bytes": sent, "recv_bytes": recv, "elements": elements,
            "baseline_bytes": baseline,
            "bits_per_element": 8.0 * sent / elements if elements else 0.0,
            "ratio_vs_baseline": sent / baseline if baseline else 0.0, **extra}


def test_collectives_name_the_kinds_the_library_records():
    from fsdp_qcomm.collectives import level_sync
    from fsdp_qcomm.fsdp import all_gather, change_tracker, tp_peers

    kinds = {k for c in comm_stats.COLLECTIVES for k in c.kinds}
    assert {all_gather.KIND, all_gather.KIND_INTRA, level_sync.KIND, change_tracker.KIND,
            tp_peers.KIND, "grad_intra", "grad_inter", "grad_replica"} == kinds


def test_split_stats_counts_the_grad_baseline_once():
    stats = {
        "weight_allgather": _kind(4, 1000, 4000, 2000, 8000),
        "grad_intra": _kind(2, 300, 300, 400, 1600),
        "grad_inter": _kind(2, 100, 100, 200, 1600),
        "notes": ["something"],
        "summary": {"steps": 2, "sent_bytes": 1400, "cross_node_bytes": 0},  # not a kind
    }
    assert comm_stats.split_stats(stats) == {
        "weight": {"calls": 4, "sent": 1000, "recv": 4000, "elements": 2000, "baseline": 8000},
        "grad": {"calls": 2, "sent": 400, "recv": 400, "elements": 400, "baseline": 1600},
        "kind:weight_allgather": {"sent": 1000, "elements": 2000},
        "kind:grad_intra": {"sent": 300, "elements": 400},
        "kind:grad_inter": {"sent": 100, "elements": 200},
    }
    # one level (or one hop of a degenerate layout): that hop alone
    one = comm_stats.split_stats({"grad_inter": _kind(1, 50, 50, 100, 400), "notes": []})
    assert (one["grad"]["sent"], one["grad"]["baseline"]) == (50, 400) and "weight" not in one
    assert comm_stats.split_stats({"notes": []}) == {}


class _Handle:
    def __init__(self):
        self.s = {"notes": []}
        self.steps = 0
        self.module_names = ["a", "b"]
        self.enabled = True

    def stats(self):
        return {**self.s, "summary": {"steps": self.steps, "sent_bytes": 0}}

    def gather_modes(self):
        return {"plain": 3}


def _part(handle):
    part = torch.nn.Linear(2, 2)
    att = comm_stats.QCommAttachment(QCommConfig(), "x", handle=handle, fsdp_modules=2)
    setattr(part, comm_stats.ATTACHMENT_ATTR, att)
    return part


def test_tracker_figures_per_step_and_total():
    """Counters over 2 steps -> per-step bytes, bits, ratios; an unmeasured kind is FSDP's own."""
    h = _Handle()
    part = _part(h)
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


def test_every_kind_the_library_records_and_unknown_ones_make_figures():
    """learned levels (``levels_sync``, baseline 0), HSDP's replica all-reduce
    (``grad_replica``), a kind this module has never heard of, and extra per-kind counters:
    all become figures, count in the total, and format without error."""
    h = _Handle()
    part = _part(h)
    t = comm_stats.CommTracker()
    t.reference = comm_stats.Reference(weight_bytes=800, weight_elements=200, grad_bytes=1600,
                                       grad_elements=400, replica_bytes=400,
                                       replica_elements=100, replicas=2)
    h.s = {"notes": []}
    t.figures(0, 0, [part], 1)
    h.s = {
        "weight_allgather": _kind(4, 200, 400, 400, 1600, cross_node_bytes=0, sending_calls=2,
                                  sending_elements=200, sending_bits_per_element=8.0),
        "grad_intra": _kind(2, 400, 400, 800, 3200, cross_node_bytes=0),
        "grad_inter": _kind(2, 200, 200, 400, 3200, cross_node_bytes=200),
        "grad_replica": _kind(2, 100, 100, 200, 800, cross_node_bytes=100, note="ignored"),
        "levels_sync": _kind(4, 96, 96, 0, 0),
        "future_thing": _kind(1, 10, 10, 5, 20),
        "notes": ["n"],
    }
    f = t.figures(2, 2, [part], 1)  # 2 steps
    assert f["qcomm/weight_bytes_per_step"] == 100 and f["qcomm/weight_bits_per_elem"] == 4.0
    assert f["qcomm/grad_bytes_per_step"] == 300 and f["qcomm/grad_baseline_bytes_per_step"] == 1600
    assert f["qcomm/grad_intra_bits_per_elem"] == 4.0 and f["qcomm/grad_inter_bits_per_elem"] == 4.0
    assert f["qcomm/replica_bytes_per_step"] == 50
    assert f["qcomm/replica_ratio_vs_unquantized"] == 50 / 400
    assert f["qcomm/replica_bits_per_elem"] == 8.0 * 50 / 100  # the reference's fp32 elements
    assert f["qcomm/levels_bytes_per_step"] == 48
    assert "qcomm/levels_ratio_vs_unquantized" not in f  # pure overhead: no baseline
    assert f["qcomm/future_thing_bytes_per_step"] == 5
    assert f["qcomm/future_thing_bits_per_elem"] == 8.0 * 5 / 2.5
    assert f["qcomm/grad_cross_node_bytes_per_step"] == 100
    assert f["qcomm/total_cross_node_bytes_per_step"] == 150
    # counters of the calls that sent bytes: the cost of one sending gather; the library's
    # float ratios are recomputed, never summed; call counts make no cross-collective total
    assert f["qcomm/weight_sending_bits_per_elem"] == 8.0 * 100 / 100
    assert f["qcomm/weight_sending_calls_per_step"] == 1
    assert not any("sending_bits_per_element" in k for k in f)
    assert "qcomm/total_sending_calls_per_step" not in f
    sent = 100 + 300 + 50 + 48 + 5
    base = 800 + 1600 + 400 + 0 + 10
    assert f["qcomm/total_ratio_vs_unquantized"] == pytest.approx(sent / base, rel=1e-12)
    line = comm_stats.format_figures(f)
    assert line.startswith("qcomm: W 100B/step of 800B 4.00b/el")
    assert "(intra 4.00b, inter 4.00b)" in line and "  R 50B/step of 400B" in line
    assert "  L 48B/step (overhead)" in line and "future_thing 5B/step of 10B" in line
    # the replica all-reduce left to FSDP: counted at its reference size, named in the line
    h.s = {k: v for k, v in h.s.items() if k != "grad_replica"}
    f = comm_stats.CommTracker()
    f.reference = t.reference
    fig = f.figures(2, 2, [part], 1)
    assert "qcomm/replica_bytes_per_step" not in fig and "R FSDP's own" in \
        comm_stats.format_figures(fig)


def test_node_crossing_bytes_and_the_intra_node_weight_hop_in_the_line():
    """The line ends with the bytes this rank sent to other nodes per step, says when a
    collective left to FSDP also crosses nodes (unmeasured), and shows the node-sharded
    reference's hop inside the node without counting its baseline in the total."""
    h = _Handle()
    part = _part(h)
    t = comm_stats.CommTracker()
    t.reference = comm_stats.Reference(weight_bytes=800, weight_elements=200, grad_bytes=1600,
                                       grad_elements=400, crossing=frozenset({"weight", "grad"}))
    h.s = {"notes": []}
    t.figures(0, 0, [part], 1)
    h.s = {"weight_allgather": _kind(4, 200, 400, 400, 1600, cross_node_bytes=120),
           "weight_allgather_intra": _kind(4, 600, 1200, 600, 600), "notes": []}
    f = t.figures(2, 2, [part], 1)
    assert f["qcomm/weight_intra_bytes_per_step"] == 300
    assert f["qcomm/weight_intra_baseline_bytes_per_step"] == 0  # not FSDP's: no baseline
    assert "qcomm/weight_intra_ratio_vs_unquantized" not in f
    assert f["qcomm/total_ratio_vs_unquantized"] == (100 + 300 + 1600) / (800 + 1600)
    assert f["qcomm/ref_weight_crosses_nodes"] == f["qcomm/ref_grad_crosses_nodes"] == 1.0
    line = comm_stats.format_figures(f)
    assert "  Wn 300B/step (inside nodes)" in line
    assert "X-node 60B/step + FSDP's own G" in line  # FSDP's reduce-scatter crosses, unmeasured
    # the reduce-scatter inside a node (HSDP): FSDP's own, but nothing of it crosses
    t.reference = dataclasses.replace(t.reference, crossing=frozenset({"weight"}))
    h.s = {"weight_allgather": _kind(6, 300, 600, 600, 2400, cross_node_bytes=180), "notes": []}
    line = comm_stats.format_figures(t.figures(4, 4, [part], 1))
    assert line.endswith("G FSDP's own  X-node 30B/step  total x0.825"), line


def test_run_summary_is_json_and_divides_by_the_handles_steps(tmp_path):
    h = _Handle()
    part = _part(h)
    run = comm_stats.QCommRun(microbatches=2)
    run.tracker.reference = comm_stats.Reference(weight_bytes=80, weight_elements=20)
    h.steps = 2  # the handle counted 2 training steps
    h.s = {"weight_allgather": _kind(4, 40, 80, 20, 160), "levels_sync": _kind(1, 8, 8, 0, 0),
           "notes": []}
    fig = run.figures(2, [part])
    assert fig["qcomm/weight_bytes_per_step"] == 20  # divided by the 2 counted steps
    line = run.record(2, 3.5, 0.1, fig)
    assert line.startswith("qcomm: [2 microbatches/step] W 20B/step of 80B")
    run.record_validation(2, 3.25, [part])
    path = run.close(str(tmp_path), [part], "gpt", "tiny")
    s = json.loads(open(path).read())
    assert s["loss"] == [3.5] and s["validation"] == [{"step": 2, "loss": 3.25}]
    assert s["training_steps"] == 2 and s["hooked_modules"] == 2 and s["installed"]
    assert s["measured_cumulative"]["levels_sent"] == 8
    assert s["measured_cumulative"]["weight_allgather_sent"] == 40
    assert s["gather_modes"] == {"plain": 3}


def test_print_summary_names_every_collective(capsys):
    from fsdp_qcomm.titan_common.launch import print_summary

    hist = [{"step": 1, "loss": 9.0},
            {"step": 2, "loss": 8.0, "qcomm/weight_bytes_per_step": 10.0,
             "qcomm/weight_baseline_bytes_per_step": 40.0, "qcomm/weight_bits_per_elem": 8.0,
             "qcomm/levels_bytes_per_step": 4.0, "qcomm/levels_baseline_bytes_per_step": 0.0,
             "qcomm/total_ratio_vs_unquantized": 0.5}]
    print_summary({"model": "m", "flavor": "f", "preset": "qsdp", "world_size": 2, "replicas": 2,
                   "last_step": 2, "wall_time_s": 1.0, "loss": [9.0, 8.0],
                   "steps_logged": [1, 2], "installed": True, "history": hist,
                   "reference_bytes_per_step": {"weights": 40.0, "grads": 80.0, "replicas": 20.0},
                   "measured_cumulative": {"weight_sent": 20.0, "weight_baseline": 80.0,
                                           "levels_sent": 8.0, "levels_baseline": 0.0},
                   "training_steps": 2})
    out = capsys.readouterr().out
    assert "2 ranks x 2 replicas (HSDP)" in out
    assert "grads    FSDP's own collective" in out and "replicas FSDP's own collective" in out
    assert re.search(r"weights\s+10 B vs\s+40 B  ratio 0.2500", out)
    assert re.search(r"levels\s+4 B vs\s+0 B", out)
    assert "sent 28 B vs 80 B (ratio 0.3500)" in out


def test_mesh_tagged_kinds_are_their_collectives_counted_apart():
    """MoE experts on their own mesh record ``<kind>:<tag>`` (``stats.TaggedStats``): the
    figures and the console line show them beside the dense collective, with its semantics
    (the two gradient hops share one baseline), and without the unknown-kind warning."""
    c = comm_stats.collective_of("grad_inter:efsdp")
    assert (c.name, c.tag, c.kinds) == ("grad:efsdp", "G:efsdp",
                                        ("grad_intra:efsdp", "grad_inter:efsdp"))
    assert c.shared_baseline and c.reference == "grad"
    assert comm_stats.collective_named("weight:efsdp").kinds == ("weight_allgather:efsdp",)
    h = _Handle()
    part = _part(h)
    t = comm_stats.CommTracker()
    t.reference = comm_stats.Reference(weight_bytes=800, weight_elements=200)
    t.figures(0, 0, [part], 1)
    h.s = {"weight_allgather": _kind(2, 100, 200, 200, 800),
           "weight_allgather:efsdp": _kind(2, 60, 120, 120, 480), "notes": []}
    f = t.figures(2, 2, [part], 1)
    assert f["qcomm/weight_bytes_per_step"] == 50 and f["qcomm/weight:efsdp_bytes_per_step"] == 30
    line = comm_stats.format_figures(f)
    assert "W 50B/step of 400B" in line and "W:efsdp 30B/step of 240B" in line, line


def test_print_summary_leads_with_node_crossing_bytes_against_fsdp2(capsys):
    """The line that matters first: what crossed nodes against FSDP2's node-crossing bytes in
    fp32 and with bf16 parameters; left out when a collective FSDP runs itself crosses nodes
    unmeasured (the ratio would flatter the run)."""
    from fsdp_qcomm.titan_common.launch import print_summary

    step = {"step": 2, "loss": 8.0, "qcomm/weight_bytes_per_step": 10.0,
            "qcomm/weight_baseline_bytes_per_step": 40.0,
            "qcomm/total_cross_node_bytes_per_step": 100.0,
            "qcomm/ref_cross_node_fp32_bytes_per_step": 1600.0,
            "qcomm/ref_cross_node_bf16_fp32_bytes_per_step": 1200.0,
            "qcomm/ref_weight_crosses_nodes": 1.0}
    base = {"model": "m", "flavor": "f", "preset": "sdp4bit", "world_size": 4, "last_step": 2,
            "wall_time_s": 1.0, "loss": [9.0, 8.0], "steps_logged": [1, 2], "installed": True,
            "reference_bytes_per_step": {"weights": 40.0}, "training_steps": 2}
    print_summary({**base, "history": [{"step": 1}, step]})
    out = capsys.readouterr().out
    lead = [ln for ln in out.splitlines() if ln.startswith("node-crossing bytes")]
    assert lead == ["node-crossing bytes per rank and step: 100 B, against FSDP2's 1.56 KiB in "
                    "fp32 (16.00x fewer) and 1.17 KiB with bf16 parameters and fp32 reduction "
                    "(12.00x fewer)"], out
    assert out.index("node-crossing bytes") < out.index("bytes sent per rank and step")
    assert "sent to other nodes: 100 B per step (FSDP2: 1.56 KiB in fp32" in out
    unmeasured = dict(step, **{"qcomm/ref_grad_crosses_nodes": 1.0})
    print_summary({**base, "history": [{"step": 1}, unmeasured]})
    assert "node-crossing bytes per rank" not in capsys.readouterr().out


# --------------------------------------------------------------------------- data
def test_builtin_tokenizer_and_corpus():
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer

    path = data.resolve_hf_assets_path("fsdp_qcomm:pystdlib_bpe8192")
    tok = Tokenizer.from_file(f"{path}/tokenizer.json")
    cfg = json.loads(open(f"{path}/tokenizer_config.json").read())
    assert tok.get_vocab_size() == 8192 == data.tokenizer_vocab_size(path)
    assert tok.token_to_id(cfg["bos_token"]) is not None
    assert tok.token_to_id(cfg["eos_token"]) is not None
    ids = tok.encode("Return the absolute value.").ids
    assert tok.decode(ids) == "Return the absolute value."
    meta = json.loads((data.corpus_dir() / "meta.json").read_text())
    assert meta["characters"]["train"] > 500_000 and meta["documents"]["val"] > 20
    with pytest.raises(ValueError, match="unknown built-in tokenizer"):
        data.resolve_hf_assets_path("fsdp_qcomm:nope")
    assert data.resolve_hf_assets_path("/some/dir") == "/some/dir"
    with pytest.raises(ValueError, match="has 8192 tokens but model flavor 'tiny' has "
                       "vocab_size 4096"):
        data.check_tokenizer_fits(path, 4096, "model flavor 'tiny'", warn=print)
    data.check_tokenizer_fits(path, 8192, "model", warn=print)


def test_pieces_split_at_paragraphs():
    text = "\n\n".join(["a" * 900] * 5)
    pieces = list(data._pieces(text, limit=2048))
    assert "\n\n".join(pieces) == text
    assert all(len(p) <= 2048 for p in pieces) and len(pieces) == 3


def test_local_text_and_jsonl_datasets(tmp_path, monkeypatch):
    pytest.importorskip("datasets")
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


def test_datasets_register_in_torchtitans_table():
    pytest.importorskip("torchtitan")
    from torchtitan.hf_datasets.text_datasets import DATASETS

    data.register_datasets()
    assert {"pystdlib", "pystdlib_val", "text", "jsonl"} <= set(DATASETS)
    with pytest.raises(ValueError, match="needs a dataset path"):
        DATASETS["text"].loader("")


# --------------------------------------------------------------------------- shapes, version
def test_paper_flavor_sizes():
    # weights excluding the untied output layer must be near the GPT-3 names
    expect = {"125M": 125e6, "350M": 355e6, "1.3B": 1.3e9, "2.7B": 2.7e9, "6.7B": 6.7e9,
              "13B": 13e9}
    assert tuple(expect) == shapes.PAPER_FLAVORS
    for name, n in expect.items():
        s = shapes.GPT_SHAPES[name]
        tied = s.param_count() - s.vocab_size * s.dim
        assert abs(tied - n) / n < 0.06, (name, tied)
        assert s.dim % s.n_heads == 0
    assert 1e6 <= shapes.GPT_SHAPES["debug"].param_count() <= 10e6


def test_debug_jobs_keep_out_of_site_packages(tmp_path, monkeypatch):
    """From a checkout a debug job's dump folder is the checkout's outputs/ and torchrun starts
    there; from an installed package (site-packages holds no pyproject.toml or recipes/) both
    are the working directory's, never site-packages. Its ranks stay on the CPU, GPUs or not."""
    from fsdp_qcomm.titan_common import launch

    assert launch.checkout() == launch.REPO_ROOT
    assert launch.default_dump("x") == launch.REPO_ROOT / "outputs" / "x"
    site = tmp_path / "site-packages"
    (site / "fsdp_qcomm").mkdir(parents=True)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setattr(launch, "REPO_ROOT", site)
    monkeypatch.chdir(work)
    assert launch.checkout() is None
    assert launch.default_dump("x") == work / "outputs" / "x"
    seen = {}
    monkeypatch.setattr(data, "ensure_tokenizer", lambda vocab: "tok")
    monkeypatch.setattr(launch.subprocess, "call",
                        lambda cmd, env, cwd: seen.update(cwd=cwd, env=env) or 3)
    monkeypatch.delenv("FSDP_QCOMM_DEVICE", raising=False)
    assert launch.run_debug_job(["torchrun"], work / "outputs" / "x", 8) == 3
    assert seen["cwd"] == str(work)
    # the CPU debug job on a host with GPUs: its ranks are told to stay on the CPU
    assert seen["env"]["FSDP_QCOMM_DEVICE"] == "cpu"


def test_pipeline_runs_log_and_summarize_the_last_stages_rank():
    """Under pipeline parallelism only the last stage computes the loss: the debug job prints
    that stage's first rank's log and that rank writes the summary (torchtitan's metrics
    rank), else the summary held rank 0's placeholder loss."""
    from fsdp_qcomm.titan_common.comm_stats import metrics_rank
    from fsdp_qcomm.titan_common.launch import loss_rank, torchrun_prefix

    flag = "--parallelism.pipeline_parallel_degree"
    assert loss_rank(4, []) == 0 and loss_rank(4, ["--training.steps", "3"]) == 0
    assert loss_rank(4, [flag, "2"]) == 2 and loss_rank(8, [f"{flag}=4"]) == 6
    assert loss_rank(4, [flag, "2", "--parallelism.pipeline_parallel_schedule",
                         "ZBVZeroBubble"]) == 0  # V schedules end on rank 0
    assert loss_rank(4, [flag, "x"]) == 0 and loss_rank(2, [flag, "4"]) == 0
    assert metrics_rank(1, 8, "1F1B") == 0
    assert metrics_rank(2, 8, "Interleaved1F1B") == 4
    cmd = torchrun_prefix(4, "/d", log_rank=2)
    assert cmd[cmd.index("--local-ranks-filter") + 1] == "2"


def test_version_check_names_the_adapter_to_use(monkeypatch):
    assert version.parse_version("0.3.0.dev20260101+cu128") == (0, 3, 0)
    assert version.parse_version("v0.2.2") == (0, 2, 2)
    with pytest.raises(ValueError):
        version.parse_version("main")
    monkeypatch.setattr(version, "installed_version", lambda: "0.3.0")
    assert version.require_torchtitan("fsdp_qcomm.titan03") == "0.3.0"
    with pytest.raises(version.TorchtitanVersionError,
                       match=r"fsdp_qcomm.titan is the integration for torchtitan >=0.2.2,<0.3, "
                             r"but torchtitan 0.3.0 is installed: use fsdp_qcomm.titan03 instead"):
        version.require_torchtitan("fsdp_qcomm.titan")
    monkeypatch.setenv(version.SKIP_ENV, "1")
    assert version.require_torchtitan("fsdp_qcomm.titan") == "0.3.0"
    monkeypatch.delenv(version.SKIP_ENV)
    monkeypatch.setattr(version, "installed_version", lambda: "0.5.1")
    with pytest.raises(version.TorchtitanVersionError, match="no fsdp_qcomm adapter supports"):
        version.require_torchtitan("fsdp_qcomm.titan03")
    monkeypatch.setattr(version, "installed_version", lambda: None)
    with pytest.raises(version.TorchtitanVersionError,
                       match=r"not installed; pip install 'fsdp-qcomm\[titan03\]'"):
        version.require_torchtitan("fsdp_qcomm.titan03")
    # not an ImportError: torchtitan 0.3's --module loader swallows those
    assert not issubclass(version.TorchtitanVersionError, ImportError)


# --------------------------------------------------------------------------- DiLoCo's tokens
def test_replica_tokens_normalize_by_the_replica_groups_own_tokens():
    """``titan_common.diloco.ReplicaTokens`` (torchtitan 0.3 under DiLoCo): the step's data
    iterator counts each drawn batch's valid tokens (labels other than the ignore index); every
    forward-backward call of the step runs with that count (here a one-rank replica group: no
    all-reduce) instead of torchtitan's count over all replica groups, and returns the loss
    rescaled to torchtitan's normalizer (the logged average over every replica group's
    tokens). A new step counts afresh."""
    from fsdp_qcomm.titan_common.diloco import ReplicaTokens

    ignore = -100
    batches = [({"input": torch.zeros(2, 3)}, torch.tensor([[1, 2, ignore], [3, ignore, ignore]])),
               ({"input": torch.zeros(2, 3)}, torch.tensor([[4, 5, 6], [7, 8, ignore]]))]
    tokens = ReplicaTokens(None, ignore)
    it = tokens.start_step(iter(batches))
    drawn = [next(it), next(it)]
    assert drawn == batches  # the batches themselves, unchanged
    seen = []

    def call(**kwargs):  # torchtitan's forward_backward_step: local loss sum / normalizer
        seen.append(kwargs["global_valid_tokens"])
        return torch.tensor(21.0) / kwargs["global_valid_tokens"]

    everyone = torch.tensor(28)  # torchtitan's count over all replica groups (4 x 7)
    losses = [tokens.forward_backward(call, {"input_dict": None, "labels": None,
                                             "global_valid_tokens": everyone})
              for _ in range(2)]
    assert [int(t) for t in seen] == [3 + 5, 3 + 5]  # the replica group's own, every micro-batch
    assert all(loss.item() == pytest.approx(21.0 / 28) for loss in losses)
    with pytest.raises(StopIteration):
        next(it)
    it = tokens.start_step(iter(batches[1:]))
    next(it)
    seen.clear()
    tokens.forward_backward(call, {"global_valid_tokens": everyone})
    assert [int(t) for t in seen] == [5]


def test_section_module_fields_become_enable_arguments():
    """``exclude_modules`` and ``module_presets`` are the section's own fields: enable's
    module_filter_fn and module_configs, each override carrying the section's per-call
    fields; a malformed entry is refused naming the section."""
    from fsdp_qcomm import QCommConfig
    from fsdp_qcomm.titan_common.section import QComm

    s = QComm(preset="lowbit", ranks_per_node=2, exclude_modules="norm, layers.1*",
              module_presets="tok_embeddings=sdp4bit,output=sdp4bit")
    assert "exclude_modules" not in s.overrides() and s.resolve().ranks_per_node == 2
    choice = s.module_choice()
    keep = choice["module_filter_fn"]
    assert keep(None, "layers.0") and not keep(None, "norm") and not keep(None, "layers.10")
    configs = choice["module_configs"]
    assert list(configs) == ["tok_embeddings", "output"]
    assert configs["output"] == QCommConfig.preset("sdp4bit", ranks_per_node=2)
    assert QComm(preset="sdp4bit").module_choice() == {"module_filter_fn": None,
                                                       "module_configs": None}
    with pytest.raises(ValueError, match=r"\[qcomm\] module_presets entry 'output:sdp4bit'"):
        QComm(preset="sdp4bit", module_presets="output:sdp4bit").module_choice()


# --------------------------------------------------------------------------- install
def _install_with_fsdp_on_rank_0_only(rank: int, world: int) -> str:
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard

    from fsdp_qcomm.titan_common.install import install_qcomm

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    if rank == 0:
        fully_shard(model)
    try:
        install_qcomm([model], QCommConfig.preset("sdp4bit", ranks_per_node=1))
        return "no error"
    except ValueError as e:
        return str(e)


def test_a_part_with_fsdp_on_some_ranks_only_is_refused_on_every_rank():
    """Before: rank 1 (no FSDP modules) skipped the part while rank 0 entered ``enable``'s world
    collectives, and waited there for a peer that had gone on."""
    from fsdp_qcomm.testing import run_ranks

    for text in run_ranks(_install_with_fsdp_on_rank_0_only, 2, timeout=120):
        assert text.startswith("qcomm: the model parts hold FSDP modules on some ranks only "
                               "(which parts have them, per rank: [True] on ranks [0]; [False] "
                               "on ranks [1])"), text


class _Entry:
    """Stands for ``DiLoCoState``: its pre-load check refuses on rank 1 only (another replica's
    key missing, as with more replica groups than the checkpoint was written with)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.calls = rank, []

    def begin_load(self):
        self.calls.append("begin")

    def abort_load(self):
        self.calls.append("abort")

    def finish_load(self):
        self.calls.append("finish")

    def engine_keys(self):
        self.calls.append("engine")
        return ["group_rank0"]

    def check_checkpoint(self, keys, where):
        if self.rank == 1:
            raise ValueError(f"{where}'s 'diloco' entry has no ['diloco.replica1']")


def _dcp_load_refused_on_rank_1(rank: int, world: int) -> dict:
    from fsdp_qcomm.titan_common import checkpoint as ck

    ck.checkpoint_keys = lambda checkpoint_id: ["diloco.replica0.w"]
    entry, loaded = _Entry(rank), []

    class Manager:
        def dcp_load(self, state_dict, checkpoint_id):
            loaded.append(checkpoint_id)  # dcp.load: collective in a real run

    manager = Manager()
    ck.wrap_dcp_load(manager, entry)
    try:
        manager.dcp_load({ck.DILOCO_KEY: entry}, "step-10")
        error = None
    except ValueError as e:
        error = str(e)
    return {"error": error, "loaded": loaded, "calls": entry.calls}


def test_a_diloco_entry_refused_on_one_rank_is_refused_on_every_rank():
    """Before: rank 0 went on into dcp.load's collectives while rank 1 raised."""
    from fsdp_qcomm.testing import run_ranks

    r0, r1 = run_ranks(_dcp_load_refused_on_rank_1, 2, timeout=120)
    assert r1["error"] == "checkpoint step-10's 'diloco' entry has no ['diloco.replica1']"
    assert r0["error"] == ("checkpoint step-10: its DiLoCo entry was refused on rank(s) [1] of "
                           "2, so no rank loads it. Rank 1: ValueError: checkpoint step-10's "
                           "'diloco' entry has no ['diloco.replica1']"), r0["error"]
    for r in (r0, r1):  # the engine built on every rank (collective), whatever the check says
        assert r["loaded"] == [] and r["calls"] == ["begin", "engine", "abort"], r


def _handles_state_refused_for_one_part_on_one_rank(rank: int, world: int) -> dict:
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard

    import fsdp_qcomm
    from fsdp_qcomm.titan_common.checkpoint import HandlesState

    torch.manual_seed(0)
    parts = [nn.Sequential(nn.Linear(8, 8), nn.Linear(8, k)) for k in (4, 6)]
    handles = []
    for part in parts:
        fully_shard(part)
        handles.append(fsdp_qcomm.enable(part, QCommConfig.preset("sdp4bit", ranks_per_node=1)))
    entry = HandlesState(handles)

    def step():
        for part in parts:
            part(torch.randn(2, 8)).sum().backward()

    step()
    saved = entry.state_dict()
    step()  # the counters move on: a load of ``saved`` would change them
    before = entry.state_dict()
    out = {}
    for case in ("part1 of rank 1 refused", "one part fewer on rank 1"):
        state = dict(saved)
        if rank == 1 and case.startswith("part1"):
            state["part1"] = saved["part0"]  # another part's modules: other shapes
        if rank == 1 and case.startswith("one part"):
            del state["part1"]
        try:
            entry.load_state_dict(state)
            out[case] = "loaded"
        except fsdp_qcomm.CheckpointMismatch as e:
            out[case] = str(e)
        out[case + " unchanged"] = _same_state(before, entry.state_dict())
    entry.load_state_dict(saved)  # accepted everywhere: loads
    out["loaded"] = not _same_state(before, entry.state_dict())
    return out


def _same_state(a, b) -> bool:
    """Equal nested states: the same leaves (tensors bit for bit, everything else by value)."""
    la, lb = _leaves(a), _leaves(b)
    return len(la) == len(lb) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(la, lb))


def _leaves(x):
    if isinstance(x, dict):
        return [v for k in sorted(x) for v in _leaves(x[k])]
    if isinstance(x, (list, tuple)):
        return [v for e in x for v in _leaves(e)]
    return [x]


def test_a_part_refused_on_one_rank_loads_no_part_on_any_rank():
    """torchtitan's ``HandlesState`` (the model parts of a pipeline stage) loads every part's
    state after one exchange. Before: one exchange per part, so a refusal of part 1 left part 0
    loaded on every rank, and a checkpoint with another part count raised on that rank alone
    while the others waited in part 0's exchange."""
    from fsdp_qcomm.testing import run_ranks

    r0, r1 = run_ranks(_handles_state_refused_for_one_part_on_one_rank, 2, timeout=180)
    for r in (r0, r1):
        assert r["part1 of rank 1 refused unchanged"] and r["one part fewer on rank 1 unchanged"]
        assert r["loaded"]
    assert r1["part1 of rank 1 refused"].startswith(
        "fsdp_qcomm: the fsdp_qcomm state for rank 1 of 2 was saved by a run that differs"), r1
    assert r0["part1 of rank 1 refused"].startswith(
        "the fsdp_qcomm state was refused on rank(s) [1] of 2, so no rank loads it"), r0
    assert r1["one part fewer on rank 1"].startswith(
        "the checkpoint's 'qcomm' entry covers model parts ['part0'], this run has "
        "['part0', 'part1']"), r1
    assert r0["one part fewer on rank 1"].startswith(
        "the fsdp_qcomm state was refused on rank(s) [1] of 2"), r0

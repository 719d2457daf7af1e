"""The accuracy benchmark's mixture-of-experts workload (``benchmarks/campaigns/moe.toml``): the
MoE GPT counts its parameters right, refuses layouts it cannot build, trains on 4 gloo ranks as
2 nodes x 2 with its experts on their own FSDP mesh (expert parallelism 2), and records and
tabulates the bytes per step of each kind of traffic, dense and expert groups apart."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.fsdp._fully_shard import _fsdp_common

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import _model  # noqa: E402
import _seeds  # noqa: E402
import accuracy  # noqa: E402

from fsdp_qcomm.testing import run_ranks  # noqa: E402

TINY_MOE = ["--dim", "16", "--layers", "1", "--heads", "2", "--seq", "16", "--batch", "2",
            "--steps", "4", "--warmup", "2", "--eval-every", "2", "--eval-batches", "1",
            "--eval-full", "--full-last", "1", "--tail", "1", "--experts", "2",
            "--expert-parallel", "2"]


@pytest.fixture
def data(tmp_path) -> Path:
    p = tmp_path / "d.txt"
    p.write_text("to be or not to be, that is the question. " * 400)
    return p


def test_moe_shape_counts_the_parameters_of_the_model_it_builds():
    shape = _model.GPTShape(vocab=29, dim=32, layers=2, heads=4, seq=16, experts=4,
                            expert_parallel=2)
    model = _model.GPT(shape, _model.expert_seed(3, 0))
    assert shape.params() == sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert shape.expert_params() == experts
    assert shape.params_all_experts() == shape.params() + experts  # two expert sets
    assert not hasattr(model.blocks[0], "fc")  # the MoE replaces the dense MLP
    # a rank's experts hold the dense MLP's weights: the model stays within 2x the dense one
    dense = _model.GPTShape(vocab=29, dim=32, layers=2, heads=4, seq=16)
    assert shape.params_all_experts() < 2 * dense.params()
    # expert sets differ, and one set is the same on every rank that holds it
    other = _model.GPT(shape, _model.expert_seed(3, 1))
    again = _model.GPT(shape, _model.expert_seed(3, 0))
    w = model.blocks[0].moe.experts.w_in
    assert torch.equal(w, again.blocks[0].moe.experts.w_in)
    assert not torch.equal(w, other.blocks[0].moe.experts.w_in)
    assert model(torch.randint(0, 29, (2, 16))).shape == (2, 16, 29)
    with pytest.raises(ValueError, match="must be positive and divide 4 \\* dim"):
        _model.GPT(_model.GPTShape(vocab=29, dim=32, layers=1, heads=4, seq=16, experts=5))


def test_expert_sets_stay_inside_a_node_or_are_refused(data):
    assert _model.expert_groups(4, 2, 2) == [[0, 2], [1, 3]]
    assert _model.expert_groups(8, 4, 2) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    with pytest.raises(ValueError, match="must divide the ranks per node"):
        _model.expert_groups(4, 2, 4)
    base = ["--data", str(data), "--experts", "2"]
    for extra in (["--expert-parallel", "4"], ["--ranks-per-node", "3"]):
        with pytest.raises(SystemExit):
            accuracy._args([*base, "--expert-parallel", "2", *extra])
    with pytest.raises(SystemExit):  # HSDP shards the dense weights inside a node only
        accuracy._args([*base, "--expert-parallel", "2", "--schemes", "SDP4Bit HSDP 2x2"])
    with pytest.raises(SystemExit):
        accuracy._args(["--data", str(data), "--expert-parallel", "2"])  # no experts
    # MoE runs have a store of their own; dense stores stay valid
    moe = accuracy._setup(accuracy._args([*base, "--expert-parallel", "2"]))
    assert (moe["experts"], moe["expert_parallel"]) == (2, 2)
    assert "experts" not in accuracy._setup(accuracy._args(["--data", str(data)]))


class _Handle:
    """``handle.stats()`` counters growing by one unit per call."""

    def __init__(self) -> None:
        self.calls = 0

    def stats(self) -> dict:
        self.calls += 1
        k = self.calls
        return {
            "weight_allgather": {"sent_bytes": 10 * k, "baseline_bytes": 80 * k,
                                 "cross_node_bytes": 20 * k, "bits_per_element": 1.0},
            "weight_allgather_intra": {"sent_bytes": 5 * k, "baseline_bytes": 5 * k},
            "grad_intra": {"sent_bytes": 30 * k, "baseline_bytes": 400 * k},
            "grad_inter": {"sent_bytes": 7 * k, "baseline_bytes": 400 * k,
                           "cross_node_bytes": 3 * k},
            "weight_allgather:edp": {"sent_bytes": 4 * k, "baseline_bytes": 40 * k,
                                     "cross_node_bytes": 4 * k},
            "grad_inter:edp": {"sent_bytes": 9 * k, "baseline_bytes": 80 * k,
                               "cross_node_bytes": 4 * k},
            "summary": {"steps": k}, "notes": [],
        }


def test_traffic_counts_training_steps_and_tabulates_each_kind(tmp_path, data):
    t = accuracy.StepTraffic(_Handle())
    t.step_done()
    t.step_done()
    t.evaluated()
    t.step_done()  # follows an evaluation: left out
    t.step_done()
    rec = t.record()
    assert rec["steps"] == 3
    # both hops of a two-level reduction share one FSDP2 baseline; the intra-node qWD hop is a
    # kind of its own, without one (FSDP2 has no such hop)
    assert rec["dense"]["grad"] == {"sent": 37.0, "baseline": 400.0, "cross_node": 3.0}
    assert rec["dense"]["weight"] == {"sent": 10.0, "baseline": 80.0, "cross_node": 20.0}
    assert rec["dense"]["weight_intra"] == {"sent": 5.0, "baseline": 0.0, "cross_node": 0.0}
    assert rec["expert"]["weight"] == {"sent": 4.0, "baseline": 40.0, "cross_node": 4.0}
    a = accuracy._args(["--data", str(data), *TINY_MOE, "--out", str(tmp_path / "out")])
    store = _seeds.RunStore(tmp_path / "out", accuracy._setup(a))
    run = {"final_val": 2.0, "seconds": 1.0, "train": [2.0], "val": [[1, 2.0]], "params": 1,
           "vocab": 11}
    store.save("baseline", 1, accuracy._row("baseline"), run)
    store.save("SDP4Bit", 1, accuracy._row("SDP4Bit"), dict(run, traffic=rec))
    md = accuracy.write_traffic(a, store)
    assert md == (tmp_path / "out" / "bytes.md").read_text()
    lines = {ln.split(" | ")[0][2:]: ln for ln in md.splitlines() if ln.startswith("| ")}
    # FSDP2's node-crossing bytes: a gather's shard to each of 2 remote members (dense) or 1
    # (the expert set {0, 2}); a reduce-scatter the remote rows (2 of 4; 1 of 2)
    assert lines["dense weight gather"].endswith("| 80 | 10 | 0.125 | 160 | 20 | 0.125 |")
    assert lines["dense gradient reduction"].endswith("| 400 | 37 | 0.092 | 200 | 3 | 0.015 |")
    assert lines["expert weight gather"].endswith("| 40 | 4 | 0.100 | 40 | 4 | 0.100 |")
    assert lines["expert gradient reduction"].endswith("| 80 | 9 | 0.113 | 40 | 4 | 0.100 |")
    intra = next(v for k, v in lines.items() if k.startswith("dense weight gather's hop"))
    assert intra.endswith("| 0 | 5 | - | 0 | 0 | - |")
    assert lines["**total**"].endswith("| 600 | 65 | 0.108 | 440 | 31 | 0.070 |")
    assert "## baseline" not in md  # no hooks, nothing counted
    dense = accuracy._args(["--data", str(data), "--out", str(tmp_path / "out")])
    assert accuracy.write_traffic(dense, store) is None  # bytes.md for MoE stores only


def _moe_runs(rank: int, world: int, a) -> dict:
    """Both rows of the MoE workload, with the weights every rank computed with in its last
    forward (``ComputeWeights``, registered on the model ``_train_one`` builds)."""
    import _model as m
    import accuracy as acc

    from fsdp_qcomm.testing import ComputeWeights, digest

    build, watch = m.build_fsdp_gpt, {}

    def watched(*args, **kw):
        model = build(*args, **kw)
        watch["w"] = ComputeWeights(model)
        return model

    m.build_fsdp_gpt = watched
    data = acc.load_data(a)
    shape = acc.shape_of(a, data.vocab)
    out = {}
    for label in ("baseline", "SDP4Bit"):
        rec = acc._train_one(rank, world, a, data, shape, label, 11)
        out[label] = {"rec": rec,
                      "weights": {k: digest(v) for k, v in watch["w"].weights.items()}}
        watch["w"].remove()
    return out


def test_moe_workload_trains_with_experts_on_their_own_mesh(tmp_path, data):
    a = accuracy._args(["--data", str(data), *TINY_MOE, "--out", str(tmp_path / "out")])
    if not hasattr(_fsdp_common, "ShardPlacementResult"):  # torch < 2.13: refused, by name
        with pytest.raises(AssertionError, match="per-parameter meshes.*torch 2.13"):
            run_ranks(_moe_runs, 4, a, timeout=300)
        return
    runs = run_ranks(_moe_runs, 4, a, timeout=300)
    for label in ("baseline", "SDP4Bit"):
        w = [r[label]["weights"] for r in runs]
        experts = [k for k in w[0] if ".experts." in k]
        dense = [k for k in w[0] if ".experts." not in k]
        assert experts and dense, sorted(w[0])
        for k in dense:  # one group over the 4 ranks
            assert len({x[k] for x in w}) == 1, (label, k)
        for k in experts:  # set e on ranks {e, e + 2}; the sets differ
            assert w[0][k] == w[2][k] and w[1][k] == w[3][k], (label, k)
            assert w[0][k] != w[1][k], (label, k)
    base, q = runs[0]["baseline"]["rec"], runs[0]["SDP4Bit"]["rec"]
    assert "traffic" not in base  # FSDP2's own collectives: no hooks, nothing counted
    t = q["traffic"]
    assert t["steps"] == 3  # steps 1, 2 and 4: step 3 follows the evaluation at step 2
    for group in ("dense", "expert"):
        for kind in ("weight", "grad"):
            v = t[group][kind]
            assert 0 < v["cross_node"] and 0 < v["sent"] < v["baseline"], (group, kind, v)
    b, s = base["val_full"][-1][1], q["val_full"][-1][1]
    assert math.isfinite(b) and abs(s - b) < 0.03 * b, (s, b)
    # the score is the same on every rank (every expert set on every window)
    assert len({r["SDP4Bit"]["rec"]["val_full"][-1][1] for r in runs}) == 1

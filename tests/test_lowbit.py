"""Below 4 bits: 2- and 3-bit weight differences (uniform, learned levels, Hadamard-rotated)
keep every rank bit-identical and send what the wire formula says. How well they train is
``benchmarks/frontier.py``'s question; how far the reference drifts, ``benchmarks/qwd_drift.py``'s.

One launch of 4 gloo ranks (2 emulated nodes x 2) trains a tiny tied-embedding LM per variant
with the consistency guard on at every forward gather.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from _models import TinyLM, batch, lm_loss, shard
from torch.distributed.fsdp import FSDPModule

import fsdp_qcomm
from fsdp_qcomm import QCommConfig
from fsdp_qcomm.codec import hadamard_len, wire_bytes
from fsdp_qcomm.codec.levels import levels_wire_bytes
from fsdp_qcomm.fsdp import internals
from fsdp_qcomm.testing import ComputeWeights, run_ranks

VARIANTS = {
    "w2": dict(weight_bits=2),
    "w3": dict(weight_bits=3),
    "w2_hadamard": dict(weight_bits=2, weight_hadamard=True),
    "w3_hadamard": dict(weight_bits=3, weight_hadamard=True),
    "w2_learned": dict(weight_bits=2, weight_levels="learned", levels_refresh_every=2),
    "w3_learned": dict(weight_bits=3, weight_levels="learned", levels_refresh_every=2),
    "w3_asym": dict(weight_bits=3, weight_symmetric=False),
}
STEPS = 6


def _segments(model):
    return [[internals.padded_shard_numel(fp) for fp in internals.fsdp_params(g)]
            for m in model.modules() if isinstance(m, FSDPModule)
            for g in internals.param_groups(m)]


def _run(rank: int, world: int) -> dict:
    out = {}
    for name, kw in VARIANTS.items():
        cfg = QCommConfig(weight_scheme="qwd", weight_group_size=32, ranks_per_node=2,
                          consistency_check_every=1, seed=3, **kw)
        torch.manual_seed(0)
        model = TinyLM()
        shard(model, True)
        handle = fsdp_qcomm.enable(model, cfg)
        used = ComputeWeights(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for s in range(STEPS):
            used.clear()
            loss = lm_loss(model, batch(s, rank))
            used.check_same(f"{name}: weights of step {s}'s forward")  # raises if not
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        used.remove()
        st = handle.stats()["weight_allgather"]
        out[name] = dict(losses=losses, same=True,
                         sent=st["sent_bytes"], modes=handle.gather_modes(),
                         segments=_segments(model), bits=st["sending_bits_per_element"])
        handle.disable()
    return out


def _corrupted(rank: int, world: int) -> dict:
    """One rank computes with other weights than its peers: the check must say so."""
    torch.manual_seed(0)
    model = TinyLM()
    shard(model, True)
    handle = fsdp_qcomm.enable(model, QCommConfig(weight_scheme="qwd", weight_bits=2,
                                                  weight_group_size=32, ranks_per_node=2))
    out = {}
    clean = ComputeWeights(model)
    lm_loss(model, batch(0, rank))
    clean.check_same("uncorrupted forward")
    clean.remove()

    def corrupt(module, args):  # after FSDP's unshard, before the capture below
        with torch.no_grad():
            module.fc1.weight.view(-1)[3] += 1e-3
    if rank == 1:
        hook = model.blocks[1].register_forward_pre_hook(corrupt)
    used = ComputeWeights(model)
    lm_loss(model, batch(1, rank))
    try:
        used.check_same("corrupted forward")
        out["error"] = None
    except AssertionError as e:
        out["error"] = str(e)
    out["keys"] = sorted(used.weights)
    if rank == 1:
        hook.remove()
    handle.disable()
    return out


def test_compute_weight_check_catches_one_rank_with_other_weights():
    for rank, r in enumerate(run_ranks(_corrupted, 2, timeout=300)):
        assert r["error"] is not None, r
        assert f"rank {1 - rank} differs on ['blocks.1.fc1.weight']" in r["error"], r
        assert "emb.weight" in r["keys"] and "blocks.0.qkv.weight" in r["keys"]


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_ranks(_run, 4, timeout=400)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_low_bit_differences_keep_ranks_identical(runs, name):
    for r in runs:
        v = r[name]
        assert v["same"]  # and the guard compared every forward gather without firing
        assert all(x == x for x in v["losses"])  # finite


@pytest.mark.parametrize("name", list(VARIANTS))
def test_low_bit_wire_bytes(runs, name):
    kw = VARIANTS[name]
    spec = QCommConfig(weight_scheme="qwd", weight_group_size=32, **kw).weight_spec()
    v = runs[0][name]
    diffs = v["modes"]["qwd_diff"]
    fulls = v["modes"]["qwd_full"]
    learned = kw.get("weight_levels") == "learned"

    def row(n):
        if learned:
            return levels_wire_bytes(n, spec)
        return wire_bytes(hadamard_len(n) if kw.get("weight_hadamard") else n, spec)

    per_diff = [sum(row(n) for n in segs if n) for segs in v["segments"]]
    per_full = [4 * sum(segs) for segs in v["segments"]]
    # every module sends one full gather, then one difference per step (forward only: the
    # backward re-gathers reuse the reference)
    assert fulls == len(v["segments"]) and diffs == len(v["segments"]) * (STEPS - 1)
    assert v["sent"] == sum(per_full) + (STEPS - 1) * sum(per_diff)


# ---- the bit budget ---------------------------------------------------------------------------
def test_bit_budget_chooses_widths_under_the_budget():
    ladder = QCommConfig.BUDGET_LADDER
    for budget in (2.2, 2.5, 2.8, 3.0, 3.5, 3.7, 4.2, 8.0):
        cfg = QCommConfig.preset("lowbit", bit_budget=budget)
        w, g, mean = cfg.node_crossing_bits()
        assert mean <= budget, (budget, cfg)
        # the first ladder point that fits: every one before it is over the budget
        point = (cfg.weight_bits, cfg.weight_levels, cfg.grad_inter_bits)
        assert point in ladder
        for wb, levels, gb in ladder[: ladder.index(point)]:
            trial = cfg.replace(bit_budget=None, weight_bits=wb, weight_levels=levels,
                                grad_inter_bits=gb)
            assert trial.node_crossing_bits()[2] > budget
        assert cfg.grad_group_size == 128 and cfg.grad_error_feedback == "none"
    assert QCommConfig.preset("lowbit", bit_budget=3.0).replace(bit_budget=None) == (
        QCommConfig.preset("lowbit"))
    assert QCommConfig.preset("lowbit", bit_budget=4.2).weight_levels == "uniform"
    assert QCommConfig.preset("sdp4bit").node_crossing_bits()[2] == pytest.approx(4.1328125)
    assert QCommConfig.preset("lowbit").node_crossing_bits()[2] == pytest.approx(2.6328125)
    with pytest.raises(ValueError, match="bit_budget=1.5 must be a number"):
        QCommConfig.preset("lowbit", bit_budget=1.5)
    with pytest.raises(ValueError, match="start from QCommConfig.preset\\('lowbit'"):
        QCommConfig(bit_budget=3.0)


def test_replace_keeps_the_budget_and_refuses_widths_next_to_it():
    """``replace`` of a budget config keeps the widths the budget chose (a field the budget
    does not depend on changes nothing); a width set while a budget is set is an error naming
    both fields instead of being overwritten silently; ``bit_budget=None`` hands the widths
    back to the user."""
    cfg = QCommConfig.preset("lowbit", bit_budget=3.0)
    chosen = (cfg.weight_bits, cfg.weight_levels, cfg.grad_inter_bits)
    assert (2, "learned", 3) == chosen
    again = cfg.replace(seed=5, ranks_per_node=2)
    assert (again.weight_bits, again.weight_levels, again.grad_inter_bits) == chosen
    for field, value in (("weight_bits", 4), ("grad_inter_bits", 4),
                         ("weight_levels", "uniform")):
        with pytest.raises(ValueError, match=rf"{field}={value!r} cannot be set while "
                                             r"QCommConfig.bit_budget=3.0 is set"):
            cfg.replace(**{field: value})
        with pytest.raises(ValueError, match=rf"{field}={value!r} cannot be set while "
                                             r"QCommConfig.bit_budget=2.5 is set"):
            QCommConfig.preset("lowbit", bit_budget=2.5, **{field: value})
    with pytest.raises(ValueError, match="bit_budget=3.0 is set"):
        QCommConfig.preset("lowbit").replace(bit_budget=3.0, weight_bits=3)
    mine = cfg.replace(bit_budget=None, weight_bits=4, grad_inter_bits=4)
    assert (mine.weight_bits, mine.grad_inter_bits, mine.bit_budget) == (4, 4, None)
    assert mine.replace(seed=1).weight_bits == 4  # no budget: nothing re-chosen
    assert cfg.replace(bit_budget=4.2).weight_levels == "uniform"  # a new budget re-chooses
    assert QCommConfig.from_dict(cfg.to_dict()) == cfg  # round trip of a budget config


def test_lowbit_preset_is_the_frontier_row_it_ships():
    """The preset must be the configuration the frontier measured, not a neighbour of it."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "frontier.py"
    spec = importlib.util.spec_from_file_location("_frontier_rows", path)
    sys.path.insert(0, str(path.parent))
    try:
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(path.parent))
    row = mod.ROWS[mod.LOWBIT_ROW]
    assert QCommConfig.preset(row.preset, **row.overrides) == QCommConfig.preset("lowbit")


def _budget_run(rank: int, world: int, budget: float) -> dict:
    cfg = QCommConfig.preset("lowbit", bit_budget=budget, ranks_per_node=2)
    torch.manual_seed(0)
    model = TinyLM(vocab=97, d=128, hidden=512)
    shard(model, True)
    handle = fsdp_qcomm.enable(model, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for s in range(4):
        if s == 1:
            handle.reset_stats()  # steady state: after the full-precision first gathers
        lm_loss(model, batch(s, rank, vocab=97)).backward()
        opt.step()
        opt.zero_grad()
    st = handle.stats()
    w = st["weight_allgather"]["sending_bits_per_element"]
    g = st["grad_inter"]["sending_bits_per_element"]
    return dict(w=w, g=g, mean=(w + g) / 2, estimate=cfg.node_crossing_bits())


@pytest.mark.parametrize("budget", [3.0, pytest.param(2.5, marks=pytest.mark.long)])
def test_bit_budget_is_met_on_the_wire(budget):
    for r in run_ranks(_budget_run, 4, budget, timeout=300):
        assert r["mean"] <= 1.02 * budget, r  # measured, partial groups and padding included
        assert r["mean"] >= r["estimate"][2] * 0.98, r

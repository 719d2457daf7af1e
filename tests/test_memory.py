"""What fsdp_qcomm keeps per rank (``handle.kept_bytes()``), measured by ``benchmarks/memory.py``
on 4 gloo ranks as 2 nodes x 2, equals the formula its 7B/13B/70B projection uses."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import memory  # noqa: E402

from fsdp_qcomm.testing import run_ranks  # noqa: E402

ROWS = ("fsdp2", "sdp4bit_full", "sdp4bit_node", "lowbit_ef", "hsdp_sdp4bit")
ARGS = dict(vocab=97, dim=90, layers=3, heads=3, seq=33, batch=2, steps=2)


def _rows(rank, world, nodes, gpus):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    import memory as m

    a = argparse.Namespace(**ARGS)
    return {name: m._measure(rank, world, a, m.ROWS[name], nodes, gpus) for name in ROWS}


@pytest.fixture(scope="module")
def measured():
    return run_ranks(_rows, 4, 2, 2, timeout=600)


def test_categories_equal_the_formula_2_nodes_x_2(measured):
    a = argparse.Namespace(**ARGS)
    params = memory._shape(a).params()
    p_pad = memory.padded_params(memory._param_shapes(a), 4)
    for name in ROWS:
        m0 = measured[0][name]
        assert memory.check(a, "2x2", memory.ROWS[name], m0, 2, 2, params) == [], name
        for r in measured:  # every rank keeps the same bytes for fsdp_qcomm
            for cat in ("reference", "error_feedback", "level_tables"):
                assert r[name][cat] == m0[cat], (name, cat)
        assert 0 < m0["live"] <= m0["peak"]
    by = {name: measured[0][name] for name in ROWS}
    # fp32 reference: full (1 + 1/4) of the padded model, node-sharded 1/G = 1/2 of it, HSDP none
    assert by["sdp4bit_full"]["reference"] == p_pad * 4 + p_pad * 4 // 4
    assert by["sdp4bit_node"]["reference"] == p_pad * 4 // 2
    assert by["lowbit_ef"]["reference"] == p_pad * 4 // 2
    assert by["fsdp2"]["reference"] == by["hsdp_sdp4bit"]["reference"] == 0
    # the bound for the node reference: (1/G + 1/world) P
    assert by["sdp4bit_node"]["reference"] <= (1 / 2 + 1 / 4) * params * 4
    # lowbit + grad_error_feedback="inter": hop 2's residuals, [nodes, shard] fp32 (shard
    # Hadamard-padded per span), and level tables
    shard = p_pad * 4 // 4
    assert 2 * shard <= by["lowbit_ef"]["error_feedback"] <= 2 * shard * 1.02
    assert by["lowbit_ef"]["level_tables"] > 0
    assert by["sdp4bit_node"]["error_feedback"] == by["sdp4bit_node"]["level_tables"] == 0
    # HSDP with the presets: FSDP2 shards over the node's 2 ranks, nothing kept for qWD
    assert by["hsdp_sdp4bit"]["params"] == memory.padded_params(memory._param_shapes(a), 2) * 2


def test_projection_7b_on_8_nodes_x_8():
    proj = memory.projection()["7B"]
    full = proj["sdp4bit flat, full reference (before)"]
    node = proj["sdp4bit flat, node reference (now)"]
    assert full["reference"] == pytest.approx((1 + 1 / 64) * 7e9 * 2)
    assert node["reference"] == pytest.approx(7e9 / 8 * 2)  # 1.75 GB, the goal: <= 1.8 GB
    assert node["extra"] <= 1.8e9
    assert proj["sdp4bit HSDP 8 x 8 (replica hop only)"]["extra"] == 0
    assert proj["FSDP2 alone, flat over 64"]["params"] == pytest.approx(7e9 * 4 / 64)
    # one rank per node or one node: the reference stays full
    assert memory.reference_fraction(8, 1, "node", False) == pytest.approx(1 + 1 / 8)
    assert memory.reference_fraction(1, 8, "node", False) == pytest.approx(1 + 1 / 8)


def test_memory_timeline_counts_from_the_session_start():
    ev = [{"name": "[memory]", "ts": 1, "args": {"Bytes": 100, "Total Allocated": 1100}},
          {"name": "[memory]", "ts": 2, "args": {"Bytes": 50, "Total Allocated": 1150}},
          {"name": "memory_measurement", "ts": 3},
          {"name": "[memory]", "ts": 4, "args": {"Bytes": -150, "Total Allocated": 1000}}]
    assert memory.memory_timeline(ev, "memory_measurement") == (150, 150)

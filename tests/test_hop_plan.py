"""fsdp/hop_plan.py: which collectives are quantized on which node layouts (pure, no ranks)."""

from __future__ import annotations

import pytest

from fsdp_qcomm import QCommConfig
from fsdp_qcomm.collectives.topology import plan_layout
from fsdp_qcomm.fsdp import hop_plan


def _layout(ranks, rpn, rank=0):
    return plan_layout(list(ranks), rank, rpn)


def _plan(preset, gather, rs=None, replicas=None, gloo=False, **over):
    cfg = QCommConfig.preset(preset, **over)
    return hop_plan.plan_module(cfg, gather, rs or gather, replicas, gloo=gloo)


def test_flat_across_nodes_quantizes_both_hops_with_a_node_sharded_reference():
    lay = _layout(range(4), 2)  # 2 nodes x 2
    p = _plan("sdp4bit", lay)
    assert p.weights.weight_scheme == "qwd" and p.node_reference
    assert p.reduce_scatter is not None and p.reduce_scatter.grad_scheme == "two_level"
    assert p.replica is None
    assert p.why == (
        "weight all-gather: qwd 4-bit, node-sharded reference (1/2 of the parameters): "
        "2 nodes of 2 rank(s)",
        "gradient reduce-scatter: two-level, 8-bit inside then 4-bit across nodes: 2 nodes of 2 "
        "rank(s)",
    )


@pytest.mark.parametrize("reference", ["node", "full"])
def test_full_reference_when_asked_or_one_rank_per_node(reference):
    one_per_node = _plan("sdp4bit", _layout(range(3), 1), weight_reference=reference)
    assert not one_per_node.node_reference
    assert one_per_node.why[0].startswith(
        "weight all-gather: qwd 4-bit, full reference" + (" (one rank per node)"
                                                          if reference == "node" else ":"))
    two_per_node = _plan("sdp4bit", _layout(range(4), 2), weight_reference=reference)
    assert two_per_node.node_reference == (reference == "node")


def test_unequal_nodes_keep_a_full_reference():
    lay = _layout([0, 1, 2], 2)  # node 0: ranks 0, 1; node 1: rank 2
    p = _plan("qwd", lay)
    assert not p.node_reference
    assert "nodes hold unequal numbers of the group" in p.why[0]


def test_one_node_is_left_to_fsdp_unless_asked():
    lay = _layout(range(4), 4)
    p = _plan("sdp4bit", lay)
    assert p.weights.weight_scheme == "none" and not p.node_reference
    assert p.reduce_scatter is None  # FSDP2's own reduce-scatter on NCCL
    assert all("(quantize_intra_node=False)" in w for w in p.why)
    gloo = _plan("sdp4bit", lay, gloo=True)  # a plain hook, which applies divide factors itself
    assert gloo.reduce_scatter is not None and gloo.reduce_scatter.grad_scheme == "none"
    asked = _plan("sdp4bit", lay, quantize_intra_node=True)
    assert asked.weights.weight_scheme == "qwd" and asked.reduce_scatter.grad_scheme != "none"
    assert not asked.node_reference  # one node: the full reference


def test_hsdp_quantizes_only_the_replica_all_reduce():
    shard = _layout([0, 1], 2)  # a shard group is one node
    replicas = _layout([0, 2], 2)  # the replica group crosses nodes
    p = _plan("sdp4bit", shard, replicas=replicas)
    assert p.weights.weight_scheme == "none" and p.reduce_scatter is None
    assert p.replica is not None and p.replica.grad_scheme == "two_level"
    assert p.why[-1] == "HSDP all-reduce across replicas: quantized 4-bit: 2 nodes of 1 rank(s)"
    # replicas inside one node: FSDP2's own all-reduce
    inside = _plan("sdp4bit", _layout([0], 4), replicas=_layout([0, 1], 4))
    assert inside.replica is None
    assert inside.why[-1].startswith("HSDP all-reduce across replicas: FSDP2's own")
    # grad_overlap needs the hook to defer it, even unquantized
    overlap = _plan("sdp4bit", _layout([0], 4), replicas=_layout([0, 1], 4), grad_overlap=True)
    assert overlap.replica is not None and overlap.replica.grad_scheme == "none"


def test_one_rank_groups_run_no_collective():
    p = _plan("sdp4bit", _layout([0], 1), weight_reuse_unchanged=True)
    assert p.weights.weight_scheme == "none" and not p.weights.reuses_unchanged_weights
    assert p.why == (
        "weight all-gather: none, a group of one rank (FSDP2 runs no collective)",
        "gradient reduce-scatter: none, a group of one rank (FSDP2 runs no collective)",
    )


def test_notes_group_modules_by_decision():
    a = _plan("sdp4bit", _layout(range(4), 2))
    b = _plan("sdp4bit", _layout(range(4), 4))
    plans = {f"m{i}": a for i in range(5)} | {"other": b}
    notes = hop_plan.notes(plans)
    assert len(notes) == 4
    assert notes[0].endswith("[5 module(s): m0, m1, m2, m3 and 1 more]")
    assert notes[2].endswith("[1 module(s): other]")


def test_the_hint_comes_only_when_a_quantizing_config_quantizes_nothing():
    one_node = _layout(range(4), 4)
    plans = {"m": _plan("sdp4bit", one_node)}
    hint = hop_plan.nothing_quantized_hint(plans, QCommConfig.preset("sdp4bit"))
    assert hint is not None and "quantize_intra_node=True" in hint and "ranks_per_node" in hint
    assert hop_plan.nothing_quantized_hint(
        {"m": _plan("baseline", one_node)}, QCommConfig.preset("baseline")) is None
    two_nodes = {"m": _plan("sdp4bit", _layout(range(4), 2))}
    assert hop_plan.nothing_quantized_hint(two_nodes, QCommConfig.preset("sdp4bit")) is None
    asked = {"m": _plan("sdp4bit", one_node, quantize_intra_node=True)}
    assert hop_plan.nothing_quantized_hint(asked, QCommConfig.preset("sdp4bit")) is None

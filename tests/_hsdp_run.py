"""Checks shared by the torchtitan 0.2.2 and 0.3 tests of a CPU run of the debug recipe as HSDP,
2 replicas x 2 shards on 4 ranks that count as 2 nodes x 2 (``ranks_per_node=2``): each shard
group is one node, the replica all-reduce crosses nodes."""

from __future__ import annotations

import math

import pytest

#: the torchtitan flags of the layout (both versions name them alike)
HSDP_FLAGS = ("--parallelism.data_parallel_replicate_degree", "2",
              "--parallelism.data_parallel_shard_degree", "2", "--qcomm.ranks_per_node", "2")


def check_hsdp_sdp4bit_summary(s: dict, steps: int, microbatches: int = 1) -> None:
    """The summary file of ``steps`` logged steps of sdp4bit as HSDP 2 x 2 with
    ``microbatches`` per optimizer step: only the replica all-reduce, the hop that crosses nodes,
    is quantized (4-bit inter-node codes), once per module and optimizer step whatever the
    micro-batch count (the adapters skip it on all but the last micro-batch); the weight
    all-gather and the reduce-scatter stay inside a node, unquantized (the recipe's
    ``grad_overlap`` runs the reduce-scatter through the library's plain hook, so it is
    counted: every micro-batch); every collective's baseline equals the FSDP reference, the
    node-crossing bytes are the replica hop's, and the loss falls."""
    assert s["world_size"] == 2 and s["replicas"] == 2 and s["preset"] == "sdp4bit"
    assert s["installed"] and s["training_steps"] == steps and s["microbatches"] == microbatches
    notes = " | ".join(s["notes"])
    assert "HSDP all-reduce across replicas: quantized 4-bit: 2 nodes of 1 rank(s)" in notes, notes
    assert "weight all-gather: unquantized, its 2 rank(s) share one node" in notes, notes
    assert "gradient reduce-scatter: unquantized, its 2 rank(s) share one node" in notes, notes
    n = s["hooked_modules"]
    assert 0 < n <= s["fsdp_modules"]
    loss = s["loss"]
    assert len(loss) == steps and all(math.isfinite(x) for x in loss)
    assert sum(loss[-2:]) / 2 < loss[0] - 0.3, loss
    cum = s["measured_cumulative"]
    assert set(s["gather_modes"]) == {"plain"}  # no qWD inside a node: no reference
    assert cum["grad_calls"] == steps * microbatches * n  # reduce-scatter every micro-batch
    assert cum["replica_calls"] == steps * n  # one all-reduce across replicas per step
    assert cum["grad_replica_sent"] == cum["replica_sent"] > 0
    assert "grad_inter_sent" not in cum  # a shard group is one node: no inter-node hop
    # only the replica all-reduce leaves a node
    assert cum["replica_cross_node_bytes"] > 0
    assert cum.get("grad_cross_node_bytes", 0) == cum.get("weight_cross_node_bytes", 0) == 0
    ref = s["reference_bytes_per_step"]
    # the reduced fp32 shard, once per step; the reduce-scatter's input every micro-batch
    assert ref["replicas"] == ref["grads"] / (2 * microbatches)
    for h in s["history"]:
        for c in ("weight", "grad", "replica"):
            assert h[f"qcomm/{c}_baseline_bytes_per_step"] == h[f"qcomm/ref_{c}_bytes_per_step"]
        assert h["qcomm/ref_replica_crosses_nodes"] == 1.0
        assert h["qcomm/ref_weight_crosses_nodes"] == h["qcomm/ref_grad_crosses_nodes"] == 0.0
        assert h["qcomm/weight_bits_per_elem"] == h["qcomm/grad_bits_per_elem"] == 32.0
        # 4-bit codes + one fp32 scale per 128 values carried on the wire ...
        assert 4.25 <= h["qcomm/grad_replica_bits_per_elem"] < 4.26
        # ... in three half-shards per all-reduce of a shard (the reduce-scatter's all-to-all
        # is handed both replicas' halves, the all-gather this replica's half)
        assert h["qcomm/replica_bits_per_elem"] == pytest.approx(
            1.5 * h["qcomm/grad_replica_bits_per_elem"], rel=1e-9)
        assert h["qcomm/replica_ratio_vs_unquantized"] == pytest.approx(
            h["qcomm/replica_bits_per_elem"] / 32, rel=1e-12)
        # two of those three half-shards go to the other node
        assert h["qcomm/total_cross_node_bytes_per_step"] == \
            h["qcomm/replica_cross_node_bytes_per_step"] == pytest.approx(
                h["qcomm/replica_bytes_per_step"] * 2 / 3, rel=1e-9)
        sent = sum(h[f"qcomm/{c}_bytes_per_step"] for c in ("weight", "grad", "replica"))
        base = sum(h[f"qcomm/{c}_baseline_bytes_per_step"] for c in ("weight", "grad", "replica"))
        assert h["qcomm/total_ratio_vs_unquantized"] == pytest.approx(sent / base, rel=1e-12)


def check_diloco_summary(s: dict, output: str, steps: int, outer_steps: int) -> None:
    """A run of 2 replica groups x 2 shards with ``--diloco.enable``: the ``diloco:`` part of
    the qcomm line, DiLoCo's counters in the summary's last figures, node-crossing bytes of the
    outer all-reduce only (no per-step replica all-reduce), a falling loss."""
    assert "diloco: node-crossing" in output
    last = s["history"][-1]
    assert last["diloco/inner_steps"] == steps and last["diloco/outer_steps"] == outer_steps
    assert last["diloco/outer_cross_node_bytes_per_inner_step"] > 0
    assert not any(k.startswith("qcomm/grad_replica") and v for k, v in last.items())
    assert s["history"][-1]["loss"] < s["history"][0]["loss"]


def cross_node_bytes_per_step(s: dict) -> float:
    """The node-crossing bytes of one optimizer step (all logged steps agree)."""
    values = {h["qcomm/total_cross_node_bytes_per_step"] for h in s["history"]}
    assert len(values) == 1, values
    return values.pop()

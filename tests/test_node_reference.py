"""The node-sharded qWD reference: the same bits as the full one, at 1/G of its memory.

``NodeShardedQwd`` keeps on each rank only the reference of the shards of the ranks with its
local index (one per node) and rebuilds FSDP's unsharded buffer with an all-gather inside the
node. Its output must be bit for bit the full reference's (``QwdAllGather``: same keys, same
bytes across nodes), over many steps, for every layout of nodes; a gather of unchanged weights
must cross no node; under FSDP, training with it must give the same losses and weights as with
the full reference, with learned levels, gradient accumulation and backward re-gathers, and keep
``(1/G + 1/world)`` of the parameters or less per rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _models import TinyLM, batch, lm_loss, shard
from torch.distributed.fsdp import FSDPModule

import fsdp_qcomm
from fsdp_qcomm import QCommConfig, RngKey
from fsdp_qcomm.collectives.topology import node_topology
from fsdp_qcomm.collectives.weight_gather import NodeShardedQwd, QwdAllGather
from fsdp_qcomm.config import QuantSpec
from fsdp_qcomm.testing import digest, run_ranks

SPEC = QuantSpec(bits=4, group_size=16)
SEGS = (23, 0, 17, 9)  # parameters of odd sizes (and an empty shard of one)


def _collective(rank, world, rpn, steps, direct=True, coalesce=True):
    """FSDP-free: the node-sharded and the full reference side by side, fed the same shards
    (``direct=False``: hop 2 through its staging buffer and permuting copy, the path of layouts
    whose nodes are not consecutive slots; ``coalesce=False``: hop 2's all-gathers one by one,
    as on a gloo group with CUDA tensors)."""
    from fsdp_qcomm.collectives import _c10d

    if not coalesce:
        _c10d.coalesces = lambda group, device: False  # this rank's process only
        _c10d.coalesced = None  # and a call would fail
    group = dist.group.WORLD
    n = sum(SEGS)
    topo = node_topology(group, rpn)
    full = QwdAllGather(n, torch.float32, torch.device("cpu"), SPEC, group, segments=SEGS)
    node = None
    if topo.intra is not None:
        node = NodeShardedQwd(n, torch.float32, torch.device("cpu"), SPEC, group, topo.layout,
                              topo.intra, topo.inter, segments=SEGS)
        assert node._node_starts == [q * rpn for q in range(world // rpn)]
        if not direct:
            node._node_starts = None
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(n, generator=g)
    out = {"equal": [], "cross": [], "reuse_cross": None, "bytes": None}
    for step in range(steps):
        if step:
            x = x + 0.05 * torch.randn(n, generator=g)
        key = RngKey(7, step, rank, 3)
        want = torch.empty(world * n)
        full(x.clone(), key, full=step == 0)
        want.copy_(full.ref)
        if node is None:
            continue
        got = torch.empty(world * n)
        seen = []
        node(x.clone(), key, output=got, full=step == 0, on_done=seen.append)
        out["equal"].append(torch.equal(got, want))
        out["cross"].append(seen[0].cross_node_bytes)
    if node is not None:
        again, seen = torch.empty(world * n), []
        node.reuse("qwd_reuse", output=again, on_done=seen.append)
        out["reuse_equal"] = torch.equal(again, full.ref)
        out["reuse_cross"] = seen[0].cross_node_bytes
        out["bytes"] = (node.nbytes, full.nbytes, node.nodes, node.local)
        out["own"] = torch.equal(node.own_ref, full.own_ref)
    out["ref"] = digest(full.ref)
    return out


@pytest.mark.parametrize("rpn,direct,coalesce", [(1, True, True), (2, True, True),
                                                  (3, True, True), (3, False, True),
                                                  (3, True, False)])
def test_same_bits_as_the_full_reference_6_ranks(rpn, direct, coalesce):
    res = run_ranks(_collective, 6, rpn, 6, direct, coalesce, timeout=300)
    assert len({r["ref"] for r in res}) == 1  # the full reference: identical on every rank
    for r in res:
        if rpn == 1:  # one rank per node: a node's shard is the whole reference
            assert r["equal"] == [] and r["bytes"] is None
            continue
        nodes, local = 6 // rpn, rpn
        assert r["equal"] == [True] * 6 and r["reuse_equal"] and r["own"]
        node_bytes, full_bytes, n_nodes, n_local = r["bytes"]
        assert (n_nodes, n_local) == (nodes, local)
        n = sum(SEGS)
        assert node_bytes == nodes * n * 4 and full_bytes == (6 + 1) * n * 4
        assert r["reuse_cross"] == 0  # unchanged weights: nothing crosses a node
        # the first gather sends the shard itself, then differences, to nodes - 1 peers each
        assert r["cross"][0] == (nodes - 1) * n * 4 and all(
            0 < c < r["cross"][0] for c in r["cross"][1:])


def test_hop_2_gathers_in_place_only_where_each_nodes_members_are_consecutive_slots():
    from fsdp_qcomm.collectives.topology import NodeLayout
    from fsdp_qcomm.collectives.weight_gather import _node_blocks

    def layout(nodes):
        return NodeLayout(global_ranks=tuple(range(6)), ranks_per_node=len(nodes[0]),
                          nodes=nodes, rank=0)

    assert _node_blocks(layout(((0, 1, 2), (3, 4, 5)))) == [0, 3]
    assert _node_blocks(layout(((3, 4, 5), (0, 1, 2)))) == [3, 0]
    assert _node_blocks(layout(((0, 2, 4), (1, 3, 5)))) is None  # interleaved
    assert _node_blocks(layout(((1, 0, 2), (3, 4, 5)))) is None  # out of local order


def _train(rank, world, rpn, reference, preset, raf, micro):
    cfg = QCommConfig.preset(preset, ranks_per_node=rpn, weight_group_size=16,
                             weight_reference=reference)
    torch.manual_seed(0)
    model = TinyLM()
    shard(model, raf)
    handle = fsdp_qcomm.enable(model, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    losses = []
    for step in range(4):
        for m in range(micro):
            model.set_requires_gradient_sync(m == micro - 1)
            loss = lm_loss(model, batch(micro * step + m, rank))
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        losses.append(lm_loss(model, batch(99, rank)).item())
    for m in model.modules():  # reshard_after_forward=False leaves parameters unsharded
        if isinstance(m, FSDPModule):
            m.reshard()
    params = sum(p.numel() for p in model.parameters())
    out = {"losses": losses, "weights": {n: digest(p.to_local()) for n, p in
                                         model.named_parameters()},
           "reference": handle.reference_bytes(), "params": params,
           "modes": handle.gather_modes(), "stats": handle.stats()}
    handle.disable()
    return out


@pytest.mark.parametrize("preset,raf,micro", [
    pytest.param("sdp4bit", True, 1, marks=pytest.mark.long),
    pytest.param("lowbit", True, 2, marks=pytest.mark.long),
    ("sdp4bit", False, 2)])
def test_training_matches_the_full_reference_2_nodes_x_2(preset, raf, micro):
    node = run_ranks(_train, 4, 2, "node", preset, raf, micro)
    full = run_ranks(_train, 4, 2, "full", preset, raf, micro)
    for a, b in zip(node, full):
        assert a["losses"] == b["losses"]
        assert a["weights"] == b["weights"]
        assert a["modes"] == b["modes"]
        # node-crossing weight bytes: no more than the full reference's
        cross = a["stats"]["weight_allgather"]["cross_node_bytes"]
        assert 0 < cross <= b["stats"]["weight_allgather"]["cross_node_bytes"]
        # memory: 2 nodes' shards of 4 (1/G of the padded parameters) against the full
        # reference's world + 1 shards
        assert a["reference"] * (4 + 1) == b["reference"] * 2
        # unchanged weights (backward re-gathers, micro-batches) stay inside the node
        intra = a["stats"]["weight_allgather_intra"]
        assert intra["calls"] == a["stats"]["weight_allgather"]["calls"]


def _memory(rank, world, rpn):
    cfg = QCommConfig.preset("sdp4bit", ranks_per_node=rpn, weight_group_size=16)
    torch.manual_seed(0)
    model = TinyLM(vocab=61, d=30, hidden=53, layers=3)
    shard(model, True)
    handle = fsdp_qcomm.enable(model, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        lm_loss(model, batch(step, rank, vocab=61)).backward()
        opt.step()
        opt.zero_grad()
    params = sum(p.numel() for p in model.parameters())  # the whole model (tied once)
    out = (handle.reference_bytes(), params, handle.stats()["notes"])
    handle.disable()
    return out


@pytest.mark.parametrize("rpn", [2, pytest.param(3, marks=pytest.mark.long)])
def test_kept_bytes_at_most_one_over_g_plus_one_over_world_6_ranks(rpn):
    for kept, params, notes in run_ranks(_memory, 6, rpn, timeout=300):
        assert 0 < kept <= (1 / rpn + 1 / 6) * params * 4, (kept, params)
        assert any("node-sharded reference" in n for n in notes), notes

"""Gradient accumulation under HSDP: one node-crossing all-reduce per optimizer step.

HSDP 2 x 2 (4 gloo ranks counted as 2 nodes of 2, one replica per node) with the presets: the
only traffic that crosses nodes is the all-reduce across replicas (``grad_replica``). With K = 4
micro-batches and ``model.set_requires_all_reduce(micro == K - 1)`` (the documented one-liner)
the bytes this rank sends to the other node per optimizer step equal those of K = 1; without it
FSDP all-reduces every micro-batch (K times the bytes). The torchtitan adapters' schedule
(``titan_common.accumulation.ReplicaSync``, counting forwards as the 0.2.2 adapter does) gives
the same bytes, and refuses an optimizer step whose last micro-batch skipped the all-reduce.
"""

from __future__ import annotations

import pytest
import torch
from _models import TinyLM, batch, lm_loss
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fsdp_qcomm
from fsdp_qcomm import QCommConfig
from fsdp_qcomm.testing import digest, run_ranks
from fsdp_qcomm.titan_common.accumulation import ReplicaSync

STEPS = 2


def _build(preset: str):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = TinyLM()
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    handle = fsdp_qcomm.enable(model, QCommConfig.preset(preset, ranks_per_node=2))
    return model, handle


def _run(rank: int, preset: str, k: int, how: str) -> dict:
    """``STEPS`` optimizer steps of ``k`` micro-batches; ``how``: "one_liner"
    (set_requires_all_reduce(last)), "every" (FSDP's default: all-reduce every micro-batch),
    "sync" (the adapters' ReplicaSync, counting training forwards)."""
    model, handle = _build(preset)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sync = None
    if how == "sync":
        sync = ReplicaSync([model], k)
        sync.install_forward_hook(model)
        sync.attach_optimizers(opt)
    for step in range(STEPS):
        for micro in range(k):
            if how == "one_liner":
                model.set_requires_all_reduce(micro == k - 1)
            (lm_loss(model, batch(k * step + micro, rank)) / k).backward()
        opt.step()
        opt.zero_grad()
    st = handle.stats()
    out = {"summary": st["summary"], "replica": st["grad_replica"],
           "cross": {kind: v["cross_node_bytes"] for kind, v in st.items()
                     if isinstance(v, dict) and "cross_node_bytes" in v and kind != "summary"},
           "digests": {n: digest(p.to_local()) for n, p in model.named_parameters()}}
    if sync is not None:
        out["sync"] = (sync.active, sync.describe())
        # a step whose last micro-batch skipped the all-reduce (one micro-batch of k): refused
        with torch.no_grad():
            lm_loss(model, batch(99, rank))  # evaluation under no_grad: not counted
        lm_loss(model, batch(100, rank)).backward()
        try:
            opt.step()
            out["refused"] = None
        except RuntimeError as e:
            out["refused"] = str(e)
        sync.remove()
    handle.disable()
    return out


def _all(rank: int, world: int) -> dict:
    res = {}
    for preset, runs in (("sdp4bit", [(1, "every"), (4, "one_liner"), (4, "every"),
                                      (4, "sync")]),
                         ("lowbit", [(1, "every"), (4, "one_liner")])):
        for k, how in runs:
            res[(preset, k, how)] = _run(rank, preset, k, how)
    return res


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_all, 4, timeout=600)


@pytest.mark.parametrize("preset", ["sdp4bit", "lowbit"])
def test_node_crossing_bytes_per_step_k4_equal_k1(runs, preset):
    for r in runs:
        one, four = r[(preset, 1, "every")], r[(preset, 4, "one_liner")]
        # the replica all-reduce is the only node-crossing traffic under the presets
        for res in (one, four):
            assert res["summary"]["steps"] == STEPS
            assert res["summary"]["cross_node_bytes"] == res["replica"]["cross_node_bytes"] > 0
            assert set(k for k, v in res["cross"].items() if v) == {"grad_replica"}
        assert four["summary"]["cross_node_bytes_per_step"] == \
            one["summary"]["cross_node_bytes_per_step"]
        assert four["replica"]["calls"] == one["replica"]["calls"]  # one per module and step
        assert four["replica"]["sent_bytes"] == one["replica"]["sent_bytes"]


def test_without_the_one_liner_fsdp_all_reduces_every_micro_batch(runs):
    for r in runs:
        one, every = r[("sdp4bit", 1, "every")], r[("sdp4bit", 4, "every")]
        assert every["replica"]["calls"] == 4 * one["replica"]["calls"]
        assert every["summary"]["cross_node_bytes_per_step"] == \
            4 * one["summary"]["cross_node_bytes_per_step"]


def test_replicas_stay_bit_identical_with_accumulation(runs):
    for key in runs[0]:
        # ranks 0 and 2 (1 and 3) are replicas of the same shard
        assert runs[0][key]["digests"] == runs[2][key]["digests"], key
        assert runs[1][key]["digests"] == runs[3][key]["digests"], key


def test_adapters_schedule_counts_forwards_and_refuses_a_short_step(runs):
    for r in runs:
        sync, one_liner = r[("sdp4bit", 4, "sync")], r[("sdp4bit", 4, "one_liner")]
        assert sync["sync"][0] and "at the last of 4 micro-batches" in sync["sync"][1]
        assert sync["summary"]["cross_node_bytes_per_step"] == \
            one_liner["summary"]["cross_node_bytes_per_step"]
        assert sync["digests"] == one_liner["digests"]  # the same training
        assert sync["refused"] is not None and "never combined" in sync["refused"], \
            sync["refused"]


def test_schedule_is_inactive_without_replicas_or_accumulation():
    model = torch.nn.Linear(2, 2)
    assert ReplicaSync([model], 4).why == "no FSDP modules"
    assert not ReplicaSync([model], 1).active

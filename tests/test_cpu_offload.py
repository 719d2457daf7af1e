"""FSDP2's ``CPUOffloadPolicy`` under ``enable``: sharded parameters, their optimizer state and
gradients live on the CPU while FSDP gathers and computes on the accelerator.

Two things of ours see the CPU shards: the change agreement digests them (``p.data`` writes are
found by content), and DiLoCo keeps its outer state beside them. Both then talk to their peers,
and a process group made for NCCL alone has no backend for CPU tensors. On this CPU machine the
shards and FSDP's compute device are the same, so the trainings below check that offloading
composes with each scheme; the device routing is checked on stand-ins (a ``meta`` compute
device) and with a process group whose only backend is registered for CUDA, which refuses CPU
tensors as an NCCL group does.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _models import MLPNet

import fsdp_qcomm
from fsdp_qcomm.fsdp import change_tracker
from fsdp_qcomm.fsdp.change_tracker import Agreement, Change
from fsdp_qcomm.testing import run_ranks


def _train(rank: int, world: int, preset, offload: bool, write: bool) -> dict:
    """Four AdamW steps, an evaluation forward, then (``write``) a ``p.data`` write and one
    more evaluation forward; the losses, this rank's shards and the gathers' modes."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    torch.manual_seed(0)
    model = MLPNet(3)
    kw = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if offload else {}
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    handle = None
    if preset is not None:  # one rank per node: every gather and reduction is quantized
        handle = fsdp_qcomm.enable(model, fsdp_qcomm.QCommConfig.preset(preset,
                                                                         ranks_per_node=1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1 + rank)
    losses = []
    for _ in range(4):
        loss = model(torch.randn(8, 5, generator=g)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    x = torch.randn(8, 5, generator=g)
    with torch.no_grad():
        losses.append(model(x).pow(2).mean().item())
        if write:  # no optimizer step explains it, no version counter sees it: by content only
            model.blocks[1].fc1.weight.data.mul_(0.5)
        losses.append(model(x).pow(2).mean().item())
    model.reshard()  # the root stays unsharded after a no_grad forward
    out = {"losses": losses,
           "params": {n: p.to_local().clone() for n, p in model.named_parameters()},
           "devices": sorted({str(p.to_local().device) for p in model.parameters()})}
    if handle is not None:
        out["modes"] = handle.gather_modes()
        handle.disable()
    return out


@pytest.mark.parametrize("preset", ["sdp4bit", "qsdp"])
def test_offloaded_shards_train_as_without_offload(preset):
    """Offloading moves no bit under either paper's scheme, and a ``p.data`` write outside an
    optimizer step is still found (the agreement digests the CPU shards) and re-sent in full."""
    runs = {off: run_ranks(_train, 2, preset, off, True, timeout=200) for off in (False, True)}
    for rank in range(2):
        a, b = runs[False][rank], runs[True][rank]
        assert b["devices"] == ["cpu"]
        assert a["losses"] == b["losses"], (a["losses"], b["losses"])
        assert a["params"].keys() == b["params"].keys()
        for name in a["params"]:
            assert torch.equal(a["params"][name], b["params"][name]), name
        assert a["modes"] == b["modes"] == runs[True][0]["modes"]
    if preset == "sdp4bit":  # the write was found: one full-precision gather beyond the
        assert runs[True][0]["modes"]["qwd_full"] == 4 + 1  # first one of each of 4 modules


class _Tracker:
    """A stand-in ``ChangeTracker``: FSDP computes on ``device``; its shard's content answer
    (``change_tracker.content_changes``, patched below) is a CPU tensor when the shard is
    offloaded, else on ``device``."""

    def __init__(self, flags: int, changed: bool, offloaded: bool, device: torch.device) -> None:
        self.name, self.device = "m", device
        self._flags = flags
        self._content = torch.tensor(int(Change.CONTENT) if changed else 0)
        if not offloaded:
            self._content = self._content.to(device)

    def local_flags(self, backward: bool) -> int:
        return self._flags


class _Exchanged(Exception):
    pass


def _agreement_routing(rank: int, world: int) -> dict:
    meta = torch.device("meta")
    seen: dict = {}
    agreement = Agreement(dist.group.WORLD)

    def to_device(flags, device):
        seen["flags"], seen["flags_device"] = list(flags), device
        return torch.tensor(flags, dtype=torch.int64).to(device)

    def gather(out, mine, group=None, async_op=False):
        seen["exchanged"] = {str(out.device), str(mine.device)}
        raise _Exchanged  # meta tensors hold no values to read back

    agreement._to_device = to_device
    trackers = [_Tracker(int(Change.STEP), True, True, meta),
                _Tracker(int(Change.NONE), False, True, meta),
                _Tracker(int(Change.STEP), True, False, meta)]
    original = change_tracker._c10d.all_gather_single, change_tracker.content_changes
    change_tracker._c10d.all_gather_single = gather
    change_tracker.content_changes = lambda ts: [t._content for t in ts]
    try:
        agreement.agree(trackers, "test")
    except _Exchanged:
        pass
    finally:
        change_tracker._c10d.all_gather_single, change_tracker.content_changes = original
    return seen


def test_agreement_exchanges_on_fsdp_compute_device_when_shards_are_offloaded():
    """The flags travel on FSDP's compute device (the ``meta`` stand-in here), never on the
    CPU the offloaded shards' digests come from: an offloaded shard's content answer joins its
    host flags; a shard on the device keeps its device answer."""
    for seen in run_ranks(_agreement_routing, 2, timeout=120):
        assert seen["exchanged"] == {"meta"}, seen
        assert seen["flags_device"] == torch.device("meta")
        assert seen["flags"] == [int(Change.STEP | Change.CONTENT), int(Change.NONE),
                                 int(Change.STEP)]


def _diloco_refusal(rank: int, world: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from fsdp_qcomm.diloco import DiLoCo, DiLoCoConfig

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    fully_shard(model, mesh=mesh["shard"], offload_policy=CPUOffloadPolicy(pin_memory=False))
    cuda_only = dist.new_group([0, 1], backend="cuda:gloo")  # as NCCL: no CPU tensors
    try:
        DiLoCo(model, DiLoCoConfig(), replicas=cuda_only)
    except ValueError as e:
        return str(e)
    return ""


def _tp_refusal(rank: int, world: int) -> str:
    """The groups a merge settles TP-shared values over are checked like the replicas'."""
    from fsdp_qcomm.diloco.engine import _check_carries
    from fsdp_qcomm.diloco.layout import MeshDim

    gloo = dist.new_group([0, 1])
    tp = MeshDim((0, 1), dist.new_group([0, 1], backend="cuda:gloo"), rank, "tp")
    _check_carries(gloo, torch.device("cpu"), False, [])  # a plain group: no replicas to check
    try:
        _check_carries(gloo, torch.device("cpu"), False, [tp])
    except ValueError as e:
        return str(e)
    return ""


def test_diloco_refuses_tp_groups_that_cannot_carry_offloaded_shards():
    for msg in run_ranks(_tp_refusal, 2, timeout=120):
        assert "tensor-parallel (tp) process group" in msg and "cuda:nccl,cpu:gloo" in msg, msg


def test_diloco_refuses_replicas_that_cannot_carry_offloaded_shards():
    """Refused at construction, naming the backend fix, instead of torch's 'No backend type
    associated with device type cpu' after the first round of inner steps."""
    for msg in run_ranks(_diloco_refusal, 2, timeout=120):
        assert "CPUOffloadPolicy" in msg and "cuda:nccl,cpu:gloo" in msg, msg

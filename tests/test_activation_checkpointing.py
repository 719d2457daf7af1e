"""Activation checkpointing (``checkpoint_wrapper`` per block, as torchtitan applies it) beside
``enable``: the recomputation inside backward gathers with the weights its forward used."""

from __future__ import annotations

import torch
from _models import TinyLM, batch, lm_loss, shard

import fsdp_qcomm
from fsdp_qcomm import QCommConfig
from fsdp_qcomm.testing import run_ranks

SDP4 = dict(ranks_per_node=1)


def _ac_run(rank: int, world: int, ac: bool) -> list[float]:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    model = TinyLM()
    if ac:  # activation checkpointing per block, as torchtitan applies it, before fully_shard
        model.blocks = torch.nn.ModuleList(checkpoint_wrapper(b) for b in model.blocks)
    shard(model, True)
    handle = fsdp_qcomm.enable(model, QCommConfig.preset("sdp4bit", **SDP4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(4):
        loss = lm_loss(model, batch(step, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    modes = dict(handle.gather_modes())
    handle.disable()
    return [losses, modes]


def test_activation_checkpointing_trains_bit_identically():
    """checkpoint_wrapper per block: the recomputation inside backward gathers with the
    weights its forward used (qWD reuses them, nothing sent, no random numbers drawn), so the
    run is the run without activation checkpointing, bit for bit."""
    plain = run_ranks(_ac_run, 2, False)
    ac = run_ranks(_ac_run, 2, True)
    assert [r[0] for r in ac] == [r[0] for r in plain]
    assert ac[0][1].get("qwd_reuse", 0) >= plain[0][1].get("qwd_reuse", 0) > 0

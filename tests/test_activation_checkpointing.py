"""Activation checkpointing (``checkpoint_wrapper`` per block, as torchtitan applies it) beside
``enable``: the recomputation inside backward gathers with the weights its forward used, and a
checkpoint resumes whether the resumed run turned it on or off."""

from __future__ import annotations

import torch
from _models import TinyLM, batch, lm_loss, shard

import fsdp_qcomm
from fsdp_qcomm import QCommConfig
from fsdp_qcomm.testing import run_ranks

SDP4 = dict(ranks_per_node=1)


def _build(ac: bool):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    model = TinyLM()
    if ac:  # activation checkpointing per block, as torchtitan applies it, before fully_shard
        model.blocks = torch.nn.ModuleList(checkpoint_wrapper(b) for b in model.blocks)
    shard(model, True)
    handle = fsdp_qcomm.enable(model, QCommConfig.preset("sdp4bit", **SDP4))
    return model, handle, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _steps(model, opt, rank: int, steps) -> list[float]:
    losses = []
    for step in steps:
        loss = lm_loss(model, batch(step, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _ac_run(rank: int, world: int, ac: bool) -> list:
    model, handle, opt = _build(ac)
    losses = _steps(model, opt, rank, range(4))
    modes = dict(handle.gather_modes())
    handle.disable()
    return [losses, modes]


def _resumed_the_other_way(rank: int, world: int, ac: bool) -> list[float]:
    """Two steps with activation checkpointing on (or off), then the model's, the optimizer's
    and the handle's state loaded into a model with it off (or on), and two more steps."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, handle, opt = _build(ac)
    losses = _steps(model, opt, rank, range(2))
    model_state, opt_state = get_state_dict(model, opt)  # torch's names: no wrapper segments
    state = handle.state_dict()
    handle.disable()
    model, handle, opt = _build(not ac)
    set_state_dict(model, opt, model_state_dict=model_state, optim_state_dict=opt_state)
    handle.load_state_dict(state)
    return losses + _steps(model, opt, rank, range(2, 4))


def test_activation_checkpointing_trains_bit_identically():
    """checkpoint_wrapper per block: the recomputation inside backward gathers with the
    weights its forward used (qWD reuses them, nothing sent, no random numbers drawn), so the
    run is the run without activation checkpointing, bit for bit."""
    plain = run_ranks(_ac_run, 2, False)
    ac = run_ranks(_ac_run, 2, True)
    assert [r[0] for r in ac] == [r[0] for r in plain]
    assert ac[0][1].get("qwd_reuse", 0) >= plain[0][1].get("qwd_reuse", 0) > 0


def test_a_checkpoint_resumes_with_activation_checkpointing_turned_on_or_off():
    """The handle's state names parameters as torch's state dicts do, without the wrapper's
    ``_checkpoint_wrapped_module`` segment, so it loads into a model wrapped the other way
    (before: a CheckpointMismatch on the parameter names), and the resumed run is the
    uninterrupted one, bit for bit (the restored qWD reference included)."""
    plain = [r[0] for r in run_ranks(_ac_run, 2, False)]
    for ac in (True, False):
        assert run_ranks(_resumed_the_other_way, 2, ac) == plain


def test_state_names_leave_out_the_wrapper_segments():
    """Activation checkpointing's and torch.compile's module segments, wherever they sit; the
    saved names of older checkpoints go through it too, so they still compare equal."""
    from fsdp_qcomm.fsdp.checkpoint import state_name

    assert state_name("layers.0._checkpoint_wrapped_module.attn._orig_mod.wq.weight") == \
        "layers.0.attn.wq.weight"
    assert state_name("_orig_mod.output.weight") == "output.weight"
    assert state_name("norm.weight") == "norm.weight"

"""``torch.compile`` beside ``enable`` (docs/gpu_path.md section 8): each block compiled, as
torchtitan does, or the whole model, whose graph breaks at every FSDP module. The collectives
run eagerly in FSDP's hooks either way, so a compiled model exchanges what an eager one does."""

from __future__ import annotations

import pytest
import torch
from _models import TinyLM, batch, lm_loss, shard, train_step

import fsdp_qcomm
from fsdp_qcomm import QCommConfig
from fsdp_qcomm.testing import run_ranks

SDP4 = dict(ranks_per_node=1, weight_group_size=64, grad_group_size=32)


def _run(model: TinyLM, rank: int) -> dict:
    handle = fsdp_qcomm.enable(model, QCommConfig.preset("sdp4bit", **SDP4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = [train_step(lm_loss(model, batch(step, rank)), opt) for step in range(4)]
    stats = handle.stats()
    out = {"losses": losses, "modes": dict(handle.gather_modes()),
           "calls": {k: v["calls"] for k, v in stats.items()
                     if isinstance(v, dict) and "calls" in v}}
    handle.disable()
    return out


def _compiled(rank: int, world: int, cases: list) -> dict:
    out = {}
    for name, where, backend in cases:
        torch.manual_seed(0)
        model = TinyLM()
        shard(model, True)
        if where == "blocks":  # after fully_shard, as torchtitan applies it
            for blk in model.blocks:
                blk.compile(backend=backend)
        elif where == "model":
            model.compile(backend=backend)
        out[name] = _run(model, rank)
        torch._dynamo.reset()
    return out


def _check(res: list[dict], names: list[str], rtol: float) -> None:
    for r in res:
        eager = r["eager"]
        assert eager["modes"].get("qwd_diff", 0) > 0 and eager["calls"]["grad_inter"] > 0
        for name in names:
            got = r[name]
            # the same collectives, as many times: the hooks ran eagerly around the graphs
            assert got["calls"] == eager["calls"] and got["modes"] == eager["modes"], name
            assert got["losses"] == pytest.approx(eager["losses"], rel=rtol), name


def test_compiled_blocks_exchange_what_eager_does():
    """Blocks traced by Dynamo and AOTAutograd (``aot_eager``: the graphs that inductor would
    generate code for) train with the eager run's collectives and losses."""
    cases = [("eager", None, None), ("blocks", "blocks", "aot_eager"),
             ("model", "model", "aot_eager")]
    res = run_ranks(_compiled, 2, cases, timeout=600)
    _check(res, ["blocks", "model"], 1e-5)


@pytest.mark.long
def test_inductor_compiled_blocks_train_like_eager():
    """Inductor's generated kernels per block (as torchtitan compiles) and for the whole model:
    the same collectives, losses within fused-kernel rounding."""
    cases = [("eager", None, None), ("blocks", "blocks", "inductor"),
             ("model", "model", "inductor")]
    res = run_ranks(_compiled, 2, cases, timeout=900)
    _check(res, ["blocks", "model"], 1e-3)


def _compiled_step(rank: int, world: int) -> dict:
    out = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = TinyLM()
        shard(model, True)
        handle = fsdp_qcomm.enable(model, QCommConfig.preset("sdp4bit", **SDP4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step = torch.compile(opt.step, backend="eager") if compiled else opt.step
        losses = []
        for s in range(3):
            loss = lm_loss(model, batch(s, rank))
            loss.backward()
            step()
            opt.zero_grad()
            losses.append(loss.item())
        before = handle.gather_modes().get("qwd_full", 0)
        with torch.no_grad():  # right after a step: re-sent exactly, found by the step digest
            for p in model.parameters():
                p.data.mul_(0.5)
            lm_loss(model, batch(9, rank))
        out[compiled] = {"losses": losses,
                         "full": handle.gather_modes().get("qwd_full", 0) - before}
        handle.disable()
        torch._dynamo.reset()
    return out


def test_a_compiled_optimizer_step_runs_the_step_hooks_eagerly():
    """``torch.compile(opt.step)``: the hooks ``enable`` installs around every step (the step
    digest among them) run eagerly; Dynamo tracing into them crashed in the digest."""
    for r in run_ranks(_compiled_step, 2):
        assert r[True]["losses"] == pytest.approx(r[False]["losses"], rel=1e-4)
        assert r[True]["full"] == r[False]["full"] == 3, r  # every module, exactly

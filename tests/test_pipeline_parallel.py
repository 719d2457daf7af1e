"""Pipeline parallelism (``torch.distributed.pipelining``) with FSDP2 over each stage's
data-parallel ranks, as torchtitan stacks them: each stage's module is ``fully_shard``-ed over
the ``dp`` dimension and ``enable``-d on its own; the stage-to-stage activations are not ours.

What could go wrong: a schedule runs several microbatches' forwards before their backwards
(GPipe) or interleaves them (1F1B), skips gradient reduction until the last microbatch, and the
two stages never run the same collective at the same time, so every gather decision and every
agreement must stay inside a stage's data-parallel group. Checked on 2 stages x 2
data-parallel ranks, each rank its own node (every weight gather and gradient reduction
quantized), with ``consistency_check_every=1``: every forward gather compares the gathered
weights across the stage's ranks and raises on the first difference.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fsdp_qcomm.testing import run_ranks

D, MICRO, STEPS = 16, 4, 4


def _pipeline(rank: int, world: int, preset, schedule: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    import fsdp_qcomm

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
              for _ in range(4)]
    stage_module = nn.Sequential(*blocks[2 * pp:2 * pp + 2])
    for block in stage_module:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(stage_module, mesh=mesh["dp"])
    handle = None
    if preset is not None:
        handle = fsdp_qcomm.enable(stage_module, fsdp_qcomm.QCommConfig.preset(
            preset, ranks_per_node=1, consistency_check_every=1))
    stage = PipelineStage(stage_module, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    sched = kind(stage, n_microbatches=MICRO, loss_fn=lambda out, y: ((out - y) ** 2).mean())
    opt = torch.optim.AdamW(stage_module.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + dp)  # each data-parallel rank its batch
        x = torch.randn(2 * MICRO, D, generator=g)
        if pp == 0:
            sched.step(x)
        else:
            micro: list = []
            sched.step(target=torch.sin(x), losses=micro)
            losses.append(float(torch.stack(micro).detach().mean()))
        opt.step()
        opt.zero_grad()
    out = {"pp": pp, "dp": dp, "losses": losses}
    if handle is not None:
        stats = handle.stats()
        out["modes"] = handle.gather_modes()
        out["kinds"] = {k: (v["calls"], round(v["bits_per_element"], 2))
                        for k, v in stats.items() if isinstance(v, dict) and "calls" in v}
        handle.disable()
    return out


def _check(preset: str, schedule: str) -> None:
    base = run_ranks(_pipeline, 4, None, schedule, timeout=240)
    runs = run_ranks(_pipeline, 4, preset, schedule, timeout=240)
    modules = 2  # per stage: two blocks with parameters (the stage's root holds none)
    for b, r in zip(base, runs):
        assert (b["pp"], b["dp"]) == (r["pp"], r["dp"])
        if r["pp"] == 1:  # the last stage computes the loss: within the schemes' noise
            assert len(r["losses"]) == STEPS
            for lb, lq in zip(b["losses"], r["losses"]):
                assert abs(lq - lb) <= 0.02 * lb, (b["losses"], r["losses"])
        kinds = r["kinds"]
        # one reduction per module and optimizer step (the schedule defers it to the last
        # microbatch's backward), quantized; every forward gather compared across the stage
        grad = [k for k in kinds if k.startswith("grad_")]
        assert grad and all(kinds[k][0] == modules * STEPS for k in grad), kinds
        assert all(kinds[k][1] < 10 for k in grad), kinds
        assert kinds["weight_allgather"][1] < 10, kinds
        assert sum(r["modes"].values()) >= modules * STEPS * MICRO, r["modes"]
    if preset == "sdp4bit":  # one full gather each, then differences, then reuse
        modes = runs[0]["modes"]
        assert modes["qwd_full"] == modules and modes["qwd_diff"] == modules * (STEPS - 1), modes


def test_pipeline_1f1b_with_sdp4bit_stages():
    _check("sdp4bit", "1f1b")


@pytest.mark.long
@pytest.mark.parametrize("preset,schedule", [("sdp4bit", "gpipe"), ("qsdp", "1f1b"),
                                             ("qsdp", "gpipe")])
def test_pipeline_schedules_and_schemes(preset, schedule):
    _check(preset, schedule)

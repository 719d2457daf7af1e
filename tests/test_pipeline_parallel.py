"""Pipeline parallelism (``torch.distributed.pipelining``) with FSDP2 over each stage's
data-parallel ranks, as torchtitan stacks them: each stage's module is ``fully_shard``-ed over
the ``dp`` dimension and ``enable``-d on its own; the stage-to-stage activations are not ours.

What could go wrong: a schedule runs several microbatches' forwards before their backwards
(GPipe) or interleaves them (1F1B), skips gradient reduction until the last microbatch, and the
two stages never run the same collective at the same time, so every gather decision and every
agreement must stay inside a stage's data-parallel group. Checked on 2 pipeline ranks x 2
data-parallel ranks (one stage per rank, or two under interleaved 1F1B: two ``enable`` handles
in one process), each rank its own node (every weight gather and gradient reduction
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
    """Four blocks over 2 pipeline ranks: two stages of two blocks (GPipe, 1F1B; each block
    sharded, the stage its FSDP root), or four one-block stages, two per rank (interleaved
    1F1B; each stage its own FSDP root and its own ``enable``). Either way two FSDP modules
    with parameters per rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    import fsdp_qcomm

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
              for _ in range(4)]
    if schedule == "interleaved":
        stage_modules = {pp: blocks[pp], pp + 2: blocks[pp + 2]}
    else:
        stage_modules = {pp: nn.Sequential(*blocks[2 * pp:2 * pp + 2])}
        for block in stage_modules[pp]:
            fully_shard(block, mesh=mesh["dp"])
    handles, stages = [], []
    for index, module in stage_modules.items():
        fully_shard(module, mesh=mesh["dp"])
        if preset is not None:
            handles.append(fsdp_qcomm.enable(module, fsdp_qcomm.QCommConfig.preset(
                preset, ranks_per_node=1, consistency_check_every=1)))
        stages.append(PipelineStage(module, index, 2 * len(stage_modules), torch.device("cpu"),
                                    group=mesh["pp"].get_group()))
    loss_fn = lambda out, y: ((out - y) ** 2).mean()  # noqa: E731
    if schedule == "interleaved":
        sched = ScheduleInterleaved1F1B(stages, n_microbatches=MICRO, loss_fn=loss_fn)
    else:
        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        sched = kind(stages[0], n_microbatches=MICRO, loss_fn=loss_fn)
    opt = torch.optim.AdamW([p for m in stage_modules.values() for p in m.parameters()], lr=1e-2)
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
    if handles:  # summed over the rank's handles (bits per element: the largest)
        out["modes"], out["kinds"] = {}, {}
        for handle in handles:
            for k, v in handle.gather_modes().items():
                out["modes"][k] = out["modes"].get(k, 0) + v
            for k, v in handle.stats().items():
                if isinstance(v, dict) and "calls" in v:
                    calls, bits = out["kinds"].get(k, (0, 0.0))
                    bits = max(bits, round(v["bits_per_element"], 2))
                    out["kinds"][k] = (calls + v["calls"], bits)
            handle.disable()
    return out


def _check(preset: str, schedule: str) -> None:
    base = run_ranks(_pipeline, 4, None, schedule, timeout=240)
    runs = run_ranks(_pipeline, 4, preset, schedule, timeout=240)
    modules = 2  # FSDP modules with parameters per rank (``_pipeline``)
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
        if schedule != "interleaved":  # the blocks reshard after each microbatch's forward
            assert kinds["weight_allgather"][1] < 10, kinds
            assert sum(r["modes"].values()) >= modules * STEPS * MICRO, r["modes"]
        # (one-block stages are FSDP roots, which gather about once per step: the first,
        # full-precision gather weighs on the average, more so on torch 2.11; the modes below
        # say the rest were quantized differences)
    if preset == "sdp4bit":  # one full gather each, then differences, then reuse
        modes = runs[0]["modes"]
        assert modes["qwd_full"] == modules and modes["qwd_diff"] == modules * (STEPS - 1), modes


def test_pipeline_1f1b_with_sdp4bit_stages():
    _check("sdp4bit", "1f1b")


@pytest.mark.long
@pytest.mark.parametrize("preset,schedule", [("sdp4bit", "gpipe"), ("qsdp", "1f1b"),
                                             ("qsdp", "gpipe"), ("sdp4bit", "interleaved")])
def test_pipeline_schedules_and_schemes(preset, schedule):
    _check(preset, schedule)

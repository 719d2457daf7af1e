"""Every preset and every ``QCommConfig`` field, through the real hooks and the figures both
torchtitan adapters log: nothing the library records can crash a metrics log, and every byte
it records is counted.

One launch of 4 gloo ranks as 2 "nodes" x 2 (``ranks_per_node=2``) trains a tiny FSDP model
3 steps per variant of ``tests/_qcomm_fields.py`` (each field at each other value it can take)
and hands the handles' stats to ``titan_common.comm_stats`` exactly as the metrics processors
do: figures at steps 1 and 3, the console line, the summary file.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: _models, _qcomm_fields

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _models import MLPBlock  # noqa: E402
from _qcomm_fields import field_variants  # noqa: E402

from fsdp_qcomm import QCommConfig  # noqa: E402
from fsdp_qcomm.testing import run_ranks  # noqa: E402
from fsdp_qcomm.titan_common import comm_stats  # noqa: E402
from fsdp_qcomm.titan_common.install import install_qcomm  # noqa: E402

VARIANTS = field_variants()


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(24, 40)
        self.blocks = nn.ModuleList(MLPBlock(40, 72) for _ in range(2))
        self.out = nn.Linear(40, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def _config(preset: str, overrides: dict) -> QCommConfig:
    # 4 ranks on one host as 2 "nodes": the library wants that said explicitly
    return QCommConfig.preset(preset, **{"ranks_per_node": 2, **overrides})


def _one(variant: tuple, rank: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    name, preset, overrides = variant
    torch.manual_seed(0)
    model = _Net()
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    cfg = _config(preset, overrides)
    (att,) = install_qcomm([model], cfg, preset=preset, overrides=overrides)
    run = comm_stats.QCommRun(microbatches=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    figs, lines = {}, []
    for step in (1, 2, 3):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(8, 24, generator=g)
        loss = F.mse_loss(model(x), x.flip(1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step in (1, 3):
            figs[step] = run.figures(step, [model])
            lines.append(run.record(step, loss.item(), 0.0, figs[step]))
    summary = json.loads(json.dumps(run.summary([model], "test", "tiny")))
    stats = att.handle.stats()
    att.handle.disable()
    if rank != 0:
        return {}
    return {"figs": figs, "lines": lines, "summary": summary, "stats": stats}


def _all(rank: int, world: int) -> dict:
    return {v[0]: _one(v, rank) for v in VARIANTS}


@pytest.fixture(scope="module")
def results() -> dict:
    return run_ranks(_all, 4, timeout=600)[0]


@pytest.mark.parametrize("variant", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_variant_runs_and_every_byte_is_counted(results, variant):
    name, preset, overrides = variant
    r = results[name]
    cfg = _config(preset, overrides)
    stats, summary, figs = r["stats"], r["summary"], r["figs"]
    assert all(line.startswith("qcomm: ") and "nan" not in line for line in r["lines"])
    assert summary["installed"] and summary["training_steps"] == 3
    assert summary["qcomm_config"] == cfg.to_dict()
    # every kind the handle recorded is in the cumulative counters the figures come from
    cum = summary["measured_cumulative"]
    kinds = [k for k in stats if k not in comm_stats.NOT_KINDS]
    for k in kinds:
        assert cum[f"{k}_sent"] == stats[k]["sent_bytes"], k
    groups = {comm_stats.collective_of(k).name for k in kinds}
    assert sum(cum[f"{g}_sent"] for g in groups) == sum(stats[k]["sent_bytes"] for k in kinds)
    late = figs[3]  # steps 2-3
    for c in comm_stats.COLLECTIVES:
        if f"qcomm/{c.name}_bytes_per_step" in late and c.reference in ("weight", "grad"):
            # the library's baseline equals the one computed from FSDP's parameter groups
            assert late[f"qcomm/{c.name}_baseline_bytes_per_step"] == \
                late[f"qcomm/ref_{c.reference}_bytes_per_step"], c.name
    assert ("qcomm/grad_bytes_per_step" in late) == (cfg.grad_scheme != "none")
    learned = cfg.weight_levels == "learned" or cfg.grad_levels == "learned"
    assert ("levels_sync" in stats) == learned
    if learned:  # the table exchanges (on first use; after qWD's full first gather) show up
        assert any(f.get("qcomm/levels_bytes_per_step", 0) > 0 for f in figs.values())
        assert any(" L " in line and "(overhead)" in line for line in r["lines"])
    # the handle's own node-crossing total (stats["summary"]) is what the figures add up
    assert summary["measured_cumulative"].get("weight_cross_node_bytes", 0) + sum(
        cum.get(f"{g}_cross_node_bytes", 0) for g in groups - {"weight"}
    ) == stats["summary"]["cross_node_bytes"]
    # and FSDP2's, which the handle counts per call, is what FSDP's parameter groups give
    # (fp32 parameters and gradients here; two-level hops count their one baseline once)
    if "qcomm/weight_bytes_per_step" in late and "qcomm/grad_bytes_per_step" in late:
        s = stats["summary"]
        assert s["baseline_cross_node_bytes"] == 3 * late.get(
            "qcomm/ref_cross_node_fp32_bytes_per_step", 0.0), name
        assert s["baseline_bytes"] == 3 * (late["qcomm/ref_weight_bytes_per_step"]
                                           + late["qcomm/ref_grad_bytes_per_step"]), name
    # every collective FSDP2 also runs costs at most what FSDP2 hands over (the table and
    # agreement overhead included); the node-sharded reference's intra-node hop (no FSDP2
    # counterpart, no baseline) comes on top of the total ratio, never across nodes
    counted = [c.name for c in comm_stats.COLLECTIVES if c.counts_baseline]
    sent = sum(late.get(f"qcomm/{c}_bytes_per_step", 0.0) for c in counted)
    base = sum(late.get(f"qcomm/{c}_baseline_bytes_per_step", 0.0) for c in counted)
    intra = late.get("qcomm/weight_intra_bytes_per_step", 0.0)
    assert sent <= base * (1.0 + 1e-9), (sent, base)
    total = late["qcomm/total_ratio_vs_unquantized"]
    assert math.isfinite(total) and 0 < total and (intra > 0 or total <= 1.0 + 1e-9), total

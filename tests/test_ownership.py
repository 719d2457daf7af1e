"""What ``enable`` installs lives and dies with the model, not with the handle or the process.

The guards keep working when the caller drops the ``QCommHandle`` (FSDP holds the hooks, the
hooks hold the session), a replaced hook or collective stops training on every rank before an
unsynchronized step, and a dropped model takes everything along (no module-global table keeps
it, its process groups or its reduction thread alive).
"""

from __future__ import annotations

import gc
import threading
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F
from _models import MLPBlock
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fsdp_qcomm
from fsdp_qcomm import QCommConfig
from fsdp_qcomm.testing import run_ranks

CFG = QCommConfig.preset("sdp4bit", ranks_per_node=2, weight_group_size=16)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(10, 10)
        self.blocks = nn.ModuleList(MLPBlock(10, 19) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return h


def _build(hsdp: bool) -> nn.Module:
    torch.manual_seed(0)
    model = _Net()
    kw = {}
    if hsdp:
        kw["mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for b in model.blocks:
        fully_shard(b, **kw)
    fully_shard(model, **kw)
    return model


def _step(model, opt, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(4, 10, generator=g)
    F.mse_loss(model(x), x.sin()).backward()
    opt.step()
    opt.zero_grad()


def _dropped_handle(rank, world):
    out = {}
    # 1. the handle is dropped at once: HSDP's guard still stops a replaced all-reduce hook
    model = _build(hsdp=True)
    fsdp_qcomm.enable(model, CFG.replace(grad_overlap=True))
    gc.collect()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, opt, rank, 0)
    model.blocks[1].set_all_reduce_hook(lambda t: None)
    try:
        _step(model, opt, rank, 1)
        out["hook"] = "no error"
    except RuntimeError as e:
        out["hook"] = str(e)

    # 2. a replaced all-gather is refused before the next forward (any optimizer, none at all)
    model = _build(hsdp=False)
    fsdp_qcomm.enable(model, CFG)
    gc.collect()
    with torch.no_grad():
        model(torch.randn(2, 10))
    model.blocks[0].set_custom_all_gather(None)
    try:
        with torch.no_grad():
            model(torch.randn(2, 10))
        out["gather"] = "no error"
    except RuntimeError as e:
        out["gather"] = str(e)

    # 3. a dropped model (and handle) is collected, with its reduction thread
    model = _build(hsdp=True)
    handle = fsdp_qcomm.enable(model, CFG.replace(grad_overlap=True))
    _step(model, torch.optim.SGD(model.parameters(), lr=0.1), rank, 0)
    alive = weakref.ref(model)
    session = weakref.ref(handle._session)
    threads = [t for t in threading.enumerate() if t.name.startswith("fsdp_qcomm_grad")]
    del model, handle
    gc.collect()
    out["collected"] = (alive() is None, session() is None)
    out["threads"] = (len(threads) > 0,
                      [t.name for t in threading.enumerate() if t.is_alive() and t in threads])
    return out


def test_guards_outlive_a_dropped_handle_and_die_with_the_model():
    for r in run_ranks(_dropped_handle, 4):
        assert "all-reduce hook was replaced after fsdp_qcomm.enable()" in r["hook"], r["hook"]
        assert "'blocks.1'" in r["hook"], r["hook"]
        assert "all-gather was replaced after fsdp_qcomm.enable()" in r["gather"], r["gather"]
        assert "'blocks.0'" in r["gather"], r["gather"]
        assert r["collected"] == (True, True), r
        had_thread, still_alive = r["threads"]
        assert had_thread and still_alive == [], r


def _ours(hooks: dict) -> int:
    return sum(getattr(h, "__module__", "") == "fsdp_qcomm.fsdp.session" for h in hooks.values())


def _optimizer_hooks(rank, world):
    from torch.optim import optimizer

    def count():
        return (_ours(optimizer._global_optimizer_pre_hooks),
                _ours(optimizer._global_optimizer_post_hooks))

    out = {"before": count()}
    a, b = _build(hsdp=False), _build(hsdp=False)
    ha = fsdp_qcomm.enable(a, CFG)
    hb = fsdp_qcomm.enable(b, CFG)
    out["two"] = count()
    ha.disable()
    out["one left"] = count()
    _step(b, torch.optim.SGD(b.parameters(), lr=0.1), rank, 0)  # b's session still counts
    out["b steps"] = hb.stats()["summary"]["steps"]
    hb.disable()
    out["none"] = count()
    hc = fsdp_qcomm.enable(_build(hsdp=False), CFG)
    out["again"] = count()
    hc.disable()
    return out


def test_optimizer_step_hooks_live_while_a_session_does():
    """One pair of process-wide ``torch.optim`` step hooks while any session lives, whatever
    their number; the last ``disable`` removes them, so nothing of ours runs in a later step;
    a later ``enable`` registers them again."""
    for r in run_ranks(_optimizer_hooks, 2):
        assert r["before"] == (0, 0) and r["none"] == (0, 0), r
        assert r["two"] == r["one left"] == r["again"] == (1, 1), r
        assert r["b steps"] == 1, r

"""Deliberately broken FSDP2 internals: each must stop ``enable`` (or the first step, where the
change can only be seen while training) with an error that names the torch version and what
moved, or, where only speed is at stake, say why in the handle's notes; never train on with
other bytes or gradients.

Each case breaks one thing the way a torch release could: an attribute of a live parameter
group hidden (renamed or removed), a helper taking its arguments in another order, FSDP keeping
its own replica group instead of reading the one ``enable`` swapped in, a division after the
reductions that makes deferral impossible. The checks that need ranks run in one 4-rank spawn.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _models import MLPBlock
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_collectives
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

from fsdp_qcomm import QCommConfig, enable
from fsdp_qcomm.fsdp import internals
from fsdp_qcomm.fsdp.internals import FSDPInternalsChanged, unverified_param_groups
from fsdp_qcomm.testing import run_ranks

D, H = 8, 13
VERSION = torch.__version__.split("+")[0]
ROOT = Path(__file__).resolve().parents[1]

#: attributes of a live FSDPParamGroup fsdp_qcomm reads (``internals.verify_group``)
GROUP_ATTRS = [
    "fsdp_params", "modules", "device", "mesh_info", "_all_gather_comm", "_reduce_scatter_comm",
    "_all_reduce_hook", "_all_gather_result", "_partial_reduce_output", "post_forward_mesh_info",
    "gradient_divide_factor", "force_sum_reduction_for_comms", "all_reduce_grads",
    "reduce_grads", "_use_post_forward_mesh", "is_sharded_post_forward", "is_sharded",
    "_training_state",
] + (["mp_policy"] if internals.torch_minor() < (2, 15) else [])
#: attributes of each FSDPParam
PARAM_ATTRS = [
    "sharded_param", "padded_sharded_param_size", "_sharded_local_tensor", "_sharded_param_data",
    "offload_to_cpu", "mp_policy", "_module_info",
] + (["sharded_grad_dtype"] if internals.torch_minor() >= (2, 15) else [])
#: attributes of the HSDP mesh info
MESH_ATTRS = ["shard_process_group", "replicate_process_group"]


def _config(**kw) -> QCommConfig:
    return QCommConfig.preset("sdp4bit", ranks_per_node=2, weight_group_size=64,
                              grad_group_size=32, **kw)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(D, H) for _ in range(2))
        self.head = nn.Linear(D, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _build(shape: tuple[int, ...]) -> nn.Module:
    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    torch.manual_seed(0)
    model = Net()
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _groups(model: nn.Module) -> list:
    return [g for m in model.modules() if isinstance(m, FSDPModule)
            for g in unverified_param_groups(m)]  # unverified on purpose


def _step(model: nn.Module, rank: int) -> None:
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(4, D, generator=g), torch.randn(4, 5, generator=g)
    F.mse_loss(model(x), y).backward()


def _outcome(fn) -> tuple[str, str]:
    """(error type name, message), or ("", "") when nothing was raised."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the type is what the tests assert
        return type(e).__name__, str(e)
    return "", ""


def _hide(obj, attr: str):
    """Make ``obj.attr`` disappear (as a release that renamed or removed it would) by giving
    ``obj`` a subclass whose property of that name raises AttributeError; returns the undo."""
    cls = type(obj)

    def gone(self):
        raise AttributeError(f"{cls.__name__!r} object has no attribute {attr!r}")

    obj.__class__ = type(cls.__name__, (cls,), {attr: property(gone)})
    return lambda: setattr(obj, "__class__", cls)


def _forced_sum_factors(reduce_scatter_group, all_reduce_group, reduce_dtype, device_type="",
                        factor=None, force_sum_reduction_for_comms=False):
    """``_get_gradient_divide_factors`` of a release that always reduces with SUM and divides
    afterwards (as FSDP already does on MTIA): same signature, same averages."""
    return _ORIG_FACTORS(reduce_scatter_group, all_reduce_group, reduce_dtype, device_type,
                         factor, True)


def _reordered_factors(all_reduce_group, reduce_scatter_group, reduce_dtype, device_type="",
                       factor=None, force_sum_reduction_for_comms=False):
    return _ORIG_FACTORS(reduce_scatter_group, all_reduce_group, reduce_dtype, device_type,
                         factor, force_sum_reduction_for_comms)


_ORIG_FACTORS = _fsdp_collectives._get_gradient_divide_factors


# ---- checks that need no process group ----------------------------------------------------------
def _assert_names(err: BaseException, *words: str) -> None:
    msg = str(err)
    assert f"torch {VERSION}" in msg and all(w in msg for w in words), msg


def test_reordered_divide_factor_arguments_are_refused(monkeypatch):
    monkeypatch.setattr(_fsdp_collectives, "_get_gradient_divide_factors", _reordered_factors)
    with pytest.raises(FSDPInternalsChanged) as e:
        internals.verify_torch()
    _assert_names(e.value, "_get_gradient_divide_factors", "all_reduce_group")


def test_torch_below_the_minimum_is_refused_naming_it(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.9.1+cu128")
    with pytest.raises(FSDPInternalsChanged) as e:
        internals.verify_torch()
    assert "needs torch >= 2.10; this is torch 2.9.1" in str(e.value), e.value
    monkeypatch.setattr(torch, "__version__", "2.10.0+cpu")
    internals.verify_torch()


def test_missing_pre_backward_state_is_refused(monkeypatch):
    from enum import Enum

    monkeypatch.setattr(internals, "TrainingState", Enum("TrainingState", "FORWARD IDLE"))
    with pytest.raises(FSDPInternalsChanged) as e:
        internals.verify_torch()
    _assert_names(e.value, "PRE_BACKWARD")


def test_missing_graph_task_id_is_refused(monkeypatch):
    monkeypatch.delattr(torch._C, "_current_graph_task_id")
    with pytest.raises(FSDPInternalsChanged) as e:
        internals.verify_torch()
    _assert_names(e.value, "_current_graph_task_id")


def test_replica_group_no_longer_a_property_is_refused(monkeypatch):
    monkeypatch.setattr(FSDPParamGroup, "_all_reduce_process_group", None)
    with pytest.raises(FSDPInternalsChanged) as e:
        internals.verify_torch()
    _assert_names(e.value, "_all_reduce_process_group", "property")


def test_missing_comm_base_class_fails_the_import_with_the_torch_version():
    code = ("import torch.distributed.fsdp._fully_shard._fsdp_api as api\n"
            "del api.AllGather\n"
            "import fsdp_qcomm\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + sys.path))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    assert proc.returncode != 0
    assert f"fsdp_qcomm: FSDP2 in torch {VERSION}" in proc.stderr and "AllGather" in \
        proc.stderr, proc.stderr[-2000:]


# ---- the battery on 4 ranks ----------------------------------------------------------------------
def _battery(rank: int, world: int) -> dict:
    res: dict = {"hidden": {}}

    # 1. every private attribute fsdp_qcomm reads, hidden on a live group: enable refuses,
    #    naming it, and installs nothing
    model = _build((2, 2))
    group = _groups(model)[0]
    targets = ([("FSDPParamGroup", a, group) for a in GROUP_ATTRS]
               + [("FSDPParam", a, group.fsdp_params[0]) for a in PARAM_ATTRS]
               + [("HSDPMeshInfo", a, group.mesh_info) for a in MESH_ATTRS])
    for owner, attr, obj in targets:
        undo = _hide(obj, attr)
        try:
            res["hidden"][f"{owner}.{attr}"] = _outcome(lambda: enable(model, _config()))
        finally:
            undo()

    # 2. _get_gradient_divide_factors with its groups the other way round: enable refuses
    _fsdp_collectives._get_gradient_divide_factors = _reordered_factors
    try:
        res["reordered"] = _outcome(lambda: enable(model, _config()))
    finally:
        _fsdp_collectives._get_gradient_divide_factors = _ORIG_FACTORS

    # 3. the same model, untouched: enable and a step work (the errors above came from the
    #    breakage, and a refused enable left nothing installed)
    def clean():
        handle = enable(model, _config())
        _step(model, rank)
        handle.disable()

    res["clean"] = _outcome(clean)

    # 4. FSDP keeps the real replica group (cached) instead of reading the swapped one: its own
    #    full-precision all-reduce would run beside ours; the first backward must stop
    model = _build((2, 2))
    cache = {id(g): g.mesh_info.replicate_process_group for g in _groups(model)}
    prop = FSDPParamGroup._all_reduce_process_group
    FSDPParamGroup._all_reduce_process_group = property(
        lambda self: cache.get(id(self), self.mesh_info.replicate_process_group))
    try:
        enable(model, _config())
        res["cached_replica_group"] = _outcome(lambda: _step(model, rank))
    finally:
        FSDPParamGroup._all_reduce_process_group = prop

    # 4b. the same under DiLoCo's isolation (isolate_replicas): FSDP's all-reduce on the cached
    #     real group would average the replica groups at every step; the first backward stops
    from fsdp_qcomm.diloco import isolate_replicas

    model = _build((2, 2))
    cache = {id(g): g.mesh_info.replicate_process_group for g in _groups(model)}
    FSDPParamGroup._all_reduce_process_group = property(
        lambda self: cache.get(id(self), self.mesh_info.replicate_process_group))
    try:
        isolate_replicas(model)
        res["cached_replica_group_isolated"] = _outcome(lambda: _step(model, rank))
    finally:
        FSDPParamGroup._all_reduce_process_group = prop

    # 5. grad_overlap when FSDP divides after every reduction (deferral impossible): nothing is
    #    deferred, the notes say why; unpatched, the 1-D run defers
    def overlap(shape, factors) -> dict:
        m = _build(shape)
        _fsdp_collectives._get_gradient_divide_factors = factors
        try:
            h = enable(m, _config(grad_overlap=True))
            _step(m, rank)
            h._session.queue.drain()  # the optimizer step would wait for them
            out = {"deferred": h.deferred_reductions, "notes": h.stats()["notes"],
                   "grads": all(p.grad is not None and bool(p.grad.to_local().isfinite().all())
                                for p in m.parameters())}
            h.disable()
            return out
        finally:
            _fsdp_collectives._get_gradient_divide_factors = _ORIG_FACTORS

    res["overlap"] = {
        "flat": overlap((world,), _ORIG_FACTORS),
        "flat_forced_sum": overlap((world,), _forced_sum_factors),
        "hsdp_forced_sum": overlap((2, 2), _forced_sum_factors),
    }
    return res


@pytest.fixture(scope="module")
def battery() -> list[dict]:
    return run_ranks(_battery, 4, timeout=400)


@pytest.mark.parametrize("attr", [f"FSDPParamGroup.{a}" for a in GROUP_ATTRS]
                         + [f"FSDPParam.{a}" for a in PARAM_ATTRS]
                         + [f"HSDPMeshInfo.{a}" for a in MESH_ATTRS])
def test_hidden_attribute_is_refused_at_enable(battery, attr):
    for r in battery:
        kind, msg = r["hidden"][attr]
        name = attr.split(".")[1]
        assert kind == "FSDPInternalsChanged" and name in msg and f"torch {VERSION}" in msg, (
            f"hiding {attr} gave {kind or 'no error'}: {msg}")


def test_reordered_divide_factor_arguments_are_refused_at_enable(battery):
    for r in battery:
        kind, msg = r["reordered"]
        assert kind == "FSDPInternalsChanged" and "_get_gradient_divide_factors" in msg, (
            kind, msg)


def test_untouched_model_enables_and_trains(battery):
    assert all(r["clean"] == ("", "") for r in battery), [r["clean"] for r in battery]


def test_fsdp_all_reduce_on_a_cached_real_replica_group_stops_the_first_backward(battery):
    for r in battery:
        kind, msg = r["cached_replica_group"]
        assert kind == "FSDPInternalsChanged" and "ran 0 time(s)" in msg and \
            f"torch {VERSION}" in msg, (kind, msg)


def test_isolated_replicas_on_a_cached_real_replica_group_stop_the_first_backward(battery):
    """``isolate_replicas`` relies on the same read as ``enable``'s HSDP swap: a torch that
    kept the real replica group would average DiLoCo's replica groups at every step; the
    isolation's check stops the first backward instead."""
    for r in battery:
        kind, msg = r["cached_replica_group_isolated"]
        assert kind == "FSDPInternalsChanged" and "ran 0 time(s)" in msg and \
            f"torch {VERSION}" in msg, (kind, msg)


def test_overlap_defers_when_nothing_reads_the_output(battery):
    for r in battery:
        o = r["overlap"]["flat"]
        assert o["deferred"] > 0 and o["grads"], o


def test_overlap_that_cannot_defer_says_why(battery):
    for r in battery:
        flat, hsdp = r["overlap"]["flat_forced_sum"], r["overlap"]["hsdp_forced_sum"]
        assert flat["deferred"] == 0 and flat["grads"] and any(
            "forced-sum mode: FSDP divides the output right after the call" in n
            for n in flat["notes"]), flat
        assert hsdp["deferred"] == 0 and hsdp["grads"] and any(
            "replica all-reduce finished inside its call: FSDP divides the output right after "
            "the hook" in n for n in hsdp["notes"]), hsdp

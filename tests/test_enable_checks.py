"""What ``enable`` refuses or decides before installing anything (issue 22, item 7): a
``replicate()`` module, learned gradient levels under HSDP, the reduction op FSDP's own
all-reduce runs with on the one-rank HSDP group (never AVG off CPU), and who divides a plain
FSDP module's reduced gradients (the hook, in its last decode); and what it says of its
decisions through the ``fsdp_qcomm`` logger.

Launches: 2 gloo ranks (``replicate``, the log), 4 (HSDP 2 x 2), 3 (the division).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fsdp_qcomm
from fsdp_qcomm import QCommConfig
from fsdp_qcomm.fsdp import internals
from fsdp_qcomm.testing import digest, run_ranks


def _raises(fn, *args) -> str:
    try:
        fn(*args)
    except (ValueError, RuntimeError, TypeError, AttributeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _replicated(rank: int, world: int) -> dict:
    from torch.distributed._composable.replicate_with_fsdp import replicate

    out = {}
    for preset in ("qwd", "sdp4bit", "baseline"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        replicate(model[0])
        replicate(model)
        out[preset] = _raises(fsdp_qcomm.enable, model, QCommConfig.preset(preset,
                                                                           ranks_per_node=1))
        out[f"{preset}_untouched"] = all(
            not type(c).__module__.startswith("fsdp_qcomm.")
            for m in model.modules() if isinstance(m, internals.FSDPModule)
            for g in internals.param_groups(m) for c in internals.installed_comms(g))
    return out


def _replaced_comms(rank: int, world: int) -> dict:
    """Modules whose collectives already run through something else than FSDP2's defaults."""
    class Theirs(internals.AllGather):  # someone else's hook: never called here
        def allocate(self, *a, **k):
            raise AssertionError("not reached")

        def __call__(self, *a, **k):
            raise AssertionError("not reached")

    out = {}
    for name in ("default", "process_group_buffers", "custom"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        fully_shard(model[0])
        fully_shard(model)
        if name == "process_group_buffers":
            model[0].set_allocate_memory_from_process_group_for_comm(True)
        elif name == "custom":
            model[0].set_custom_all_gather(Theirs())
        before = [type(c).__name__ for g in internals.param_groups(model[0])
                  for c in internals.installed_comms(g)]
        cfg = QCommConfig.preset("sdp4bit", ranks_per_node=1)
        try:
            fsdp_qcomm.enable(model, cfg).disable()
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
        out[f"{name}_kept"] = before == [type(c).__name__ for g in internals.param_groups(
            model[0]) for c in internals.installed_comms(g)]
    return out


def test_collectives_that_are_not_fsdps_defaults_are_not_replaced():
    """Installing fsdp_qcomm's collectives over process-group buffers or another hook (or
    symmetric memory, which needs CUDA and is not set here) would drop them silently: enable
    refuses, naming the class, and leaves the module as it was."""
    for r in run_ranks(_replaced_comms, 2, timeout=300):
        assert r["default"] == "no error" and r["default_kept"]
        for name, cls in (("process_group_buffers", "ProcessGroupAllocAllGather"),
                          ("custom", "Theirs")):
            assert r[name].startswith(f"FSDP module '0' already runs its all-gather through "
                                      f"{cls}, which fsdp_qcomm would replace"), r[name]
            assert "module_filter_fn" in r[name] and r[f"{name}_kept"]


def _logged(rank: int, world: int) -> dict:
    """The ``fsdp_qcomm`` log of ``enable`` on two ranks of one node, and as two nodes."""
    import logging

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    log = logging.getLogger("fsdp_qcomm")
    log.addHandler(Keep())
    log.setLevel(logging.INFO)
    out = {}
    for name, rpn in (("one_node", 2), ("two_nodes", 1)):
        records.clear()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 3))
        fully_shard(model[0])
        fully_shard(model)
        handle = fsdp_qcomm.enable(model, QCommConfig.preset("sdp4bit", ranks_per_node=rpn))
        out[name] = {"log": [(r.levelname, r.getMessage()) for r in records],
                     "notes": handle.stats()["notes"]}
        handle.disable()
    return out


def _hsdp(shape):
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 3))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _learned_and_ops(rank: int, world: int) -> dict:
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        _get_gradient_divide_factors,
    )

    out = {}
    learned = QCommConfig.preset("W8G4-learned", ranks_per_node=2)
    out["learned_hsdp"] = _raises(fsdp_qcomm.enable, _hsdp((2, 2)), learned)
    flat = nn.Linear(6, 3)
    fully_shard(flat)
    handle = fsdp_qcomm.enable(flat, learned)  # a 1-D mesh keeps learned gradient levels
    handle.disable()
    # grad_overlap: the op FSDP's own all-reduce runs with on the one-rank group fsdp_qcomm
    # swaps in. On CPU FSDP passes AVG / PREMUL_SUM to the hook (no forced sum); anywhere else
    # SUM is forced, as NCCL's AVG over a group of one is documented as unreliable. The device
    # is what enable reads; no CUDA is needed to check the decision.
    real = internals.group_device
    for device in ("cpu", "cuda"):
        model = _hsdp((2, 2))
        cfg = QCommConfig.preset("sdp4bit", ranks_per_node=2, grad_overlap=True)
        internals.group_device = lambda g, d=device: torch.device(d)
        try:
            handle = fsdp_qcomm.enable(model, cfg)
        finally:
            internals.group_device = real
        ops = []
        for m in model.modules():
            if isinstance(m, internals.FSDPModule):
                for g in internals.param_groups(m):
                    _, _, rs_op, ar_op = _get_gradient_divide_factors(
                        internals.reduce_scatter_group(g), internals.replicate_group(g),
                        torch.float32, device, internals.gradient_divide_factor(g),
                        internals.force_sum(g))
                    ops.append((internals.force_sum(g), internals.replicate_group(g).size(),
                                str(rs_op), str(ar_op)))
        out[device] = ops
        handle.disable()
    return out


def _division(rank: int, world: int) -> dict:
    """One step of a plain FSDP model (no HSDP) under sdp4bit across 3 nodes of one rank: with
    FSDP's AVG left to the hook (``enable``'s choice), with SUM forced before ``enable`` (FSDP
    divides the reduced shard by 3 itself), and with a divide factor (``enable`` forces SUM)."""
    out = {}
    for how in ("avg", "forced", "factor"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 40), nn.Linear(40, 3))
        fully_shard(model[0])
        fully_shard(model)
        modules = [m for m in model.modules() if isinstance(m, internals.FSDPModule)]
        groups = [g for m in modules for g in internals.param_groups(m)]
        for m in modules:
            if how == "forced":
                m.set_force_sum_reduction_for_comms(True)
            elif how == "factor":
                m.set_gradient_divide_factor(3.0)
        handle = fsdp_qcomm.enable(model, QCommConfig.preset("sdp4bit", ranks_per_node=1))
        out[f"{how}_force_sum"] = [internals.force_sum(g) for g in groups]
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(rank))
        model(x).square().sum().backward()
        out[how] = {k: digest(p.grad.to_local()) for k, p in model.named_parameters()}
        handle.disable()
        out[f"{how}_restored"] = [internals.force_sum(g) for g in groups]
    return out


@pytest.fixture(scope="module")
def checks() -> list[dict]:
    return [run_ranks(_replicated, 2, timeout=300), run_ranks(_learned_and_ops, 4, timeout=300),
            run_ranks(_logged, 2, timeout=300), run_ranks(_division, 3, timeout=300)]


def test_the_hook_divides_a_plain_modules_sum_as_fsdp_would(checks):
    """FSDP's AVG reaches the quantized reduce-scatter, whose last decode divides by the group
    size in the same pass: the bits FSDP's own division of the sum gives (3 has no exact
    reciprocal); a divide factor keeps FSDP's forced SUM."""
    for r in checks[3]:
        assert r["avg_force_sum"] == [False, False] and r["forced_force_sum"] == [True, True]
        assert r["factor_force_sum"] == [True, True], r
        assert r["avg"] == r["forced"] == r["factor"]  # a factor of 3: the same mean
        assert r["avg_restored"] == [False, False] and r["factor_restored"] == [False, False]


def test_replicate_is_refused_with_a_clear_error(checks):
    for r in checks[0]:
        for preset in ("qwd", "sdp4bit", "baseline"):
            assert r[preset].startswith("ValueError: module '<root>' is replicated without "
                                        "sharding (replicate()"), r[preset]
            assert r[f"{preset}_untouched"]


def test_learned_gradient_levels_are_refused_under_hsdp(checks):
    for r in checks[1]:
        assert r["learned_hsdp"].startswith(
            "ValueError: QCommConfig.grad_levels='learned' is not supported under HSDP"), r


def test_one_rank_hsdp_group_never_gets_avg_off_cpu(checks):
    for r in checks[1]:
        # (forced sum, size of the group FSDP all-reduces over, reduce-scatter op, all-reduce op)
        assert r["cuda"] and all(f and n == 1 and "SUM" in rs and "SUM" in ar and "AVG" not in ar
                                 for f, n, rs, ar in r["cuda"]), r["cuda"]
        # on CPU (gloo) FSDP keeps passing AVG, which the hooks apply themselves
        assert r["cpu"] and all(not f and n == 1 and "AVG" in ar
                                for f, n, _, ar in r["cpu"]), r["cpu"]


def test_enable_logs_each_decision_once_and_warns_when_nothing_is_quantized(checks):
    first, second = checks[2]
    assert second["one_node"]["log"] == [] and second["two_nodes"]["log"] == []  # rank 0 only
    one = first["one_node"]
    warnings = [m for lvl, m in one["log"] if lvl == "WARNING"]
    assert len(warnings) == 1 and "quantize_intra_node=True" in warnings[0], one["log"]
    assert "quantizes nothing" in warnings[0] and warnings[0].split(": ", 1)[1] in one["notes"]
    infos = [m.split(": ", 1)[1] for lvl, m in one["log"] if lvl == "INFO"]
    assert len(infos) == 2 and set(infos) <= set(one["notes"]), (infos, one["notes"])
    assert all("unquantized" in m for m in infos), infos
    two = first["two_nodes"]
    assert [lvl for lvl, _ in two["log"]] == ["INFO", "INFO"], two["log"]
    text = " | ".join(m for _, m in two["log"])
    assert "weight all-gather: qwd 4-bit" in text, text
    assert "two-level, 8-bit inside then 4-bit across nodes" in text, text
    assert not any("quantizes nothing" in n for n in two["notes"])

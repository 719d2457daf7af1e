"""``enable(..., module_filter_fn=, module_configs=)``: modules kept out stay on FSDP2's own
collectives, modules with an override get their own widths; flat FSDP, HSDP and a checkpoint
round trip, and the errors for what cannot work."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _models import TinyLM, batch, lm_loss, shard
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fsdp_qcomm
from fsdp_qcomm import CheckpointMismatch, QCommConfig
from fsdp_qcomm.fsdp import internals
from fsdp_qcomm.fsdp.all_gather import QuantizedAllGather
from fsdp_qcomm.testing import run_ranks

SDP4 = dict(ranks_per_node=1)


def _ours(module) -> bool:
    return any(isinstance(g, QuantizedAllGather) for g in
               (internals.installed_comms(grp)[0] for grp in internals.param_groups(module)))


def _train(model, handle, steps: int, rank: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    for step in range(steps):
        loss = lm_loss(model, batch(0, rank))  # one batch: the loss must fall
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def _flat(rank: int, world: int) -> dict:
    res = {}
    torch.manual_seed(0)
    model = TinyLM()
    shard(model, True)
    eight = QCommConfig.preset("sdp4bit", weight_bits=8, **SDP4)
    handle = fsdp_qcomm.enable(
        model, QCommConfig.preset("sdp4bit", **SDP4),
        module_filter_fn=lambda m, fqn: fqn != "blocks.1",
        module_configs={"blocks.0": eight})
    res["labels"] = [i.label for i in handle._installs]
    res["weight_bits"] = {i.label: i.all_gather._spec.bits for i in handle._installs}
    res["ours"] = {n: _ours(m) for n, m in (("<root>", model), ("blocks.0", model.blocks[0]),
                                            ("blocks.1", model.blocks[1]))}
    res["losses"] = _train(model, handle, 3, rank)
    res["notes"] = handle.stats()["notes"]
    handle.disable()
    # the errors, the same on every rank, before anything is installed
    errors = {}
    for name, kwargs in {
        "unused": dict(module_configs={"block.0": eight}),
        "seed": dict(module_configs={"blocks.0": eight.replace(seed=7)}),
        "not_bool": dict(module_filter_fn=lambda m, fqn: None),
        "all_out": dict(module_filter_fn=lambda m, fqn: False),
        "not_config": dict(module_configs={"blocks.0": {"weight_bits": 8}}),
    }.items():
        try:
            fsdp_qcomm.enable(model, QCommConfig.preset("sdp4bit", **SDP4), **kwargs)
            errors[name] = "no error"
        except (TypeError, ValueError) as e:
            errors[name] = f"{type(e).__name__}: {e}"
    res["errors"] = errors
    res["clean_after_errors"] = not any(_ours(m) for m in (model, *model.blocks))
    return res


def test_flat_filter_and_overrides():
    res = run_ranks(_flat, 2)
    r = res[0]
    assert r["labels"] == ["<root>", "blocks.0"]  # blocks.1 kept out
    assert r["weight_bits"] == {"<root>": 4, "blocks.0": 8}
    assert r["ours"] == {"<root>": True, "blocks.0": True, "blocks.1": False}
    assert all(x["losses"][-1] < x["losses"][0] for x in res)  # it trains
    e = r["errors"]
    assert e["unused"].startswith("ValueError") and "'block.0'" in e["unused"] \
        and "'blocks.0'" in e["unused"], e["unused"]
    assert "module_configs['blocks.0'].seed=7 differs" in e["seed"], e["seed"]
    assert e["not_bool"].startswith("TypeError") and "True (quantize) or False" in e["not_bool"]
    assert "keeps every FSDP module" in e["all_out"], e["all_out"]
    assert e["not_config"].startswith("TypeError"), e["not_config"]
    assert r["clean_after_errors"]


def _hsdp(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = TinyLM()
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    handle = fsdp_qcomm.enable(model, QCommConfig.preset("sdp4bit", ranks_per_node=2),
                               module_filter_fn=lambda m, fqn: fqn != "")  # root kept out
    replica_hooks = {i.label: i.replica is not None for i in handle._installs}
    root_hook = internals.all_reduce_hook(internals.param_groups(model)[0])
    losses = _train(model, handle, 3, dist.get_rank())
    st = handle.stats()
    handle.disable()
    return {"replica_hooks": replica_hooks, "root_hook": root_hook is None,
            "losses": losses, "replica_calls": st["grad_replica"]["calls"]}


def test_hsdp_filter():
    res = run_ranks(_hsdp, 4)
    r = res[0]
    assert r["replica_hooks"] == {"blocks.0": True, "blocks.1": True}
    assert r["root_hook"]  # FSDP2's own all-reduce across replicas for the root
    assert r["replica_calls"] == 2 * 3  # two modules, three steps
    assert all(x["losses"][-1] < x["losses"][0] for x in res)  # it trains


def _checkpoint(rank: int, world: int) -> dict:
    eight = QCommConfig.preset("sdp4bit", weight_bits=8, **SDP4)

    def build(configs):
        torch.manual_seed(0)
        model = TinyLM()
        shard(model, True)
        return model, fsdp_qcomm.enable(model, QCommConfig.preset("sdp4bit", **SDP4),
                                        module_configs=configs)

    model, handle = build({"blocks.*": eight})
    _train(model, handle, 2, rank)
    state = handle.state_dict()
    handle.disable()
    out = {"module_config": "config" in state[next(iter(state))]["owner"]["modules"]["blocks.0"]}
    model2, same = build({"blocks.*": eight})
    same.load_state_dict(state)
    out["same"] = "loaded"
    same.disable()
    model3, other = build(None)
    try:
        other.load_state_dict(state)
        out["other"] = "loaded"
    except CheckpointMismatch as e:
        out["other"] = str(e)
    return out


def test_checkpoint_records_each_modules_config():
    r = run_ranks(_checkpoint, 2)[0]
    assert r["module_config"] and r["same"] == "loaded"
    assert "FSDP module 'blocks.0': saved with its own module_configs entry" in r["other"]
    assert "now the enable() config" in r["other"]


def test_config_checks_without_ranks():
    from fsdp_qcomm.fsdp import module_choice

    base = QCommConfig.preset("sdp4bit")
    with pytest.raises(TypeError, match="maps fnmatch patterns"):
        module_choice.check_overrides(base, [("x", base)])
    cfg, pattern = module_choice.choose(torch.nn.Linear(2, 2), "", base, None,
                                        {"<root>": base.replace(weight_bits=8)})
    assert cfg.weight_bits == 8 and pattern == "<root>"


"""The fsdp_qcomm state through Hugging Face Accelerate's and Lightning Fabric's own save and load
paths (``fsdp_qcomm.integrations``), 2 CPU ranks each: the documented way resumes bit for bit,
the tempting way (the handle handed to the framework as a custom object) saves without error
and is refused at load on the rank that got another rank's state.

On CPU, Accelerate selects FSDP only when its state is told so (docs/reliability.md): the
Accelerator is built with ``cpu=True`` (gloo, correct process indices), then its state's
``distributed_type`` and ``fsdp_plugin`` and ``PartialState``'s shared ``distributed_type`` are
set to FSDP, and ``prepare`` runs Accelerate's own ``fsdp2_prepare_model``. Lightning's
``ModelParallelStrategy`` runs FSDP2 over 2 processes with ``data_parallel_size=2,
tensor_parallel_size=1``.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from _models import MLPNet

import fsdp_qcomm
from fsdp_qcomm import CheckpointMismatch, QCommConfig
from fsdp_qcomm.testing import digest, run_ranks

# two "nodes" of one rank: every gather and reduction crosses nodes and is quantized; 2-bit
# qWD differences on learned levels, 3-bit Hadamard gradients
CFG = QCommConfig.preset("lowbit", weight_group_size=32, grad_group_size=32, ranks_per_node=1,
                         seed=21)


def _shards(model) -> dict[str, str]:
    return {k: digest(p.to_local()) for k, p in model.named_parameters()}


# ---- Accelerate 1.15, FSDP2 plugin, a tiny GPT-2 built from its config -------------------------
def _accelerator_model():
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType
    from transformers import GPT2Config, GPT2LMHeadModel

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["GPT2Block"], state_dict_type="SHARDED_STATE_DICT")
    acc = Accelerator(cpu=True, fsdp_plugin=plugin)
    state = AcceleratorState()  # without a GPU Accelerate never picks FSDP itself
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt, fsdp_qcomm.enable(model, CFG)


def _gpt_steps(acc, model, opt, rank, steps) -> list[float]:
    out = []
    for s in steps:
        g = torch.Generator().manual_seed(100 * s + rank)
        x = torch.randint(0, 64, (2, 16), generator=g)
        loss = model(input_ids=x, labels=x).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def _accelerate(rank: int, world: int, root: str) -> dict:
    from fsdp_qcomm.integrations import accelerate as qacc

    good, wrong = os.path.join(root, "good"), os.path.join(root, "wrong")
    acc, model, opt, handle = _accelerator_model()
    qacc.register(acc, handle)
    _gpt_steps(acc, model, opt, rank, range(3))
    with torch.no_grad():  # the Trainer's order at a step that does both: evaluate, then save
        model(input_ids=torch.randint(0, 64, (2, 16),
                                      generator=torch.Generator().manual_seed(7 + rank)))
    acc.save_state(good)
    ref = _gpt_steps(acc, model, opt, rank, range(3, 6))
    acc_b, model_b, opt_b, handle_b = _accelerator_model()
    qacc.register(acc_b, handle_b)
    acc_b.load_state(good)
    got = _gpt_steps(acc_b, model_b, opt_b, rank, range(3, 6))
    out = dict(ref=ref, got=got, same=_shards(model) == _shards(model_b),
               files=sorted(os.listdir(os.path.join(good, "fsdp_qcomm"))),
               modes=handle_b.gather_modes())
    # the tempting way: Accelerate's own custom-object checkpointing
    acc.register_for_checkpointing(handle)
    acc.save_state(wrong)  # torch.save of rank 0's state: plain copies, so this works now
    acc_c, _, _, handle_c = _accelerator_model()
    acc_c.register_for_checkpointing(handle_c)
    with pytest.raises(ValueError, match="register_for_checkpointing"):
        qacc.register(acc_c, handle_c)
    try:
        acc_c.load_state(wrong)  # every rank loads custom_checkpoint_0.pkl: rank 0's state
        out["wrong"] = None
    except CheckpointMismatch as e:
        out["wrong"] = str(e)
    return out


def test_accelerate_save_state_and_load_state(tmp_path):
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    res = run_ranks(_accelerate, 2, str(tmp_path), timeout=600)
    for rank, r in enumerate(res):
        assert r["got"] == r["ref"] and r["same"], (r["got"], r["ref"])
        assert r["files"] == ["rank0_of_2.pt", "rank1_of_2.pt"]
        assert r["modes"].get("qwd_restore") and not r["modes"].get("qwd_full"), r["modes"]
    # rank 0 got its own state, but rank 1 refused its copy: no rank loads it, every rank raises
    assert res[0]["wrong"].startswith("the fsdp_qcomm state was refused on rank(s) [1] of 2"), \
        res[0]["wrong"]
    for r in res:
        assert "rank 1 of 2 was given the fsdp_qcomm state that rank(s) [0] of 2 saved" in \
            r["wrong"]
        assert "fsdp_qcomm.integrations.accelerate.register" in r["wrong"]


# ---- Lightning Fabric 2.6, ModelParallelStrategy (FSDP2), a tiny MLP ---------------------------
def _parallelize(model: MLPNet, mesh) -> MLPNet:
    from torch.distributed.fsdp import fully_shard

    dp = mesh["data_parallel"]
    for b in model.blocks:
        fully_shard(b, mesh=dp)
    fully_shard(model, mesh=dp)
    return model


def _fabric_model(distributed_checkpoint: bool = True):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(parallelize_fn=_parallelize, data_parallel_size=2,
                                     tensor_parallel_size=1,
                                     save_distributed_checkpoint=distributed_checkpoint)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()  # the processes exist already (LOCAL_RANK is set): nothing is spawned
    torch.manual_seed(0)
    model = fabric.setup_module(MLPNet())
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return fabric, model, opt, fsdp_qcomm.enable(model, CFG)


def _mlp_steps(fabric, model, opt, rank, steps) -> list[float]:
    out = []
    for s in steps:
        g = torch.Generator().manual_seed(100 * s + rank)
        x = torch.randn(6, 5, generator=g)
        loss = F.mse_loss(model(x), x[:, :1].sin())
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def _lightning(rank: int, world: int, root: str) -> dict:
    from fsdp_qcomm.integrations import lightning as ql

    good, wrong, full = (os.path.join(root, k) for k in ("good", "wrong", "full.ckpt"))
    fabric, model, opt, handle = _fabric_model()
    _mlp_steps(fabric, model, opt, rank, range(3))
    with torch.no_grad():  # Lightning's ModelCheckpoint saves at the end of validation
        model(torch.randn(6, 5, generator=torch.Generator().manual_seed(7 + rank)))
    ql.save(fabric, good, {"model": model, "optimizer": opt, "step": 3}, handle)
    ref = _mlp_steps(fabric, model, opt, rank, range(3, 6))
    fabric_b, model_b, opt_b, handle_b = _fabric_model()
    state = {"model": model_b, "optimizer": opt_b, "step": 0}
    ql.load(fabric_b, good, state, handle_b)
    got = _mlp_steps(fabric_b, model_b, opt_b, rank, range(3, 6))
    out = dict(ref=ref, got=got, same=_shards(model) == _shards(model_b), step=state["step"],
               files=sorted(os.listdir(os.path.join(good, "fsdp_qcomm"))),
               modes=handle_b.gather_modes())
    with pytest.raises(ValueError, match="pass it as the handle argument only"):
        ql.save(fabric, good, {"model": model, "qcomm": handle}, handle)
    # the tempting way, a distributed checkpoint: the handle's state is rank 0's metadata, and
    # fabric.load hands it back as a plain dict without calling load_state_dict
    fabric.save(wrong, {"model": model, "optimizer": opt, "qcomm": handle})
    fabric_c, model_c, opt_c, handle_c = _fabric_model()
    state = {"model": model_c, "optimizer": opt_c, "qcomm": handle_c}
    fabric_c.load(wrong, state)
    out["returned"] = (type(state["qcomm"]).__name__, sorted(state["qcomm"]))
    try:
        handle_c.load_state_dict(state["qcomm"])
        out["wrong"] = None
    except CheckpointMismatch as e:
        out["wrong"] = str(e)
    # a single-file checkpoint: fabric.load calls load_state_dict itself, with rank 0's state
    fabric_d, model_d, opt_d, handle_d = _fabric_model(distributed_checkpoint=False)
    _mlp_steps(fabric_d, model_d, opt_d, rank, range(1))
    fabric_d.save(full, {"model": model_d, "optimizer": opt_d, "qcomm": handle_d})
    try:
        fabric_d.load(full, {"model": model_d, "optimizer": opt_d, "qcomm": handle_d})
        out["full"] = None
    except CheckpointMismatch as e:  # on every rank: rank 0 no longer waits in fabric.load
        out["full"] = str(e)
    return out


@pytest.mark.long
def test_lightning_fabric_save_and_load(tmp_path):
    pytest.importorskip("lightning")
    res = run_ranks(_lightning, 2, str(tmp_path), timeout=600)
    for rank, r in enumerate(res):
        assert r["got"] == r["ref"] and r["same"], (r["got"], r["ref"])
        assert r["step"] == 3  # fabric.load restored the rest of the state as usual
        assert r["files"] == ["rank0_of_2.pt", "rank1_of_2.pt"]
        assert r["modes"].get("qwd_restore") and not r["modes"].get("qwd_full"), r["modes"]
        assert r["returned"] == ("dict", ["rank0_of_2"])  # rank 0's copy on every rank
    for key in ("wrong", "full"):  # refused on rank 1, so on rank 0 too, which names it
        assert res[0][key].startswith("the fsdp_qcomm state was refused on rank(s) [1] of 2"), \
            res[0][key]
        for r in res:
            assert "rank 1 of 2 was given the fsdp_qcomm state that rank(s) [0] of 2 saved" in \
                r[key]
            assert "fsdp_qcomm.integrations.lightning.save/load" in r[key]


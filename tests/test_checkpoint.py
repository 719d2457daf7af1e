"""The fsdp_qcomm state in checkpoints (``fsdp_qcomm/fsdp/checkpoint.py``): bit-identical resume
with learned level tables, each rank's state saved and loaded back by that rank under DCP, plain
copies any checkpointer can save, and refusals naming what differs.

One 4-rank launch (2 emulated nodes x 2) trains, checkpoints with DCP and resumes sdp4bit and
three configurations with learned levels; a 2-rank launch reads its checkpoint with another world
size; another 2-rank launch checks the refusals. Accelerate and Lightning: test_integrations.py.
"""

from __future__ import annotations

import dataclasses
import io
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from _models import MLPNet
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fsdp_qcomm
from fsdp_qcomm import CheckpointMismatch, QCommConfig
from fsdp_qcomm.fsdp.checkpoint import CONFIG_FIELDS, NOT_SAVED_FIELDS
from fsdp_qcomm.integrations import load_rank_state, save_rank_state
from fsdp_qcomm.testing import digest, run_ranks


def _build(cfg, shape=None, layers=2):
    """``MLPNet`` sharded per block and at the root: 1-D over all ranks (``shape`` None) or on a
    (replicate, shard) mesh; fsdp_qcomm enabled; AdamW."""
    kw = {}
    if shape is not None:
        kw["mesh"] = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = MLPNet(layers)
    for b in model.blocks:
        fully_shard(b, **kw)
    fully_shard(model, **kw)
    handle = fsdp_qcomm.enable(model, cfg)
    return model, handle, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model, opt, step: int, rank: int) -> float:
    g = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randn(6, 5, generator=g)
    loss = F.mse_loss(model(x), x[:, :1].sin() + 0.3 * x[:, 1:2] * x[:, 2:3])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _shards(model) -> dict[str, str]:
    return {k: digest(p.to_local()) for k, p in model.named_parameters()}


def _save(path, model, opt, handle=None):
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    if handle is not None:
        state["qcomm"] = handle  # a Stateful: DCP calls state_dict()
    dcp.save(state, checkpoint_id=path)


def _load(path, model, opt, handle=None):
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    if handle is not None:
        state["qcomm"] = handle  # DCP calls load_state_dict() with this rank's entry
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _tensor_digests(state) -> dict[str, str]:
    """Every tensor of a (nested) state by path, and the non-tensor leaves as text."""
    out = {}

    def walk(x, path):
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{path}/{k}")
        elif isinstance(x, torch.Tensor):
            out[path] = digest(x)
        else:
            out[path] = repr(x)

    walk(state, "")
    return out


# ---- 4 ranks as 2 nodes x 2: learned levels resume bit for bit ----------------------------------
G = dict(weight_group_size=32, grad_group_size=32, ranks_per_node=2)
CONFIGS = {
    # 4-bit qWD differences and two-level gradients on uniform levels (no tables): the
    # reference shards and RNG counters alone make the resume exact
    "sdp4bit-flat": (QCommConfig.preset("sdp4bit", seed=10, **G), None),
    # 2-bit qWD differences on learned levels (refitted at counters 2, 4, 8, then every 100),
    # 3-bit two-level Hadamard gradients; the gather group spans both nodes: node-sharded
    # reference
    "lowbit-flat": (QCommConfig.preset("lowbit", seed=11, **G), None),
    # HSDP: the shard group is one node, quantized too (quantize_intra_node): a full reference
    "lowbit-hsdp": (QCommConfig.preset("lowbit", seed=12, quantize_intra_node=True, **G),
                    (2, 2)),
    # QSDP: direct 4-bit weights and one-level 4-bit gradients, both on learned levels,
    # refitted every 3 calls (so one refit falls on each side of the checkpoint)
    "qsdp-learned": (QCommConfig.preset("W4G4-learned", group_size=32, ranks_per_node=2,
                                        levels_refresh_every=3, seed=13), None),
}
BEFORE, AFTER = 4, 4


def _learned(rank: int, world: int, root: str) -> dict:
    out = {}
    for name, (cfg, shape) in CONFIGS.items():
        path = os.path.join(root, name)
        model, handle, opt = _build(cfg, shape)
        for s in range(BEFORE):
            _step(model, opt, s, rank)
        saved = handle.state_dict()
        _save(path, model, opt, handle)
        if name == "lowbit-flat":  # for the world-size test: one file per rank as well
            save_rank_state(handle, os.path.join(root, "files"))
        ref = [_step(model, opt, s, rank) for s in range(BEFORE, BEFORE + AFTER)]
        model_b, handle_b, opt_b = _build(cfg, shape)
        _load(path, model_b, opt_b, handle_b)
        got = [_step(model_b, opt_b, s, rank) for s in range(BEFORE, BEFORE + AFTER)]
        tables = [(i.all_gather.levels, getattr(i.reduce_scatter, "levels", None))
                  for i in handle_b._installs]
        # what DCP hands this rank back: a template of the handle's own layout, overwritten
        template = {"qcomm": handle_b.state_dict()}
        for v in _leaves(template):
            v.fill_(float("nan"))
        dcp.load(template, checkpoint_id=path)
        out[name] = dict(
            ref=ref, got=got, same_shards=_shards(model) == _shards(model_b),
            saved=_tensor_digests(saved), loaded=_tensor_digests(template["qcomm"]),
            keys=list(saved), refits=[(w.refreshes if w else 0, g.refreshes if g else 0)
                                      for w, g in tables],
        )
    return out


def _leaves(state):
    if isinstance(state, dict):
        for v in state.values():
            yield from _leaves(v)
    elif isinstance(state, torch.Tensor) and state.is_floating_point():
        yield state


@pytest.fixture(scope="module")
def learned(tmp_path_factory):
    root = tmp_path_factory.mktemp("learned")
    return str(root), run_ranks(_learned, 4, str(root), timeout=900)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_learned_levels_resume_is_bit_identical(learned, name):
    """Losses and every rank's shards of a run resumed from a DCP checkpoint equal the
    uninterrupted run's, with learned weight (and, for QSDP, gradient) level tables, and for
    sdp4bit without them."""
    for r in learned[1]:
        res = r[name]
        assert res["got"] == res["ref"], (name, res["got"], res["ref"])
        assert res["same_shards"]
        if name != "sdp4bit-flat":
            assert all(w > 0 for w, _ in res["refits"]), res["refits"]  # tables in use


def test_each_rank_gets_its_own_state_back_from_dcp(learned):
    """Under DCP every rank writes its state under its own key and reads back exactly what it
    wrote: rank r's loaded state is rank r's saved state, and the ranks' states differ (so a
    mix-up would show)."""
    res = learned[1]
    for name in CONFIGS:
        for rank, r in enumerate(res):
            st = r[name]
            assert st["keys"] == [f"rank{rank}_of_4"]
            assert st["loaded"] == st["saved"], name
            assert st["saved"][f"/rank{rank}_of_4/owner/rank"] == repr(rank)
        # qWD: each rank's reference shard is its own (QSDP's tables are the same everywhere)
        refs = [{k.split("/", 2)[2]: v for k, v in r[name]["saved"].items() if "/reference/" in k}
                for r in res]
        assert name.startswith("qsdp") or refs[0] and refs[0] != refs[1], name


def _other_world(rank: int, world: int, root: str) -> dict:
    # two "nodes" of one rank, so that the gathers are quantized on 2 ranks too
    cfg = dataclasses.replace(CONFIGS["lowbit-flat"][0], ranks_per_node=1)
    path = os.path.join(root, "lowbit-flat")
    model, handle, opt = _build(cfg)
    out = {}
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    with pytest.raises(CheckpointException) as e:  # DCP: no key for this rank in a 4-rank one
        _load(path, model, opt, handle)
    out["dcp"] = str(e.value)
    with pytest.raises(CheckpointMismatch) as e:  # the per-rank files
        load_rank_state(handle, os.path.join(root, "files"))
    out["files"] = str(e.value)
    saved = torch.load(os.path.join(root, "files", f"rank{rank}_of_4.pt"), weights_only=True)
    with pytest.raises(CheckpointMismatch) as e:  # a state handed over by hand
        handle.load_state_dict(saved)
    out["direct"] = str(e.value)
    # the remedy the errors name: model and optimizer alone (DCP reshards them); the next
    # gathers send full precision
    _load(path, model, opt)
    _step(model, opt, BEFORE, rank)
    out["modes"] = handle.gather_modes()
    return out


def test_another_world_size_is_refused(learned):
    res = run_ranks(_other_world, 2, learned[0], timeout=300)
    for rank, r in enumerate(res):
        assert f"Missing key in checkpoint state_dict: qcomm.rank{rank}_of_2" in r["dcp"]
        assert (f"holds the fsdp_qcomm state of rank(s) [0, 1, 2, 3] of a run of 4 ranks, none "
                f"for rank {rank} of 2") in r["files"]
        assert "cannot move to another world size" in r["direct"]
        assert "full precision" in r["direct"] and "without the fsdp_qcomm state" in r["direct"]
        assert r["modes"].get("qwd_full") == 3 and "qwd_restore" not in r["modes"]


# ---- 2 ranks: plain state, and what load_state_dict refuses ---------------------------------
def _refusals(rank: int, world: int, root: str) -> dict:
    cfg = QCommConfig.preset("sdp4bit", weight_group_size=32, grad_group_size=32,
                             ranks_per_node=1, grad_error_feedback="inter", seed=3)
    model, handle, opt = _build(cfg)
    _step(model, opt, 0, rank)
    _step(model, opt, 1, rank)
    state = handle.state_dict()
    out = {"key": list(state)}
    # plain copies: each tensor owns its storage, nothing is a DTensor or a view
    tensors = list(_all_tensors(state))
    out["plain"] = all(type(t) is torch.Tensor and t._base is None and t.storage_offset() == 0
                       and t.untyped_storage().nbytes() == t.nbytes for t in tensors)
    out["kinds"] = sorted({k for e in state.values() for m in e["modules"].values() for k in m})
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)
    assert _tensor_digests(back) == _tensor_digests(state)
    handle.load_state_dict(back)  # its own state: accepted
    before = _tensor_digests(handle.state_dict())

    def refused(st, h=handle) -> str:
        with pytest.raises(CheckpointMismatch) as e:
            h.load_state_dict(st)
        return str(e.value)

    # rank 0's state on every rank (what a rank-0-only checkpointer does): refused on rank 1,
    # so on rank 0 too, before anything changed there (before, rank 0 loaded it and went on)
    obj = [state if rank == 0 else None]
    dist.broadcast_object_list(obj, src=0)
    out["rank0_state"] = refused(obj[0])
    # per-rank files: one missing (a replaced node's local disk) is refused on every rank
    files = os.path.join(root, "files")
    save_rank_state(handle, files)
    if rank == 1:
        os.remove(os.path.join(files, "rank1_of_2.pt"))
    dist.barrier()
    with pytest.raises(CheckpointMismatch) as e:
        load_rank_state(handle, files)
    out["missing_file"] = str(e.value)
    # a write that fails on one rank raises on every rank
    blocked = os.path.join(root, f"blocked{rank}")
    if rank == 1:
        open(blocked, "w").close()  # a file where the folder should be
    with pytest.raises((OSError, RuntimeError)) as e:
        save_rank_state(handle, os.path.join(blocked, "state"))
    out["write"] = f"{type(e.value).__name__}: {e.value}"
    # another world size, by key
    (entry,) = state.values()
    out["world"] = refused({f"rank{rank}_of_4": entry})
    # an entry moved to another key
    moved = {**entry, "owner": {**entry["owner"], "rank": 1 - rank}}
    out["moved"] = refused({f"rank{rank}_of_2": moved})
    out["format1"] = refused({"version": 1, "modules": {}})
    out["junk"] = refused({"model": {}})
    assert _tensor_digests(handle.state_dict()) == before  # refusals changed nothing
    handle.disable()
    # another configuration, node size, mesh, model
    for what, kw in (("config", dict(weight_bits=3, grad_group_size=64)),
                     ("node", dict(ranks_per_node=2))):
        h = fsdp_qcomm.enable(model, dataclasses.replace(cfg, **kw))
        out[what] = refused(state, h)
        h.disable()
    _, h, _ = _build(cfg, shape=(2, 1))
    out["mesh"] = refused(state, h)
    h.disable()
    _, h, _ = _build(cfg, layers=3)
    out["model"] = refused(state, h)
    return out


def _all_tensors(state):
    if isinstance(state, dict):
        for v in state.values():
            yield from _all_tensors(v)
    elif isinstance(state, torch.Tensor):
        yield state


def test_state_is_plain_and_refused_where_it_does_not_belong(tmp_path):
    res = run_ranks(_refusals, 2, str(tmp_path), timeout=300)
    for rank, r in enumerate(res):
        assert r["key"] == [f"rank{rank}_of_2"]
        assert r["plain"]
        assert {"weight_calls", "grad_calls", "replica_calls", "reference", "reference_valid",
                "grad_residuals"} <= set(r["kinds"])
        assert "rank 1 of 2 was given the fsdp_qcomm state that rank(s) [0] of 2 saved" in \
            r["rank0_state"]
        for text in ("register_for_checkpointing", "fsdp_qcomm.integrations.accelerate",
                     "torch.distributed.checkpoint"):
            assert text in r["rank0_state"]
        assert "none for rank 1 of 2" in r["missing_file"], r["missing_file"]
        assert "cannot move to another world size" in r["world"]
        assert "without the fsdp_qcomm state" in r["world"]
        assert "the entry was moved or edited" in r["moved"]
        assert "format 1" in r["format1"]
        assert "not a QCommHandle state" in r["junk"]
        assert "QCommConfig.weight_bits: saved 4, now 3" in r["config"]
        assert "QCommConfig.grad_group_size: saved 32, now 64" in r["config"]
        assert "node size (ranks_per_node): saved 1, now 2" in r["node"]
        assert f"saved on a mesh of shape [2] at coordinate [{rank}], now [2, 1] at " \
            f"[{rank}, 0]" in r["mesh"]
        assert "covers FSDP modules" in r["model"] and "blocks.2" in r["model"]
        for k in ("config", "node", "mesh", "model"):
            assert "Resume with the same QCommConfig" in r[k], r[k]
    for key in ("rank0_state", "missing_file"):  # rank 0 names rank 1's refusal
        assert res[0][key].startswith("the fsdp_qcomm state was refused on rank(s) [1] of 2, "
                                      "so no rank loads it"), res[0][key]
    assert res[1]["write"].startswith(("FileExistsError", "NotADirectoryError")), res[1]
    assert res[0]["write"].startswith("RuntimeError: fsdp_qcomm: writing the per-rank state "
                                      "to "), res[0]["write"]
    assert "failed on rank(s) [1] of 2, so no rank replaced its file there" in \
        res[0]["write"]


def _async_saved(rank: int, world: int, root: str) -> dict:
    """Evaluate after the steps, then ``dcp.async_save`` (its own gloo group, as any async save
    beside training collectives needs: on the default group plain FSDP2's next collectives
    abort), train on while it writes, resume from it in a fresh model."""
    cfg = QCommConfig.preset("sdp4bit", seed=4, **G)
    model, handle, opt = _build(cfg)
    for s in range(3):
        _step(model, opt, s, rank)
    with torch.no_grad():
        model(torch.randn(6, 5, generator=torch.Generator().manual_seed(rank)))
    msd, osd = get_state_dict(model, opt)
    future = dcp.async_save({"model": msd, "optim": osd, "qcomm": handle}, checkpoint_id=root,
                            process_group=dist.new_group(backend="gloo"))
    ref = [_step(model, opt, s, rank) for s in range(3, 6)]
    future.result()
    model_b, handle_b, opt_b = _build(cfg)
    _load(root, model_b, opt_b, handle_b)
    got = [_step(model_b, opt_b, s, rank) for s in range(3, 6)]
    return dict(ref=ref, got=got, same=_shards(model) == _shards(model_b),
                modes=handle_b.gather_modes())


def test_async_save_after_an_evaluation_resumes_bit_for_bit(tmp_path):
    for r in run_ranks(_async_saved, 4, str(tmp_path), timeout=600):
        assert r["got"] == r["ref"] and r["same"], r  # the digest's part: after an evaluation
        assert r["modes"].get("qwd_restore") and not r["modes"].get("qwd_full"), r["modes"]


def _key_paths(state, path=""):
    if isinstance(state, dict):
        return {p for k, v in state.items() for p in _key_paths(v, f"{path}/{k}")}
    return {path}


def _layouts(rank: int, world: int) -> dict:
    """The state's key paths per weight scheme, under each value of the fields a state does
    not depend on that decide what a gather keeps or measures, before and after a step."""
    out = {}
    for scheme in ("none", "bf16", "direct", "qwd"):
        for reuse in (False, True):
            for verify in (False, True):
                cfg = QCommConfig(weight_scheme=scheme, grad_scheme="none", weight_group_size=32,
                                  quantize_intra_node=True, weight_reuse_unchanged=reuse,
                                  verify_weight_writes=verify)
                model, handle, opt = _build(cfg)
                (empty,) = handle.state_dict().values()
                _step(model, opt, 0, rank)
                (stepped,) = handle.state_dict().values()
                out[scheme, reuse, verify] = (sorted(_key_paths(empty["modules"])),
                                              sorted(_key_paths(stepped["modules"])))
                handle.disable()
    return out


def test_state_keys_do_not_depend_on_fields_it_does_not_save():
    """DCP loads into a template of the loading run's keys, and stops on a key the checkpoint
    lacks: a run resumed with ``weight_reuse_unchanged`` or ``verify_weight_writes`` changed
    (both in ``NOT_SAVED_FIELDS``) must ask for the keys the saving run wrote."""
    for r in run_ranks(_layouts, 2):
        for scheme in ("none", "bf16", "direct", "qwd"):
            layouts = [v for (s, *_), v in r.items() if s == scheme]
            assert all(v == layouts[0] for v in layouts), (scheme, layouts)
            empty, stepped = layouts[0]
            assert empty == stepped
            assert any(p.endswith("/gathered_digest") for p in empty), empty


def test_every_config_field_is_classified():
    """A new QCommConfig field must say whether a saved state depends on it."""
    fields = {f.name for f in dataclasses.fields(QCommConfig)}
    assert set(CONFIG_FIELDS) | set(NOT_SAVED_FIELDS) == fields
    assert not set(CONFIG_FIELDS) & set(NOT_SAVED_FIELDS)

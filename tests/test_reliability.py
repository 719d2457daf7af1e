"""Reliability under FSDP2 + fsdp_qcomm: checkpoint/resume, the consistency guard, non-finite
values, bad configuration, and a rank dying mid-step.

All on gloo CPU ranks (fsdp_qcomm.testing). Checks are bit-level: losses of a resumed run equal the
uninterrupted run's exactly, weights are compared by digest across ranks.
"""

from __future__ import annotations

import math
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from _models import MLPBlock, OptimizerContainer
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import FSDPModule, fully_shard

import fsdp_qcomm
import fsdp_qcomm.fsdp.all_gather as ag_mod
from fsdp_qcomm import CheckpointMismatch, QCommConfig
from fsdp_qcomm.fsdp.internals import unverified_param_groups
from fsdp_qcomm.testing import digest as _digest
from fsdp_qcomm.testing import run_ranks
from fsdp_qcomm.testing import same_on_all_ranks as _same_on_all_ranks


# ---- a tiny model: sizes that are multiples of no group size -------------------------------
class Net(nn.Module):
    def __init__(self, d: int = 13, hidden: int = 37, layers: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(5, d)
        self.blocks = nn.ModuleList(MLPBlock(d, hidden) for _ in range(layers))
        self.out = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def _build(cfg: QCommConfig, group_io: bool = False):
    torch.manual_seed(0)
    model = Net()
    if group_io:  # one FSDP group over two modules whose parameters share local names
        fully_shard([model.inp, model.out])
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    handle = fsdp_qcomm.enable(model, cfg)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, handle, opt


def _data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randn(6, 5, generator=g)
    return x, x[:, :1].sin() + 0.3 * x[:, 1:2] * x[:, 2:3]


def _loss(model: nn.Module, step: int, rank: int, poison: bool = False) -> torch.Tensor:
    x, y = _data(step, rank)
    if poison:
        x[0, 0] = float("nan")
    return F.mse_loss(model(x), y)


def _train_step(model, opt, step, rank) -> float:
    loss = _loss(model, step, rank)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()



def _full_digests(model: nn.Module) -> dict[str, str]:
    return {k: _digest(p.full_tensor()) for k, p in model.named_parameters()}


def _gathered(model: nn.Module) -> dict[str, torch.Tensor]:
    """Weights the next forward computes with, captured at each leaf's forward."""
    seen: dict[str, torch.Tensor] = {}
    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.Linear, nn.LayerNorm)):
            def pre(m, args, name=name):
                for p, t in m.named_parameters(recurse=False):
                    seen[f"{name}.{p}"] = t.detach().clone()
            hooks.append(mod.register_forward_pre_hook(pre))
    return seen, hooks



def _units(model: nn.Module) -> list:
    return [g for m in model.modules() if isinstance(m, FSDPModule)
            for g in unverified_param_groups(m)]


def _save(path: str, model, opt, handle=None) -> None:
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    if handle is not None:
        state["qcomm"] = handle
    dcp.save(state, checkpoint_id=path)


def _load(path: str, model, opt, handle=None) -> None:
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    if handle is not None:
        state["qcomm"] = handle  # a Stateful: DCP calls state_dict() and load_state_dict()
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


# Runs of 2 ranks share one host, one node: quantize_intra_node=True quantizes their gathers
# (by default fsdp_qcomm leaves collectives inside a node alone).
_ONE_NODE = dict(quantize_intra_node=True)


# ---- checkpoint and resume (4 ranks, 2 "nodes": qWD + TLq-HS) -------------------------------
_SDP4 = QCommConfig.preset(
    "sdp4bit", ranks_per_node=2, weight_group_size=32, grad_group_size=32, seed=5
)


def _resume(rank, world, root, n_before, n_after):
    ckpt = os.path.join(root, "step")
    # A: uninterrupted, with a checkpoint after n_before steps
    model, handle, opt = _build(_SDP4)
    ref = [_train_step(model, opt, s, rank) for s in range(n_before)]
    _save(ckpt, model, opt, handle)
    ref += [_train_step(model, opt, s, rank) for s in range(n_before, n_before + n_after)]
    ref_final = _full_digests(model)
    modes_a = handle.gather_modes()
    units = len(_units(model))
    assert modes_a == {"qwd_diff": units * (n_before + n_after - 1), "qwd_full": units,
                       "qwd_reuse": (units - 1) * (n_before + n_after)}, modes_a  # root stays
    # unsharded after forward, so only the blocks re-gather (from the reference) in backward
    out = {"ref": ref}

    # B: fresh process state (new model, fully_shard, enable), load, continue: bit-identical
    model_b, handle_b, opt_b = _build(_SDP4)
    _load(ckpt, model_b, opt_b, handle_b)
    got = [_train_step(model_b, opt_b, s, rank) for s in range(n_before, n_before + n_after)]
    assert got == ref[n_before:], (got, ref[n_before:])
    assert _full_digests(model_b) == ref_final
    modes_b = handle_b.gather_modes()
    assert modes_b.get("qwd_restore") == units and "qwd_full" not in modes_b, modes_b
    rs = [g._reduce_scatter_comm.call_count for g in _units(model_b)]
    assert rs == [g._reduce_scatter_comm.call_count for g in _units(model)]  # counters resumed

    # C: the same without the fsdp_qcomm state: the first gather is full precision, counters
    # restart at 0, so the stochastic rounding bits and the reference differ from A
    model_c, handle_c, opt_c = _build(_SDP4)
    _load(ckpt, model_c, opt_c)
    got_c = [_train_step(model_c, opt_c, s, rank) for s in range(n_before, n_before + n_after)]
    assert handle_c.gather_modes()["qwd_full"] == units
    out["no_state"] = got_c

    # D: load into the already-trained handle of run A. Model + optimizer only: qWD sees
    # parameters changed outside the optimizer and resends full precision (exact weights);
    # with the fsdp_qcomm state: A's steps replay bit for bit.
    _load(ckpt, model, opt)
    seen, hooks = _gathered(model)
    exact = {k: p.full_tensor().clone() for k, p in model.named_parameters()}
    _train_step(model, opt, n_before, rank)
    for h in hooks:
        h.remove()
    for k, v in exact.items():
        assert torch.equal(seen[k], v), f"{k}: weights after a load are not the loaded ones"
    assert handle.gather_modes()["qwd_full"] == 2 * units
    _load(ckpt, model, opt, handle)
    replay = [_train_step(model, opt, s, rank) for s in range(n_before, n_before + n_after)]
    assert replay == ref[n_before:], (replay, ref[n_before:])
    assert _full_digests(model) == ref_final
    return out


def test_checkpoint_resume_is_bit_identical_4_ranks_two_level(tmp_path):
    n_before, n_after = 3, 3
    out = run_ranks(_resume, 4, str(tmp_path), n_before, n_after)
    for r in out:  # without the fsdp_qcomm state: close, but not the same bits
        ref, no_state = r["ref"][n_before:], r["no_state"]
        assert no_state != ref
        assert max(abs(a - b) / abs(b) for a, b in zip(no_state, ref)) < 0.05


def _first_step_modes(model, opt, handle, step, rank) -> tuple[float, dict[str, int]]:
    loss = _train_step(model, opt, step, rank)
    return loss, handle.gather_modes()


def _minus(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: a.get(k, 0) - b.get(k, 0) for k in sorted(set(a) | set(b))
            if a.get(k, 0) != b.get(k, 0)}


_EVALUATED = {
    # 4 ranks as 2 nodes x 2: the node-sharded reference, two-level gradients
    "node-sharded": (4, _SDP4),
    # 2 ranks, one node, quantized: the full reference, which FSDP's output buffer aliases
    "full": (2, QCommConfig.preset("qwd", weight_group_size=32, **_ONE_NODE, seed=9)),
    # direct 4-bit weights keyed by the counter, re-sent by every forward (no kept weights)
    "direct": (2, QCommConfig.preset("qsdp", weight_group_size=32, grad_group_size=32, **_ONE_NODE,
                                  seed=8)),
    # the same keeping the gathered weights: a load drops them, the first gather re-sends
    "direct-kept": (2, QCommConfig.preset("qsdp", weight_group_size=32, grad_group_size=32,
                                       weight_reuse_unchanged=True, **_ONE_NODE, seed=8)),
}


def _digests(handle) -> list:
    """Each FSDP module's ``gathered_digest`` in the state the handle would save now."""
    (entry,) = handle.state_dict().values()
    return [m["gathered_digest"] for m in entry["modules"].values()]


def _calls(handle) -> dict[str, int]:
    """Each FSDP module's weight-gather counter (one per gather that sent new weights)."""
    (entry,) = handle.state_dict().values()
    return {k: m["weight_calls"] for k, m in entry["modules"].items()}


def _resume_after_evaluation(rank, world, root, kind, n_before, n_after):
    # Train, evaluate (a no-grad forward: its gathers send the stepped weights), save. The
    # uninterrupted run's next forward sends nothing (qWD) or the same bits under the same key
    # (direct): so must the resumed run's, proven by the digest saved with the state.
    ckpt = os.path.join(root, "evaluated")
    cfg = _EVALUATED[kind][1]
    qwd = not kind.startswith("direct")
    model, handle, opt = _build(cfg)
    for s in range(n_before):
        _train_step(model, opt, s, rank)
    with torch.no_grad():
        _loss(model, 90_000, rank)
    saved = handle.state_dict()
    _save(ckpt, model, opt, handle)
    before = handle.gather_modes()
    ref = [_train_step(model, opt, s, rank) for s in range(n_before, n_before + n_after)]
    sent_after_save = _minus(handle.gather_modes(), before)
    units = len(_units(model))
    (entry,) = saved.values()
    digests = [m.get("gathered_digest") for m in entry["modules"].values()]
    assert len(digests) == units and all(isinstance(d, int) for d in digests), digests

    # resumed: bit for bit, with the uninterrupted run's counters; qWD re-assembles the
    # reference and its first forward sends nothing
    model_b, handle_b, opt_b = _build(cfg)
    _load(ckpt, model_b, opt_b, handle_b)
    assert _digests(handle_b) == digests  # saved again before any gather: the same digests
    first_b, modes_b = _first_step_modes(model_b, opt_b, handle_b, n_before, rank)
    calls_b = _calls(handle_b)
    got = [first_b] + [_train_step(model_b, opt_b, s, rank)
                       for s in range(n_before + 1, n_before + n_after)]
    if qwd:
        assert "qwd_diff" not in modes_b, modes_b  # the first step sent no difference
        assert _minus(handle_b.gather_modes(), {"qwd_restore": units}) == sent_after_save
    assert got == ref, (got, ref)
    assert _full_digests(model_b) == _full_digests(model)
    assert _calls(handle_b) == _calls(handle)
    assert calls_b == {k: m["weight_calls"] for k, m in entry["modules"].items()}

    # one rank's shard written through .data after the load (no version bump): its digest no
    # longer matches, and every rank sends that module (CONTENT is or-ed over the ranks)
    model_c, handle_c, opt_c = _build(cfg)
    _load(ckpt, model_c, opt_c, handle_c)
    if rank == 0:
        model_c.blocks[0].fc1.weight.to_local().data.mul_(1.01)
    _, modes_c = _first_step_modes(model_c, opt_c, handle_c, n_before, rank)
    assert _minus(_calls(handle_c), calls_b) == {"blocks.0": 1}
    if qwd:
        assert _minus(modes_c, modes_b) == {"qwd_diff": 1, "qwd_reuse": -1}, (modes_c, modes_b)

    # loaded where writes are not verified: no digest is compared, every module sends
    model_f, handle_f, opt_f = _build(cfg.replace(verify_weight_writes=False))
    _load(ckpt, model_f, opt_f, handle_f)
    _first_step_modes(model_f, opt_f, handle_f, n_before, rank)
    assert _minus(_calls(handle_f), calls_b) == {k: 1 for k in calls_b}

    # a state without the digest (saved before it existed, or with a change pending): every
    # module sends, as a load always did; a digest that is no int64 is refused
    model_d, handle_d, opt_d = _build(cfg)
    _load(ckpt, model_d, opt_d)
    for bad in ("1", True, 1 << 63):
        for m in entry["modules"].values():
            m["gathered_digest"] = bad
        with pytest.raises(CheckpointMismatch, match="gathered_digest"):
            handle_d.load_state_dict(saved)
    for m in entry["modules"].values():
        m["gathered_digest"] = None
    handle_d.load_state_dict(saved)
    _, modes_d = _first_step_modes(model_d, opt_d, handle_d, n_before, rank)
    assert _minus(_calls(handle_d), calls_b) == {k: 1 for k in calls_b}
    if qwd:
        assert _minus(modes_d, modes_b) == {"qwd_diff": units, "qwd_reuse": -units}, modes_d

    # handle.reset() after a load re-sends (qWD: at full precision), as it does anywhere else
    model_e, handle_e, opt_e = _build(cfg)
    _load(ckpt, model_e, opt_e, handle_e)
    handle_e.reset()
    _, modes_e = _first_step_modes(model_e, opt_e, handle_e, n_before, rank)
    assert _minus(_calls(handle_e), calls_b) == {k: 1 for k in calls_b}
    if qwd:
        # and re-assembles no loaded reference first
        assert _minus(modes_e, modes_b) == {"qwd_full": units, "qwd_reuse": -units,
                                            "qwd_restore": -units}, modes_e

    # a digest is saved only where the uninterrupted run's next gather sends nothing new
    assert _digests(handle) == [None] * units  # an optimizer step since the last gather
    with torch.no_grad():
        _loss(model, 90_001, rank)
    assert None not in _digests(handle)
    for group in opt.param_groups:
        group["lr"] = 0.0
    _train_step(model, opt, 99, rank)  # a step that changes no value still sends
    assert _digests(handle) == [None] * units
    with torch.no_grad():
        _loss(model, 90_002, rank)
    if rank == 0:  # a write without a version bump since that gather: on this rank only
        model.blocks[1].fc2.bias.to_local().data.add_(1.0)
    assert [d is None for d in _digests(handle)] == [
        rank == 0 and name == "blocks.1" for name in entry["modules"]], _digests(handle)
    handle.reset()
    assert _digests(handle) == [None] * units
    return True


@pytest.mark.parametrize("kind", list(_EVALUATED))
def test_resume_after_an_evaluation_forward_is_bit_identical(tmp_path, kind):
    run_ranks(_resume_after_evaluation, _EVALUATED[kind][0], str(tmp_path), kind, 3, 3)


def _resume_after_a_resend(rank, world, root, kind):
    # A checkpoint written while the next gather must re-send full precision (handle.reset(),
    # or a write found by version counter, as DiLoCo's global_weights() makes on exit): the
    # resumed run re-sends too (its state holds no reference), bit for bit.
    # A write then mark_changed() after the save: a quantized difference in both runs; a write
    # an optimizer step took in before the save: full precision in both, mark_changed() or not.
    # A p.data write after the step, or after an evaluation on rank 0 only: found by content,
    # saved per rank (reference_valid 4), or-ed by the agreement: full precision in both.
    cfg = _EVALUATED[kind][1]
    qwd = not kind.startswith("direct")
    hows = ("reset", "write", "write_then_mark_changed", "write_stepped_then_mark_changed",
            "data_after_step", "data_after_evaluation_on_rank_0", "data_after_a_raised_step")
    for how in hows:
        ckpt = os.path.join(root, how)
        model, handle, opt = _build(cfg)
        for s in range(2):
            _train_step(model, opt, s, rank)
        if how == "reset":
            handle.reset()
        elif how == "write_stepped_then_mark_changed":
            _loss(model, 2, rank).backward()
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.99)
            opt.step()
            opt.zero_grad()
        elif how.startswith("data_"):
            if how == "data_after_a_raised_step":
                _loss(model, 2, rank).backward()
                try:
                    OptimizerContainer(opt, fail=True).step()
                except RuntimeError:
                    pass
                opt.zero_grad()
            with torch.no_grad():
                if how.endswith("rank_0"):
                    _loss(model, 99, rank)
                    model.reshard()  # else the root's parameters are its gathered copy
                if rank == 0 or not how.endswith("rank_0"):
                    for p in model.parameters():
                        p.data.add_(0.01)  # every value: rank 0's part of each module too
        else:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.99)
        saved = handle.state_dict()
        _save(ckpt, model, opt, handle)
        if how.endswith("mark_changed"):
            handle.mark_changed()
        before = handle.gather_modes()
        ref = [_train_step(model, opt, s, rank) for s in range(2, 4)]
        sent = _minus(handle.gather_modes(), before)
        model_b, handle_b, opt_b = _build(cfg)
        _load(ckpt, model_b, opt_b, handle_b)
        if how.endswith("mark_changed"):
            handle_b.mark_changed()
        got = [_train_step(model_b, opt_b, s, rank) for s in range(2, 4)]
        assert got == ref, (how, got, ref)
        assert _full_digests(model_b) == _full_digests(model), how
        assert _calls(handle_b) == _calls(handle), how
        if qwd:  # what the first gather sent, as in the uninterrupted run
            units = len(_units(model))
            (entry,) = saved.values()
            valid = {m["reference_valid"] for m in entry["modules"].values()}
            want = 0 if how == "reset" else 3 if "stepped" in how else 2
            if how.startswith("data_"):
                want = 4 if rank == 0 or not how.endswith("rank_0") else 1
            assert valid == {want}, (how, valid)
            first = "qwd_diff" if how == "write_then_mark_changed" else "qwd_full"
            assert sent.get(first, 0) >= units, (how, sent)
            # no reference is re-assembled where full precision is re-sent
            restored = units if how == "write_then_mark_changed" else 0
            assert _minus(handle_b.gather_modes(), {"qwd_restore": restored}) == sent, (
                how, handle_b.gather_modes(), sent)
        handle.disable()
        handle_b.disable()
    return True


@pytest.mark.parametrize("kind", ["node-sharded", "full", "direct"])
def test_resume_after_a_reset_or_a_write_is_bit_identical(tmp_path, kind):
    run_ranks(_resume_after_a_resend, _EVALUATED[kind][0], str(tmp_path), kind)


def _pending_on_one_rank_loaded_unverified(rank, world, root):
    # Saved with a p.data write after the step on rank 0 only (reference_valid 4 there, 1 on
    # rank 1), loaded by a run with verify_weight_writes=False: no agreement ors the pending
    # write, so no rank may act on it alone (rank 0 re-sent full precision while rank 1 sent
    # a difference: a collective mismatch).
    ckpt = os.path.join(root, "pending")
    cfg = QCommConfig.preset("qwd", weight_group_size=32, **_ONE_NODE, seed=9)
    model, handle, opt = _build(cfg)
    for s in range(2):
        _train_step(model, opt, s, rank)
    if rank == 0:
        with torch.no_grad():
            for p in model.parameters():
                p.data.add_(0.01)
    (entry,) = handle.state_dict().values()
    valid = {m["reference_valid"] for m in entry["modules"].values()}
    _save(ckpt, model, opt, handle)
    unverified = QCommConfig.preset("qwd", weight_group_size=32, **_ONE_NODE, seed=9,
                                    verify_weight_writes=False)
    model_b, handle_b, opt_b = _build(unverified)
    _load(ckpt, model_b, opt_b, handle_b)
    losses = [_train_step(model_b, opt_b, s, rank) for s in range(2, 4)]
    handle.disable()
    handle_b.disable()
    return valid, losses, _full_digests(model_b)


def test_a_write_pending_on_some_ranks_loads_into_an_unverified_run(tmp_path):
    r0, r1 = run_ranks(_pending_on_one_rank_loaded_unverified, 2, str(tmp_path))
    assert r0[0] == {4} and r1[0] == {1}, (r0[0], r1[0])
    assert r0[2] == r1[2]  # the same weights after two more steps


def _accumulate_step(model, opt, step, rank, k: int = 2) -> list[float]:
    losses = []
    for m in range(k):
        model.set_requires_gradient_sync(m == k - 1)
        loss = _loss(model, 100 * step + m, rank)
        loss.backward()
        losses.append(loss.item())
    opt.step()
    opt.zero_grad()
    return losses


def _resume_accumulating(rank, world, root):
    # Gradient accumulation with forward-only evaluation: one exchange per step, before and
    # after a resume, and the resumed run is the uninterrupted one bit for bit.
    cfg = QCommConfig.preset("qwd", weight_group_size=32, **_ONE_NODE, seed=7)
    ckpt = os.path.join(root, "step")

    def run(model, opt, steps):
        out = []
        for s in steps:
            with torch.no_grad():
                out.append(_loss(model, 50_000 + s, rank).item())
            out += _accumulate_step(model, opt, s, rank)
        return out

    model, handle, opt = _build(cfg)
    run(model, opt, range(2))
    _save(ckpt, model, opt, handle)
    ref = run(model, opt, range(2, 4))
    units = len(_units(model))
    # per step: one exchange (at the evaluation) per module, every other gather reuses: the
    # blocks re-gather for both micro-batches' forward and backward, the root (not resharded
    # after forward) only for the second micro-batch's forward
    reuses = 4 * (units - 1) + 1
    assert handle.gather_modes() == {"qwd_full": units, "qwd_diff": 3 * units,
                                     "qwd_reuse": 4 * reuses}, handle.gather_modes()
    model_b, handle_b, opt_b = _build(cfg)
    _load(ckpt, model_b, opt_b, handle_b)
    got = run(model_b, opt_b, range(2, 4))
    assert got == ref, (got, ref)
    assert _full_digests(model_b) == _full_digests(model)
    assert handle_b.gather_modes() == {"qwd_restore": units, "qwd_diff": 2 * units,
                                       "qwd_reuse": 2 * reuses}, handle_b.gather_modes()
    return True


def test_resume_under_gradient_accumulation_is_bit_identical(tmp_path):
    run_ranks(_resume_accumulating, 2, str(tmp_path))


def _resume_shared_group(rank, world, root):
    # torchtitan-style fully_shard([norm, output]): the group's parameters are inp.weight,
    # inp.bias, out.weight, out.bias; each needs its own checkpoint entry.
    cfg = QCommConfig.preset("qwd", weight_group_size=32, **_ONE_NODE, seed=3)
    ckpt = os.path.join(root, "step")
    model, handle, opt = _build(cfg, group_io=True)
    [_train_step(model, opt, s, rank) for s in range(2)]
    _save(ckpt, model, opt, handle)
    ref = [_train_step(model, opt, s, rank) for s in range(2, 4)]
    (entry,) = handle.state_dict().values()  # this rank's, under "rank<r>_of_<W>"
    keys = sorted(k for st in entry["modules"].values() for k in st.get("reference", {}))
    model_b, handle_b, opt_b = _build(cfg, group_io=True)
    _load(ckpt, model_b, opt_b, handle_b)
    got = [_train_step(model_b, opt_b, s, rank) for s in range(2, 4)]
    assert got == ref, (got, ref)
    assert _full_digests(model_b) == _full_digests(model)
    return keys


def test_checkpoint_names_parameters_of_a_shared_group_apart(tmp_path):
    keys = run_ranks(_resume_shared_group, 2, str(tmp_path))[0]
    names = [k for k, _ in Net().named_parameters()]
    assert keys == sorted(names), keys  # one entry per parameter, under its model name


# ---- the consistency guard ---------------------------------------------------------------------
def _guard(rank, world):
    calls = []
    orig = ag_mod.consistency_error

    def counting(flat, w, segs, names, group, where, *args):
        calls.append(where)
        return orig(flat, w, segs, names, group, where, *args)

    ag_mod.consistency_error = counting
    try:
        # off by default: no check
        model, handle, opt = _build(
            QCommConfig.preset("qwd", weight_group_size=32, **_ONE_NODE))
        for s in range(2):
            _train_step(model, opt, s, rank)
        assert calls == []
        handle.disable()
        # every 3rd forward gather: steps 0 and 3 of 5, per module, nothing fires
        cfg = QCommConfig.preset("qwd", weight_group_size=32, **_ONE_NODE,
                                 consistency_check_every=3)
        model, handle, opt = _build(cfg)
        units = len(_units(model))
        for s in range(5):
            _train_step(model, opt, s, rank)
        assert len(calls) == 2 * units, calls
        assert all("forward gather #1 " in c or "forward gather #4 " in c for c in calls)
        # corrupt rank 1's copy of rank 0's slot of blocks.1.fc2.weight (one flipped mantissa
        # bit; a one-ulp change would be rounded away by the next added difference)
        g = unverified_param_groups(model.blocks[1])[0]
        q = g._all_gather_comm._qwd
        names = g._all_gather_comm._param_names()
        k = names.index("blocks.1.fc2.weight")
        off = sum(math.prod(fp.padded_sharded_param_size) for fp in g.fsdp_params[:k])
        if rank == 1:
            q.ref[off:off + 1].view(torch.int32).bitwise_xor_(1 << 20)
        # the next check (gather #7 = step 6) fires on every rank, naming the parameter
        _train_step(model, opt, 5, rank)
        with pytest.raises(RuntimeError, match=r"'blocks\.1\.fc2\.weight' differ between group "
                                               r"rank 0 and group rank\(s\) \[1\]"):
            _train_step(model, opt, 6, rank)
    finally:
        ag_mod.consistency_error = orig
    return True


def test_consistency_guard_silent_normally_fires_on_corruption():
    run_ranks(_guard, 2)


# ---- non-finite values --------------------------------------------------------------------------
def _total_norm(model) -> torch.Tensor:
    n = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    return n.full_tensor() if hasattr(n, "full_tensor") else n


def _nonfinite(rank, world, root):
    cfg = _SDP4.replace(consistency_check_every=1)
    model, handle, opt = _build(cfg)
    units = len(_units(model))
    # 1. a NaN input on one rank: its gradient reaches every rank's reduced shard (NaN scale
    # on the wire), the grad norm is NaN everywhere, every rank skips the step together
    losses, skipped = [], []
    for s in range(6):
        before = _full_digests(model)
        loss = _loss(model, s, rank, poison=(s == 2 and rank == 3))
        loss.backward()
        norm = _total_norm(model)
        if torch.isfinite(norm):
            opt.step()
        else:
            skipped.append(s)
            bad = any(not torch.isfinite(p.grad.to_local()).all() for p in model.parameters())
            every = [None] * world
            dist.all_gather_object(every, bad)
            assert all(every), "every rank's reduced gradient shard should carry the NaN"
            assert _full_digests(model) == before
        opt.zero_grad()
        losses.append(loss.item())
    assert skipped == [2]
    assert all(math.isfinite(v) for i, v in enumerate(losses) if i != 2 or rank != 3), losses
    # (the consistency guard ran at every forward gather and found the ranks identical)

    # 2. a NaN weight update on one rank's shard: qWD sends NaN differences for that group, so
    # every rank gets the same NaN weights (never a silent desync); recovery = load a checkpoint
    ckpt = os.path.join(root, "before_nan")
    _save(ckpt, model, opt, handle)
    loss = _loss(model, 6, rank)
    loss.backward()
    w = model.blocks[0].fc1.weight
    if rank == 0 and w.grad.to_local().numel():
        w.grad.to_local().view(-1)[0] = float("nan")
    opt.step()
    opt.zero_grad()
    seen, hooks = _gathered(model)
    loss = _loss(model, 7, rank)
    for h in hooks:
        h.remove()
    _same_on_all_ranks(seen, "weights after a NaN update on rank 0")
    assert torch.isnan(seen["blocks.0.fc1.weight"]).any()
    assert torch.isfinite(seen["blocks.0.fc2.weight"]).all()  # other parameters untouched
    assert math.isnan(loss.item())
    loss.backward()
    opt.zero_grad()
    _load(ckpt, model, opt, handle)
    restored = handle.gather_modes().get("qwd_restore", 0)
    seen, hooks = _gathered(model)
    after = _train_step(model, opt, 8, rank)
    for h in hooks:
        h.remove()
    assert handle.gather_modes()["qwd_restore"] == restored + units
    assert math.isfinite(after) and all(torch.isfinite(v).all() for v in seen.values())
    _same_on_all_ranks(seen, "weights after recovering from the checkpoint")
    return True


@pytest.mark.long
def test_nonfinite_gradient_skip_step_and_nan_update_stay_identical(tmp_path):
    run_ranks(_nonfinite, 4, str(tmp_path))


# ---- bad configuration and bad use --------------------------------------------------------------
_BAD = [
    ("weight_scheme", "qwd4"), ("grad_scheme", "two-level"), ("weight_bits", 1),
    ("weight_bits", 9), ("weight_bits", 4.0), ("weight_group_size", 100),
    ("weight_group_size", 0), ("weight_symmetric", 1), ("weight_rounding", "up"),
    ("grad_intra_bits", 16), ("grad_inter_bits", 0), ("grad_group_size", 12),
    ("grad_symmetric", "yes"), ("grad_rounding", "floor"), ("grad_hadamard", 1),
    ("grad_pipeline_chunks", 0), ("grad_pipeline_chunks", 65), ("scale_dtype", "float64"),
    ("ranks_per_node", 0), ("ranks_per_node", True), ("seed", -1),
    ("consistency_check_every", -1), ("consistency_check_every", 1.5),
    ("weight_reuse_unchanged", 1), ("weight_reuse_unchanged", "true"),
]


@pytest.mark.parametrize("field,value", _BAD, ids=[f"{f}={v!r}" for f, v in _BAD])
def test_invalid_config_value_names_the_field(field, value):
    base = {"grad_scheme": "two_level"} if field.startswith("grad_") else {}
    with pytest.raises(ValueError, match=rf"QCommConfig\.{field}"):
        QCommConfig(**{**base, field: value})


def test_config_rejects_unknown_fields_and_presets():
    with pytest.raises(ValueError, match=r"unknown QCommConfig field\(s\) \['weight_bit'\]"):
        QCommConfig.from_dict({"weight_bit": 4})
    with pytest.raises(ValueError, match="known presets"):
        QCommConfig.preset("sdp8bit")
    with pytest.raises(ValueError, match="grad_scheme='one_level' or 'two_level'"):
        QCommConfig(grad_hadamard=True)


def _misuse(rank, world):
    # a node size that does not divide the world size: refused at enable, naming the fix
    model = Net()
    fully_shard(model)
    groups = _units(model)
    before = [g._all_gather_comm for g in groups]
    with pytest.raises(ValueError, match="ranks_per_node=3 does not divide the world size 4"):
        fsdp_qcomm.enable(model, QCommConfig.preset("tlq", ranks_per_node=3))
    assert [g._all_gather_comm for g in groups] == before  # nothing installed
    # two-level without node information: the host names say one node of 4 ranks
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    derived = fsdp_qcomm.enable(model, QCommConfig.preset("sdp4bit"))
    assert (derived.placement.ranks_per_node, derived.placement.source) == (4, "host names")
    derived.disable()
    # a checkpoint from a differently sharded model
    handle = fsdp_qcomm.enable(model, _SDP4)
    ((key, entry),) = handle.state_dict().items()
    entry["owner"]["modules"]["blocks.0"] = entry["owner"]["modules"]["<root>"]
    with pytest.raises(ValueError, match="covers FSDP modules .* apply fully_shard"):
        handle.load_state_dict({key: entry})
    with pytest.raises(ValueError, match="not a QCommHandle state"):
        handle.load_state_dict({"model": {}})
    handle.disable()
    with pytest.raises(RuntimeError, match="already disabled"):
        handle.state_dict()
    return True


def test_bad_node_size_and_bad_checkpoint_state_4_ranks():
    run_ranks(_misuse, 4)


# ---- a rank dies mid-step -----------------------------------------------------------------------
_PG_TIMEOUT = 8.0


def _dies(rank, world):
    model, handle, opt = _build(QCommConfig.preset("sdp4bit", ranks_per_node=1))
    _train_step(model, opt, 0, rank)
    if rank == 1:  # in the middle of the next forward, between two FSDP gathers
        model.blocks[1].register_forward_pre_hook(lambda m, a: os._exit(3))
    t0 = time.monotonic()
    try:
        _train_step(model, opt, 1, rank)
    except Exception as e:  # noqa: BLE001 - what matters is that it raises, and how fast
        return time.monotonic() - t0, type(e).__name__, str(e)[:300]
    return time.monotonic() - t0, None, "returned normally"


def test_dead_rank_makes_peers_fail_within_timeout():
    t0 = time.monotonic()
    out = run_ranks(_dies, 3, timeout=60, pg_timeout=_PG_TIMEOUT, may_exit=(1,))
    assert out[1] is None  # the killed rank
    for r in (0, 2):
        elapsed, kind, msg = out[r]
        assert kind in ("RuntimeError", "DistBackendError"), f"rank {r}: {kind}: {msg}"
        assert elapsed < _PG_TIMEOUT + 5.0, (r, elapsed, msg)
    assert time.monotonic() - t0 < 60

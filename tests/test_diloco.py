"""DiLoCo across replica groups (``fsdp_qcomm.diloco``) on gloo CPU ranks.

Every replica group is an FSDP2 model sharded over its own ranks (the ``shard`` dimension of a
2-D ``(replicate, shard)`` mesh); only the outer all-reduces cross replica groups. What is
checked: the schedule; replicas bit-identical after every outer step (2 groups x 2 ranks and 3
x 1, quantized at 2-4 bits, with and without error feedback, streaming fragments); the overlap
thread really runs the all-reduce during the next inner step and gives the same bits as the
synchronous reference; resume from a DCP checkpoint at an outer step and mid-round (an
all-reduce in flight) is bit-identical; mismatched checkpoints are refused, and so are replicas
launched with other settings, on every replica alike; bytes and outer state are accounted.
"""

from __future__ import annotations

import hashlib
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _models import MLPBlock
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from fsdp_qcomm.codec import hadamard_len, wire_bytes
from fsdp_qcomm.diloco import DiLoCo, DiLoCoConfig, isolate_replicas
from fsdp_qcomm.diloco.schedule import Schedule
from fsdp_qcomm.testing import run_ranks

D, HID = 12, 20


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _build(shape, seed: int = 0, fsdp: bool = True, isolated: bool = False):
    """The model sharded over each replica group's own ranks (``mesh["shard"]``), or with
    ``isolated`` as HSDP over the 2-D mesh with its replica all-reduce isolated
    (``isolate_replicas``)."""
    R, G = shape
    mesh = init_device_mesh("cpu", (R, G), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(seed)
    model = nn.Sequential(MLPBlock(D, HID), MLPBlock(D, HID), nn.Linear(D, D))
    if fsdp:
        shard_mesh = mesh if isolated else mesh["shard"]
        for m in model[:2]:
            fully_shard(m, mesh=shard_mesh)
        fully_shard(model, mesh=shard_mesh)
        if isolated:
            isolate_replicas(model)
    return model, mesh


def _batch(mesh, t: int):
    r = mesh["replicate"].get_local_rank()
    g = mesh["shard"].get_local_rank()
    gen = torch.Generator().manual_seed(1000 + 100 * r + 10 * g + 7919 * t)
    x = torch.randn(4, D, generator=gen)
    return x, torch.sin(x).flip(-1)


def _inner_step(model, opt, mesh, t: int) -> torch.Tensor:
    """One inner step on this rank's batch ``t``: forward, backward, optimizer step; the loss."""
    x, y = _batch(mesh, t)
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _same_across_replicas(tensors: dict, group) -> bool:
    mine = {k: _digest(v) for k, v in sorted(tensors.items())}
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    return all(d == mine for d in every)


def _shards(diloco: DiLoCo, fragment: int) -> dict:
    """This rank's shard of every parameter of ``fragment`` and the start-of-round weights of
    every fragment."""
    out = {f"param.{r.name}": r.local().clone() for r in diloco.fragments[fragment].refs}
    out.update({f"global.{f.index}": f.global_.clone() for f in diloco.fragments})
    return out


def _train(model, opt, diloco, mesh, steps: int, check: bool = True) -> dict:
    """``steps`` inner steps; after every outer step, compare the merged fragment's shards and
    every start-of-round buffer across replicas."""
    rgroup = mesh["replicate"].get_group()
    losses, checks, same = [], 0, True
    for _ in range(steps):
        t = diloco.inner_steps
        loss = _inner_step(model, opt, mesh, t)
        before = diloco.outer_steps
        merging = diloco._pending.fragment if diloco._pending is not None else None
        diloco.step()
        if merging is None and diloco.config.delay == 0:
            merging = diloco.schedule.launch_at(diloco.inner_steps)
        losses.append(loss.item())
        if check and diloco.outer_steps > before:
            checks += 1
            same &= _same_across_replicas(_shards(diloco, merging), rgroup)
    return {"losses": losses, "checks": checks, "same": same}


def _identical_run(rank: int, world: int, shape, cfg_kw: dict, steps: int,
                   qcomm: bool = False, isolated: bool = False) -> dict:
    model, mesh = _build(shape, isolated=isolated)
    handle = None
    if qcomm:
        from fsdp_qcomm import QCommConfig, enable

        handle = enable(model, QCommConfig.preset("qwd", quantize_intra_node=True,
                                                  ranks_per_node=shape[1]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    diloco = DiLoCo(model, DiLoCoConfig(**cfg_kw), replicas=mesh, handle=handle)
    out = _train(model, opt, diloco, mesh, steps)
    diloco.finish()
    diloco.close()
    if handle is not None:
        out["modes"] = handle.gather_modes()
        out["modules"] = len(handle.module_names)
    # global_weights(): every replica computes with the start-of-round weights inside, its own
    # weights come back after
    before = {f"{i}": f.local_flat() for i, f in enumerate(diloco.fragments)}
    x = torch.randn(4, D, generator=torch.Generator().manual_seed(5))  # the same on every rank
    with diloco.global_weights():
        inside = {f"{i}": f.local_flat() for i, f in enumerate(diloco.fragments)}
        inside["out"] = model(x).detach()
    out["global_weights"] = _same_across_replicas(inside, mesh["replicate"].get_group()) and all(
        torch.equal(inside[k], diloco.fragments[int(k)].global_) for k in before) and all(
        torch.equal(before[k], f.local_flat()) for k, f in zip(before, diloco.fragments))
    out["stats"] = diloco.stats()
    out["state"] = diloco.outer_state_breakdown()
    out["numels"] = [f.numel for f in diloco.fragments]
    out["outer_steps"] = diloco.outer_steps
    out["position"] = (diloco.group_rank, diloco.group_size)
    out["params"] = {n: _digest(p.detach().to_local()) for n, p in model.named_parameters()}
    out["diagnostics"] = diloco.diagnostics()
    if handle is not None:
        out["handle_kinds"] = sorted(k for k in handle.stats() if k != "summary")
    return out


# ---- the schedule and the config ---------------------------------------------------------------
def test_schedule_round_robin_and_delay():
    s = Schedule(sync_every=8, fragments=2, delay=1)
    launches = {t: s.launch_at(t) for t in range(1, 25) if s.launch_at(t) is not None}
    merges = {t: s.merge_at(t) for t in range(1, 25) if s.merge_at(t) is not None}
    assert launches == {4: 0, 8: 1, 12: 0, 16: 1, 20: 0, 24: 1}  # each fragment every 8 steps
    assert merges == {t + 1: f for t, f in launches.items() if t + 1 < 25}
    assert [s.sync_index(t) for t in launches] == [0, 1, 2, 3, 4, 5]
    one = Schedule(sync_every=5, fragments=1, delay=0)
    assert [t for t in range(1, 16) if one.launch_at(t) == 0] == [5, 10, 15]
    assert all(one.merge_at(t) == one.launch_at(t) for t in range(16))


@pytest.mark.parametrize("kw, field", [
    (dict(sync_every=6, fragments=4), "fragments"),
    (dict(sync_every=8, fragments=2, delay=4), "delay"),
    (dict(bits=1), "bits"),
    (dict(bits=None), "hadamard"),
    (dict(bits=None, hadamard=False, error_feedback=True), "error_feedback"),
    (dict(overlap=True), "overlap"),
    (dict(alpha=1.5), "alpha"),
    (dict(group_size=12), "group_size"),
])
def test_config_refuses_bad_values_by_name(kw, field):
    with pytest.raises(ValueError, match=field):
        DiLoCoConfig(**kw)


def test_config_defaults_are_the_papers():
    c = DiLoCoConfig()
    assert (c.outer_lr, c.outer_momentum, c.outer_nesterov) == (0.7, 0.9, True)
    assert c.bits == 4 and c.hadamard and not c.error_feedback
    assert c.wire_bits() == 4.25
    assert DiLoCoConfig(delay=1, sync_every=4).overlaps and not DiLoCoConfig().overlaps
    with pytest.raises(ValueError, match="unknown"):
        DiLoCoConfig.from_dict({"H": 4})


# ---- replicas bit-identical after every outer step ---------------------------------------------
def test_replicas_identical_2x2_with_qwd_hooks():
    """DiLoCo (F=1, 4-bit) over 2 replica groups of 2 FSDP ranks, with fsdp-qcomm's qWD gathers
    inside each group: after each outer step every shard is the same on both replicas, and
    the gathers after an outer step send quantized differences (``mark_changed``), not a
    full-precision resend."""
    steps = 12
    res = run_ranks(_identical_run, 4, (2, 2), dict(sync_every=4), steps, True, timeout=300)
    for r in res:
        assert r["checks"] == steps // 4 and r["same"] and r["global_weights"]
        assert r["modes"].get("qwd_full", 0) == r["modules"]  # the first gather only
        assert r["modes"].get("qwd_diff", 0) > 0
    # both replicas computed different losses (different data) yet ended identical
    assert res[0]["losses"] != res[2]["losses"]


def test_replicas_identical_streaming_2x2_error_feedback():
    """Streaming DiLoCo: 2 fragments, 2-bit outer gradients with error feedback, the all-reduce
    overlapping one inner step on the background thread."""
    steps = 17
    cfg = dict(sync_every=8, fragments=2, delay=1, bits=2, error_feedback=True)
    res = run_ranks(_identical_run, 4, (2, 2), cfg, steps, timeout=300)
    for r in res:
        assert r["checks"] == 4 and r["same"] and r["global_weights"]
        assert r["state"]["residuals"] > 0


def test_replicas_identical_3x1():
    steps = 8
    cfg = dict(sync_every=4, bits=3, error_feedback=True)
    res = run_ranks(_identical_run, 3, (3, 1), cfg, steps + 1, timeout=300)
    for r in res:
        assert r["checks"] == 2 and r["same"]
        assert r["global_weights"]


# ---- bytes and memory ----------------------------------------------------------------------------
def test_stats_count_the_wire_bytes_per_inner_step():
    steps, H = 8, 4
    cfg = DiLoCoConfig(sync_every=H, bits=4)
    res = run_ranks(_identical_run, 4, (2, 2), dict(sync_every=H, bits=4), steps, timeout=300)
    for r in res:
        (m,) = r["numels"]
        st = r["stats"]
        row = wire_bytes(hadamard_len(-(-m // 2)), cfg.spec())  # one of R rows, R = 2
        assert st["outer_allreduce"]["calls"] == steps // H
        assert st["outer_allreduce"]["sent_bytes"] == (steps // H) * 3 * row  # R + 1 rows
        assert st["outer_allreduce"]["cross_node_bytes"] == (steps // H) * 2 * row
        s = st["summary"]
        assert s["inner_steps"] == steps and s["outer_steps"] == steps // H
        assert s["outer_cross_node_bytes_per_inner_step"] == 2 * row / H
        assert "outer_weight" not in st  # a static group: every replica counts 1
        assert st["outer_init"]["elements"] == m  # replica 0's weights, once
        b = r["state"]
        assert b["global"] == 4 * m and b["optimizer"] == 4 * m  # SGD momentum
        assert b["residuals"] == 0 and b["in_flight"] == 0
        assert s["outer_state_bytes"] == sum(b.values())


def test_diagnostics_measure_each_outer_step_and_change_no_bit():
    """DiLoCoConfig.diagnostics: per outer step the fp32 mean beside the quantized one (an
    extra unquantized all-reduce), their cosine and relative error, the pseudo-gradient's and
    the update's norms; the training is bit for bit the run without it, and fp32 outer
    gradients agree with their own reference exactly."""
    steps, kw = 8, dict(sync_every=4, bits=2, outer_momentum=0.8)
    plain = run_ranks(_identical_run, 4, (2, 2), kw, steps, timeout=300)
    diag = run_ranks(_identical_run, 4, (2, 2), {**kw, "diagnostics": True}, steps, timeout=300)
    fp32 = run_ranks(_identical_run, 4, (2, 2), dict(sync_every=4, bits=None, hadamard=False,
                                                     diagnostics=True), steps, timeout=300)
    assert [r["params"] for r in diag] == [r["params"] for r in plain]
    assert plain[0]["diagnostics"] == []
    d = diag[0]["diagnostics"]
    assert [x["outer_step"] for x in d] == [1, 2] and all(x == d for x in
                                                          (r["diagnostics"] for r in diag))
    for x in d:
        assert 0.0 < x["cosine"] < 1.0 and x["relative_error"] > 0, x  # 2 bits: noisy
        assert x["mean_fp32_norm"] <= x["pseudo_gradient_norm"] * (1 + 1e-9)  # a mean shrinks
        assert x["update_norm"] > 0
    for x in fp32[0]["diagnostics"]:
        assert x["relative_error"] == 0.0 and abs(x["cosine"] - 1.0) < 1e-12, x
    # the extra fp32 all-reduce is not part of the counted traffic
    assert diag[0]["stats"]["outer_allreduce"] == plain[0]["stats"]["outer_allreduce"]


# ---- the overlap thread -------------------------------------------------------------------------
#: inner steps after which ``_overlap_run``'s schedule launches an all-reduce (6 steps, 2 fragments)
_LAUNCHES = (3, 6, 9, 12)


def _overlap_run(rank: int, world: int, overlap: bool) -> dict:
    import threading

    model, mesh = _build((2, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = DiLoCoConfig(sync_every=6, fragments=2, delay=2, overlap=overlap, bits=4)
    diloco = DiLoCo(model, cfg, replicas=mesh)
    started = {}  # inner step being trained when each all-reduce started, by launch step
    training = {"t": -1}
    cond = threading.Condition()

    def on_start(t_launch: int) -> None:  # the background thread, before the all-reduce
        with cond:
            cond.wait_for(lambda: training["t"] > t_launch, timeout=30)
            started[t_launch] = (training["t"], threading.current_thread().name)
            cond.notify_all()

    diloco._overlap.on_start = on_start
    losses = []
    for _ in range(13):
        n = diloco.inner_steps + 1  # the inner step about to run (1-based)
        with cond:
            if overlap:  # each all-reduce has seen step L + 1 running before step L + 2 starts
                cond.wait_for(lambda: all(L in started for L in _LAUNCHES if L + 1 < n),
                              timeout=30)
            training["t"] = n
            cond.notify_all()
        loss = _inner_step(model, opt, mesh, diloco.inner_steps)
        diloco.step()
        losses.append(loss.item())
    diloco.close()
    return {"losses": losses, "started": started,
            "shards": {k: _digest(v) for k, v in _shards(diloco, 0).items()},
            "shards1": {k: _digest(v) for k, v in _shards(diloco, 1).items()}}


def test_overlap_runs_during_inner_steps_and_matches_sync():
    """With ``delay=2`` each all-reduce starts on the background thread only once the next
    inner step is running (it waits for it: a synchronous all-reduce would time out there),
    and the run is bit-identical to the same schedule run synchronously."""
    on = run_ranks(_overlap_run, 2, True, timeout=300)
    off = run_ranks(_overlap_run, 2, False, timeout=300)
    for a, b in zip(on, off):
        assert a["started"] and not b["started"]
        for t, (training, thread) in a["started"].items():
            assert training == t + 1 and thread.startswith("qcomm-diloco")
        assert sorted(a["started"]) == list(_LAUNCHES)
        assert a["losses"] == b["losses"]
        assert a["shards"] == b["shards"] and a["shards1"] == b["shards1"]


# ---- checkpoints ------------------------------------------------------------------------------
_RESUME_CFG = dict(sync_every=8, fragments=2, delay=1, bits=3, error_feedback=True)


def _app(model, opt):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.stateful import Stateful

    class App(Stateful):
        def state_dict(self):
            m, o = get_state_dict(model, opt)
            return {"model": m, "optim": o}

        def load_state_dict(self, sd):
            set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    return App()


def _resume_run(rank: int, world: int, root: str, phase: str, save_at=(), load_at=None,
                steps: int = 14) -> dict:
    import torch.distributed.checkpoint as dcp

    model, mesh = _build((2, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    diloco = DiLoCo(model, DiLoCoConfig(**_RESUME_CFG), replicas=mesh)
    rep = mesh["replicate"].get_local_rank()
    pg = mesh["shard"].get_group()

    def where(t):
        return os.path.join(root, f"t{t}", f"replica{rep}")

    if load_at is not None:
        dcp.load({"app": _app(model, opt), "diloco": diloco}, checkpoint_id=where(load_at),
                 process_group=pg)
        assert diloco.inner_steps == load_at
    losses = {}
    while diloco.inner_steps < steps:
        loss = _inner_step(model, opt, mesh, diloco.inner_steps)
        diloco.step()
        losses[diloco.inner_steps] = loss.item()
        if diloco.inner_steps in save_at:
            pending = diloco._pending is not None
            dcp.save({"app": _app(model, opt), "diloco": diloco},
                     checkpoint_id=where(diloco.inner_steps), process_group=pg)
            losses[f"pending{diloco.inner_steps}"] = pending
    diloco.finish()
    diloco.close()
    shards = {}
    for f in range(2):
        shards.update({k: _digest(v) for k, v in _shards(diloco, f).items()})
    res = diloco.state_dict()[diloco._residual_key()]
    shards.update({f"res.{f}.{s}": _digest(v) for f, d in res.items() for s, v in d.items()})
    return {"losses": losses, "shards": shards}


@pytest.mark.long
def test_dcp_resume_is_bit_identical(tmp_path):
    """Save at an outer step (t=5, right after fragment 0's merge) and mid-round with fragment
    1's all-reduce in flight (t=8); a fresh run loading either one ends bit-identical to the
    run that never stopped (losses, shards, start-of-round weights, residuals)."""
    ref = run_ranks(_resume_run, 4, str(tmp_path), "ref", (5, 8), timeout=300)
    for r in ref:
        assert r["losses"]["pending8"] and not r["losses"]["pending5"]
    for t in (5, 8):
        got = run_ranks(_resume_run, 4, str(tmp_path), "resume", (), t, timeout=300)
        for a, b in zip(ref, got):
            tail = {k: v for k, v in a["losses"].items() if isinstance(k, int) and k > t}
            assert b["losses"] == tail
            assert b["shards"] == a["shards"]


def _mismatch_run(rank: int, world: int) -> dict:
    model, mesh = _build((2, 1))
    base = DiLoCo(model, DiLoCoConfig(sync_every=4, fragments=2), replicas=mesh)
    state = base.state_dict()
    errors = {}
    for name, kw in (("fragments", dict(sync_every=4, fragments=1)),
                     ("bits", dict(sync_every=4, fragments=2, bits=2))):
        other = DiLoCo(model, DiLoCoConfig(**kw), replicas=mesh)
        try:
            other.load_state_dict(state)
        except ValueError as e:
            errors[name] = str(e)
    wide, _ = _build((2, 1), fsdp=False)
    wide[2] = nn.Linear(D, D + 1)
    other = DiLoCo(nn.Sequential(*wide[:2], nn.Linear(D, D + 2)),
                   DiLoCoConfig(sync_every=4, fragments=2), replicas=mesh)
    try:
        other.load_state_dict(state)
    except ValueError as e:
        errors["shapes"] = str(e)
    # refused on one rank only: refused on both (before, rank 0 loaded it and trained on)
    one = DiLoCo(model, DiLoCoConfig(sync_every=4, fragments=2), replicas=mesh)
    try:
        one.load_state_dict(state if rank == 0 else {**state, "version": -1})
    except ValueError as e:
        errors["one_rank"] = str(e)
    same = DiLoCo(model, DiLoCoConfig(sync_every=4, fragments=2), replicas=mesh)
    same.load_state_dict(state)  # accepted
    return errors


def test_load_refuses_another_layout_or_config():
    res = run_ranks(_mismatch_run, 2, timeout=200)
    for errors in res:
        assert "fragments" in errors["fragments"]
        assert "'bits'" in errors["bits"]
        assert "fragments" in errors["shapes"]
    assert res[1]["one_rank"].startswith("not a DiLoCo state (version -1"), res[1]
    assert res[0]["one_rank"].startswith(
        "DiLoCo: the state was refused on rank(s) [1] of 2, so no rank loads it. Rank 1: "
        "ValueError: not a DiLoCo state"), res[0]


def _other_settings_run(rank: int, world: int) -> dict:
    """Replica 1 launched with other settings, one difference at a time, then alike."""
    model, mesh = _build((2, 1))
    r = mesh["replicate"].get_local_rank()
    base = dict(sync_every=4, fragments=2)
    out = {}
    for name, kw in (("outer_lr", dict(outer_lr=0.5)), ("sync_every", dict(sync_every=8)),
                     ("bits", dict(bits=2, hadamard=False))):
        try:
            DiLoCo(model, DiLoCoConfig(**{**base, **(kw if r == 1 else {})}), replicas=mesh)
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    momentum = 0.9 if r == 0 else 0.8
    try:
        DiLoCo(model, DiLoCoConfig(**base), replicas=mesh, outer_optimizer=lambda ps: (
            torch.optim.SGD(ps, lr=0.7, momentum=momentum)))
        out["optimizer"] = "no error"
    except ValueError as e:
        out["optimizer"] = str(e)
    def refusing(params):  # a check of the replica's own that fails on replica 1 only
        if r == 1:
            raise ValueError("this replica's outer optimizer refuses")
        return torch.optim.SGD(params, lr=0.7)

    try:
        DiLoCo(model, DiLoCoConfig(**base), replicas=mesh, outer_optimizer=refusing)
        out["one_fails"] = "no error"
    except (ValueError, RuntimeError) as e:
        out["one_fails"] = f"{type(e).__name__}: {e}"
    # alike: overlap None and False at delay 0; a tensor learning rate compared by its value
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    diloco = DiLoCo(model, DiLoCoConfig(**base, overlap=None if r == 0 else False),
                    replicas=mesh, outer_optimizer=lambda ps: torch.optim.Adam(
                        ps, lr=torch.tensor(0.01), betas=(0.9, 0.95)))
    out["alike"] = _train(model, opt, diloco, mesh, 8)["same"]
    return out


def test_replicas_launched_with_other_settings_refuse_alike():
    """Before: another outer learning rate or momentum on one replica merged into weights that
    drifted apart without an error; another schedule or wire format paired all-reduces of
    other rounds or sizes. Now every replica raises the same error, naming the field."""
    results = run_ranks(_other_settings_run, 2, timeout=200)
    assert results[1]["one_fails"] == "ValueError: this replica's outer optimizer refuses"
    assert results[0]["one_fails"] == (
        "RuntimeError: DiLoCo failed on replica(s) [1] (global rank(s) [1]), so it stops on "
        "every replica: ValueError: this replica's outer optimizer refuses"), results[0]
    for res in results:
        del res["one_fails"]
    assert results[0] == results[1]
    out = results[0]
    assert out["outer_lr"].startswith(
        "DiLoCo: the replicas would not run the same outer steps. config.outer_lr: 0.7 on "
        "replica(s) [0] (global rank(s) [0]); 0.5 on replica(s) [1] (global rank(s) [1])"), out
    assert "config.sync_every: 4 on replica(s) [0]" in out["sync_every"], out
    assert "config.bits: 4 on" in out["bits"] and "config.hadamard: True on" in out["bits"], out
    assert ("outer_optimizer.momentum: [0.9, 0.9] on replica(s) [0] (global rank(s) [0]); "
            "[0.8, 0.8] on replica(s) [1] (global rank(s) [1]). Give") in out["optimizer"], out
    assert "Give every replica the same DiLoCoConfig" in out["optimizer"], out
    assert out["alike"] is True


def _refuse_hsdp(rank: int, world: int, qcomm: bool) -> str:
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    model = nn.Linear(D, D)
    fully_shard(model, mesh=mesh)
    if qcomm:  # its quantized replica all-reduce hides FSDP's replica group behind a 1-rank one
        from fsdp_qcomm import QCommConfig, enable

        enable(model, QCommConfig.preset("sdp4bit", ranks_per_node=1))
    try:
        DiLoCo(model, DiLoCoConfig(), replicas=mesh)
    except ValueError as e:
        return str(e)
    return ""


@pytest.mark.parametrize("qcomm", [False, True], ids=["fsdp2", "sdp4bit"])
def test_refuses_hsdp_meshes(qcomm):
    """HSDP whose replicas are not isolated all-reduces across them at every step: refused,
    naming both ways out, also when fsdp-qcomm's hooks run that all-reduce."""
    for msg in run_ranks(_refuse_hsdp, 2, qcomm, timeout=120):
        assert "mesh['shard']" in msg and "isolate_replicas" in msg, msg


def _refuse_two_shard_groups(rank: int, world: int) -> str:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    model = nn.Sequential(nn.Linear(D, D), nn.Linear(D, D))
    fully_shard(model[0], mesh=mesh["b"])  # ranks {0, 1} and {2, 3}
    fully_shard(model[1], mesh=mesh["a"])  # ranks {0, 2} and {1, 3}
    try:
        DiLoCo(model, DiLoCoConfig(), replicas=mesh["a"].get_group())
    except ValueError as e:
        return str(e)
    return ""


def test_refuses_parameters_sharded_over_different_groups():
    """Two FSDP modules sharded over different groups of ranks: no single position inside a
    replica group exists, so refused, naming the sizes and a parameter of each."""
    for msg in run_ranks(_refuse_two_shard_groups, 4, timeout=120):
        assert "sharded over different FSDP groups" in msg and "one shard mesh" in msg, msg
        assert "0.weight" in msg and "1.weight" in msg, msg


# ---- HSDP with isolated replicas (isolate_replicas) ------------------------------------------
def _isolated_against_shard_mesh(rank: int, world: int, factor) -> dict:
    """The same model, init and batches twice: FSDP over ``mesh["shard"]`` and HSDP over the
    2-D mesh with isolated replicas; 3 AdamW steps with FSDP's default scaling (``factor``
    None) or torchtitan's (divide factor 1.0, forced sum: gloo has no PREMUL_SUM), each
    clipped as torchtitan clips (the total norm of the DTensor gradients, ``full_tensor``).
    Returns whether every step's gradients, norm and weights are bit-identical, whether the
    two replica groups' gradients differ (nothing averaged them), and the isolated groups'
    state."""
    from fsdp_qcomm.fsdp import hsdp
    from fsdp_qcomm.fsdp import internals as fsdp

    runs = []
    for isolated in (False, True):
        model, mesh = _build((2, 2), isolated=isolated)
        mods = [m for m in model.modules() if isinstance(m, FSDPModule)]
        if factor is not None:
            for m in mods:
                m.set_gradient_divide_factor(factor)
                m.set_force_sum_reduction_for_comms(True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        steps = []
        for t in range(3):
            x, y = _batch(mesh, t)
            ((model(x) - y) ** 2).mean().backward()
            seen = {f"grad.{n}": p.grad.to_local().detach().clone()
                    for n, p in model.named_parameters()}
            # torchtitan's clipping: the norm of each replica group's own gradients
            params = list(model.parameters())
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
            norm = norm.full_tensor()
            torch.nn.utils.clip_grads_with_norm_(params, 0.01, norm, foreach=True)
            seen["norm"] = norm.detach().clone()
            opt.step()
            opt.zero_grad()
            seen.update({f"param.{n}": p.detach().to_local().clone()
                         for n, p in model.named_parameters()})
            steps.append(seen)
        groups = [g for m in mods for g in fsdp.param_groups(m)]
        runs.append((steps, groups, mesh))
    (plain, _, mesh), (iso, groups, _) = runs
    same = all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
               for a, b in zip(plain, iso))
    first_grads = {k: v for k, v in iso[0].items() if k.startswith("grad.")}
    norms = [float(step["norm"]) for step in iso]
    return {
        "same": same,
        "replicas_differ": not _same_across_replicas(first_grads,
                                                     mesh["replicate"].get_group()),
        "isolated": all(hsdp.is_isolated(g) for g in groups),
        "fsdp_replica_size": {fsdp.replicate_group(g).size() for g in groups},
        "real_replicas": {hsdp.isolated_replica_group(g).size() for g in groups},
        "force_sum": {fsdp.force_sum(g) for g in groups},
        "norms": norms,
    }


@pytest.mark.parametrize("factor", [None, 1.0])
def test_isolated_hsdp_trains_exactly_as_fsdp_over_the_shard_group(factor):
    """HSDP 2 x 2 with ``isolate_replicas`` against FSDP over ``mesh["shard"]``: the same
    gradients and weights bit for bit at every step, under FSDP's default scaling (the mean
    over the shard group: ``isolate`` forces FSDP's SUM, FSDP divides by 2, as gloo's AVG
    does) and under torchtitan's (divide factor 1.0); the replica groups' gradients differ
    (no all-reduce across them), and so do their clipping norms (each group's own, clipping
    active); FSDP all-reduces over a one-rank group, the real replica group is kept."""
    res = run_ranks(_isolated_against_shard_mesh, 4, factor, timeout=300)
    for r in res:
        assert r["same"] and r["replicas_differ"] and r["isolated"]
        assert r["fsdp_replica_size"] == {1} and r["real_replicas"] == {2}
        assert r["force_sum"] == {True}
        assert all(n > 0.01 for n in r["norms"]), r["norms"]  # the clipping acted
    assert res[0]["norms"] == res[1]["norms"] != res[2]["norms"] == res[3]["norms"]


def test_diloco_on_isolated_hsdp_is_diloco_on_the_shard_mesh():
    """DiLoCo (4-bit, H=4) over 2 replica groups of 2 ranks: on isolated HSDP (2-D
    parameters) the run is bit-identical to the one on ``mesh["shard"]`` (losses, shards,
    outer state), the replicas are identical after every outer step, and DiLoCo reads each
    rank's position from its shard group."""
    steps = 12
    plain = run_ranks(_identical_run, 4, (2, 2), dict(sync_every=4), steps, timeout=300)
    iso = run_ranks(_identical_run, 4, (2, 2), dict(sync_every=4), steps, False, True,
                    timeout=300)
    for rank, (a, b) in enumerate(zip(plain, iso)):
        assert b["checks"] == steps // 4 and b["same"] and b["global_weights"]
        assert b["position"] == a["position"] == (rank % 2, 2)
        assert b["losses"] == a["losses"] and b["params"] == a["params"]
        assert b["stats"]["summary"]["outer_sent_bytes"] == a["stats"]["summary"][
            "outer_sent_bytes"]
    assert iso[0]["losses"] != iso[2]["losses"]


def test_isolated_hsdp_with_qwd_hooks():
    """isolate_replicas before fsdp_qcomm.enable: enable sees one replica (no replica
    all-reduce kind in its stats), the qWD gathers inside each group send quantized
    differences after outer steps, replicas identical after each."""
    steps = 12
    res = run_ranks(_identical_run, 4, (2, 2), dict(sync_every=4), steps, True, True,
                    timeout=300)
    for r in res:
        assert r["checks"] == steps // 4 and r["same"] and r["global_weights"]
        assert r["modes"].get("qwd_diff", 0) > 0
        assert not any(k.startswith("grad_replica") for k in r["handle_kinds"]), r["handle_kinds"]


def _isolation_edges(rank: int, world: int) -> dict:
    from fsdp_qcomm import QCommConfig, enable
    from fsdp_qcomm.fsdp import internals as fsdp

    out = {}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    # enable first, then isolate: refused, nothing changed
    model = nn.Sequential(MLPBlock(D, HID), nn.Linear(D, D))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    handle = enable(model, QCommConfig.preset("sdp4bit", ranks_per_node=2))
    try:
        isolate_replicas(model)
        out["after_enable"] = ""
    except RuntimeError as e:
        out["after_enable"] = str(e)
    handle.disable()
    # DiLoCo over the wrong replicas (the shard group) is refused
    iso = isolate_replicas(model)
    try:
        DiLoCo(model, DiLoCoConfig(), replicas=mesh["shard"].get_group())
        out["wrong_replicas"] = ""
    except ValueError as e:
        out["wrong_replicas"] = str(e)
    # undo: FSDP averages across replicas again
    iso.undo()
    groups = [g for m in (model, model[0]) for g in fsdp.param_groups(m)]
    out["undone"] = (all(fsdp.replicate_group(g).size() == 2 for g in groups)
                     and all(fsdp.all_reduce_hook(g) is None for g in groups))
    x, y = _batch(mesh, 0)
    ((model(x) - y) ** 2).mean().backward()
    grads = {n: p.grad.to_local() for n, p in model.named_parameters()}
    out["averaged_again"] = _same_across_replicas(grads, mesh["replicate"].get_group())
    # a plain FSDP model has nothing to isolate
    plain = nn.Linear(D, D)
    fully_shard(plain, mesh=mesh["shard"])
    try:
        isolate_replicas(plain)
        out["plain"] = ""
    except ValueError as e:
        out["plain"] = str(e)
    return out


def test_isolation_refusals_and_undo():
    for r in run_ranks(_isolation_edges, 4, timeout=300):
        assert "before enable()" in r["after_enable"]
        assert "not the replica group of the isolated HSDP modules" in r["wrong_replicas"]
        assert r["undone"] and r["averaged_again"]
        assert "no FSDP module" in r["plain"]

"""HSDP (shard inside a node, replicate across nodes): the quantized all-reduce across replicas.

Each launch of gloo ranks measures many things and returns numbers that the tests assert:
2 x 2 (replicas x shards) for the collective, training against native HSDP, scaling, gradient
accumulation, NaN, reduce dtypes, clipping, hooks and disable; 2 x 2 for checkpoints; 2 x 1,
1 x 4 and 3 x 2 for other meshes; 4 ranks for the node-placement checks. Two emulated nodes per
host (``ranks_per_node``) stand for two real nodes.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from _models import MLPBlock
from torch.distributed import ReduceOp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

from fsdp_qcomm import QCommConfig, enable
from fsdp_qcomm.codec import hadamard_len, wire_bytes
from fsdp_qcomm.collectives.grad_reduce import premul_sum
from fsdp_qcomm.collectives.replica_reduce import all_reduce_quantized, replica_key
from fsdp_qcomm.collectives.topology import check_placement
from fsdp_qcomm.fsdp import internals
from fsdp_qcomm.fsdp.hsdp import replica_op
from fsdp_qcomm.stats import CommStats
from fsdp_qcomm.testing import digest, run_ranks

SDP4 = dict(weight_group_size=64, grad_group_size=32)  # small groups for small test tensors
VOCAB, D, HIDDEN = 29, 24, 61


class Net(nn.Module):
    """Embedding with a tied output head, two MLP blocks (sizes that are multiples of no group
    size), a final norm."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(MLPBlock(D, HIDDEN) for _ in range(layers))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        nn.init.normal_(self.emb.weight, std=0.2)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def _build(shape, cfg=None, mp=None, layers=2):
    """``Net`` sharded on a (replicate, shard) mesh of ``shape`` (blocks, then the root), with
    fsdp_qcomm enabled when ``cfg`` is given."""
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = Net(layers)
    kw = {} if mp is None else {"mp_policy": mp}
    for b in model.blocks:
        fully_shard(b, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    handle = enable(model, cfg) if cfg is not None else None
    return model, handle, mesh


def _batch(step: int, rank: int, micro: int = 0):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    idx = torch.randint(0, VOCAB, (4, 9), generator=g)
    return idx, (idx * 7 + 3) % VOCAB


def _loss(model, step, rank, micro=0, poison=False):
    idx, tgt = _batch(step, rank, micro)
    loss = F.cross_entropy(model(idx).reshape(-1, VOCAB), tgt.reshape(-1))
    return loss * float("nan") if poison else loss


def _fsdp_modules(model):
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _groups(model):
    return [g for m in _fsdp_modules(model) for g in internals.param_groups(m)]


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.to_local().detach().clone() for n, p in model.named_parameters()}


def _locals(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().to_local().clone() for n, p in model.named_parameters()}


def _rel(a: dict, b: dict) -> float:
    num = sum(float((a[k].float() - b[k].float()).square().sum()) for k in a)
    den = sum(float(b[k].float().square().sum()) for k in a)
    return math.sqrt(num / den)


def _same_across_replicas(tensors: dict, mesh) -> bool:
    """Every rank's local tensors equal those of the ranks holding the same shard."""
    mine = {k: digest(v) for k, v in sorted(tensors.items())}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    grid = mesh.mesh  # [R, S] global ranks
    s = int((grid == dist.get_rank()).nonzero()[0, 1])
    return all(every[int(r)] == mine for r in grid[:, s])


def _native(shape, mp=None):
    """``Net`` under FSDP2's own HSDP, with the forced-sum reduction ``enable`` sets (the same
    op path, so the comparison isolates the quantization)."""
    model, _, _ = _build(shape, mp=mp)
    for m in _fsdp_modules(model):
        m.set_force_sum_reduction_for_comms(True)
    return model


# ---- pure checks ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("factor", [None, 1.0, 3.0, 2.0])
@pytest.mark.parametrize("force_sum", [False, True])
@pytest.mark.parametrize("shards,replicas", [(2, 2), (1, 2), (4, 3), (2, 1)])
def test_replica_op_gives_native_hsdp_scaling(shards, replicas, force_sum, factor, dtype):
    """Native HSDP's product of divide factors equals FSDP's product once it counts the shard
    group only, times the op ``replica_op`` makes the replica all-reduce apply."""

    class G:  # what _get_gradient_divide_factors reads of a process group
        def __init__(self, n):
            self.n = n

        def size(self):
            return self.n

    def scale(pre, post, rs_op, ar_op, s, r):
        f = (pre or 1.0) * (post or 1.0)
        for op, n in ((rs_op, s), (ar_op, r)):
            if op == ReduceOp.AVG:
                f *= n
            elif op == ReduceOp.PREMUL_SUM:  # before torch 2.13 FSDP's 1 / factor, unreadable
                f /= float(getattr(op, "factor", 1.0 / factor))
        return f

    native = _get_gradient_divide_factors(G(shards), G(replicas), dtype, "cpu", factor, force_sum)
    ours = _get_gradient_divide_factors(G(shards), G(1), dtype, "cpu", factor, force_sum)
    mine = replica_op(factor)
    ours_total = scale(*ours, shards, 1) * (replicas if mine == ReduceOp.AVG else 1)
    assert ours_total == pytest.approx(scale(*native, shards, replicas)), (native, ours, mine)


def test_placement_against_host_names():
    a4, b4 = ["a"] * 4, ["b"] * 4
    p = check_placement(None, "host names", a4 + b4)
    assert (p.ranks_per_node, p.num_nodes, p.emulated) == (4, 2, False)
    assert check_placement(4, "LOCAL_WORLD_SIZE", a4 + b4).ranks_per_node == 4
    p = check_placement(2, "QCommConfig.ranks_per_node", a4)  # explicit: an emulation
    assert (p.num_nodes, p.emulated) == (2, True)
    with pytest.raises(ValueError, match=r"ranks 0\.\.7 are treated as one node.*hosts \['a', "
                                         r"'b'\].*ranks_per_node"):
        check_placement(8, "LOCAL_WORLD_SIZE", a4 + b4)
    with pytest.raises(ValueError, match="same host \\(a\\).*set QCommConfig.ranks_per_node=2 "
                                         "explicitly"):
        check_placement(2, "LOCAL_WORLD_SIZE", a4)
    with pytest.raises(ValueError, match="does not divide the world size 8"):
        check_placement(3, "QCommConfig.ranks_per_node", a4 + b4)
    with pytest.raises(ValueError, match="cannot tell the node size.*a x2, b x2, a x2"):
        check_placement(None, "host names", ["a", "a", "b", "b", "a", "a"])
    with pytest.raises(ValueError, match="cannot tell the node size"):
        check_placement(None, "host names", ["a", "a", "b"])


# ---- 2 x 2: the collective and training against native HSDP -----------------------------------
def _exact_sum(x: torch.Tensor, group) -> torch.Tensor:
    y = x.clone()
    dist.all_reduce(y, group=group)
    return y


def _collective(rank: int, mesh) -> dict:
    """all_reduce_quantized over the replica group against the exact all_reduce."""
    group = mesh.get_group("replicate")
    R = group.size()
    out: dict = {}
    for m in (1, 3, 100, 1000, 4099):
        for name, spec_kw, had in (("4hs", dict(bits=4), True), ("8", dict(bits=8), False)):
            cfg = QCommConfig(grad_scheme="one_level", grad_inter_bits=spec_kw["bits"],
                              grad_group_size=32)
            spec = cfg.grad_inter_spec()
            g = torch.Generator().manual_seed(7 * m + rank)
            x = torch.randn(m, generator=g)
            exact = x.clone()
            dist.all_reduce(exact, group=group)
            stats = CommStats()
            y = x.clone()
            all_reduce_quantized(y, group, spec, replica_key(3, m, dist.get_rank(), 0),
                                 hadamard=had, stats=stats, remote_peers=R - 1)
            c = -(-m // R)
            w = wire_bytes(hadamard_len(c) if had else c, spec)
            st = stats.snapshot()["grad_replica"]
            out[(name, m)] = dict(
                err=float((y - exact).norm() / exact.norm()), digest=digest(y),
                bytes=(st["sent_bytes"], st["recv_bytes"], st["cross_node_bytes"],
                       st["elements"], st["baseline_bytes"]),
                expect=((R + 1) * w, 2 * R * w, (R - 1) * 2 * w, R * c + c, 4 * m),
            )
    # ops, dtypes, spans, NaN (8-bit: small error, so scale mistakes are obvious)
    spec = QCommConfig(grad_scheme="one_level", grad_inter_bits=8, grad_group_size=32
                       ).grad_inter_spec()
    x = torch.randn(777, generator=torch.Generator().manual_seed(rank))
    exact = x.clone()
    dist.all_reduce(exact, group=group)
    for label, op, want in (("sum", ReduceOp.SUM, exact), ("avg", ReduceOp.AVG, exact / R),
                            ("premul", premul_sum(0.25), exact * 0.25)):
        y = x.clone()
        all_reduce_quantized(y, group, spec, replica_key(1, 0, dist.get_rank(), 0), op=op)
        out[label] = float((y - want).norm() / want.norm())
    # spans change the random bits, not the group boundaries or bytes; 777 values pad the last
    # row, 776 do not (an fp32 tensor then is its own send rows and takes the decoded sums)
    for label, m in (("chunks", 777), ("chunks_unpadded", 776)):
        sizes = []
        want = _exact_sum(x[:m], group)
        for chunks in (1, 3):
            stats, y = CommStats(), x[:m].clone()
            all_reduce_quantized(y, group, spec, replica_key(1, 0, dist.get_rank(), 0),
                                 chunks=chunks, stats=stats)
            st = stats.snapshot()["grad_replica"]
            sizes.append((st["sent_bytes"], float((y - want).norm() / want.norm()), digest(y)))
        out[label] = sizes
    for dt in (torch.bfloat16, torch.float16):
        y = x.to(dt)
        all_reduce_quantized(y, group, spec, replica_key(1, 0, dist.get_rank(), 0))
        out[str(dt)] = (y.dtype == dt, float((y.float() - exact).norm() / exact.norm()),
                        digest(y))
    bad = x.clone()
    if dist.get_rank(group) == 0:  # one replica of each replica group
        bad[5] = float("nan")
    all_reduce_quantized(bad, group, spec, replica_key(1, 0, dist.get_rank(), 0))
    out["nan"] = (bool(torch.isnan(bad[5])), bool(torch.isfinite(bad[64:]).all()), digest(bad))
    with pytest.raises(TypeError, match="float32/bfloat16/float16"):
        all_reduce_quantized(torch.zeros(4, dtype=torch.int32), group, spec,
                             replica_key(0, 0, 0, 0))
    return out


def _train_steps(model, handle, steps, rank, opt=None, accumulate=1, mode="sync", clip=None):
    """``steps`` optimizer steps of ``accumulate`` micro-batches; ``mode`` says how the first
    micro-batches skip communication: "sync" (set_requires_gradient_sync(False)) or
    "all_reduce" (set_requires_all_reduce(False): reduce-scatter every micro-batch)."""
    opt = opt or torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, grads, norms = [], [], []
    for s in range(steps):
        for k in range(accumulate):
            last = k == accumulate - 1
            if mode == "sync":
                model.set_requires_gradient_sync(last)
            else:
                model.set_requires_all_reduce(last)
            loss = _loss(model, s, rank, k) / accumulate
            loss.backward()
        losses.append(float(loss.detach()))
        grads.append(_grads(model))
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    return dict(losses=losses, grads=grads, norms=norms, params=_locals(model))


def _hsdp_2x2(rank: int, world: int) -> dict:
    shape = (2, 2)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    res: dict = {"collective": _collective(rank, mesh)}
    sdp4 = QCommConfig.preset("sdp4bit", ranks_per_node=2, **SDP4)

    # training: sdp4bit against native HSDP, replicas identical at every step
    nat = _native(shape)
    native = _train_steps(nat, None, 8, rank)
    model, handle, mesh = _build(shape, sdp4)
    ours = _train_steps(model, handle, 8, rank)
    res["train"] = dict(
        native_losses=native["losses"], losses=ours["losses"],
        grad_err0=_rel(ours["grads"][0], native["grads"][0]),
        replicas_identical=all(_same_across_replicas(g, mesh) for g in ours["grads"])
        and _same_across_replicas(ours["params"], mesh),
        stats=handle.stats(), modules=len(_groups(model)),
        shards=[(internals.padded_shard_numel(fp), fp.sharded_param.dtype)
                for g in _groups(model) for fp in internals.fsdp_params(g)],
        group_numels=[sum(internals.padded_shard_numel(fp) for fp in internals.fsdp_params(g))
                      for g in _groups(model)],
    )
    handle.disable()

    # scaling (8-bit both hops: small error, so a wrong factor would stand out)
    q8 = QCommConfig(grad_scheme="two_level", grad_intra_bits=8, grad_inter_bits=8,
                     grad_group_size=32, ranks_per_node=2)
    scaling = {}
    for label, factor, force in (("avg", None, False), ("sum", 1.0, False),
                                 ("factor3", 3.0, False), ("force_sum", None, True)):
        runs = []
        for cfg in (None, q8):
            mdl, h, _ = _build(shape, cfg)
            for m in _fsdp_modules(mdl):
                if factor is not None:
                    m.set_gradient_divide_factor(factor)
                if force or cfg is None:
                    m.set_force_sum_reduction_for_comms(True)
            runs.append(_train_steps(mdl, h, 1, rank)["grads"][0])
        scaling[label] = _rel(runs[1], runs[0])
    res["scaling"] = scaling

    # gradient accumulation: 3 micro-batches, both ways of skipping communication
    accum = {}
    for mode in ("sync", "all_reduce"):
        nat = _native(shape)
        want = _train_steps(nat, None, 2, rank, accumulate=3, mode=mode)
        mdl, h, mesh = _build(shape, q8)
        got = _train_steps(mdl, h, 2, rank, accumulate=3, mode=mode)
        st = h.stats()
        accum[mode] = dict(
            err=max(_rel(a, b) for a, b in zip(got["grads"], want["grads"])),
            replica_calls=st["grad_replica"]["calls"], rs_calls=st["grad_intra"]["calls"],
            identical=all(_same_across_replicas(g, mesh) for g in got["grads"]),
        )
        h.disable()
    res["accumulate"] = accum

    # NaN in one rank's loss reaches every rank's gradients
    mdl, h, _ = _build(shape, sdp4)
    _loss(mdl, 0, rank, poison=(rank == 1)).backward()
    res["nan"] = all(bool(torch.isnan(g).all()) for g in _grads(mdl).values())
    h.disable()

    # reduce dtypes
    dtypes = {}
    for dt in (torch.bfloat16, torch.float16):
        mp = MixedPrecisionPolicy(reduce_dtype=dt)
        nat = _native(shape, mp=mp)
        want = _train_steps(nat, None, 1, rank)["grads"][0]
        mdl, h, mesh = _build(shape, sdp4, mp=mp)
        got = _train_steps(mdl, h, 2, rank)
        dtypes[str(dt)] = dict(err=_rel(got["grads"][0], want),
                               identical=all(_same_across_replicas(g, mesh)
                                             for g in got["grads"]))
        h.disable()
    res["dtypes"] = dtypes

    # clip_grad_norm_ sees the same total norm on every rank, close to native's
    nat = _native(shape)
    want = _train_steps(nat, None, 2, rank, clip=0.5)["norms"]
    mdl, h, _ = _build(shape, q8)
    got = _train_steps(mdl, h, 2, rank, clip=0.5)["norms"]
    res["clip"] = (got, want)
    h.disable()

    # a user's all-reduce hook: set before enable it runs after ours on the reduced output;
    # set after enable it would skip the replica all-reduce, so the next backward refuses
    seen = []
    mdl, _, _ = _build(shape)
    for m in _fsdp_modules(mdl):
        m.set_all_reduce_hook(lambda t: seen.append(t.detach().clone()))
    h = enable(mdl, q8)
    _loss(mdl, 0, rank).backward()
    mine = torch.cat([g.reshape(-1) for g in _grads(mdl).values()])
    res["user_hook"] = (len(seen), sum(t.numel() for t in seen), mine.numel())
    opt = torch.optim.SGD(mdl.parameters(), lr=0.1)
    opt.step()
    opt.zero_grad()
    mdl.blocks[0].set_all_reduce_hook(lambda t: None)
    try:
        _loss(mdl, 1, rank).backward()
        opt.step()
        res["guard"] = "no error"
    except RuntimeError as e:
        res["guard"] = str(e)
    h.disable()

    # grad_overlap: the replica all-reduce runs on the background thread, same bits
    overlap = {}
    for label, cfg in (("sdp4bit", sdp4), ("baseline", QCommConfig(ranks_per_node=2))):
        mdl, h, mesh = _build(shape, cfg.replace(grad_overlap=True))
        got = _train_steps(mdl, h, 3, rank)
        overlap[label] = dict(deferred=h.deferred_reductions, grads=got["grads"],
                              losses=got["losses"], stats=h.stats(),
                              identical=all(_same_across_replicas(g, mesh) for g in got["grads"]))
        h.disable()
    mdl, h, _ = _build(shape, sdp4)
    sync = _train_steps(mdl, h, 3, rank)
    h.disable()
    nat, _, _ = _build(shape)
    native = _train_steps(nat, None, 3, rank)  # FSDP's own HSDP, its default AVG ops
    res["overlap"] = dict(
        sdp4bit_exact=sync["losses"] == overlap["sdp4bit"]["losses"] and all(
            torch.equal(a[k], b[k]) for a, b in zip(sync["grads"], overlap["sdp4bit"]["grads"])
            for k in a),
        baseline_err=max(_rel(a, b) for a, b in zip(overlap["baseline"]["grads"],
                                                    native["grads"])),
        deferred={k: v["deferred"] for k, v in overlap.items()},
        identical={k: v["identical"] for k, v in overlap.items()},
        baseline_stats=overlap["baseline"]["stats"],
    )

    # disable restores FSDP's own HSDP: bit-identical to a model never enabled
    nat, _, _ = _build(shape)
    a = _train_steps(nat, None, 1, rank)["grads"][0]
    mdl, h, _ = _build(shape, sdp4)
    swapped = [internals.replicate_group(g).size() for g in _groups(mdl)]
    h.disable()
    restored = [internals.replicate_group(g).size() for g in _groups(mdl)]
    c = _train_steps(mdl, None, 1, rank)["grads"][0]
    res["disable"] = (swapped, restored, all(torch.equal(a[k], c[k]) for k in a))
    # the consistency guard compares the replicas too: silent normally, loud on a corruption
    # (last: after the error FSDP's prefetched gathers are left in flight)
    mdl, h, _ = _build(shape, sdp4.replace(consistency_check_every=1))
    opt = torch.optim.AdamW(mdl.parameters(), lr=3e-3)
    _train_steps(mdl, h, 2, rank, opt=opt)
    # Rank 2's shard of blocks.0.fc1.weight drifts (written through .data, which no version
    # counter sees: a replica that skipped an update, say). Its shard group still agrees with
    # itself (qWD sends the difference to its peer), the replicas no longer do.
    if rank == 2:
        mdl.blocks[0].fc1.weight.to_local().data.add_(1.0)
    try:
        _train_steps(mdl, h, 1, rank, opt=opt)
        res["guard_replicas"] = "no error"
    except RuntimeError as e:
        res["guard_replicas"] = str(e)
    return res  # run_ranks keeps every rank until all have returned, so no peer's check is cut


@pytest.fixture(scope="module")
def two_by_two() -> list[dict]:
    return run_ranks(_hsdp_2x2, 4, timeout=600)


@pytest.mark.parametrize("m", [1, 3, 100, 1000, 4099])
@pytest.mark.parametrize("name", ["4hs", "8"])
def test_collective_against_exact_all_reduce(two_by_two, name, m):
    for r in two_by_two:
        rec = r["collective"][(name, m)]
        assert rec["bytes"] == rec["expect"], (rec["bytes"], rec["expect"])
        # 8-bit, groups of 32, two replicas, m=100, over 300 keys: mean 0.0103, sd 0.0010,
        # max 0.0138; a wrong factor gives 0.5, a bit less per element about twice the mean
        bound = 0.016 if name == "8" else 0.3
        assert rec["err"] < bound, rec["err"]
    # replicas (ranks 0 and 2, ranks 1 and 3) hold bit-identical results
    for a, b in ((0, 2), (1, 3)):
        assert two_by_two[a]["collective"][(name, m)]["digest"] == \
            two_by_two[b]["collective"][(name, m)]["digest"]


def test_collective_ops_dtypes_spans_and_nan(two_by_two):
    for r in two_by_two:
        c = r["collective"]
        assert c["sum"] < 0.012 and c["avg"] < 0.012 and c["premul"] < 0.012
        for label in ("chunks", "chunks_unpadded"):
            (one, err1, _), (three, err3, _) = c[label]
            assert one == three and err1 < 0.012 and err3 < 0.012, (label, c[label])
        for dt in ("torch.bfloat16", "torch.float16"):
            keeps_dtype, err, _ = c[dt]
            assert keeps_dtype and err < 0.015, (dt, err)
        is_nan, rest_finite, _ = c["nan"]
        assert is_nan and rest_finite
    for a, b in ((0, 2), (1, 3)):
        for k in ("torch.bfloat16", "torch.float16", "nan"):
            assert two_by_two[a]["collective"][k][-1] == two_by_two[b]["collective"][k][-1]
        for label in ("chunks", "chunks_unpadded"):
            for ka, kb in zip(two_by_two[a]["collective"][label],
                              two_by_two[b]["collective"][label]):
                assert ka[-1] == kb[-1]


def test_training_tracks_native_hsdp(two_by_two):
    t = two_by_two[0]["train"]
    assert t["losses"][0] == t["native_losses"][0]  # the first loss precedes any reduction
    assert t["native_losses"][-1] < 0.8 * t["native_losses"][0]  # it learns
    for a, b in zip(t["losses"], t["native_losses"]):
        assert abs(a - b) < 0.03 * b, (t["losses"], t["native_losses"])
    # 8-bit inside the node, 4-bit Hadamard across replicas twice (groups of 32): measured 0.18
    assert max(r["train"]["grad_err0"] for r in two_by_two) < 0.25


def test_replicas_stay_bit_identical(two_by_two):
    assert all(r["train"]["replicas_identical"] for r in two_by_two)


def test_replica_hop_is_its_own_stats_kind_with_wire_bytes(two_by_two):
    t = two_by_two[0]["train"]
    st, steps, R = t["stats"], 8, 2
    rep = st["grad_replica"]
    assert rep["calls"] == t["modules"] * steps
    # per module and step: R + 1 rows of ceil(m / R) values (Hadamard-padded), m = the shard
    spec = QCommConfig.preset("sdp4bit", **SDP4).grad_inter_spec()
    want = 0
    for m in t["group_numels"]:
        c = -(-m // R)
        want += (R + 1) * wire_bytes(hadamard_len(c), spec)
    assert rep["sent_bytes"] == steps * want
    assert rep["cross_node_bytes"] == steps * want * 2 // 3  # all but the a2a row to oneself
    lo = 4 + 32 / 32  # 4-bit codes and one fp32 scale per group of 32; padding on top
    assert lo <= rep["bits_per_element"] < lo + 0.3
    # nothing else crosses nodes: the weight all-gather and the reduce-scatter stay inside the
    # node, unquantized (fp32 here: 32 bits; only what crosses nodes is quantized by default)
    assert st["weight_allgather"]["cross_node_bytes"] == 0
    assert st["weight_allgather"]["bits_per_element"] == 32.0
    assert st["grad_intra"]["cross_node_bytes"] == 0 and "grad_inter" not in st
    assert st["grad_intra"]["bits_per_element"] == 32.0
    assert any(n.startswith("HSDP all-reduce across replicas: quantized") for n in st["notes"])
    assert any(n.startswith("weight all-gather: unquantized") for n in st["notes"])
    summary = st["summary"]
    assert summary["cross_node_bytes"] == rep["cross_node_bytes"]
    # FSDP2's fp32 all-reduce hands 2/R of each reduced shard to the other replica, per module
    # and step; its all-gather and reduce-scatter stay inside the node
    assert summary["baseline_cross_node_bytes"] == steps * sum(4 * m for m in t["group_numels"])
    assert summary["baseline_bytes"] == sum(
        st[k]["baseline_bytes"] for k in ("weight_allgather", "grad_intra", "grad_replica"))


def test_scaling_matches_native_hsdp(two_by_two):
    for r in two_by_two:
        for label, err in r["scaling"].items():
            assert err < 0.02, (label, err)  # a factor-2 mistake would give 0.5


@pytest.mark.parametrize("mode", ["sync", "all_reduce"])
def test_gradient_accumulation(two_by_two, mode):
    modules = two_by_two[0]["train"]["modules"]
    for r in two_by_two:
        a = r["accumulate"][mode]
        assert a["err"] < 0.02 and a["identical"]
        assert a["replica_calls"] == 2 * modules  # one all-reduce per optimizer step
        # set_requires_all_reduce(False) still reduce-scatters every micro-batch
        assert a["rs_calls"] == (2 if mode == "sync" else 6) * modules


def test_nan_reaches_every_rank(two_by_two):
    assert all(r["nan"] for r in two_by_two)


@pytest.mark.parametrize("dtype", ["torch.bfloat16", "torch.float16"])
def test_reduce_dtypes(two_by_two, dtype):
    for r in two_by_two:
        d = r["dtypes"][dtype]
        assert d["err"] < 0.25 and d["identical"], d


def test_clip_grad_norm_sees_one_norm(two_by_two):
    norms = [r["clip"][0] for r in two_by_two]
    assert all(n == norms[0] for n in norms)
    for got, want in zip(*two_by_two[0]["clip"]):
        assert abs(got - want) < 0.02 * want


def test_user_hook_runs_after_ours_and_replacing_ours_is_refused(two_by_two):
    for r in two_by_two:
        calls, values, grads = r["user_hook"]
        assert calls == two_by_two[0]["train"]["modules"] and values >= grads
        assert "all-reduce hook was replaced after fsdp_qcomm.enable()" in r["guard"]


def test_overlap_defers_the_replica_all_reduce(two_by_two):
    modules = two_by_two[0]["train"]["modules"]
    for r in two_by_two:
        o = r["overlap"]
        assert o["sdp4bit_exact"] and all(o["identical"].values())
        assert o["deferred"] == {"sdp4bit": 3 * modules, "baseline": 3 * modules}
        assert o["baseline_err"] < 1e-6  # unquantized: FSDP's values up to rounding
        st = o["baseline_stats"]
        numel = sum(two_by_two[0]["train"]["group_numels"])
        # fp32 all-reduce of each shard: 4 bytes per value, half of it crosses to the other
        # replica in each of the reduce-scatter and all-gather phases
        assert st["grad_replica"]["sent_bytes"] == 3 * 4 * numel
        assert st["grad_replica"]["cross_node_bytes"] == 3 * 4 * numel


def test_consistency_guard_compares_replicas(two_by_two):
    for r in two_by_two:  # every rank raises (none is left waiting in a collective)
        msg = r["guard_replicas"]
        assert "consistency check failed" in msg and "blocks.0.fc1.weight" in msg, msg
        # each shard group agrees with itself (qWD sent the drift to the peer): only the
        # replicas (whose gathered buffers both hold a slot of the drifted shard) differ
        assert "across HSDP replicas" in msg


def test_disable_restores_native_hsdp(two_by_two):
    for r in two_by_two:
        swapped, restored, exact = r["disable"]
        assert set(swapped) == {1} and set(restored) == {2}  # FSDP's all-reduce group
        assert exact


# ---- 2 x 2: checkpoints -----------------------------------------------------------------------
def _save(path, model, opt, handle):
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "qcomm": handle}, checkpoint_id=path)


def _load(path, model, opt, handle):
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "qcomm": handle}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _step(model, opt, step, rank) -> float:
    loss = _loss(model, step, rank)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def _resume(rank: int, world: int, root: str) -> dict:
    cfg = QCommConfig.preset("sdp4bit", ranks_per_node=2, seed=9, **SDP4)
    path = os.path.join(root, "ckpt")
    model, handle, mesh = _build((2, 2), cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ref = [_step(model, opt, s, rank) for s in range(3)]
    _save(path, model, opt, handle)
    ref += [_step(model, opt, s, rank) for s in range(3, 6)]
    final = _locals(model)
    (entry,) = handle.state_dict().values()  # this rank's, under "rank<r>_of_<W>"
    state = entry["modules"]
    model_b, handle_b, _ = _build((2, 2), cfg)
    opt_b = torch.optim.AdamW(model_b.parameters(), lr=3e-3)
    _load(path, model_b, opt_b, handle_b)
    got = [_step(model_b, opt_b, s, rank) for s in range(3, 6)]
    return dict(
        ref=ref, got=got, exact=all(torch.equal(final[k], v) for k, v in _locals(model_b).items()),
        replica_calls=[m["replica_calls"] for m in state.values()],
        steps=handle.stats()["summary"]["steps"], steps_b=handle_b.stats()["summary"]["steps"],
        identical=_same_across_replicas(_locals(model_b), mesh),
    )


def test_checkpoint_resume_is_bit_identical(tmp_path):
    res = run_ranks(_resume, 4, str(tmp_path), timeout=300)
    for r in res:
        assert r["got"] == r["ref"][3:] and r["exact"] and r["identical"]
        assert set(r["replica_calls"]) == {6}  # one all-reduce per module and step
        assert r["steps"] == 6 and r["steps_b"] == 3  # DCP's dummy step on load is not counted


# ---- other meshes: 2 x 1, 1 x 4, 3 x 2 --------------------------------------------------------
def _mesh_run(rank: int, world: int, shape, preset: str = "sdp4bit") -> dict:
    cfg = QCommConfig.preset(preset, ranks_per_node=shape[1], **SDP4)
    nat = _native(shape)
    want = _train_steps(nat, None, 3, rank)
    model, handle, mesh = _build(shape, cfg)
    got = _train_steps(model, handle, 3, rank)
    st = handle.stats()
    return dict(
        err=_rel(got["grads"][0], want["grads"][0]),
        identical=all(_same_across_replicas(g, mesh) for g in got["grads"])
        and _same_across_replicas(got["params"], mesh),
        kinds=sorted(k for k in st if k not in ("notes", "summary")),
        replica=st.get("grad_replica"), modules=len(_groups(model)),
        group_numels=[sum(internals.padded_shard_numel(fp) for fp in internals.fsdp_params(g))
                      for g in _groups(model)],
        losses=(got["losses"], want["losses"]),
    )


@pytest.mark.parametrize("shape", [(2, 1), (1, 4), pytest.param((3, 2), marks=pytest.mark.long)],
                         ids=["2x1", "1x4", "3x2"])
def test_other_meshes(shape):
    R, S = shape
    res = run_ranks(_mesh_run, R * S, shape, timeout=400)
    spec = QCommConfig.preset("sdp4bit", **SDP4).grad_inter_spec()
    for r in res:
        assert r["identical"]
        assert r["losses"][0][0] == r["losses"][1][0]
        if R == 1:  # one replica: nothing to all-reduce, HSDP is plain FSDP here
            assert "grad_replica" not in r["kinds"] and r["err"] < 0.05
            continue
        assert r["err"] < 0.3, r["err"]
        rep = r["replica"]
        assert rep["calls"] == 3 * r["modules"]
        want = sum((R + 1) * wire_bytes(hadamard_len(-(-m // R)), spec)
                   for m in r["group_numels"])
        assert rep["sent_bytes"] == 3 * want
        if S == 1:  # no shard group: FSDP neither gathers nor reduce-scatters
            assert r["kinds"] == ["grad_replica"]
        else:
            assert r["kinds"] == ["grad_intra", "grad_replica", "weight_allgather"]


def test_lowbit_preset_under_hsdp():
    """lowbit's 3-bit replica hop keeps the replicas bit-identical and sends the wire format
    (its 2-bit weight differences would gather inside the node: left unquantized)."""
    res = run_ranks(_mesh_run, 4, (2, 2), "lowbit", timeout=400)
    spec = QCommConfig.preset("lowbit", **SDP4).grad_inter_spec()
    assert spec.bits == 3
    for r in res:
        assert r["identical"]
        assert r["losses"][0][0] == r["losses"][1][0]  # first forward: full-precision gather
        assert r["err"] < 0.5, r["err"]
        rep = r["replica"]
        assert rep["calls"] == 3 * r["modules"]
        want = sum(3 * wire_bytes(hadamard_len(-(-m // 2)), spec) for m in r["group_numels"])
        assert rep["sent_bytes"] == 3 * want
        assert {"grad_intra", "grad_replica", "weight_allgather"} <= set(r["kinds"])


# ---- node placement ---------------------------------------------------------------------------
def _placement(rank: int, world: int) -> dict:
    out = {}
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # two launchers on one host, by mistake
    model, _, _ = _build((2, 2))
    try:
        enable(model, QCommConfig.preset("sdp4bit"))
        out["lws"] = "no error"
    except ValueError as e:
        out["lws"] = str(e)
    assert all(internals.replicate_group(g).size() == 2 for g in _groups(model))  # untouched
    del os.environ["LOCAL_WORLD_SIZE"]
    h = enable(model, QCommConfig.preset("sdp4bit"))  # host names: one node of 4
    out["derived"] = (h.placement.ranks_per_node, h.placement.source, h.placement.emulated)
    _loss(model, 0, rank).backward()
    st = h.stats()
    out["one_node"] = (sorted(k for k in st if k.startswith("grad")), st["notes"])
    h.disable()
    # four replicas on two emulated nodes: one hop over all, with a note
    model, _, _ = _build((4, 1))
    h = enable(model, QCommConfig.preset("sdp4bit", ranks_per_node=2))
    _loss(model, 0, rank).backward()
    st = h.stats()
    out["partly"] = (st["grad_replica"]["cross_node_bytes"], st["grad_replica"]["sent_bytes"],
                     st["notes"])
    return out


def test_node_placement_is_checked_at_enable():
    res = run_ranks(_placement, 4, timeout=300)
    for r in res:
        assert "LOCAL_WORLD_SIZE says nodes of 2 rank(s)" in r["lws"]
        assert "set QCommConfig.ranks_per_node=2 explicitly" in r["lws"]
        assert r["derived"] == (4, "host names", False)
        # replicas share the node: nothing crosses nodes, so nothing is quantized (FSDP2's own
        # all-reduce; the reduce-scatter through the plain hook gloo needs), and a note says so
        kinds, notes = r["one_node"]
        assert kinds == ["grad_intra"], kinds
        assert any("HSDP all-reduce across replicas: FSDP2's own, unquantized, its 2 rank(s) "
                   "share one node" in n for n in notes), notes
        cross, sent, notes = r["partly"]
        # 2 of the 3 other replicas are remote: of every 5 rows sent (4 a2a + 1 gathered),
        # the two a2a rows to them and the gathered row to each of them cross
        assert cross == sent * 4 // 5
        assert any("share this rank's node" in n for n in notes)


def test_backend_without_sequence_numbers_trains_and_says_the_check_is_off():
    """torch's ``fake`` backend (rank 0 of 2, in this process) counts no collectives: HSDP's
    proof that FSDP's own all-reduce runs on the one-rank group cannot be taken there, so
    ``enable`` trains with it off and says so, rather than failing inside ``enable`` with
    torch's "does not yet support sequence numbers"."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
        torch.manual_seed(0)
        model = nn.Sequential(MLPBlock(D, HIDDEN), nn.Linear(D, VOCAB))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        handle = enable(model, QCommConfig.preset("sdp4bit", ranks_per_node=1, **SDP4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            model(torch.randn(4, D)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        stats = handle.stats()
        handle.disable()
        assert stats["grad_replica"]["calls"] == 4  # 2 modules x 2 steps
        off = [n for n in stats["notes"] if "counts no sequence numbers" in n]
        assert off and "'fake' backend" in off[0], stats["notes"]
    finally:
        dist.destroy_process_group()


def _guard_one_group(rank: int, world: int) -> str:
    """2 replicas x 2 shards, one rank per node (qWD between the shard peers). Rank 0's copy of
    rank 1's slot of blocks.1's reference flips a bit: shard group {0, 1} and replicas {0, 2}
    see it; replicas {1, 3} compare equal buffers."""
    cfg = QCommConfig.preset("qwd", weight_group_size=32, ranks_per_node=1,
                             consistency_check_every=1)
    model, handle, _ = _build((2, 2), cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    _train_steps(model, handle, 1, rank, opt=opt)
    g = internals.unverified_param_groups(model.blocks[1])[0]
    shard = sum(math.prod(fp.padded_sharded_param_size) for fp in g.fsdp_params)
    if rank == 0:
        g._all_gather_comm._qwd.ref[shard:shard + 1].view(torch.int32).bitwise_xor_(1 << 20)
    try:
        _train_steps(model, handle, 1, rank, opt=opt)
        return "no error"
    except RuntimeError as e:
        return str(e)


def test_consistency_guard_stops_every_rank_when_one_group_differs():
    """Before: ranks 0-2 raised, rank 3 (whose groups all agreed) went on into the next
    collective and waited there."""
    res = run_ranks(_guard_one_group, 4, timeout=300)
    for r in res[:3]:
        assert "consistency check failed" in r and "parameter 'blocks.1." in r, r
    assert res[3].startswith("fsdp_qcomm consistency check failed at forward gather #2 of FSDP "
                             "module 'blocks.1' on another rank of the model's meshes"), res[3]

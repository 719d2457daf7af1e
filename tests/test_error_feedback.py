"""Error feedback on the quantized gradient hops (``QCommConfig.grad_error_feedback``).

On a fixed input, the time average of T quantized reductions converges to the exact reduction
with error feedback (the residual telescopes: error ~ 1/T) and does not without it (nearest
rounding: a fixed bias; stochastic rounding: ~ 1/sqrt(T)). One launch of 4 gloo ranks (2
emulated nodes x 2) measures the flat one- and two-level reduce-scatters and HSDP's replica
all-reduce; a second checks training: memory figures, resume and non-finite steps.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import fsdp_qcomm
from fsdp_qcomm import QCommConfig
from fsdp_qcomm.codec import RngKey
from fsdp_qcomm.collectives.error_feedback import (
    FeedbackState,
    MappedFeedback,
    ValueLayout,
    open_residuals,
)
from fsdp_qcomm.collectives.grad_reduce import feedback_shapes, reduce_scatter_quantized
from fsdp_qcomm.collectives.grad_reduce import feedback_sites as grad_sites
from fsdp_qcomm.collectives.replica_reduce import all_reduce_quantized, replica_key
from fsdp_qcomm.collectives.replica_reduce import feedback_sites as replica_sites
from fsdp_qcomm.collectives.topology import NodeLayout, layout_topology, node_topology
from fsdp_qcomm.testing import digest, run_ranks

M = 1000  # values per rank: a multiple of no group size
STEPS = (1, 10, 100)


def _heavy(rank: int, rows: int, m: int) -> torch.Tensor:
    """Gaussian with outlier channels: what makes low-bit gradients hard."""
    g = torch.Generator().manual_seed(50 + rank)
    x = torch.randn(rows, m, generator=g)
    x[:, ::97] *= 30
    return x


def _avg_error(run, exact: torch.Tensor, steps=STEPS) -> list[float]:
    acc = torch.zeros_like(exact)
    errs = []
    for t in range(1, max(steps) + 1):
        acc += run(t)
        if t in steps:
            errs.append(float((acc / t - exact).norm() / exact.norm()))
    return errs


def _fixed_input(rank: int, world: int) -> dict:
    res: dict = {}
    x = _heavy(rank, world, M)
    exact = torch.empty(M)
    dist.reduce_scatter_tensor(exact, x.reshape(-1).clone())
    for scheme, base in (("one_level", dict(grad_scheme="one_level", grad_inter_bits=3)),
                         ("two_level", dict(grad_scheme="two_level", grad_intra_bits=8,
                                            grad_inter_bits=2, grad_hadamard=True))):
        for rounding in ("nearest", "stochastic"):
            for mode in ("none", "inter", "all"):
                cfg = QCommConfig(**base, grad_group_size=64, grad_rounding=rounding,
                                  grad_error_feedback=mode, ranks_per_node=2)
                prepare = node_topology if scheme == "two_level" else layout_topology
                topo = prepare(None, 2)
                fb = FeedbackState()

                def run(t, cfg=cfg, fb=fb, topo=topo):
                    out = torch.empty(M)
                    reduce_scatter_quantized(out, x.reshape(-1), None, cfg,
                                             RngKey(1, t, rank, 0), topology=topo, feedback=fb)
                    return out

                res[(scheme, rounding, mode)] = _avg_error(run, exact)
                res[(scheme, mode, "bytes")] = fb.nbytes
                res[(scheme, mode, "shapes")] = feedback_shapes(cfg, world, M, topo.layout)
    # HSDP's replica all-reduce over replicas {0, 2} and {1, 3}
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    group = groups[rank % 2]
    y = _heavy(rank, 1, M)[0]
    want = y.clone()
    dist.all_reduce(want, group=group)
    spec = QCommConfig(grad_scheme="one_level", grad_inter_bits=2, grad_group_size=64,
                       grad_rounding="nearest").grad_inter_spec()
    for use in (False, True):
        fb = FeedbackState() if use else None
        outs = []

        def run(t, fb=fb, outs=outs):
            z = y.clone()
            all_reduce_quantized(z, group, spec, replica_key(3, t, dist.get_rank(), 0),
                                 hadamard=True, feedback=fb)
            outs.append(digest(z))
            return z

        res[("replica", use)] = _avg_error(run, want)
        res[("replica", use, "digests")] = outs[:5]
        res[("replica", use, "bytes")] = fb.nbytes if fb else 0
    # a non-finite step does not poison the residual
    cfg = QCommConfig(grad_scheme="one_level", grad_inter_bits=3, grad_group_size=64,
                      grad_error_feedback="all", ranks_per_node=2)
    fb, topo, out = FeedbackState(), layout_topology(None, 2), torch.empty(M)
    bad = x.clone()
    if rank == 1:
        bad[0, 5] = float("nan")
    for t, inp in enumerate((x, bad, x, x)):
        reduce_scatter_quantized(out, inp.reshape(-1), None, cfg, RngKey(2, t, rank, 0),
                                 topology=topo, feedback=fb)
        if t == 1:
            res["nan_step_output_has_nan"] = bool(torch.isnan(out).any()) if rank == 0 else None
    res["residual_finite"] = bool(torch.isfinite(fb.residuals["a2a"]).all())
    res["after_nan_finite"] = bool(torch.isfinite(out).all())
    return res


@pytest.fixture(scope="module")
def fixed() -> list[dict]:
    return run_ranks(_fixed_input, 4, timeout=400)


@pytest.mark.parametrize("scheme", ["one_level", "two_level"])
def test_time_average_converges_with_feedback(fixed, scheme):
    for r in fixed:
        e1, e10, e100 = r[(scheme, "nearest", "inter")]
        # the residual telescopes: the error of the average falls like 1/T
        assert e100 < e1 / 15 and e10 < e1 / 2, (e1, e10, e100)
        n1, _, n100 = r[(scheme, "nearest", "none")]
        assert n100 > 0.7 * n1  # nearest rounding without feedback: a fixed bias
        s1, _, s100 = r[(scheme, "stochastic", "none")]
        assert s100 < s1 / 5  # stochastic rounding: unbiased, ~1/sqrt(T)
        f1, _, f100 = r[(scheme, "stochastic", "inter")]
        assert f100 < s100 / 2  # feedback beats it
        a1, _, a100 = r[(scheme, "nearest", "all")]
        assert a100 < e1 / 15


def test_feedback_memory_matches_the_sites(fixed):
    r = fixed[0]
    # one level over 2 nodes: the single hop crosses nodes, its rows are the residual
    assert r[("one_level", "inter", "shapes")] == {"a2a": (4, M)}
    assert r[("one_level", "inter", "bytes")] == 4 * 4 * M
    assert r[("one_level", "none", "bytes")] == 0
    # two levels: "inter" keeps hop 2's partial sums (2 nodes x Hadamard-padded M) only
    pad = -(-M // 32) * 32
    assert r[("two_level", "inter", "shapes")] == {"requant": (2, pad)}
    assert r[("two_level", "inter", "bytes")] == 4 * 2 * pad
    assert r[("two_level", "all", "shapes")] == {"a2a": (4, M), "requant": (2, pad)}


def test_replica_all_reduce_feedback(fixed):
    for r in fixed:
        e1, _, e100 = r[("replica", True)]
        n1, _, n100 = r[("replica", False)]
        assert e100 < e1 / 15 and n100 > 0.7 * n1, (e1, e100, n1, n100)
        c = M // 2  # rows sent (2 x c) + the reduced row, rotated (Hadamard-padded)
        assert r[("replica", True, "bytes")] == 4 * (2 * c + -(-c // 32) * 32)
    for a, b in ((0, 2), (1, 3)):  # replicas stay bit-identical with private residuals
        assert fixed[a][("replica", True, "digests")] == fixed[b][("replica", True, "digests")]


def test_non_finite_step_does_not_poison_feedback(fixed):
    assert fixed[0]["nan_step_output_has_nan"]
    for r in fixed:
        assert r["residual_finite"] and r["after_nan_finite"]


# ---- training: HSDP and flat, memory figures, resume ----------------------------------------
def _train(rank: int, world: int, root: str) -> dict:
    from test_hsdp import SDP4, _build, _loss

    out = {}
    for label, shape in (("hsdp", (2, 2)), ("flat", (1, 4))):
        cfg = QCommConfig.preset("sdp4bit", ranks_per_node=2, grad_inter_bits=2,
                                 grad_error_feedback="inter", seed=4, **SDP4)
        path = os.path.join(root, label)

        def step(model, opt, s):
            loss = _loss(model, s, rank)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return float(loss.detach())

        model, handle, _ = _build(shape, cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        ref = [step(model, opt, s) for s in range(3)]
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd, "qcomm": handle}, checkpoint_id=path)
        ref += [step(model, opt, s) for s in range(3, 6)]
        summary = handle.stats()["summary"]
        model_b, handle_b, _ = _build(shape, cfg)
        opt_b = torch.optim.AdamW(model_b.parameters(), lr=3e-3)
        msd, osd = get_state_dict(model_b, opt_b)
        state = {"model": msd, "optim": osd, "qcomm": handle_b}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model_b, opt_b, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        got = [step(model_b, opt_b, s) for s in range(3, 6)]
        out[label] = dict(ref=ref, got=got, summary=summary,
                          numel=sum(p.numel() for p in model.parameters()))
    return out


def test_training_memory_and_bit_identical_resume(tmp_path):
    res = run_ranks(_train, 4, str(tmp_path), timeout=400)
    for r in res:
        for label in ("hsdp", "flat"):
            t = r[label]
            assert t["got"] == t["ref"][3:], (label, t)
            s = t["summary"]
            assert s["error_feedback_bytes"] > 0
            assert s["error_feedback_bytes_per_parameter"] == pytest.approx(
                s["error_feedback_bytes"] / t["numel"])
        # HSDP keeps the replica hop's residuals: (1 + 1/R) x the shard, R = 2, S = 2
        assert r["hsdp"]["summary"]["error_feedback_bytes_per_parameter"] < 4 * 1.5 / 2 * 1.5


# ---- residuals belong to parameters: the layout mapping -------------------------------------
# Three "parameters" of 50, 37 and 61 values per rank (multiples of no group or Hadamard size).
_SIZES = (50, 37, 61)
_STARTS = (0, 50, 87)


def _layout(params) -> ValueLayout:
    return ValueLayout(tuple((_STARTS[i], _SIZES[i]) for i in params), sum(_SIZES))


def _owner(full: int) -> torch.Tensor:
    """The parameter each value of the full layout belongs to."""
    return torch.cat([torch.full((n,), i) for i, n in enumerate(_SIZES)])[:full]


def _site_cases():
    two = NodeLayout(global_ranks=(0, 1, 2, 3), ranks_per_node=2, nodes=((0, 1), (2, 3)), rank=0)
    for name, kw in (("one_level", dict(grad_scheme="one_level")),
                     ("two_level", dict(grad_scheme="two_level")),
                     ("two_level_hadamard", dict(grad_scheme="two_level", grad_hadamard=True,
                                                 grad_pipeline_chunks=3))):
        cfg = QCommConfig(**kw, grad_group_size=16, grad_error_feedback="all", ranks_per_node=2)
        yield name, (lambda n, cfg=cfg: grad_sites(cfg, 4, n, two))
    spec = QCommConfig(grad_scheme="one_level", grad_group_size=16).grad_inter_spec()
    for hadamard in (False, True):
        for index in range(3):
            yield (f"replica_h{int(hadamard)}_r{index}",
                   lambda n, h=hadamard, i=index: replica_sites(n, 3, spec, h, 2, i))


@pytest.mark.parametrize("case", [c[0] for c in _site_cases()])
def test_residuals_follow_their_parameters_across_layouts(case):
    """A call holding parameters 0 and 2 only reads and writes the residuals of those two, at
    their own values; parameter 1 keeps its residual; the full layout uses the buffers as they
    are (the math and bytes of the unmapped path)."""
    sites = dict(_site_cases())[case]
    full_n = sum(_SIZES)
    state = FeedbackState()
    marks = {}
    for s, g in sites(full_n).items():  # residual = 1000 * owner + row + value index / 1000
        cols = torch.arange(g.lo, g.lo + g.width)
        pos = (1000.0 * _owner(full_n)[cols] + cols / 1000.0).expand(g.rows, -1)
        pos = pos + torch.arange(g.rows)[:, None]
        state.residuals[s] = g.native(pos.contiguous())
        marks[s] = g.positions(state.residuals[s]).clone()
    exact = {s: not g.rotated for s, g in sites(full_n).items()}

    def close(a, b, s):
        if exact[s]:
            assert torch.equal(a, b), s
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-3)

    # the full layout: the live buffers themselves
    res, done = open_residuals(MappedFeedback(state, _layout((0, 1, 2))), sites, full_n, "cpu")
    assert all(res[s] is state.residuals[s] for s in res)
    done()
    # parameters 0 and 2: each call value reads its own parameter's residual (or zero where the
    # full site does not hold that value: another replica's row), never another's
    call = _layout((0, 2))
    m = call.size
    res, done = open_residuals(MappedFeedback(state, call), sites, m, "cpu")
    call_owner = torch.cat([torch.full((_SIZES[i],), i) for i in (0, 2)])
    call_full = torch.cat([torch.arange(_STARTS[i], _STARTS[i] + _SIZES[i]) for i in (0, 2)])
    for s, g in sites(m).items():
        got = g.positions(res[s])
        fs = sites(full_n)[s]
        full_col = call_full[g.lo:g.lo + g.width]
        held = (full_col >= fs.lo) & (full_col < fs.lo + fs.width)
        want = torch.zeros(g.rows, g.width)
        want[:, held] = marks[s][:, full_col[held] - fs.lo]
        close(got, want, s)
        assert torch.equal(((got + 0.5) // 1000)[:, held], call_owner[g.lo:g.lo + g.width][held]
                           .expand(g.rows, -1).to(got.dtype)), s
        # the call writes new residuals: -(owner + 1) * 1000 at each value
        new = -1000.0 * (call_owner[g.lo:g.lo + g.width] + 1).expand(g.rows, -1).float()
        res[s].copy_(g.native(new.contiguous()))
    done()
    for s, fs in sites(full_n).items():
        after = fs.positions(state.residuals[s])
        owner = _owner(full_n)[fs.lo:fs.lo + fs.width]
        close(after[:, owner == 1], marks[s][:, owner == 1], s)  # parameter 1 untouched
        for i in (0, 2):  # written where this rank's call held the value, else untouched
            cols = torch.nonzero(owner == i).flatten()
            call_pos = torch.searchsorted(call_full, cols + fs.lo)
            g = sites(m)[s]
            wrote = (call_pos >= g.lo) & (call_pos < g.lo + g.width)
            close(after[:, cols[wrote]], torch.full_like(after[:, cols[wrote]], -1000.0 * (i + 1)),
                  s)
            close(after[:, cols[~wrote]], marks[s][:, cols[~wrote]], s)


def test_scaled_residuals_are_kept_unscaled():
    cfg = QCommConfig(grad_scheme="one_level", grad_group_size=16, grad_error_feedback="all")

    def sites(n):
        return grad_sites(cfg, 2, n, None)

    state = FeedbackState()
    state.residuals["a2a"] = torch.randn(2, sum(_SIZES))
    before = state.residuals["a2a"].clone()
    scale = torch.tensor([1024.0])
    for layout in (_layout((0, 1, 2)), _layout((0, 2))):
        res, done = open_residuals(MappedFeedback(state, layout, scale), sites, layout.size, "cpu")
        cols = torch.cat([torch.arange(a, a + n) for a, n in layout.ranges])
        assert torch.equal(res["a2a"], before[:, cols] * 1024)
        res["a2a"][0, 0] = float("inf")  # a non-finite residual never gets in
        res["a2a"][1, 0] = 2048.0
        done()
        assert torch.isfinite(state.residuals["a2a"]).all()
        assert state.residuals["a2a"][1, 0] == 2.0
        state.residuals["a2a"].copy_(before)


# ---- residuals belong to parameters: FSDP steps where a parameter has no gradient ------------
class _Branches(nn.Module):
    """Three equal branches: a step that skips one reduces the other two, in a buffer of the
    same size whichever is skipped."""

    def __init__(self, d: int = 12) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor, use: str) -> torch.Tensor:
        for name in use:
            x = torch.tanh(getattr(self, name)(x))
        return x


_USES = ("abc", "ab", "ac", "abc", "bc", "abc")  # per step: the branches with a gradient


def _recorder(calls: list, real):
    def record(output, input, group, config, key, **kw):
        fb = kw.get("feedback")
        calls.append(dict(input=input.detach().clone(), key=key, op=kw.get("op"),
                          ranges=fb.layout.ranges if isinstance(fb, MappedFeedback) else None))
        real(output, input, group, config, key, **kw)
        calls[-1]["output"] = output.detach().clone()
    return record


def _missing_params(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    from fsdp_qcomm.fsdp import internals
    from fsdp_qcomm.fsdp import reduce_scatter as rs_mod

    cfg = QCommConfig(grad_scheme="one_level", grad_inter_bits=2, grad_group_size=16,
                      grad_error_feedback="all", ranks_per_node=1, seed=7)
    torch.manual_seed(0)
    model = _Branches()
    fully_shard(model)
    handle = fsdp_qcomm.enable(model, cfg)
    group = internals.param_groups(model)[0]
    hook = group._reduce_scatter_comm
    names = [internals.local_param_name(fp) for fp in internals.fsdp_params(group)]
    sizes = [internals.padded_shard_numel(fp) for fp in internals.fsdp_params(group)]
    branch = [n for n, mod in model.named_children() for _ in mod.parameters()]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    calls: list = []
    real = rs_mod.reduce_scatter_quantized
    rs_mod.reduce_scatter_quantized = _recorder(calls, real)
    try:
        for s, use in enumerate(_USES):
            g = torch.Generator().manual_seed(100 * s + rank)
            model(torch.randn(5, 12, generator=g), use).square().sum().backward()
            model.zero_grad()
    finally:
        rs_mod.reduce_scatter_quantized = real
    # the reference: one residual per parameter, concatenated for the parameters each call
    # holds (FSDP's order), the same collective, split back
    ref = [torch.zeros(world, n) for n in sizes]
    same_outputs, layouts_ok = [], []
    for use, call in zip(_USES, calls):
        held = [i for i in range(len(sizes)) if branch[i] in use]
        layouts_ok.append(call["ranges"] == tuple((starts[i], sizes[i]) for i in held))
        fb = FeedbackState()
        fb.residuals["a2a"] = torch.cat([ref[i] for i in held], dim=1)
        out = torch.empty_like(call["output"])
        reduce_scatter_quantized(out, call["input"], None, cfg, call["key"], op=call["op"],
                                 feedback=fb)
        same_outputs.append(torch.equal(out, call["output"]))
        for i, part in zip(held, fb.residuals["a2a"].split([sizes[i] for i in held], dim=1)):
            ref[i] = part.clone()
    kept = hook.feedback.residuals["a2a"].split(sizes, dim=1)
    residuals_match = [torch.equal(k, r) for k, r in zip(kept, ref)]
    notes = _ef_notes(handle)
    # the hook called from outside FSDP's foreach_reduce: a buffer of a's and b's size (or b's
    # and c's: which, nothing says) runs without feedback and says so; one of every
    # parameter's size is the full layout
    pg = internals.reduce_scatter_group(group)
    before = hook.feedback.residuals["a2a"].clone()
    for m in (sizes[0] + sizes[1] + sizes[2] + sizes[3], sum(sizes)):
        hook(torch.empty(m), torch.randn(world * m), pg, dist.ReduceOp.SUM)
        if m != sum(sizes):
            unknown = dict(unchanged=torch.equal(before, hook.feedback.residuals["a2a"]),
                           notes=_ef_notes(handle))
    full_moved = not torch.equal(before, hook.feedback.residuals["a2a"])
    handle.disable()
    return dict(names=names, layouts_ok=layouts_ok, same_outputs=same_outputs,
                residuals_match=residuals_match, unknown=unknown, full_moved=full_moved,
                nonzero=[bool(r.abs().sum() > 0) for r in ref], notes=notes)


def test_residuals_stay_with_their_parameters_when_some_have_no_gradient():
    """Steps that leave one branch without a gradient (in a buffer of the same size whichever
    branch it is) then full steps: every call's output and every parameter's residual equal
    those of error feedback kept per parameter."""
    for r in run_ranks(_missing_params, 2, timeout=300):
        assert r["names"] == ["weight", "bias"] * 3
        assert all(r["layouts_ok"]), r  # the canary: FSDP's fsdp_params, read in the hook
        assert all(r["same_outputs"]), r
        assert all(r["residuals_match"]), r
        assert all(r["nonzero"]) and not r["notes"], r
        assert r["unknown"]["unchanged"] and r["full_moved"], r
        assert r["unknown"]["notes"] == [
            "error feedback skipped on reduce-scatter call(s): which parameters the reduction "
            "holds could not be read from FSDP, so no residual was added or updated"]


def _ef_notes(handle) -> list[str]:
    """The notes error feedback leaves (the others say which hops are quantized)."""
    return [n for n in handle.stats()["notes"] if n.startswith("error feedback")]


def _positions(sites, full_n: int, state: FeedbackState) -> dict:
    out = {}
    for s, g in sites(full_n).items():
        out[s] = (g.lo, g.positions(state.residuals[s]).clone())
    return out


def _missing_on_meshes(rank: int, world: int) -> dict:
    return {shape: _mesh_missing(rank, shape) for shape in ((2, 2), (1, 4))}


def _mesh_missing(rank: int, shape: tuple) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fsdp_qcomm.fsdp import hsdp as hsdp_mod
    from fsdp_qcomm.fsdp import internals
    from fsdp_qcomm.fsdp import reduce_scatter as rs_mod

    # quantize_intra_node: the (2, 2) mesh's reduce-scatter stays inside a node
    cfg = QCommConfig.preset("sdp4bit", ranks_per_node=2, grad_inter_bits=2, grad_group_size=16,
                             grad_pipeline_chunks=2, grad_error_feedback="all", seed=5,
                             quantize_intra_node=True)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = _Branches(d=20)
    fully_shard(model, mesh=mesh)
    handle = fsdp_qcomm.enable(model, cfg)
    group = internals.param_groups(model)[0]
    rs, rep = group._reduce_scatter_comm, internals.all_reduce_hook(group)
    sizes = [internals.padded_shard_numel(fp) for fp in internals.fsdp_params(group)]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    full_n = sum(sizes)
    layout = rs.prepared.topology.layout
    sites = {"rs": lambda n: grad_sites(rs.config, rs.prepared.group.size(), n, layout)}
    hooks = {"rs": rs}
    if rep is not None:
        sites["replica"] = lambda n: replica_sites(n, rep.replicas, rep.spec, rep.hadamard,
                                                   rep.chunks, rep.replica_group.rank())
        hooks["replica"] = rep
    ranges: dict = {"rs": [], "replica": []}

    def spy(kind, real):
        def call(*args, **kw):
            fb = kw.get("feedback")
            ranges[kind].append(fb.layout.ranges if isinstance(fb, MappedFeedback) else None)
            return real(*args, **kw)
        return call

    real_rs, real_ar = rs_mod.reduce_scatter_quantized, hsdp_mod.all_reduce_quantized
    rs_mod.reduce_scatter_quantized = spy("rs", real_rs)
    hsdp_mod.all_reduce_quantized = spy("replica", real_ar)
    snaps = []
    try:
        for s, use in enumerate(("abc", "ac", "abc")):
            g = torch.Generator().manual_seed(100 * s + rank)
            model(torch.randn(5, 20, generator=g), use).square().sum().backward()
            model.zero_grad()
            snaps.append({k: _positions(sites[k], full_n, hooks[k].feedback) for k in hooks})
    finally:
        rs_mod.reduce_scatter_quantized, hsdp_mod.all_reduce_quantized = real_rs, real_ar
    b_cols = torch.arange(starts[2], starts[4])  # b.weight, b.bias
    a_cols = torch.arange(starts[0], starts[2])
    out: dict = {"notes": _ef_notes(handle), "ranges": ranges,
                 "want": [tuple((starts[i], sizes[i]) for i in held)
                          for held in ((0, 1, 2, 3, 4, 5), (0, 1, 4, 5), (0, 1, 2, 3, 4, 5))]}
    for k in hooks:
        for s, (lo, first) in snaps[0][k].items():
            second = snaps[1][k][s][1]

            def cols(c, lo=lo, width=first.shape[1]):
                c = c - lo
                return c[(c >= 0) & (c < width)]

            b, a = cols(b_cols), cols(a_cols)
            if len(b):
                out[(k, s, "b_kept")] = float((second[:, b] - first[:, b]).abs().max())
                out[(k, s, "b_scale")] = float(first[:, b].abs().max())
            out[(k, s, "a_moved")] = (float((second[:, a] - first[:, a]).abs().max())
                                      if len(a) else None)
    handle.disable()
    return out


def test_two_level_and_hsdp_residuals_of_a_parameter_without_gradient_stay():
    """HSDP (2 replicas x 2 ranks on 2 nodes) and TLq-HS over 2 nodes x 2, feedback at every
    site: a step without gradients for one branch leaves that branch's residuals where they
    were (exactly at the sites that store values, up to fp32 rounding where they are stored
    Hadamard-rotated) while the others move on, on the reduce-scatter (both hops) and the
    replica all-reduce alike."""
    sites = set()
    for r in (m for ranks in run_ranks(_missing_on_meshes, 4, timeout=400) for m in ranks.values()):
        assert not r["notes"], r["notes"]
        for kind, got in r["ranges"].items():
            assert got == (r["want"] if got else []), (kind, got)
        for key, v in r.items():
            if not isinstance(key, tuple) or key[2] != "b_kept":
                continue
            kind, site = key[:2]
            sites.add((kind, site))
            assert r[(kind, site, "b_scale")] > 0, key
            rotated = site == "requant"  # TLq-HS and the replica hop store it rotated
            assert v <= (1e-6 * max(1.0, r[(kind, site, "b_scale")]) if rotated else 0.0), (
                key, v)
            if r[(kind, site, "a_moved")] is not None:
                assert r[(kind, site, "a_moved")] > 0, key
    assert sites == {("rs", "a2a"), ("rs", "requant"), ("replica", "a2a"), ("replica", "requant")}


# ---- loss scaling: residuals in the gradients' units, never non-finite -----------------------
_SCALER_STEPS = 6
_INF_STEP = 3


def _grad_digests(model: nn.Module) -> list:
    return [None if p.grad is None else digest(p.grad.to_local()) for p in model.parameters()]


def _scaled_run(rank: int, mode: str) -> dict:
    """``mode``: "plain" (no loss scaling, the reference), "attached" (GradScaler, attached to
    the handle) or "detached" (GradScaler, not attached: the residuals stay in scaled units).
    The scale doubles after every step and halves on the inf step, which every mode skips."""
    from torch.distributed.fsdp import fully_shard

    from fsdp_qcomm.fsdp import internals

    cfg = QCommConfig(grad_scheme="one_level", grad_inter_bits=2, grad_group_size=16,
                      grad_error_feedback="all", ranks_per_node=1, seed=9)
    torch.manual_seed(0)
    model = _Branches()
    fully_shard(model)
    handle = fsdp_qcomm.enable(model, cfg)
    hook = internals.param_groups(model)[0]._reduce_scatter_comm
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = None
    if mode != "plain":
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1)
        if mode == "attached":
            handle.attach_grad_scaler(scaler)
    out: dict = {"residuals": [], "grads": [], "finite": [], "scales": []}
    for s in range(_SCALER_STEPS):
        g = torch.Generator().manual_seed(100 * s + rank)
        loss = model(torch.randn(5, 12, generator=g), "abc" if s % 2 else "ac").square().sum()
        if s == _INF_STEP:
            loss = loss * float("inf")
        if scaler is None:
            loss.backward()
            if all(torch.isfinite(p.grad.to_local()).all() for p in model.parameters()
                   if p.grad is not None):
                out["grads"].append(_grad_digests(model))
                opt.step()
        else:
            out["scales"].append(float(scaler.get_scale()))
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            if s != _INF_STEP:
                out["grads"].append(_grad_digests(model))
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
        e = hook.feedback.residuals["a2a"]
        out["residuals"].append(digest(e))
        out["finite"].append(bool(torch.isfinite(e).all()))
    handle.disable()
    return out


def _scalers(rank: int, world: int) -> dict:
    return {mode: _scaled_run(rank, mode) for mode in ("plain", "attached", "detached")}


def test_grad_scaler_keeps_residuals_unscaled_and_finite():
    """fp16-style loss scaling (``torch.amp.GradScaler``; powers of two, so scaling commutes
    with the quantizer exactly) with the scale changing every step and an inf step: with the
    scaler attached, the residuals and the unscaled gradients are bit-identical to a run
    without loss scaling, and stay finite through the inf step. Not attached, the residuals
    stay in the scale of the step that made them, and the gradients drift from the reference
    at the first scale change."""
    for r in run_ranks(_scalers, 2, timeout=300):
        plain, att, det = r["plain"], r["attached"], r["detached"]
        assert att["scales"] == [2.0 ** k for k in (10, 11, 12, 13, 12, 13)]
        assert all(plain["finite"]) and all(att["finite"]) and all(det["finite"])
        assert att["residuals"] == plain["residuals"]
        assert att["grads"] == plain["grads"] and len(plain["grads"]) == _SCALER_STEPS - 1
        assert det["grads"][0] == plain["grads"][0] and det["grads"][1] != plain["grads"][1]

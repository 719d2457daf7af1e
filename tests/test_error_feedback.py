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
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from fsdp_qcomm import QCommConfig
from fsdp_qcomm.codec import RngKey
from fsdp_qcomm.collectives.error_feedback import FeedbackState
from fsdp_qcomm.collectives.grad_reduce import feedback_shapes, reduce_scatter_quantized
from fsdp_qcomm.collectives.replica_reduce import all_reduce_quantized, replica_key
from fsdp_qcomm.collectives.topology import layout_topology, node_topology
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

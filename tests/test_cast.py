"""bf16 exchanges (``collectives.cast``, the ``bf16`` preset): every value on the wire is the
bf16 rounding of the exact one, sums are fp32, gathered weights and replica results are
bit-identical on every rank, and the bytes are exactly what FSDP2's own bf16 runs hand their
process group (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32 or bf16)``), which
is what lets an fp32 model on CPUs time the wire GPU users run.

One launch of 4 gloo ranks (the collectives, as 2 nodes x 2) and one of 2 (FSDP2 runs)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _models import TinyLM, batch, lm_loss
from torch.distributed import ReduceOp
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fsdp_qcomm
from fsdp_qcomm import QCommConfig
from fsdp_qcomm.collectives.cast import all_reduce_cast, cast_all_gather, reduce_scatter_cast
from fsdp_qcomm.collectives.grad_reduce import premul_sum
from fsdp_qcomm.stats import CommStats
from fsdp_qcomm.testing import digest, run_ranks

BF16 = torch.bfloat16


def _inputs(rank: int, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(n, generator=g) * 10 ** torch.randint(-3, 3, (n,), generator=g)


def _collectives(rank: int, world: int) -> dict:
    out: dict = {}
    n = 37
    # ---- all-gather: every slot is the bf16 rounding of its rank's shard, on every rank
    shard = _inputs(rank, n)
    gathered = torch.empty(world * n)
    gathered[rank * n:(rank + 1) * n] = shard
    stats = CommStats()
    cast_all_gather(gathered, gathered[rank * n:(rank + 1) * n], on_done=lambda o: stats.record(
        "w", sent_bytes=o.sent_bytes, recv_bytes=o.recv_bytes, elements=o.elements,
        baseline_bytes=o.baseline_bytes))
    want = torch.cat([_inputs(r, n).to(BF16).float() for r in range(world)])
    out["gather_exact"] = torch.equal(gathered, want)
    out["gather_digest"] = digest(gathered)
    out["gather_bytes"] = stats.snapshot()["w"]["sent_bytes"]
    work = cast_all_gather(torch.empty(world * n), shard.clone(), async_op=True)
    out["gather_async_is_work"] = isinstance(work, dist.Work)
    # ---- reduce-scatter: fp32 sum of the bf16-rounded rows, in source order
    m = 53
    x = _inputs(rank, world * m, seed=1)
    for op, name in ((ReduceOp.SUM, "sum"), (ReduceOp.AVG, "avg"),
                     (premul_sum(0.25), "premul")):
        got = torch.empty(m)
        stats = CommStats()
        reduce_scatter_cast(got, x, None, op=op, stats=stats)
        rows = [_inputs(r, world * m, seed=1).view(world, m)[rank] for r in range(world)]
        acc = rows[0].to(BF16).float()
        for r in rows[1:]:
            acc = acc + r.to(BF16).float()
        scale = {"sum": 1.0, "avg": 1.0 / world, "premul": 0.25}[name]
        out[f"rs_{name}_exact"] = torch.equal(got, acc * scale)  # powers of 2: exact
        exact = sum(rows) * scale
        bound = sum(r.abs() for r in rows) * scale * 2.0 ** -8
        out[f"rs_{name}_within_rounding"] = bool(((got - exact).abs() <= bound).all())
        out[f"rs_{name}_stats"] = stats.snapshot()
    # ---- replica all-reduce: identical on every replica, bf16 of the fp32 sum
    t = _inputs(rank, 101, seed=2)
    stats = CommStats()
    all_reduce_cast(t, None, op=ReduceOp.AVG, stats=stats, remote_peers=2)
    exact = sum(_inputs(r, 101, seed=2) for r in range(world)) / world
    bound = sum(_inputs(r, 101, seed=2).abs() for r in range(world)) / world * 2.0 ** -7
    out["ar_digest"] = digest(t)
    out["ar_within_rounding"] = bool(((t - exact).abs() <= bound).all())
    out["ar_stats"] = stats.snapshot()["grad_replica"]
    return out


@pytest.fixture(scope="module")
def coll() -> list[dict]:
    return run_ranks(_collectives, 4, timeout=300)


def test_gather_sends_bf16_and_every_rank_holds_the_same_rounded_weights(coll):
    assert all(r["gather_exact"] for r in coll)
    assert len({r["gather_digest"] for r in coll}) == 1
    assert all(r["gather_bytes"] == 37 * 2 for r in coll)  # bf16: half of fp32
    assert all(r["gather_async_is_work"] for r in coll)  # FSDP waits only on real Works


@pytest.mark.parametrize("op", ["sum", "avg", "premul"])
def test_reduce_scatter_sums_the_bf16_rows_in_fp32(coll, op):
    for r in coll:
        assert r[f"rs_{op}_exact"] and r[f"rs_{op}_within_rounding"], op
        st = r[f"rs_{op}_stats"]["grad_inter"]
        assert st["sent_bytes"] == 4 * 53 * 2 and st["baseline_bytes"] == 4 * 53 * 4
        assert st["cross_node_bytes"] == st["sent_bytes"] * 3 // 4  # placement unknown


def test_replica_all_reduce_is_identical_on_every_replica_and_within_bf16(coll):
    assert len({r["ar_digest"] for r in coll}) == 1
    assert all(r["ar_within_rounding"] for r in coll)
    c = -(-101 // 4)
    st = coll[0]["ar_stats"]
    assert st["sent_bytes"] == (4 * c + c) * 2 and st["baseline_bytes"] == 101 * 4
    assert st["cross_node_bytes"] == 2 * c * 2 * 2  # a row each way to each of 2 remote peers


# ---- FSDP2: the emulated wire equals FSDP2's own bf16 runs, byte for byte --------------------
class _PGBytes:
    """Input bytes handed to torch.distributed, per family: gathers (``all_gather*``) and
    reductions (``reduce_scatter*``, ``all_to_all_single``, ``all_reduce``), whoever calls."""

    GATHER = ("all_gather_single", "all_gather_into_tensor")
    REDUCE = ("reduce_scatter_single", "reduce_scatter_tensor", "all_to_all_single",
              "all_reduce")

    def __enter__(self):
        self.bytes = {"gather": 0, "reduce": 0}
        self._orig = {}
        for family, names in (("gather", self.GATHER), ("reduce", self.REDUCE)):
            for name in names:
                fn = getattr(dist, name, None)
                if fn is None:
                    continue
                self._orig[name] = fn

                def counting(*args, _fn=fn, _family=family, **kwargs):
                    t = args[1] if len(args) > 1 else kwargs.get("input", kwargs.get(
                        "input_tensor", args[0] if args else None))
                    if _fn.__name__ == "all_reduce":
                        t = args[0] if args else kwargs["tensor"]
                    self.bytes[_family] += t.numel() * t.element_size()
                    return _fn(*args, **kwargs)

                setattr(dist, name, counting)
        return self

    def __exit__(self, *exc):
        for name, fn in self._orig.items():
            setattr(dist, name, fn)


def _fsdp_bytes(rank: int, world: int) -> dict:
    """Bytes per collective family over 2 training steps: FSDP2 itself under a bf16
    MixedPrecisionPolicy (bf16 compute, no hooks) against the fp32 model under the benchmarks'
    emulation of it (``benchmarks/_baselines.py``); and the bf16 preset's training."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from _baselines import FSDP2_BF16_BF16, FSDP2_BF16_FP32

    res: dict = {}

    def train(mp, cfg, steps=2):
        torch.manual_seed(0)
        model = TinyLM()
        for blk in model.blocks:
            fully_shard(blk, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        handle = fsdp_qcomm.enable(model, cfg) if cfg is not None else None
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        with _PGBytes() as pg:
            for step in range(steps):
                loss = lm_loss(model, batch(step, rank))
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
        notes = handle.stats()["notes"] if handle is not None else []
        if handle is not None:
            handle.disable()
        return pg.bytes, losses, notes

    for name, reduce, fields in (("bf16_fp32", torch.float32, FSDP2_BF16_FP32),
                                 ("bf16_bf16", BF16, FSDP2_BF16_BF16)):
        real = train(MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=reduce), None)[0]
        emulated = train(MixedPrecisionPolicy(), QCommConfig(**fields, ranks_per_node=2))[0]
        res[name] = (real, emulated)
    res["fp32_bytes"], res["fp32_losses"], _ = train(MixedPrecisionPolicy(), None, steps=4)
    _, res["preset_losses"], res["notes"] = train(MixedPrecisionPolicy(), QCommConfig.preset(
        "bf16", ranks_per_node=1), steps=4)
    return res


@pytest.fixture(scope="module")
def fsdp_runs() -> list[dict]:
    return run_ranks(_fsdp_bytes, 2, timeout=600)


@pytest.mark.parametrize("policy", ["bf16_fp32", "bf16_bf16"])
def test_emulated_bf16_wire_equals_fsdp2_mixed_precision_bytes(fsdp_runs, policy):
    for r in fsdp_runs:
        real, emulated = r[policy]
        assert real["gather"] > 0 and real["reduce"] > 0, real
        assert emulated == real, (policy, emulated, real)
        fp32 = {k: v / 2 for k, v in r["fp32_bytes"].items()}  # 4 steps there, 2 here
        assert real["gather"] == fp32["gather"] // 2  # bf16 weights: half of fp32
        assert real["reduce"] == (fp32["reduce"] if policy == "bf16_fp32" else
                                  fp32["reduce"] // 2)


def test_bf16_preset_trains_like_fp32_and_says_what_it_sends(fsdp_runs):
    r = fsdp_runs[0]
    fp32, bf16 = r["fp32_losses"], r["preset_losses"]
    assert all(abs(a - b) <= 0.02 * a for a, b in zip(fp32, bf16)), (fp32, bf16)
    text = " | ".join(r["notes"])
    assert "weight all-gather: bf16 (16-bit)" in text, text
    assert "gradient reduce-scatter: one hop, bf16 rows summed in fp32" in text, text


def test_bf16_fields_refuse_what_does_not_apply():
    assert QCommConfig.preset("bf16").node_crossing_bits() == (16.0, 16.0, 16.0)
    with pytest.raises(ValueError, match="grad_error_feedback needs a quantized gradient"):
        QCommConfig.preset("bf16", grad_error_feedback="inter")
    with pytest.raises(ValueError, match="weight_levels='learned' needs a quantized weight"):
        QCommConfig.preset("bf16", weight_levels="learned")
    with pytest.raises(ValueError, match="bit_budget chooses"):
        QCommConfig.preset("bf16", bit_budget=3.0)

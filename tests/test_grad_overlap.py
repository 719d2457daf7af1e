"""``QCommConfig.grad_overlap``: gradient reductions on a background thread, same results.

Each case trains the same tiny model with and without ``grad_overlap`` on gloo ranks and
compares losses, gradients and weights bit for bit, and counts how many reductions were
deferred, so a path that silently went synchronous (or deferred when FSDP reads the output
right away) fails.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _models import MLPBlock
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fsdp_qcomm
from fsdp_qcomm import QCommConfig
from fsdp_qcomm.fsdp import grad_overlap
from fsdp_qcomm.fsdp.grad_overlap import ReductionQueue
from fsdp_qcomm.testing import ComputeWeights, digest, run_ranks


class Net(nn.Module):
    """Sizes that are multiples of no group size; ``out`` shares ``inp``'s weight (tied)."""

    def __init__(self, d: int = 13, hidden: int = 37, layers: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList(MLPBlock(d, hidden) for _ in range(layers))
        self.out = nn.Linear(d, d)
        self.out.weight = self.inp.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def _batch(step: int, rank: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    x = torch.randn(6, 13, generator=g)
    return x, x.roll(1, dims=1).sin()


def _train(cfg: QCommConfig, steps: int, micro: int = 1, divide_factor=None, mp=None,
           blocks: bool = True) -> dict:
    torch.manual_seed(0)
    model = Net()
    kw = {} if mp is None else {"mp_policy": mp}
    for b in model.blocks if blocks else ():
        fully_shard(b, **kw)
    fully_shard(model, **kw)
    if divide_factor is not None:
        model.set_gradient_divide_factor(divide_factor)
    handle = fsdp_qcomm.enable(model, cfg)
    used = ComputeWeights(model)  # what each rank's forwards compute with
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    rank = dist.get_rank()
    losses, grads = [], {}
    for step in range(steps):
        for m in range(micro):
            x, y = _batch(step, rank, m)
            used.clear()
            loss = F.mse_loss(model(x).float(), y)  # torch 2.11: no mixed-dtype mse backward
            used.check_same(f"weights of step {step}, micro-batch {m}")
            loss.backward()
            assert handle._session.queue is None or handle._session.queue.pending == 0, \
                "backward() returned with reductions still running"
            losses.append(loss.item())
        grads = {k: p.grad.to_local().clone() for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    weights = {k: p.to_local().detach().clone() for k, p in model.named_parameters()}
    used.clear()
    with torch.no_grad():  # the weights the last step wrote, as the next forward gathers them
        model(_batch(steps, rank)[0])
    used.check_same("weights after the last step")
    used.remove()
    out = {
        "losses": losses, "grads": {k: digest(v) for k, v in grads.items()},
        "weights": {k: digest(v) for k, v in weights.items()},
        "grad_values": grads, "deferred": handle.deferred_reductions,
        "grad_bytes": {k: v["sent_bytes"] for k, v in handle.stats().items()
                       if k.startswith("grad")},
        "notes": handle.stats()["notes"], "threaded": handle._session.queue is not None,
    }
    handle.disable()
    return out


def _compare(rank, world, preset, steps, micro=1, divide_factor=None, reduce_dtype=None,
             blocks=True):
    mp = None
    if reduce_dtype is not None:  # bf16 compute, gradients reduced in reduce_dtype
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    cfg = QCommConfig.preset(preset, ranks_per_node=2 if world == 4 else 1)
    sync = _train(cfg, steps, micro, divide_factor, mp, blocks)
    over = _train(dataclasses.replace(cfg, grad_overlap=True), steps, micro, divide_factor, mp,
                  blocks)
    return sync, over


def _assert_same(sync: dict, over: dict, exact: bool = True) -> None:
    assert sync["grad_bytes"] == over["grad_bytes"]
    if exact:
        assert over["losses"] == sync["losses"]
        assert over["grads"] == sync["grads"]
        assert over["weights"] == sync["weights"]
        return
    for k, g in sync["grad_values"].items():
        torch.testing.assert_close(over["grad_values"][k], g, rtol=2e-6, atol=1e-9)


def test_two_level_overlap_is_bit_identical_and_defers_every_reduction():
    # 2 nodes x 2: TLq-HS on the private subgroups, qWD gathers on FSDP's group meanwhile.
    steps = 3
    res = run_ranks(_compare, 4, "sdp4bit", steps)
    for sync, over in res:
        _assert_same(sync, over)
        assert sync["deferred"] == 0
        # 4 FSDP modules (3 blocks + root) per backward, all deferred
        assert over["deferred"] == 4 * steps


def test_one_level_overlap_with_direct_weight_gathers_2_ranks():
    # QSDP: the all-to-all would share FSDP's group with the weight all-gathers; it runs on a
    # private copy of that group instead.
    res = run_ranks(_compare, 2, "qsdp", 2)
    for sync, over in res:
        _assert_same(sync, over)
        assert over["deferred"] == 4 * 2


def test_accumulation_and_mixed_precision():
    # Micro-batch 2 accumulates into existing gradients: FSDP reads the output at once, so
    # only the first micro-batch's reductions may be deferred.
    res = run_ranks(_compare, 2, "tlq_hs", 2, 2)
    for sync, over in res:
        _assert_same(sync, over)
        assert over["deferred"] == 4 * 2  # 2 steps x first micro-batch x 4 modules
    # bf16 compute, fp32 reduction into fp32 parameters: no cast, deferred.
    res = run_ranks(_compare, 2, "tlq_hs", 1, 1, None, torch.float32)
    for sync, over in res:
        _assert_same(sync, over)
        assert over["deferred"] == 4
    # bf16 reduction: FSDP casts the output to the fp32 parameters at once -> never deferred.
    res = run_ranks(_compare, 2, "tlq_hs", 1, 1, None, torch.bfloat16)
    for sync, over in res:
        _assert_same(sync, over)
        assert over["deferred"] == 0


def test_root_only_module():
    # One FSDP module: its reduction may be the first and only one of the backward pass.
    res = run_ranks(_compare, 2, "sdp4bit", 2, 1, None, None, False)
    for sync, over in res:
        _assert_same(sync, over)
        assert over["deferred"] == 2


def test_gradient_divide_factor():
    # Without overlap FSDP divides the SUM by 3 after the call; with overlap the hook applies
    # PREMUL_SUM(1/3) itself: the same average up to one rounding.
    res = run_ranks(_compare, 2, "tlq", 1, 1, 3.0)
    for sync, over in res:
        _assert_same(sync, over, exact=False)
        assert over["deferred"] == 4


def _worker_error(rank, world):
    import fsdp_qcomm.fsdp.reduce_scatter as rs

    cfg = QCommConfig.preset("tlq", grad_overlap=True, ranks_per_node=1)
    torch.manual_seed(0)
    model = Net()
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    handle = fsdp_qcomm.enable(model, cfg)

    def broken(*a, **k):
        raise RuntimeError("injected reduction failure")

    rs.reduce_scatter_quantized = broken
    x, y = _batch(0, rank)
    try:
        F.mse_loss(model(x), y).backward()
    except RuntimeError as e:
        assert handle._session.queue.pending == 0
        return str(e)
    return "no error"


def test_worker_error_surfaces_from_backward():
    assert run_ranks(_worker_error, 2) == ["injected reduction failure"] * 2


def _modules_on_a_gpu(rank, world):
    """CPU ranks whose FSDP modules ``enable`` takes for GPU ones (``_overlaps_on_a_thread``)."""
    from fsdp_qcomm.fsdp import enable as enable_module

    cfg = QCommConfig.preset("sdp4bit", ranks_per_node=1)
    sync = _train(cfg, 2)
    enable_module._overlaps_on_a_thread = lambda group: False
    return sync, _train(dataclasses.replace(cfg, grad_overlap=True), 2)


def test_gpu_modules_reduce_on_fsdps_stream_not_the_thread():
    """On a GPU FSDP2 calls the reduction hooks on its reduce-scatter stream; the background
    thread would run them on its own current stream, which FSDP's never waits for. So enable
    turns grad_overlap off for such modules: no thread, the synchronous path's bits, a note."""
    for sync, over in run_ranks(_modules_on_a_gpu, 2):
        _assert_same(sync, over)
        assert over["deferred"] == 0 and not over["threaded"]
        assert any(n.startswith("grad_overlap: off on GPUs: FSDP2 already overlaps") and
                   n.endswith("[4 module(s): <root>, blocks.0, blocks.1, blocks.2]")
                   for n in over["notes"]), over["notes"]


def test_queue_runs_in_order_and_drains_outside_backward():
    q = ReductionQueue()
    seen = []
    for i in range(5):
        q.submit(lambda i=i: seen.append(i))  # not in backward: waits at once
    assert seen == list(range(5)) and q.pending == 0 and q.deferred == 0
    q.submit(lambda: seen.append(5))
    with pytest.raises(ValueError, match="boom"):
        q.submit(lambda: (_ for _ in ()).throw(ValueError("boom")))
    assert seen == list(range(6))


def test_config_checks_the_overlap_flag():
    assert QCommConfig.preset("baseline", grad_overlap=True).grad_scheme == "none"
    with pytest.raises(ValueError, match="grad_overlap must be a bool"):
        QCommConfig(grad_scheme="two_level", grad_overlap=1)


def _unquantized(rank, world):
    fsdp_own = _train(QCommConfig.preset("baseline", ranks_per_node=2), 3)
    threaded = _train(QCommConfig.preset("baseline", ranks_per_node=2, grad_overlap=True), 3)
    return fsdp_own, threaded


def test_unquantized_reductions_on_the_thread_match_fsdp():
    """grad_scheme='none' with grad_overlap: FSDP's unquantized reduction on the background
    thread (the reference for what quantization alone gains), same values up to the rounding
    of SUM-then-divide against FSDP's AVG, and the bytes of an fp32 reduce-scatter."""
    for fsdp_own, threaded in run_ranks(_unquantized, 4):
        assert fsdp_own["grad_bytes"] == {} and fsdp_own["deferred"] == 0
        assert threaded["deferred"] == 4 * 3
        # 3 steps x 4 modules: fp32 inputs of 4 rows of the padded shards (2 emulated nodes)
        assert set(threaded["grad_bytes"]) == {"grad_inter"}
        for k, g in fsdp_own["grad_values"].items():
            torch.testing.assert_close(threaded["grad_values"][k], g, rtol=2e-6, atol=1e-9)


def test_deferrable_refuses_what_fsdp_reads_at_once():
    class FakeParam:
        def __init__(self):
            self.sharded_param = nn.Parameter(torch.zeros(3))
            self.offload_to_cpu = False
            self.sharded_grad_dtype = torch.float32

    class FakeGroup:
        _partial_reduce_output = None
        _all_reduce_hook = None

        def __init__(self):
            from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo

            self.mesh_info = object.__new__(FSDPMeshInfo)
            self.fsdp_params = [FakeParam()]

    x = torch.zeros(4)
    g = FakeGroup()
    avg = dist.ReduceOp.AVG
    reason = grad_overlap.defer_reason
    assert reason(g, x, avg) == ""
    assert "forced-sum" in reason(g, x, dist.ReduceOp.SUM)  # FSDP post-divides
    assert "casts" in reason(g, x.bfloat16(), avg)
    assert reason(None, x, avg)
    g.fsdp_params[0].sharded_param.register_post_accumulate_grad_hook(lambda p: None)
    assert "hook reads" in reason(g, x, avg)  # user code reads the gradient
    g = FakeGroup()
    g.fsdp_params[0].sharded_param.grad = torch.ones(3)
    assert "accumulate" in reason(g, x, avg)
    g = FakeGroup()
    g.fsdp_params[0].offload_to_cpu = True
    assert "offload" in reason(g, x, avg)
    g = FakeGroup()
    g._all_reduce_hook = lambda t: None
    assert "all-reduce hook" in reason(g, x, avg)
    g = FakeGroup()
    del g.fsdp_params[0].sharded_param  # a torch that moved what we read: an error, not "no"
    with pytest.raises(AttributeError):
        reason(g, x, avg)

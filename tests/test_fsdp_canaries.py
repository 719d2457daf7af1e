"""Canaries: one test per FSDP2 behaviour fsdp_qcomm relies on, named for the behaviour.

fsdp_qcomm plugs into FSDP2 through private seams (``fsdp_qcomm/fsdp/internals.py`` reads them,
``enable`` checks that they exist). Whether FSDP2 still *behaves* as assumed can only be seen by
running it, so this module runs plain FSDP2 (no fsdp_qcomm hooks: recording comms and hooks of
its own) and pins each behaviour with one test whose failure message says which behaviour moved
and which file relies on it. After a torch upgrade, run this module first.

Process groups cost a spawn each, so one 2-rank run (1-D FSDP) and one 4-rank run (HSDP, 2
replicas x 2 shards) measure everything that needs ranks and return dicts; the tests assert on
those dicts. Behaviours that need no process group are checked in this process.
"""

from __future__ import annotations

import copy
import inspect
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _models import MLPBlock
from torch.distributed import ReduceOp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_collectives
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_common import (
    DDPMeshInfo,
    FSDPMeshInfo,
    TrainingState,
)

from fsdp_qcomm.collectives import _c10d
from fsdp_qcomm.collectives.grad_reduce import PremulSum, reduce_op_finisher
from fsdp_qcomm.fsdp import internals
from fsdp_qcomm.fsdp.all_gather import QuantizedAllGather
from fsdp_qcomm.fsdp.reduce_scatter import QuantizedReduceScatter
from fsdp_qcomm.testing import digest, run_ranks

D, H = 6, 11  # H = 11: fc1's rows are padded on 2 ranks (FSDP pads dim 0 to a multiple)


def moved(behaviour: str, where: str) -> str:
    """The failure message of a canary."""
    return (f"FSDP2 in torch {torch.__version__} no longer {behaviour}: fsdp_qcomm/{where} "
            "relies on it")


# ---- a tiny model, a reference gradient, recording comms --------------------------------------
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(D, H) for _ in range(2))
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class MixedDtypes(nn.Module):
    """An fp32 linear layer and a frozen bf16 scale in one FSDP group (FSDP refuses trainable
    parameters of mixed dtypes; torch 2.15's ``param_dtype_override_fn`` mixes them too)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.scale = nn.Parameter(torch.ones(D, dtype=torch.bfloat16), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale.float()


def _batch(rank: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + micro)
    return torch.randn(4, D, generator=g), torch.randn(4, 3, generator=g)


def _loss(model: nn.Module, rank: int, micro: int = 0) -> torch.Tensor:
    x, y = _batch(rank, micro)
    return F.mse_loss(model(x), y)


def _reference_grads(ref: nn.Module, ranks: list[int], micros: tuple[int, ...] = (0,)) -> dict:
    """The data-parallel average gradient of an unsharded copy: mean over ranks of each rank's
    gradient, summed over micro-batches."""
    ref.zero_grad(set_to_none=True)
    for r in ranks:
        for m in micros:
            (_loss(ref, r, m) / len(ranks)).backward()
    return {n: p.grad.detach().clone() for n, p in ref.named_parameters()}


def _full_grads(model: nn.Module) -> dict:
    return {n: p.grad.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _close(a: dict, b: dict, scale: float = 1.0, prefix: str = "") -> bool:
    """``a`` equals ``b``, with the entries named ``prefix...`` scaled by ``scale``."""
    return a.keys() == b.keys() and all(
        torch.allclose(a[k], b[k] * (scale if k.startswith(prefix) else 1.0), rtol=1e-5,
                       atol=1e-6) for k in a)


def _zero(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def _group(module: nn.Module):
    (g,) = internals.param_groups(module)
    return g


def _bind(fn, args: tuple, kwargs: dict) -> dict:
    """How ``args``/``kwargs`` bind to fsdp_qcomm's own ``__call__`` (None: they do not)."""
    try:
        return dict(inspect.signature(fn).bind(None, *args, **kwargs).arguments)
    except TypeError:
        return {}


def _tensors_and_group(args: tuple, kwargs: dict, gather: bool):
    """(output, input, group) from whatever FSDP passed, even under other names (then the
    larger tensor is a gather's output, a reduce-scatter's input), so that a renamed keyword
    fails the canary's assertion instead of hanging the ranks."""
    vals = [*args, *kwargs.values()]
    group = next(v for v in vals if isinstance(v, dist.ProcessGroup))
    if "output_tensor" in kwargs and "input_tensor" in kwargs:
        return kwargs["output_tensor"], kwargs["input_tensor"], group
    big, small = sorted([v for v in vals if isinstance(v, torch.Tensor)][:2],
                        key=lambda t: -t.numel())
    return (big, small, group) if gather else (small, big, group)


def _sentinel(t: torch.Tensor) -> torch.Tensor:
    return t.fill_(171) if t.dtype == torch.uint8 else t.fill_(float("nan"))


def _is_sentinel(t: torch.Tensor) -> bool:
    return bool((t == 171).all()) if t.dtype == torch.uint8 else bool(t.isnan().all())


class Duck:
    """Quacks like a ``dist.Work`` without subclassing it."""

    def __init__(self) -> None:
        self.waited = False

    def wait(self, timeout=None) -> bool:
        self.waited = True
        return True


class WaitedWork(dist.Work):
    """A real ``dist.Work`` subclass around an async all-gather, noting whether FSDP waited."""

    def __init__(self, work: dist.Work) -> None:
        super().__init__()
        self.work = work
        self.waited = False

    def wait(self, timeout=None) -> bool:
        self.waited = True
        return self.work.wait()


class RecordingAllGather(AllGather):
    """Records what FSDP hands it and does a plain all-gather. ``ret``: what ``__call__``
    returns ("none", "duck": a blocking gather and a duck-typed work, "work": an async gather and
    a ``dist.Work`` subclass)."""

    def __init__(self, param_group) -> None:
        super().__init__()
        self.pg = param_group
        self.allocs: list[dict] = []
        self.calls: list[dict] = []
        self.ret = "none"
        self.returned = None

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        t = _sentinel(torch.empty(*size, dtype=dtype, device=device))
        self.allocs.append({"numel": t.numel(), "dtype": str(dtype), "ptr": t.data_ptr()})
        return t

    def __call__(self, *args, **kwargs):
        out, inp, group = _tensors_and_group(args, kwargs, gather=True)
        world, rank, n = group.size(), group.rank(), inp.numel()
        expect = torch.cat([internals.local_shard(fp) for fp in internals.fsdp_params(self.pg)])
        own = out.narrow(0, rank * n, n)
        others = [out.narrow(0, r * n, n) for r in range(world) if r != rank]
        bound = _bind(QuantizedAllGather.__call__, args, kwargs)
        self.calls.append({
            "positional": len(args), "keywords": sorted(kwargs),
            "binds": bound.get("output_tensor") is out and bound.get("input_tensor") is inp
            and bound.get("group") is group and "async_op" in bound,
            "output_is_allocated": bool(self.allocs) and out.data_ptr() == self.allocs[-1]["ptr"]
            and out.numel() == world * n,
            "input_is_own_slot": inp.data_ptr() == own.data_ptr() and inp.is_contiguous(),
            "input_is_shard": inp.dtype == torch.uint8 or torch.equal(inp, expect.to(inp.dtype)),
            "others_untouched": all(_is_sentinel(o) for o in others),
            "dtype": str(inp.dtype),
            "pre_backward": internals.in_backward(self.pg),
            "autograd": internals.autograd_running(),
        })
        if self.ret == "work":
            self.returned = WaitedWork(_c10d.all_gather_single(out, inp, group=group,
                                                                   async_op=True))
            return self.returned
        _c10d.all_gather_single(out, inp, group=group)
        self.returned = Duck() if self.ret == "duck" else None
        return self.returned


def reduce_rows(output: torch.Tensor, input: torch.Tensor, group, op) -> None:
    """Row ``j`` of ``input.view(world, m)`` goes to rank ``j`` (all-to-all of rows, then a
    sum), then ``op``: the layout fsdp_qcomm's reduce-scatter encodes."""
    world = group.size()
    rows = input.reshape(world, -1).float()
    recv = torch.empty_like(rows)
    dist.all_to_all_single(recv, rows, group=group)
    out = recv.sum(0)
    if op == ReduceOp.AVG:
        out /= world
    elif isinstance(op, PremulSum) or op == ReduceOp.PREMUL_SUM:
        out *= float(op.factor)
    elif op != ReduceOp.SUM:
        raise ValueError(f"unexpected op {op!r}")
    output.copy_(out.view_as(output))


class RecordingReduceScatter(ReduceScatter):
    """Records what FSDP hands it, reduces rows as fsdp_qcomm assumes, returns junk (FSDP must
    ignore it)."""

    def __init__(self, param_group, replicate=None) -> None:
        super().__init__()
        self.pg = param_group
        self.replicate = replicate  # HSDP: the replica group whose sequence number to note
        self.calls: list[dict] = []
        self.allocs: list[tuple] = []
        self.output_ptr = None

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        # what fsdp_qcomm's allocate reads: the gradients of an input allocation, else None
        found, grads = internals.reduce_allocation()
        self.allocs.append((math.prod(size), str(dtype), found, str(grads)))
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, *args, **kwargs):
        out, inp, group = _tensors_and_group(args, kwargs, gather=False)
        op = kwargs.get("op", args[3] if len(args) > 3 else None)
        bound = _bind(QuantizedReduceScatter.__call__, args, kwargs)
        segs = [internals.padded_shard_numel(fp) for fp in internals.fsdp_params(self.pg)]
        readable = internals.readable_reduce_op(op, self.pg)  # the factor, on every torch
        self.calls.append({
            "positional": len(args), "keywords": sorted(kwargs),
            "binds": bound.get("output_tensor") is out and bound.get("input_tensor") is inp
            and bound.get("group") is group and bound.get("op") is op,
            "layout": inp.numel() == group.size() * sum(segs) and out.numel() == sum(segs),
            "op": "AVG" if op == ReduceOp.AVG else "SUM" if op == ReduceOp.SUM
            else "PREMUL_SUM" if op == ReduceOp.PREMUL_SUM else repr(op),
            "factor": float(readable.factor) if op == ReduceOp.PREMUL_SUM else None,
            "dtype": str(inp.dtype),
            "replica_seq": (internals.sequence_number(self.replicate)
                            if self.replicate is not None else None),
        })
        self.output_ptr = out.data_ptr()
        reduce_rows(out, inp, group, readable)
        return object()  # FSDP ignores the return value (fsdp_qcomm returns None)


# ---- behaviours that need no process group ------------------------------------------------------
def test_training_states_include_pre_backward():
    names = {s.name for s in TrainingState}
    assert {"IDLE", "FORWARD", "PRE_BACKWARD", "POST_BACKWARD"} <= names, moved(
        f"has TrainingState IDLE/FORWARD/PRE_BACKWARD/POST_BACKWARD (has {sorted(names)})",
        "fsdp/internals.py in_backward")


def test_graph_task_id_is_minus_one_outside_backward_only():
    seen = []
    x = torch.ones(2, requires_grad=True)
    y = (x * 2).sum()
    y.register_hook(lambda g: seen.append(torch._C._current_graph_task_id()))
    outside = torch._C._current_graph_task_id()
    y.backward()
    assert outside == -1 and seen and seen[0] != -1, moved(
        f"reports torch._C._current_graph_task_id() == -1 outside backward and another id "
        f"inside (got {outside} outside, {seen} inside)",
        "fsdp/internals.py autograd_running and fsdp/grad_overlap.py ReductionQueue")


def test_comm_base_classes_take_allocate_and_call():
    for cls in (AllGather, ReduceScatter):
        params = inspect.signature(cls.allocate).parameters
        kinds = {n: p.kind for n, p in params.items()}
        assert list(kinds)[1:] == ["size", "dtype", "device"] and \
            kinds["dtype"] == kinds["device"] == inspect.Parameter.KEYWORD_ONLY, moved(
                f"declares {cls.__name__}.allocate(size, *, dtype, device) (has {list(kinds)})",
                "fsdp/all_gather.py and fsdp/reduce_scatter.py")
        assert callable(getattr(cls, "__call__", None)), moved(
            f"declares {cls.__name__}.__call__", "fsdp/all_gather.py and fsdp/reduce_scatter.py")


def test_all_reduce_process_group_is_a_property():
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    prop = getattr(FSDPParamGroup, "_all_reduce_process_group", None)
    assert isinstance(prop, property), moved(
        "computes FSDPParamGroup._all_reduce_process_group as a property (read at each reduce)",
        "fsdp/hsdp.py (the replica-group swap)")


class _Size:
    def __init__(self, n: int) -> None:
        self.n = n

    def size(self) -> int:
        return self.n


def test_gradient_divide_factors_argument_order():
    names = tuple(inspect.signature(_fsdp_collectives._get_gradient_divide_factors).parameters)
    assert names[:6] == internals._DIVIDE_FACTOR_ARGS, moved(
        f"takes _get_gradient_divide_factors{internals._DIVIDE_FACTOR_ARGS} (takes {names})",
        "fsdp/internals.py post_divide_factor")


@pytest.mark.parametrize("rs, ar, dtype, factor, force_sum, expect", [
    # 1-D FSDP: AVG on the reduce-scatter, nothing divided after
    (4, None, torch.float32, None, False, (None, None, "AVG", "AVG")),
    # HSDP: AVG on both hops
    (2, 2, torch.float32, None, False, (None, None, "AVG", "AVG")),
    # a factor equal to the reduce-scatter size: still AVG, SUM across replicas
    (4, 2, torch.float32, 4.0, False, (None, None, "AVG", "SUM")),
    # another factor: PREMUL_SUM(1 / factor) (gloo rejects it), SUM across replicas
    (4, None, torch.float32, 1.0, False, (None, None, ("PREMUL_SUM", 1.0), "SUM")),
    # forced sum: SUM on both hops and a post-division by the whole data-parallel size
    (4, 2, torch.float32, None, True, (None, 8.0, "SUM", "SUM")),
    (4, None, torch.float32, 3.0, True, (None, 3.0, "SUM", "SUM")),
    # fp16 (overflow risk): divide before and after, SUM
    (4, 2, torch.float16, None, False, (4, 2.0, "SUM", "SUM")),
])
def test_gradient_divide_factors_results(rs, ar, dtype, factor, force_sum, expect):
    got = _fsdp_collectives._get_gradient_divide_factors(
        _Size(rs), None if ar is None else _Size(ar), dtype, "cpu", factor, force_sum)

    def name(op):
        if op == ReduceOp.PREMUL_SUM:
            # before torch 2.13 the factor is not readable: internals rebuilds it from the group's
            # divide factor, which is what this checks then
            op = internals.readable_reduce_op(op, _Group(factor))
            return ("PREMUL_SUM", float(op.factor))
        return "AVG" if op == ReduceOp.AVG else "SUM" if op == ReduceOp.SUM else repr(op)

    got = (got[0], got[1], name(got[2]), name(got[3]))
    assert got == expect, moved(
        f"returns {expect} from _get_gradient_divide_factors(rs={rs}, ar={ar}, {dtype}, "
        f"factor={factor}, force_sum={force_sum}) (got {got})",
        "fsdp/hsdp.py replica_op, fsdp/internals.py post_divide_factor and fsdp/enable.py")


class _Group:
    """What ``internals.readable_reduce_op`` reads of a parameter group."""

    def __init__(self, factor) -> None:
        self.gradient_divide_factor = factor


def test_premul_sum_op_carries_its_factor():
    if internals.torch_minor() >= (2, 13):
        op = ReduceOp.PREMUL_SUM(0.25)
        assert op == ReduceOp.PREMUL_SUM and op != ReduceOp.SUM and float(op.factor) == 0.25, \
            moved("builds ReduceOp.PREMUL_SUM(f) that compares equal to PREMUL_SUM and exposes "
                  ".factor", "collectives/grad_reduce.py reduce_op_finisher")
    else:  # FSDP's own op has no readable factor: internals rebuilds it from FSDP's factor
        op = dist._make_nccl_premul_sum(0.25)
        assert op == ReduceOp.PREMUL_SUM and op != ReduceOp.SUM, moved(
            "builds _make_nccl_premul_sum(f) that compares equal to PREMUL_SUM",
            "fsdp/internals.py readable_reduce_op")
        op = internals.readable_reduce_op(op, _Group(4.0))
    assert float(internals.readable_reduce_op(op, _Group(4.0)).factor) == 0.25
    t = torch.ones(3)
    reduce_op_finisher(op, 4)(t)
    assert t.tolist() == [0.25] * 3


# ---- 1-D FSDP on 2 ranks ------------------------------------------------------------------------
def _flat_run(rank: int, world: int) -> dict:
    """Everything the 1-D tests check, measured on one rank."""
    res: dict = {}
    ranks = list(range(world))
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    block = model.blocks[0]
    g = _group(block)
    res["mesh_info"] = (isinstance(g.mesh_info, FSDPMeshInfo),
                        isinstance(g.mesh_info, DDPMeshInfo))
    ag, rs = RecordingAllGather(g), RecordingReduceScatter(g)
    block.set_custom_all_gather(ag)
    block.set_custom_reduce_scatter(rs)
    params = internals.sharded_params(g)
    hook_log: list[tuple[int, bool, str]] = []

    def post_acc(p):
        hook_log.append((id(p), p.grad is not None, digest(p.grad.to_local())
                         if p.grad is not None else ""))

    for p in params:
        p.register_post_accumulate_grad_hook(post_acc)

    # one training step: forward gather, backward re-gather, reduce-scatter (AVG)
    _loss(model, rank).backward()
    res["ag_calls"] = list(ag.calls)
    res["ag_allocs"] = len(ag.allocs)
    res["rs_avg"] = list(rs.calls)
    res["rs_allocs"] = list(rs.allocs)
    res["grads_avg"] = _close(_full_grads(model), _reference_grads(ref, ranks))
    res["post_acc"] = [(pid == id(p), had, d == digest(p.grad.to_local()))
                       for (pid, had, d), p in zip(hook_log, params)] \
        if len(hook_log) == len(params) else hook_log
    res["post_acc_count"] = len(hook_log)
    res["grad_views"] = all(
        p.grad.to_local().untyped_storage().data_ptr() == rs.output_ptr for p in params)
    res["sharded_dtypes"] = [str(p.dtype) for p in params]

    # forced sum: SUM, FSDP divides afterwards (same average)
    _zero(model)
    rs.calls.clear()
    block.set_force_sum_reduction_for_comms(True)
    _loss(model, rank).backward()
    res["rs_sum"] = list(rs.calls)
    res["grads_sum"] = _close(_full_grads(model), _reference_grads(ref, ranks))
    block.set_force_sum_reduction_for_comms(False)

    # accumulation: no reduction without gradient sync, one reduction (and one post-accumulate
    # call per parameter) for the micro-batch that syncs
    _zero(model)
    rs.calls.clear()
    hook_log.clear()
    model.set_requires_gradient_sync(False)
    _loss(model, rank, 0).backward()
    res["nosync_rs_calls"], res["nosync_post_acc"] = len(rs.calls), len(hook_log)
    model.set_requires_gradient_sync(True)
    _loss(model, rank, 1).backward()
    res["sync_rs_calls"], res["sync_post_acc"] = len(rs.calls), len(hook_log)
    res["grads_accumulated"] = _close(_full_grads(model), _reference_grads(ref, ranks, (0, 1)))

    # a divide factor other than the world size: PREMUL_SUM(1 / factor)
    _zero(model)
    rs.calls.clear()
    block.set_gradient_divide_factor(4.0)
    _loss(model, rank).backward()
    res["rs_premul"] = list(rs.calls)
    res["grads_premul"] = _close(_full_grads(model), _reference_grads(ref, ranks), world / 4.0,
                                 "blocks.0.")
    _zero(model)

    # what FSDP does with the returned object (a forward under no_grad gathers once)
    out = {}
    for ret in ("none", "duck", "work"):
        ag.ret = ret
        with torch.no_grad():
            y = model(_batch(rank)[0])
        out[ret] = (getattr(ag.returned, "waited", None),
                    torch.allclose(y, ref(_batch(rank)[0]), rtol=1e-5, atol=1e-6))
    res["returned"] = out
    ag.ret = "none"

    # param_signature: which writes change it
    fps = internals.fsdp_params(g)

    def sig():
        return [internals.param_signature(fp) for fp in fps]

    s = sig()
    changes = {}
    with torch.no_grad():
        for p in params:
            p.data.mul_(1.0)
    changes["p.data.mul_"] = sig() != s
    _loss(model, rank).backward()
    s = sig()
    opt = torch.optim.Adam(model.parameters(), lr=0.0, foreach=True)
    opt.step()
    changes["Adam(foreach=True).step"], s = sig() != s, sig()
    opt = torch.optim.SGD(model.parameters(), lr=0.0, foreach=True)
    opt.step()
    changes["SGD(foreach=True).step"], s = sig() != s, sig()
    with torch.no_grad():
        params[0].mul_(1.0)
        changes["p.mul_"], s = sig() != s, sig()
        params[0].copy_(params[0].detach().clone())
        changes["p.copy_"], s = sig() != s, sig()
    model.load_state_dict(model.state_dict())
    changes["load_state_dict"], s = sig() != s, sig()
    res["signature_changes"] = changes
    _zero(model)

    # set_custom_all_gather still swaps the comm after the first unshard (disable() does)
    ag2 = RecordingAllGather(g)
    block.set_custom_all_gather(ag2)
    with torch.no_grad():
        model(_batch(rank)[0])
    res["swapped_comm_calls"] = (len(ag2.calls), len(ag.calls))

    # mixed dtypes in one group: FSDP gathers raw bytes
    mixed = MixedDtypes()
    fully_shard(mixed, mesh=mesh)
    agm = RecordingAllGather(_group(mixed))
    mixed.set_custom_all_gather(agm)
    with torch.no_grad():
        mixed(torch.randn(2, D))
    res["mixed"] = ([a["dtype"] for a in agm.allocs], [c["dtype"] for c in agm.calls],
                    [c["input_is_own_slot"] and c["others_untouched"] for c in agm.calls])

    # mixed precision: bf16 all-gather and reduce, sharded parameters and gradients stay fp32
    torch.manual_seed(1)
    mpm = nn.Sequential(nn.Linear(D, H), nn.Linear(H, D))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    fully_shard(mpm, mesh=mesh, mp_policy=mp)
    gm = _group(mpm)
    res["mp_param_dtype_before_init"] = str(internals.param_dtype(gm))
    agp, rsp = RecordingAllGather(gm), RecordingReduceScatter(gm)
    mpm.set_custom_all_gather(agp)
    mpm.set_custom_reduce_scatter(rsp)
    mpm(torch.randn(4, D)).float().square().mean().backward()
    mparams = internals.sharded_params(gm)
    res["mp"] = {
        "allocs": [a["dtype"] for a in agp.allocs], "rs": [c["dtype"] for c in rsp.calls],
        "params": [str(p.dtype) for p in mparams],
        "grads": [str(p.grad.dtype) for p in mparams],
        "sharded_grad_dtypes": [str(internals.sharded_grad_dtype(fp))
                                for fp in internals.fsdp_params(gm)],
    }

    # bf16 parameters, fp32 reduction: what the reduce-scatter's allocate sees
    torch.manual_seed(1)
    bfm = nn.Sequential(nn.Linear(D, H), nn.Linear(H, D))
    fully_shard(bfm, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                               reduce_dtype=torch.float32))
    rsb = RecordingReduceScatter(_group(bfm))
    bfm.set_custom_reduce_scatter(rsb)
    bfm(torch.randn(4, D)).float().square().mean().backward()
    res["bf16_fp32_allocs"] = list(rsb.allocs)

    # coalesced all-gathers (not FSDP2's: c10d's), each into its own block of one buffer
    blocks = torch.zeros(3, world, 2)
    with _c10d.coalesced(dist.group.WORLD):
        for q in range(3):
            _c10d.all_gather_single(blocks[q].view(-1), torch.full((2,), 10.0 * q + rank))
    res["coalesced"] = blocks.tolist()
    # which groups may coalesce CUDA all-gathers: a gloo group registers gloo for CUDA tensors
    # too (without a GPU as well), and names it
    res["coalesces"] = {d: _c10d.coalesces(dist.group.WORLD, torch.device(d))
                        for d in ("cpu", "cuda")}
    return res


@pytest.fixture(scope="module")
def flat() -> list[dict]:
    return run_ranks(_flat_run, 2, timeout=400)


def test_one_dimensional_mesh_info_is_fsdp_not_ddp(flat):
    for r in flat:
        assert r["mesh_info"] == (True, False), moved(
            "describes a 1-D mesh with an FSDPMeshInfo that is not a DDPMeshInfo",
            "fsdp/internals.py is_hsdp")


def test_all_gather_calls_with_fsdp_qcomm_keyword_names(flat):
    for r in flat:
        for c in r["ag_calls"]:
            assert c["binds"] and c["positional"] == 0, moved(
                "calls AllGather.__call__(output_tensor=, input_tensor=, group=, async_op=) "
                f"(got {c['positional']} positional, keywords {c['keywords']})",
                "fsdp/all_gather.py QuantizedAllGather.__call__")


def test_all_gather_output_comes_from_allocate(flat):
    for r in flat:
        assert all(c["output_is_allocated"] for c in r["ag_calls"]), moved(
            "passes the tensor AllGather.allocate returned (world * n values) as output_tensor",
            "fsdp/all_gather.py allocate (the qWD reference is the output buffer)")


def test_all_gather_input_is_this_ranks_slot_of_the_output(flat):
    for r in flat:
        assert all(c["input_is_own_slot"] for c in r["ag_calls"]), moved(
            "passes input_tensor as the view of output_tensor at this rank's offset",
            "fsdp/all_gather.py and collectives/weight_gather.py (own_slot, own_ref)")


def test_all_gather_copies_in_the_padded_shards_before_the_call(flat):
    for r in flat:
        for c in r["ag_calls"]:
            assert c["input_is_shard"], moved(
                "copies this rank's padded shards (FSDPParam._sharded_param_data, in fsdp_params "
                "order) into input_tensor before calling AllGather",
                "fsdp/all_gather.py _segments (segment sizes from padded_sharded_param_size)")
            assert c["others_untouched"], moved(
                "leaves the other ranks' slots of the allocated output untouched before the call",
                "fsdp/all_gather.py allocate (a kept output holds the previous weights)")


def test_all_gather_runs_again_in_backward_in_pre_backward_state(flat):
    for r in flat:
        calls = r["ag_calls"]
        assert [c["pre_backward"] for c in calls] == [False, True], moved(
            "calls the all-gather once in forward and once more in backward (in "
            "TrainingState.PRE_BACKWARD) with reshard_after_forward=True "
            f"(pre_backward flags {[c['pre_backward'] for c in calls]})",
            "fsdp/all_gather.py (backward re-gathers reuse, in_backward)")
        assert [c["autograd"] for c in calls] == [False, True], moved(
            "runs the backward re-gather inside the autograd graph task",
            "fsdp/internals.py autograd_running")


def test_returned_object_is_waited_only_if_it_subclasses_work(flat):
    for r in flat:
        got = r["returned"]
        assert got["duck"][0] is False, moved(
            "skips a returned object that is not a dist.Work", "fsdp/all_gather.py")
        assert got["work"][0] is True, moved(
            "waits on a returned dist.Work subclass before reading the output",
            "collectives/weight_gather.py (async gathers return a Work subclass)")
        assert all(ok for _, ok in got.values()), "a gather's output was wrong"


def test_reduce_scatter_calls_with_fsdp_qcomm_keyword_names(flat):
    for r in flat:
        for c in r["rs_avg"] + r["rs_sum"] + r["rs_premul"]:
            assert c["binds"], moved(
                "calls ReduceScatter.__call__(output_tensor=, input_tensor=, group=, op=) "
                f"(got {c['positional']} positional, keywords {c['keywords']})",
                "fsdp/reduce_scatter.py QuantizedReduceScatter.__call__")


def test_reduce_scatter_rows_go_to_ranks(flat):
    for r in flat:
        assert all(c["layout"] for c in r["rs_avg"]), moved(
            "hands the reduce-scatter world * (sum of padded shards) values in, one padded "
            "shard sum out", "fsdp/reduce_scatter.py and fsdp/residual_state.py")
        assert r["grads_avg"], moved(
            "gives rank j row j of input.view(world, m) (gradients differ from an unsharded "
            "reference when the hook reduces rows that way)", "collectives/grad_reduce.py")


@pytest.mark.parametrize("case, grads", [("rs_allocs", "torch.float32"),
                                         ("bf16_fp32_allocs", "torch.bfloat16")])
def test_reduce_scatter_allocates_the_input_for_the_gradients_then_the_output(flat, case, grads):
    for r in flat:
        (n_in, dt_in, f_in, g_in), (n_out, dt_out, f_out, g_out) = r[case]
        assert (n_in, dt_in, f_in, g_in, dt_out, f_out, g_out) == (
            2 * n_out, "torch.float32", True, grads, "torch.float32", True, "None"), moved(
            "allocates a reduce-scatter's input (its gradients and group size in the frame) "
            "before its output, in reduce_dtype", "fsdp/reduce_scatter.py allocate")


def test_reduce_scatter_op_is_avg_by_default(flat):
    for r in flat:
        assert [c["op"] for c in r["rs_avg"]] == ["AVG"], moved(
            f"passes ReduceOp.AVG by default (got {[c['op'] for c in r['rs_avg']]})",
            "fsdp/reduce_scatter.py and fsdp/enable.py")


def test_reduce_scatter_op_is_sum_when_forced_and_fsdp_divides(flat):
    for r in flat:
        assert [c["op"] for c in r["rs_sum"]] == ["SUM"] and r["grads_sum"], moved(
            "passes ReduceOp.SUM after set_force_sum_reduction_for_comms(True) and divides the "
            f"output afterwards (ops {[c['op'] for c in r['rs_sum']]}, gradients right: "
            f"{r['grads_sum']})", "fsdp/enable.py (forced sum)")


def test_reduce_scatter_op_is_premul_sum_with_a_divide_factor(flat):
    for r in flat:
        ops = [(c["op"], c["factor"]) for c in r["rs_premul"]]
        assert ops == [("PREMUL_SUM", 0.25)] and r["grads_premul"], moved(
            "passes PREMUL_SUM(1 / factor) after set_gradient_divide_factor(factor != world) "
            f"(got {ops})", "fsdp/reduce_scatter.py and collectives/grad_reduce.py")


def test_reduce_scatter_return_value_is_ignored(flat):
    # the recording hook returns a bare object(); the gradients above came out right
    for r in flat:
        assert r["grads_avg"] and r["grads_sum"], moved(
            "ignores the reduce-scatter hook's return value", "fsdp/reduce_scatter.py")


def test_reduced_gradients_are_views_of_the_reduce_scatter_output(flat):
    for r in flat:
        assert r["grad_views"], moved(
            "makes fp32 sharded gradients views of the reduce-scatter output (no copy)",
            "fsdp/grad_overlap.py (a deferred reduction writes them after the call)")


def test_post_accumulate_grad_hooks_fire_on_sharded_params_after_the_grad_is_written(flat):
    for r in flat:
        assert r["post_acc_count"] == len(r["sharded_dtypes"]) and all(
            same and had and final for same, had, final in r["post_acc"]), moved(
            "calls post-accumulate-grad hooks on each sharded parameter once, after writing its "
            f"reduced gradient (log {r['post_acc']})",
            "fsdp/all_gather.py _NoteReduction and fsdp/grad_overlap.py")


def test_post_accumulate_grad_hooks_fire_once_per_reduction(flat):
    n = len(flat[0]["sharded_dtypes"])
    for r in flat:
        got = (r["nosync_rs_calls"], r["nosync_post_acc"], r["sync_rs_calls"], r["sync_post_acc"])
        assert got == (0, 0, 1, n) and r["grads_accumulated"], moved(
            "reduces nothing (and calls no post-accumulate-grad hook) without gradient sync, "
            f"then once for the micro-batch that syncs (got {got})",
            "fsdp/all_gather.py (a finished reduction means new weights may follow)")


def test_param_signature_changes_on_per_tensor_writes_only(flat):
    want = {"p.data.mul_": False, "Adam(foreach=True).step": False,
            "SGD(foreach=True).step": False, "p.mul_": True, "p.copy_": True,
            "load_state_dict": True}
    for r in flat:
        got = r["signature_changes"]
        assert got == want, moved(
            "changes internals.param_signature exactly on "
            f"{sorted(k for k, v in want.items() if v)} (got {got})",
            "fsdp/all_gather.py (outside writes detected by versions; p.data and foreach "
            "writes documented as needing handle.reset())")


def test_custom_all_gather_can_be_swapped_after_the_first_unshard(flat):
    for r in flat:
        new, _ = r["swapped_comm_calls"]
        assert new == 1, moved(
            "lets set_custom_all_gather replace the comm after the first unshard",
            "fsdp/enable.py (enable after training started, disable() restores FSDP's comm)")


def test_mixed_dtypes_make_the_all_gather_buffer_uint8(flat):
    for r in flat:
        allocs, calls, slots = r["mixed"]
        assert allocs == calls == ["torch.uint8"] and all(slots), moved(
            f"gathers a group of mixed dtypes as raw uint8 bytes (got {allocs}, {calls})",
            "fsdp/all_gather.py _fallback_reason (plain gather for non-float buffers)")


def test_coalesced_all_gathers_fill_their_own_outputs(flat):
    want = [[[10.0 * q + r] * 2 for r in range(2)] for q in range(3)]
    for r in flat:
        assert r["coalesced"] == want, (
            f"torch {torch.__version__}'s _coalescing_manager no longer issues all-gathers into "
            "their own outputs: fsdp_qcomm/collectives/_c10d.py coalesced relies on it "
            "(NodeShardedQwd's gather inside the node)")


def test_gloo_groups_are_known_not_to_coalesce_cuda_all_gathers(flat):
    for r in flat:
        assert r["coalesces"] == {"cpu": True, "cuda": False}, (
            f"torch {torch.__version__} no longer names a gloo group's CUDA backend 'gloo' "
            "through ProcessGroup._get_backend(device).name(): fsdp_qcomm/collectives/_c10d.py "
            "coalesces reads it to keep gloo's coalesced all-gather, which has no CUDA path, "
            "away from CUDA tensors")


def test_sharded_params_stay_in_the_original_dtype(flat):
    for r in flat:
        mp = r["mp"]
        assert set(mp["allocs"]) == {"torch.bfloat16"} and mp["rs"] == ["torch.bfloat16"], moved(
            f"gathers in param_dtype and reduces in reduce_dtype (got {mp})", "fsdp/all_gather.py")
        assert set(mp["params"]) == {"torch.float32"} and set(r["sharded_dtypes"]) == \
            {"torch.float32"}, moved(
            f"keeps sharded parameters in their original dtype (got {mp['params']})",
            "fsdp/internals.py orig_dtype")
        assert mp["grads"] == mp["sharded_grad_dtypes"], moved(
            f"casts reduced gradients to internals.sharded_grad_dtype (got {mp})",
            "fsdp/internals.py sharded_grad_dtype and fsdp/grad_overlap.py")
        assert r["mp_param_dtype_before_init"] == "torch.bfloat16", moved(
            "exposes the mixed-precision param_dtype on each FSDPParam before lazy init",
            "fsdp/internals.py param_dtype (checkpoint templates)")


# ---- HSDP, 2 replicas x 2 shards on 4 ranks ---------------------------------------------------
def _hsdp_run(rank: int, world: int) -> dict:
    res: dict = {}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    grid = mesh.mesh
    shard_index = int((grid == rank).nonzero()[0, 1])
    torch.manual_seed(0)
    model = Net()
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    modules = [m for m in model.modules()
               if isinstance(m, FSDPModule) and internals.param_groups(m)]
    block = model.blocks[0]
    g = _group(block)
    res["mesh_info"] = (isinstance(g.mesh_info, FSDPMeshInfo),
                        isinstance(g.mesh_info, DDPMeshInfo), internals.is_hsdp(g))
    real = internals.replicate_group(g)
    res["replica_size"] = real.size()

    # the sequence number counts every collective of this process on a group
    solo = dist.new_group([rank], use_local_synchronization=True)
    s = internals.sequence_number(solo)
    dist.all_reduce(torch.ones(3), group=solo)
    dist.all_reduce(torch.ones(3), group=solo)
    res["seq_per_collective"] = internals.sequence_number(solo) - s

    rs = RecordingReduceScatter(g, replicate=real)
    block.set_custom_reduce_scatter(rs)
    hook_log: list[dict] = []
    mode = {"double": False}

    def hook(t: torch.Tensor) -> None:
        hook_log.append({"seq": internals.sequence_number(real), "ptr": t.data_ptr(),
                         "rs_ptr": rs.output_ptr, "digest": digest(t)})
        if mode["double"]:
            t.mul_(2.0)

    block.set_all_reduce_hook(hook)

    def backward(micro: int = 0) -> dict:
        rs.calls.clear()
        hook_log.clear()
        before = (internals.sequence_number(real), internals.sequence_number(solo))
        _loss(model, rank, micro).backward()
        return {"real": internals.sequence_number(real) - before[0],
                "solo": internals.sequence_number(solo) - before[1],
                "hooks": list(hook_log), "rs": list(rs.calls)}

    # native HSDP: one all-reduce per module on the replica group; the hook runs right after
    # the block's all-reduce, on the reduce-scatter output it reduced
    native = backward()
    res["native"] = {k: v for k, v in native.items() if k != "hooks"}
    res["modules"] = len(modules)
    h = native["hooks"]
    res["hook_after_all_reduce"] = [x["seq"] - c["replica_seq"]
                                    for x, c in zip(h, native["rs"])]
    res["hook_on_output"] = [x["ptr"] == x["rs_ptr"] for x in h]
    every = [None] * world
    dist.all_gather_object(every, (shard_index, [x["digest"] for x in h]))
    res["hook_input_same_on_replicas"] = all(d == every[rank][1]
                                             for s_, d in every if s_ == shard_index)
    grads = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}

    # what the hook writes into the output is what FSDP makes the gradients from
    _zero(model)
    mode["double"] = True
    backward()
    mode["double"] = False
    doubled = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
    res["hook_writes_reach_grads"] = all(
        torch.allclose(doubled[n], grads[n] * (2.0 if n.startswith("blocks.0.") else 1.0),
                       rtol=1e-6, atol=1e-7) for n in grads)

    # swap the block's replica group: FSDP all-reduces over the new one from the next backward
    _zero(model)
    old = internals.swap_replicate_group(g, solo)
    swapped = backward()
    internals.swap_replicate_group(g, old)
    res["swapped"] = {"real": swapped["real"], "solo": swapped["solo"]}
    res["swapped_hook_after_all_reduce"] = [x["seq"] - c["replica_seq"]
                                            for x, c in zip(swapped["hooks"], swapped["rs"])]

    # set_requires_all_reduce(False): partial sums kept, all-reduced at the last micro-batch
    _zero(model)
    backward(0)
    backward(1)
    reference = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
    _zero(model)
    model.set_requires_all_reduce(False)
    first = backward(0)
    res["partial_kept"] = internals.partial_reduce_output(g) is not None
    model.set_requires_all_reduce(True)
    last = backward(1)
    res["accumulate"] = {"first": (first["real"], len(first["hooks"]), len(first["rs"])),
                         "last": (last["real"], len(last["hooks"]), len(last["rs"]))}
    res["partial_cleared"] = internals.partial_reduce_output(g) is None
    res["accumulated_grads"] = all(
        torch.allclose(p.grad.to_local(), reference[n], rtol=1e-5, atol=1e-6)
        for n, p in model.named_parameters())
    dist.destroy_process_group(solo)
    return res


@pytest.fixture(scope="module")
def hsdp() -> list[dict]:
    return run_ranks(_hsdp_run, 4, timeout=400)


def test_sequence_number_counts_each_collective(hsdp):
    for r in hsdp:
        assert r["seq_per_collective"] == 2, moved(
            "advances a process group's sequence number by one per collective (2 all-reduces "
            f"moved it by {r['seq_per_collective']})", "fsdp/hsdp.py SoloGroup.check")


def test_hsdp_mesh_info_is_fsdp_and_ddp_mesh_info(hsdp):
    for r in hsdp:
        assert r["mesh_info"] == (True, True, True) and r["replica_size"] == 2, moved(
            "describes a 2-D mesh with a mesh info that is both FSDPMeshInfo and DDPMeshInfo",
            "fsdp/internals.py is_hsdp and replicate_group")


def test_hsdp_all_reduces_once_per_module_on_the_replicate_group(hsdp):
    for r in hsdp:
        assert r["native"]["real"] == r["modules"] and len(r["native"]["rs"]) == 1, moved(
            f"runs one all-reduce per FSDP module on mesh_info.replicate_process_group "
            f"(got {r['native']['real']} for {r['modules']} modules)", "fsdp/hsdp.py")


def test_hsdp_reads_the_replicate_group_from_mesh_info_at_each_reduce(hsdp):
    for r in hsdp:
        assert r["swapped"] == {"real": r["modules"] - 1, "solo": 1}, moved(
            "reads the replica group from mesh_info at each reduce (after swapping one module's "
            f"group the all-reduces went {r['swapped']})",
            "fsdp/hsdp.py and fsdp/internals.py swap_replicate_group")


def test_hsdp_all_reduce_hook_runs_after_the_all_reduce_on_its_output(hsdp):
    for r in hsdp:
        assert r["hook_after_all_reduce"] == [1], moved(
            "calls the all-reduce hook right after its own all-reduce, one all-reduce per hook "
            f"call (replica collectives between reduce-scatter and hook: "
            f"{r['hook_after_all_reduce']})", "fsdp/hsdp.py SoloGroup.check")
        assert r["swapped_hook_after_all_reduce"] == [0], moved(
            "runs no replica all-reduce on the old group once it is swapped",
            "fsdp/hsdp.py SoloGroup.check")
        assert r["hook_on_output"] == [True], moved(
            "hands the hook the reduce-scatter output it all-reduced in place", "fsdp/hsdp.py")
        assert r["hook_input_same_on_replicas"], moved(
            "hands the hook the all-reduced output (identical on replicas)", "fsdp/hsdp.py")


def test_hsdp_hook_writes_become_the_gradients(hsdp):
    for r in hsdp:
        assert r["hook_writes_reach_grads"], moved(
            "makes the gradients from the output after the all-reduce hook wrote it",
            "fsdp/hsdp.py ReplicaAllReduce (writes the quantized all-reduce in place)")


def test_hsdp_requires_all_reduce_false_accumulates_and_all_reduces_at_the_last(hsdp):
    m = hsdp[0]["modules"]
    for r in hsdp:
        acc = r["accumulate"]
        assert acc == {"first": (0, 0, 1), "last": (m, 1, 1)}, moved(
            "keeps partial reduce-scatter outputs under set_requires_all_reduce(False) (no "
            "all-reduce, no hook) and all-reduces them with the last micro-batch "
            f"(got {acc}; (all-reduces, hook calls, reduce-scatters))",
            "fsdp/hsdp.py and fsdp/grad_overlap.py")
        assert r["partial_kept"] and r["partial_cleared"], moved(
            "keeps the partial output in FSDPParamGroup._partial_reduce_output until the "
            "all-reduce", "fsdp/internals.py partial_reduce_output")
        assert r["accumulated_grads"], "accumulated HSDP gradients differ from plain accumulation"

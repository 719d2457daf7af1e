"""MoE blocks with expert parameters on a mesh of their own (``shard_placement_fn`` returning
``ShardPlacementResult``, as torchtitan 0.3's ``parallelize`` does with expert parallelism): one
``fully_shard`` module holds two parameter groups, and ``enable`` installs quantized collectives
on each, planned on its own mesh.

4 gloo ranks as 2 nodes x 2. Expert parallelism 2: ranks (0, 1) and (2, 3) are expert-parallel
groups inside a node, so expert ``e`` lives on ranks {e, e + 2}, and its FSDP group (the
expert-data-parallel mesh) crosses the nodes; the dense parameters shard over all 4 ranks. Token
dispatch is out of scope: each rank runs its own experts on its own tokens. A second layout keeps
the experts on a 2-D HSDP mesh (replicate across nodes, shard inside) next to flat dense ones.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import ReduceOp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo

try:  # per-parameter meshes: torch >= 2.13
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
except ImportError:
    pytest.skip("per-parameter meshes (ShardPlacementResult) need torch >= 2.13",
                allow_module_level=True)
from torch.distributed.tensor import Shard

import fsdp_qcomm
from fsdp_qcomm import QCommConfig
from fsdp_qcomm.collectives import _c10d
from fsdp_qcomm.fsdp import internals
from fsdp_qcomm.testing import digest, run_ranks

D, H, E, V = 24, 40, 2, 29  # model dim, expert hidden, experts per rank, vocabulary
PRESETS = ("baseline", "sdp4bit", "lowbit", "qsdp", "zeropp", "bf16")


class MoEBlock(nn.Module):
    """Attention-free block: a dense projection, then this rank's experts (mean of their
    outputs, gated by a dense router's softmax)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.proj = nn.Linear(D, D)
        self.router = nn.Linear(D, E, bias=False)
        self.w_in = nn.Parameter(torch.randn(E, D, H) / D ** 0.5)
        self.w_out = nn.Parameter(torch.randn(E, H, D) / H ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.norm(x))
        gate = F.softmax(self.router(h), dim=-1)  # [B, T, E]
        experts = torch.einsum("btd,edh->bteh", h, self.w_in).relu()
        out = torch.einsum("bteh,ehd->bted", experts, self.w_out)
        return x + (gate.unsqueeze(-1) * out).sum(2)


class MoELM(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(MoEBlock() for _ in range(layers))
        self.head = nn.Linear(D, V)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


EXPERT_PARAMS = ("w_in", "w_out")


def _build(rank: int, layout: str) -> MoELM:
    """Dense weights identical on all ranks, expert weights identical within an expert group
    (seeded by the expert-parallel index), then FSDP2 with the experts on their own mesh."""
    torch.manual_seed(0)
    model = MoELM()
    ep = rank % 2
    with torch.no_grad():
        g = torch.Generator().manual_seed(100 + (ep if layout == "ep" else 0))
        for blk in model.blocks:
            for n in EXPERT_PARAMS:
                p = getattr(blk, n)
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("outer", "inner"))
    if layout == "ep":  # experts sharded over the expert-data-parallel ranks {e, e + 2}
        info = FSDPMeshInfo(mesh=mesh["outer"], shard_mesh_dim=0)
    else:  # "hsdp": experts replicated across nodes, sharded inside
        info = HSDPMeshInfo(mesh=mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
    expert_ids = {id(getattr(b, n)) for b in model.blocks for n in EXPERT_PARAMS}

    def place(p: nn.Parameter):
        return ShardPlacementResult(Shard(0), info) if id(p) in expert_ids else None

    for blk in model.blocks:
        fully_shard(blk, shard_placement_fn=place)
    fully_shard(model)
    return model


def _batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, V, (4, 13), generator=g)


def _train(rank: int, layout: str, preset, steps: int) -> dict:
    model = _build(rank, layout)
    handle = None
    if preset is not None:
        handle = fsdp_qcomm.enable(model, QCommConfig.preset(preset, ranks_per_node=2, seed=3))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, weights = [], {}
    captured: dict[str, torch.Tensor] = {}

    def capture(mod, args):  # after FSDP's own pre-forward: the unsharded weights
        for n, p in mod.named_parameters():
            captured[f"{id(mod)}.{n}"] = p.detach().clone()

    hooks = [b.register_forward_pre_hook(capture) for b in model.blocks]
    for step in range(steps):
        tokens = _batch(step, rank)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, V), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    for h in hooks:
        h.remove()
    names = {id(b): f"blocks.{k}" for k, b in enumerate(model.blocks)}
    for key, t in captured.items():
        mod_id, n = key.split(".", 1)
        weights[f"{names[int(mod_id)]}.{n}"] = digest(t)
    with torch.no_grad():  # a fixed batch, before and after: the loss the run reached
        tokens = _batch(10_000, rank)
        held = F.cross_entropy(model(tokens[:, :-1]).reshape(-1, V), tokens[:, 1:].reshape(-1))
    out = {"losses": losses, "weights": weights, "held_out": held.item()}
    if handle is not None:
        st = handle.stats()
        out["notes"] = st["notes"]
        out["kinds"] = {k: v for k, v in st.items() if k not in ("notes", "summary")}
        out["labels"] = [i.label for i in handle._installs]
        handle.disable()
    return out


def _moe(rank: int, world: int) -> dict:
    res = {"fsdp": _train(rank, "ep", None, 4), "fsdp_init": _train(rank, "ep", None, 0)[
        "held_out"]}
    for preset in PRESETS:
        res[preset] = _train(rank, "ep", preset, 4)
    res["hsdp_fsdp"] = _train(rank, "hsdp", None, 3)
    res["hsdp_sdp4bit"] = _train(rank, "hsdp", "sdp4bit", 3)
    res["ranks"] = {"ep": rank % 2}
    return res


@pytest.fixture(scope="module")
def moe() -> list[dict]:
    return run_ranks(_moe, 4, timeout=900)


def test_every_preset_installs_on_both_groups_and_trains(moe):
    for preset in PRESETS:
        r = moe[0][preset]
        groups = [lab for lab in r["labels"] if "[group" in lab]
        assert len(groups) == 4, r["labels"]  # 2 blocks x 2 groups
        assert any("on 2 ranks" in g for g in groups) and any("on 4 ranks" in g for g in groups)
        assert r["held_out"] < moe[0]["fsdp_init"], (preset, r["held_out"])


def test_expert_and_dense_traffic_both_quantized_across_nodes(moe):
    text = " | ".join(moe[0]["sdp4bit"]["notes"])
    # experts: 2 nodes of 1 rank (the expert-data-parallel group), dense: 2 nodes of 2
    assert "weight all-gather: qwd 4-bit, full reference (one rank per node): 2 nodes of 1" in text
    assert "weight all-gather: qwd 4-bit, node-sharded reference" in text, text
    assert "2 nodes of 2 rank(s)" in text and "2 nodes of 1 rank(s)" in text, text


def test_expert_traffic_is_counted_apart_from_the_dense_traffic(moe):
    kinds = moe[0]["sdp4bit"]["kinds"]
    # the groups on another mesh than the model's own: kinds tagged with that mesh's dims
    for kind in ("weight_allgather", "weight_allgather:outer", "grad_inter:outer"):
        assert kinds.get(kind, {}).get("sent_bytes", 0) > 0, (kind, sorted(kinds))
    assert "grad_intra" in kinds and "grad_intra:outer" not in kinds  # 1 rank per node there


def test_baseline_preset_is_bit_identical_to_fsdp2(moe):
    for r in moe:
        assert r["baseline"]["losses"] == r["fsdp"]["losses"]
        assert r["baseline"]["weights"] == r["fsdp"]["weights"]


def test_gathered_weights_are_bit_identical_on_the_ranks_of_each_group(moe):
    for preset in ("sdp4bit", "lowbit", "qsdp"):
        w = [r[preset]["weights"] for r in moe]
        dense = [k for k in w[0] if not k.endswith(EXPERT_PARAMS)]
        experts = [k for k in w[0] if k.endswith(EXPERT_PARAMS)]
        assert dense and experts
        for k in dense:  # one group of 4 ranks
            assert len({x[k] for x in w}) == 1, (preset, k)
        for k in experts:  # expert e on ranks {e, e + 2}; the two expert groups differ
            assert w[0][k] == w[2][k] and w[1][k] == w[3][k], (preset, k)
            assert w[0][k] != w[1][k], (preset, k)


def test_quantized_loss_stays_near_fsdp2(moe):
    base = moe[0]["fsdp"]["losses"][-1]
    for preset in ("sdp4bit", "bf16", "qsdp"):
        got = moe[0][preset]["losses"][-1]
        assert abs(got - base) < 0.03 * base, (preset, got, base)


def test_experts_on_a_2d_hsdp_mesh_beside_flat_dense_parameters(moe):
    r = moe[0]["hsdp_sdp4bit"]
    text = " | ".join(r["notes"])
    assert "HSDP all-reduce across replicas: quantized 4-bit" in text, text
    assert "grad_replica:outer,inner" in r["kinds"]  # the experts' mesh, counted apart
    base = moe[0]["hsdp_fsdp"]["losses"][-1]
    assert abs(r["losses"][-1] - base) < 0.03 * base
    w = [x["hsdp_sdp4bit"]["weights"] for x in moe]
    for k in w[0]:
        assert len({x[k] for x in w}) == 1, k  # experts replicated: identical everywhere


def _resume(rank: int, world: int, path: str, layout: str) -> dict:
    """Train 4 steps; or 2, save (model, optimizer, handle), rebuild, load, 2 more: equal.

    ``"hsdp"``: through torch.distributed.checkpoint. ``"ep"``: each rank saves its own model
    and optimizer shards and handle state (``torch.save``): this test model's experts are plain
    parameters that differ between the expert groups under one name (real expert parallelism
    makes them a DTensor sharded over the experts, which DCP keeps apart), so DCP, which keeps
    one copy per name and shard, would merge the two groups' experts."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def run(steps, start=0, load=False, save=False):
        model = _build(rank, layout)
        handle = fsdp_qcomm.enable(model, QCommConfig.preset("sdp4bit", ranks_per_node=2,
                                                             seed=3))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        if load and layout == "hsdp":
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd, "qcomm": handle}
            dcp.load(state, checkpoint_id=path)
            set_state_dict(model, opt, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
        elif load:
            state = torch.load(f"{path}.rank{rank}", weights_only=False)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optim"])
            handle.load_state_dict(state["qcomm"])
        losses = []
        for step in range(start, start + steps):
            tokens = _batch(step, rank)
            loss = F.cross_entropy(model(tokens[:, :-1]).reshape(-1, V),
                                   tokens[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        if save and layout == "hsdp":
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd, "qcomm": handle}, checkpoint_id=path)
        elif save:
            torch.save({"model": model.state_dict(), "optim": opt.state_dict(),
                        "qcomm": handle.state_dict()}, f"{path}.rank{rank}")
        params = {n: digest(p.to_local()) for n, p in model.named_parameters()}
        keys = sorted(handle.state_dict()[f"rank{rank}_of_{world}"]["modules"])
        handle.disable()
        return losses, params, keys

    whole = run(4)
    first = run(2, save=True)
    dist.barrier()
    second = run(2, start=2, load=True)
    return {"whole": whole, "resumed": (first[0] + second[0], *second[1:])}


@pytest.mark.parametrize("layout", ["ep", "hsdp"])
def test_resume_is_bit_identical(tmp_path, layout):
    for r in run_ranks(_resume, 4, str(tmp_path / "ckpt"), layout, timeout=600):
        whole, resumed = r["whole"], r["resumed"]
        assert whole[0] == resumed[0]  # every loss, the 2 steps after the load included
        assert whole[1] == resumed[1]  # every rank's shards, experts included
        assert sum("[group" in k for k in whole[2]) == 4, whole[2]


def test_fsdp2_calls_each_groups_own_comms_and_disable_restores_them():
    """The canary of ``internals.set_comms``: FSDP2 gathers and reduces each parameter group of
    a multi-group module through the comm objects on that group (so one per group is what
    runs), its public setter still refuses such a module (why the package goes per group), and
    ``disable`` puts FSDP2's own comms back."""
    for r in run_ranks(_setter_check, 4, timeout=300):
        assert r["groups"] == 2 and r["public_refuses"], r
        assert r["gathers"] == [2, 2] and r["reduces"] == [1, 1], r  # forward + backward
        assert r["restored"], r


def _setter_check(rank: int, world: int) -> dict:
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    model = _build(rank, "ep")
    blk = model.blocks[0]
    groups = internals.param_groups(blk)
    out = {"groups": len(groups)}
    try:
        blk.set_custom_all_gather(object())
        out["public_refuses"] = False
    except ValueError as e:
        out["public_refuses"] = "multiple param groups" in str(e)
    calls = {"gather": [0] * len(groups), "reduce": [0] * len(groups)}

    class Gather(AllGather):
        def __init__(self, k):
            super().__init__()
            self.k = k

        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            calls["gather"][self.k] += 1
            return _c10d.all_gather_single(output_tensor, input_tensor, group=group,
                                          async_op=async_op)

    class Reduce(ReduceScatter):
        def __init__(self, k):
            super().__init__()
            self.k = k

        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            calls["reduce"][self.k] += 1
            _c10d.reduce_scatter_single(output_tensor, input_tensor, op=ReduceOp.SUM,
                                       group=group)
            output_tensor.div_(group.size())

    before = [internals.installed_comms(g) for g in groups]
    for k, g in enumerate(groups):
        internals.set_comms(g, Gather(k), Reduce(k))
    blk.set_reshard_after_forward(True)
    tokens = _batch(0, rank)
    F.cross_entropy(model(tokens[:, :-1]).reshape(-1, V), tokens[:, 1:].reshape(-1)).backward()
    out["gathers"], out["reduces"] = calls["gather"], calls["reduce"]
    for g, (ag, rs) in zip(groups, before):
        internals.set_comms(g, ag, rs)
    handle = fsdp_qcomm.enable(model, QCommConfig.preset("sdp4bit", ranks_per_node=2))
    ours = [type(c).__module__.startswith("fsdp_qcomm") for g in groups
            for c in internals.installed_comms(g)]
    handle.disable()
    after = [internals.installed_comms(g) for g in groups]
    out["restored"] = all(ours) and before == after
    return out

"""FSDP x context parallelism on 4 CPU ranks (2 data-parallel x 2 context-parallel), as
torchtitan stacks them: FSDP shards over the flattened ``dp x cp`` mesh, and torch's
``_ContextParallel`` (its FLEX route: the keys and values all-gathered over ``cp`` in forward,
their gradients reduce-scattered in backward, ``flex_cp_allgather``) wraps each attention core.

The core computes causal attention in plain ops, because FlexAttention has no backward on CPU
and ring SDPA dispatches CUDA kernels only; torchtitan 0.3's CPU fallback makes the same swap
(``titan03.attention``). Checked: FSDP2 + CP trains as FSDP2 without CP on the same batches
(so CP really splits the sequence), and ``enable`` on the flattened group trains within 2% of
it, every forward gather compared across the ranks (``consistency_check_every=1``), its
gradient reductions quantized across the two nodes."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _models import train_step

from fsdp_qcomm.testing import run_ranks

VOCAB, DIM, HEADS, LAYERS, SEQ, STEPS = 64, 32, 4, 2, 16, 6


class CausalCore(nn.Module):
    """Causal attention over ``(q, k, v)``; under CP the queries are this rank's sequence chunk,
    starting at ``q_offset``, and the keys the whole sequence (all-gathered by CP's hook)."""

    q_offset = 0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        s = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
        qi = torch.arange(q.shape[-2]).unsqueeze(1) + self.q_offset
        s = s.masked_fill(qi < torch.arange(k.shape[-2]).unsqueeze(0), float("-inf"))
        return s.softmax(-1) @ v


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wqkv, self.wo = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.core = CausalCore()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.wqkv(x).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        return self.wo(self.core(q, k, v).transpose(1, 2).reshape(b, t, DIM))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = Attention()
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.n1(x))
        return x + self.mlp(self.n2(x))


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.out = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x)
        return self.out(self.norm(x))


def _train(rank: int, world: int, cp: int, preset, replicate: int = 1) -> dict:
    """``world`` ranks as ``replicate x dp x cp``: FSDP (HSDP with ``replicate`` > 1) over the
    flattened ``dp x cp`` ranks, CP over ``cp``; 2 ranks per node (``enable``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _context_parallel_shard,
        _ContextParallel,
    )
    from torch.distributed.tensor.parallel import parallelize_module

    import fsdp_qcomm

    dp = world // cp // replicate
    mesh = init_device_mesh("cpu", (replicate, dp, cp), mesh_dim_names=("rep", "dp", "cp"))
    shard = mesh["dp", "cp"]._flatten("dp_cp")
    fsdp_mesh = mesh["rep", "dp_cp"] if replicate > 1 else shard
    torch.manual_seed(0)
    model = LM()
    if cp > 1:
        style = _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX)
        for layer in model.layers:
            layer.attn.core.q_offset = mesh["cp"].get_local_rank() * (SEQ // cp)
            parallelize_module(layer.attn.core, mesh["cp"], style)
    for layer in model.layers:
        fully_shard(layer, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)
    handle = None
    if preset is not None:
        handle = fsdp_qcomm.enable(model, fsdp_qcomm.QCommConfig.preset(
            preset, ranks_per_node=2, consistency_check_every=1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data_rank = mesh["rep"].get_local_rank() * dp + mesh["dp"].get_local_rank()
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 * step + data_rank)
        idx = torch.randint(0, VOCAB, (4, SEQ + 1), generator=g)
        x, y = idx[:, :-1], idx[:, 1:]
        if cp > 1:  # this rank's sequence chunk (no load balancing: chunk cp_rank)
            x, y = _context_parallel_shard(mesh["cp"], [x, y], [1, 1])
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        losses.append(train_step(loss, opt))
    out = {"losses": losses, "group": fsdp_mesh.size(fsdp_mesh.ndim - 1)}
    if handle is not None:
        stats = handle.stats()
        out["kinds"] = sorted(k for k, v in stats.items() if isinstance(v, dict) and "calls" in v)
        handle.disable()
    return out


def test_context_parallel_composes():
    """FSDP2 + CP on 2 x 2 ranks is FSDP2 on 2 ranks over the whole sequences (to float
    rounding); sdp4bit over the flattened dp x cp group stays within 2% of FSDP2 + CP, with
    every forward gather consistent across ranks and its reductions quantized across nodes."""
    plain = run_ranks(_train, 2, 1, None, timeout=300)[0]
    cp = run_ranks(_train, 4, 2, None, timeout=300)
    assert cp[0]["group"] == 4
    assert cp[0]["losses"] == pytest.approx(plain["losses"], rel=1e-5, abs=1e-5)
    q = run_ranks(_train, 4, 2, "sdp4bit", timeout=300)
    assert all(r["losses"] == q[0]["losses"] for r in q)
    assert {"grad_inter", "weight_allgather"} <= set(q[0]["kinds"]), q[0]["kinds"]
    gap = (sum(q[0]["losses"][-3:]) - sum(cp[0]["losses"][-3:])) / sum(cp[0]["losses"][-3:])
    assert abs(gap) < 0.02, gap


@pytest.mark.long
@pytest.mark.parametrize("preset", ["qsdp", "lowbit"])
def test_context_parallel_under_hsdp(preset):
    """HSDP over 2 replicas x the flattened dp x cp (1 x 2) group, torchtitan's
    ``dp_replicate x dp_shard_cp``: the replica all-reduce quantized beside CP."""
    cp = run_ranks(_train, 4, 2, None, 2, timeout=300)
    q = run_ranks(_train, 4, 2, preset, 2, timeout=300)
    assert all(r["losses"] == q[0]["losses"] for r in q)
    assert "grad_replica" in q[0]["kinds"], q[0]["kinds"]
    gap = (sum(q[0]["losses"][-3:]) - sum(cp[0]["losses"][-3:])) / sum(cp[0]["losses"][-3:])
    assert abs(gap) < 0.03, (preset, gap)

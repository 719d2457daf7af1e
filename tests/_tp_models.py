"""A small Llama-like model with torchtitan's tensor-parallel plans, for FSDP x TP tests (torch
only, so rank processes load nothing of ours before they need it)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, HEADS, LAYERS, SEQ = 64, 32, 4, 2, 16


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head_dim = DIM // HEADS
        self.wq, self.wk, self.wv = (nn.Linear(DIM, DIM) for _ in range(3))
        self.wo = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))  # local heads under TP
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(a.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attention, self.feed_forward = Attention(), FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class TinyLlama(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.output = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def parallelize_tp(model: TinyLlama, tp_mesh, sequence_parallel: bool) -> None:
    """torchtitan's plan: attention and MLP Colwise/Rowwise; with ``sequence_parallel`` also
    the norms (SequenceParallel), the embedding (Rowwise) and the output (Colwise). Without it
    the norms, the embedding and the head are replicated."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    if sequence_parallel:
        parallelize_module(model, tp_mesh, {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(),
                                              output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        })
    for layer in model.layers:
        plan = {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "feed_forward.w1": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1) if sequence_parallel
                                            else Replicate()),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1) if sequence_parallel
                                               else Replicate()),
        }
        if sequence_parallel:
            plan.update({
                "attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1),),
                                                desired_input_layouts=(Replicate(),)),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                   desired_input_layouts=(Replicate(),)),
            })
        parallelize_module(layer, tp_mesh, plan)


def batch(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    idx = torch.randint(0, VOCAB, (4, SEQ + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def tp_drift(model: nn.Module, tp_group) -> tuple[float, int]:
    """The largest difference between TP peers' copies of the parameters TP leaves whole (not
    on the "tp" mesh dimension, or ``Replicate`` there), and how many such parameters there
    are."""
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate

    worst, shared = 0.0, 0
    for _, p in model.named_parameters():
        names = p.device_mesh.mesh_dim_names or ()
        if "tp" in names and not isinstance(p.placements[names.index("tp")], Replicate):
            continue
        shared += 1
        mine = p.to_local().detach().clone()
        peers = [torch.empty_like(mine) for _ in range(dist.get_world_size(tp_group))]
        dist.all_gather(peers, mine, group=tp_group)
        worst = max(worst, max((q - mine).abs().max().item() for q in peers))
    return worst, shared

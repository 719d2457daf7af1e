"""What the benchmarks share: a small GPT, its FSDP2 wrapping, and two datasets: characters of
a text file (``CharData``) and the main job's BPE corpus (``BPEData``).

The model is deliberately plain (learned positions, pre-norm blocks, GELU MLP, an output
layer untied unless ``GPTShape.tied``) so that a benchmark measures the collectives, not the
model code. Every rank builds it
from the same seed before ``fully_shard``, so all schemes start from identical weights.

``GPTShape.experts > 0`` makes each block's MLP a mixture of experts (``_MoE``): a router over
the rank's own experts, stacked as ``[E, d, h]`` parameters so ``Shard(0)`` splits them. With
``expert_parallel`` P > 1 the ranks of one node form groups of P, the rank in position e of its
group holds expert set e (seeded by (seed, e)), and ``build_fsdp_gpt`` shards the expert
parameters over the ranks of their set (the expert-data-parallel mesh ``EXPERT_DIM``), the dense
ones over all ranks: FSDP2 parameter groups on two meshes, as torchtitan's expert parallelism
makes them (``docs/moe.md``). Token dispatch between ranks is left out: each rank routes its own
tokens to its own experts, so the model measures the parameter collectives, not an all-to-all.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"
#: experts each token is routed to, among its rank's local experts (fewer if a rank has fewer)
ROUTE_TOP_K = 2
#: the name of the expert-data-parallel mesh dimension; ``enable`` counts the expert groups'
#: bytes under it (``weight_allgather:edp``, ``stats.TaggedStats``)
EXPERT_DIM = "edp"


@dataclass(frozen=True)
class GPTShape:
    vocab: int
    dim: int
    layers: int
    heads: int
    seq: int
    tied: bool = False  # the output layer's weight is the token embedding
    experts: int = 0  # experts per rank in each block's MLP (0: the dense 4d GELU MLP)
    expert_parallel: int = 1  # expert sets across the ranks of a node (see build_fsdp_gpt)

    @property
    def expert_hidden(self) -> int:
        """Hidden width of one expert: the dense MLP's 4d split over a rank's experts, so a
        rank's experts hold as many weights as the dense MLP."""
        if self.experts <= 0 or (4 * self.dim) % self.experts:
            raise ValueError(f"experts={self.experts} must be positive and divide 4 * dim = "
                             f"{4 * self.dim}")
        return 4 * self.dim // self.experts

    def expert_params(self) -> int:
        """Expert parameters of one rank (one expert set), over all blocks; 0 when dense."""
        if not self.experts:
            return 0
        d, h = self.dim, self.expert_hidden
        return self.layers * self.experts * (2 * d * h + h + d)

    def params(self) -> int:
        """Parameters of the model one rank builds and computes with (its own expert set)."""
        d = self.dim
        attention = 4 * d * d + 4 * d + 4 * d  # qkv + proj (weights and biases) + 2 LayerNorms
        mlp = 8 * d * d + 5 * d if not self.experts else d * self.experts  # 4d MLP, or router
        embeddings = self.vocab * d * (1 if self.tied else 2)
        return (embeddings + self.seq * d + self.layers * (attention + mlp) + 2 * d + self.vocab
                + self.expert_params())

    def params_all_experts(self) -> int:
        """Distinct parameters over every rank: the dense ones once, each expert set once."""
        return self.params() + (self.expert_parallel - 1) * self.expert_params()


class _Experts(nn.Module):
    """``n`` 2-layer GELU MLPs as stacked parameters (first dimension: the expert), so FSDP2's
    ``Shard(0)`` splits whole experts across ranks."""

    def __init__(self, n: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.empty(n, dim, hidden))
        self.in_bias = nn.Parameter(torch.zeros(n, hidden))
        self.w_out = nn.Parameter(torch.empty(n, hidden, dim))
        self.out_bias = nn.Parameter(torch.zeros(n, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [N, d] -> every expert's output [N, E, d]."""
        h = F.gelu(torch.einsum("nd,edh->neh", x, self.w_in) + self.in_bias)
        return torch.einsum("neh,ehd->ned", h, self.w_out) + self.out_bias


class _MoE(nn.Module):
    """Top-k routing over this rank's experts: softmax of a linear router, the k largest gates
    renormalized to sum to 1, the others 0 (deterministic: ``topk`` on CPU). Every
    expert runs on every token (a tiny model on CPU: simpler than gathering tokens per expert,
    the same result); only the routed ones count in the output and get gradients."""

    def __init__(self, dim: int, experts: int) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = _Experts(experts, dim, 4 * dim // experts)
        self.top_k = min(ROUTE_TOP_K, experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(0, -2)
        probs = F.softmax(self.router(flat), dim=-1)
        top, idx = probs.topk(self.top_k, dim=-1)
        gate = torch.zeros_like(probs).scatter(-1, idx, top / top.sum(-1, keepdim=True))
        return (gate.unsqueeze(-1) * self.experts(flat)).sum(1).view_as(x)


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, experts: int = 0) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        # the dense MLP's modules only when dense: its parameters, their order and the RNG draws
        # of its initialization stay those of the runs stored before experts existed
        self.moe = _MoE(dim, experts) if experts else None
        if not experts:
            self.fc = nn.Linear(dim, 4 * dim)
            self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        if self.moe is not None:
            return x + self.moe(self.ln2(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """``expert_seed``: the seed of this rank's expert set (``expert_seed(seed, index)``); None
    draws the experts from the global RNG, after every other parameter."""

    def __init__(self, shape: GPTShape, expert_seed: Optional[int] = None) -> None:
        super().__init__()
        if shape.dim % shape.heads:
            raise ValueError(f"dim={shape.dim} must be a multiple of heads={shape.heads}")
        if shape.experts:
            shape.expert_hidden  # noqa: B018 -- raises on a width the experts cannot split
        self.shape = shape
        self.tok = nn.Embedding(shape.vocab, shape.dim)
        self.pos = nn.Embedding(shape.seq, shape.dim)
        self.blocks = nn.ModuleList(_Block(shape.dim, shape.heads, shape.experts)
                                    for _ in range(shape.layers))
        self.ln_f = nn.LayerNorm(shape.dim)
        self.head = nn.Linear(shape.dim, shape.vocab)
        if shape.tied:
            self.head.weight = self.tok.weight
        std = 0.02
        for name, p in self.named_parameters():
            if ".experts." in name:
                continue  # _init_experts
            if p.dim() == 2:
                # GPT-2 init: residual projections scaled down with depth.
                s = std / math.sqrt(2 * shape.layers) if name.endswith(("proj.weight",
                                                                       "out.weight")) else std
                nn.init.normal_(p, 0.0, s)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        if shape.experts:
            self._init_experts(std, None if expert_seed is None
                               else torch.Generator().manual_seed(expert_seed))

    def _init_experts(self, std: float, g: Optional[torch.Generator]) -> None:
        """GPT-2's init for the experts: inputs at ``std``, outputs (residual projections)
        scaled down with depth, biases 0."""
        with torch.no_grad():
            for blk in self.blocks:
                e = blk.moe.experts
                e.w_in.copy_(torch.randn(e.w_in.shape, generator=g) * std)
                e.w_out.copy_(torch.randn(e.w_out.shape, generator=g)
                              * (std / math.sqrt(2 * self.shape.layers)))
                e.in_bias.zero_()
                e.out_bias.zero_()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def expert_seed(seed: int, index: int) -> int:
    """The seed of expert set ``index`` in a run of ``seed``."""
    return seed * 1_000_003 + 7_919 * (index + 1)


def check_expert_layout(world: int, ranks_per_node: int, expert_parallel: int) -> None:
    """Expert sets must stay inside a node (groups of ``expert_parallel`` consecutive ranks, as
    torchtitan places expert parallelism), on nodes of equal size."""
    if expert_parallel < 1 or ranks_per_node < 1 or world % ranks_per_node \
            or ranks_per_node % expert_parallel:
        raise ValueError(
            f"expert parallelism {expert_parallel} on {world} ranks with {ranks_per_node} per "
            "node: the ranks per node must divide the world size and the expert parallelism "
            "must divide the ranks per node (an expert-parallel group inside one node)")


def expert_groups(world: int, ranks_per_node: int, expert_parallel: int) -> list[list[int]]:
    """The ranks holding each expert set: set e on the ranks in position e of their group of
    ``expert_parallel``, ``[e, e + P, e + 2P, ...]``: the expert-data-parallel groups, across
    every node."""
    check_expert_layout(world, ranks_per_node, expert_parallel)
    return [list(range(e, world, expert_parallel)) for e in range(expert_parallel)]


def expert_mesh(ranks_per_node: int, expert_parallel: int):
    """The ``(EXPERT_DIM, "ep")`` mesh: rank r at ``[r // P, r % P]``, so ``mesh[EXPERT_DIM]``
    of rank r holds the ranks of its expert set (``expert_groups``). Collective: every rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    check_expert_layout(world, ranks_per_node, expert_parallel)
    return init_device_mesh("cpu", (world // expert_parallel, expert_parallel),
                            mesh_dim_names=(EXPERT_DIM, "ep"))


def _expert_placement(model: GPT, mesh):
    """``shard_placement_fn``: the expert parameters sharded (whole experts, ``Shard(0)``) over
    their expert-data-parallel mesh, everything else FSDP's default."""
    from torch.distributed.fsdp._fully_shard import _fsdp_common
    from torch.distributed.tensor import Shard

    if not hasattr(_fsdp_common, "ShardPlacementResult"):
        raise RuntimeError(
            f"expert parallelism needs per-parameter meshes (ShardPlacementResult), which FSDP2 "
            f"has from torch 2.13; this is torch {torch.__version__}: upgrade torch, or run the "
            "MoE workload with expert parallelism 1")
    FSDPMeshInfo, ShardPlacementResult = (_fsdp_common.FSDPMeshInfo,
                                          _fsdp_common.ShardPlacementResult)

    info = FSDPMeshInfo(mesh=mesh[EXPERT_DIM], shard_mesh_dim=0)
    ids = {id(p) for blk in model.blocks for p in blk.moe.experts.parameters()}

    def place(p: nn.Parameter):
        return ShardPlacementResult(Shard(0), info) if id(p) in ids else None

    return place


def build_fsdp_gpt(shape: GPTShape, seed: int, mesh=None,
                   ranks_per_node: Optional[int] = None) -> GPT:
    """The same initial weights on every rank, then FSDP2 per block and at the root (on
    ``mesh``: None for the default 1-D mesh, a 2-D ``(replicate, shard)`` mesh for HSDP).

    With ``shape.experts``, the rank's expert set is seeded by ``expert_seed(seed, index)``; with
    ``shape.expert_parallel`` P > 1 (``ranks_per_node`` needed), index = rank % P and the expert
    parameters are sharded over ``expert_mesh``'s ``EXPERT_DIM`` (the ranks of the same set),
    the dense ones over every rank: two parameter groups per block."""
    import torch.distributed as dist

    ep, emesh = 0, None
    if shape.experts and shape.expert_parallel > 1:
        if mesh is not None:
            raise ValueError("expert parallelism shards the dense parameters over every rank; "
                             "it does not combine with an HSDP mesh here")
        if ranks_per_node is None:
            raise ValueError("expert parallelism needs ranks_per_node (the expert sets stay "
                             "inside a node)")
        emesh = expert_mesh(ranks_per_node, shape.expert_parallel)
        ep = dist.get_rank() % shape.expert_parallel
    torch.manual_seed(seed)
    model = GPT(shape, expert_seed(seed, ep) if shape.experts else None)
    kw = {} if mesh is None else {"mesh": mesh}
    block_kw = kw if emesh is None else {**kw, "shard_placement_fn": _expert_placement(model,
                                                                                       emesh)}
    for blk in model.blocks:
        fully_shard(blk, **block_kw)
    fully_shard(model, **kw)
    return model


def hsdp_mesh(ranks_per_node: int):
    """HSDP's standard layout: shard inside a node, replicate across nodes."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    nodes = dist.get_world_size() // ranks_per_node
    return init_device_mesh("cpu", (nodes, ranks_per_node),
                            mesh_dim_names=("replicate", "shard"))


class _Windows:
    """What both datasets share: random training windows and a fixed validation set."""

    train: "torch.Tensor"
    val: "torch.Tensor"

    def batch(self, split: str, batch: int, seq: int, seed: int, step: int, rank: int):
        """``batch`` random windows (inputs, next-token targets), a pure function of
        (seed, split, step, rank): every scheme sees the same data."""
        data = self.train if split == "train" else self.val
        g = torch.Generator().manual_seed(
            (seed * 1_000_003 + step * 101 + rank) * 2 + (split != "train")
        )
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
        x = torch.stack([data[s:s + seq] for s in starts.tolist()])
        y = torch.stack([data[s + 1:s + seq + 1] for s in starts.tolist()])
        return x, y

    def val_windows(self, seq: int) -> int:
        """How many non-overlapping windows of ``seq`` tokens (plus the next-token target) the
        whole validation split holds."""
        return (len(self.val) - 1) // seq

    def val_window(self, indices: list[int], seq: int):
        """Inputs and targets of the non-overlapping validation windows ``indices``."""
        x = torch.stack([self.val[i * seq:(i + 1) * seq] for i in indices])
        y = torch.stack([self.val[i * seq + 1:(i + 1) * seq + 1] for i in indices])
        return x, y


class CharData(_Windows):
    """Character-level tokens of a text or JSONL file (``text`` field, else the whole record),
    split into train (first 90%) and held-out validation (last 10%)."""

    def __init__(self, path: Optional[str]) -> None:
        p = Path(path) if path else DEFAULT_DATA
        if not p.is_file():
            raise FileNotFoundError(
                f"data file {str(p)!r} not found; pass --data PATH (a text or JSONL file)"
                + ("" if path else f" or place tinyshakespeare at {DEFAULT_DATA}")
            )
        raw = p.read_text(encoding="utf-8", errors="replace")
        if p.suffix in (".jsonl", ".json"):
            parts = []
            for line in raw.splitlines():
                if line.strip():
                    rec = json.loads(line)
                    parts.append(rec.get("text", json.dumps(rec)) if isinstance(rec, dict)
                                 else str(rec))
            raw = "\n".join(parts)
        if len(raw) < 10_000:
            raise ValueError(f"{p} has only {len(raw)} characters; need at least 10000")
        self.path = p
        chars = sorted(set(raw))
        lut = {c: i for i, c in enumerate(chars)}
        self.vocab = len(chars)
        ids = torch.tensor([lut[c] for c in raw], dtype=torch.long)
        cut = int(0.9 * len(ids))
        self.train, self.val = ids[:cut], ids[cut:]

    def digest(self) -> str:
        p = self.path
        return f"{p.name} sha256:{hashlib.sha256(p.read_bytes()).hexdigest()[:16]}"


class BPEData(_Windows):
    """The main job's offline corpus (``fsdp_qcomm.titan_common.data``: the standard library's
    docstrings and language-reference topics, ~2 MB, built once and cached) in its byte-level
    BPE tokenization (vocabulary ``vocab``, trained on the training split), documents joined
    with the end-of-text token. Train and validation are the corpus's own splits (whole
    modules held out). Tokens are cached next to the tokenizer."""

    def __init__(self, vocab: int = 8192) -> None:
        from fsdp_qcomm.titan_common import data as d

        corpus, tok_dir = d.ensure_corpus(), d.ensure_tokenizer(vocab)
        cache = tok_dir / "benchmark_tokens.pt"
        if cache.is_file():
            ids = torch.load(cache)
        else:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
            eot = tok.token_to_id(d.EOS_TOKEN)
            ids = {}
            for split in ("train", "val"):
                out: list[int] = []
                with open(corpus / f"{split}.jsonl", encoding="utf-8") as f:
                    for line in f:
                        out += tok.encode(json.loads(line)["text"]).ids + [eot]
                ids[split] = torch.tensor(out, dtype=torch.long)
            tmp = cache.with_suffix(f".{os.getpid()}.tmp")
            torch.save(ids, tmp)
            tmp.replace(cache)  # ranks building it at once publish the same bytes
        self.path = tok_dir / "tokenizer.json"
        self.vocab = vocab
        self.train, self.val = ids["train"], ids["val"]

    def digest(self) -> str:
        """What a run's setup records: the token streams' hash, so a rebuilt corpus or
        tokenizer that differs cannot pass for the stored one."""
        h = hashlib.sha256(self.train.numpy().tobytes() + self.val.numpy().tobytes())
        return (f"pystdlib bpe{self.vocab} train {len(self.train)} val {len(self.val)} tokens "
                f"sha256:{h.hexdigest()[:16]}")

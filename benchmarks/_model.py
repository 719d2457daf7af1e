"""What the benchmarks share: a small GPT, its FSDP2 wrapping, and two datasets: characters of
a text file (``CharData``) and the main job's BPE corpus (``BPEData``).

The model is deliberately plain (learned positions, pre-norm blocks, GELU MLP, an output
layer untied unless ``GPTShape.tied``) so that a benchmark measures the collectives, not the
model code. Every rank builds it
from the same seed before ``fully_shard``, so all schemes start from identical weights.
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


@dataclass(frozen=True)
class GPTShape:
    vocab: int
    dim: int
    layers: int
    heads: int
    seq: int
    tied: bool = False  # the output layer's weight is the token embedding

    def params(self) -> int:
        d = self.dim
        block = 12 * d * d + 13 * d  # qkv + proj + 4d MLP (weights and biases) + 2 LayerNorms
        embeddings = self.vocab * d * (1 if self.tied else 2)
        return embeddings + self.seq * d + self.layers * block + 2 * d + self.vocab


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        if shape.dim % shape.heads:
            raise ValueError(f"dim={shape.dim} must be a multiple of heads={shape.heads}")
        self.shape = shape
        self.tok = nn.Embedding(shape.vocab, shape.dim)
        self.pos = nn.Embedding(shape.seq, shape.dim)
        self.blocks = nn.ModuleList(_Block(shape.dim, shape.heads) for _ in range(shape.layers))
        self.ln_f = nn.LayerNorm(shape.dim)
        self.head = nn.Linear(shape.dim, shape.vocab)
        if shape.tied:
            self.head.weight = self.tok.weight
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() == 2:
                # GPT-2 init: residual projections scaled down with depth.
                s = std / math.sqrt(2 * shape.layers) if name.endswith(("proj.weight",
                                                                       "out.weight")) else std
                nn.init.normal_(p, 0.0, s)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def build_fsdp_gpt(shape: GPTShape, seed: int, mesh=None) -> GPT:
    """The same initial weights on every rank, then FSDP2 per block and at the root (on
    ``mesh``: None for the default 1-D mesh, a 2-D ``(replicate, shard)`` mesh for HSDP)."""
    torch.manual_seed(seed)
    model = GPT(shape)
    kw = {} if mesh is None else {"mesh": mesh}
    for blk in model.blocks:
        fully_shard(blk, **kw)
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

"""Train a small GPT with FSDP2 and fsdp-qcomm's ~4-bit collectives; save and resume with DCP.

    torchrun --nproc-per-node 4 examples/train_fsdp.py                  # CPU (gloo) or GPUs (NCCL)
    torchrun --nproc-per-node 4 examples/train_fsdp.py --hsdp           # HSDP: shard in a node
    torchrun --nproc-per-node 4 examples/train_fsdp.py --steps 10 --save /tmp/ckpt
    torchrun --nproc-per-node 4 examples/train_fsdp.py --steps 20 --resume /tmp/ckpt

The data is byte-level English text every Python installation carries (``pydoc_data``), so
nothing is downloaded. On one machine the ranks are one node and ``enable`` would quantize
nothing (only traffic between nodes is quantized by default), so on CPU this example declares
two ranks per node, as if the processes ran on two machines; on a cluster leave
``--ranks-per-node`` unset and fsdp-qcomm reads the real layout.
"""

from __future__ import annotations

import argparse
import gc
import os
from pydoc_data.topics import topics

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fsdp_qcomm


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, dim: int, layers: int, heads: int, seq: int, vocab: int = 256) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits, one row per token: ``[batch * seq, vocab]``."""
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x).flatten(0, 1))


def batch(data: torch.Tensor, step: int, rank: int, size: int, seq: int, device):
    """The same windows for the same (step, rank) in every run: a resumed run sees the data an
    uninterrupted one would."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    starts = torch.randint(0, len(data) - seq - 1, (size,), generator=g)
    x = torch.stack([data[s:s + seq + 1] for s in starts.tolist()]).to(device)
    return x[:, :-1], x[:, 1:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--preset", default="sdp4bit", help="a QCommConfig preset; 'none': FSDP2 alone")
    p.add_argument("--hsdp", action="store_true", help="2-D mesh: replicate across nodes")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="default: the real layout on GPUs, 2 on CPU (one machine as two nodes)")
    p.add_argument("--save", default="", help="DCP checkpoint folder written after the last step")
    p.add_argument("--resume", default="", help="DCP checkpoint folder to continue from")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    train(args, cuda)
    # the model goes before the process group: an FSDP2 module still alive at
    # destroy_process_group makes torch's gloo abort the process at exit, now and then
    # (docs/known_issues.md)
    gc.collect()
    dist.destroy_process_group()


def train(args: argparse.Namespace, cuda: bool) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    per_node = args.ranks_per_node or (None if cuda else max(1, world // 2))

    # one fully_shard per block, then the root; bf16 compute with fp32 reduction on GPUs
    if args.hsdp:
        shard = per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
        mesh = init_device_mesh(device.type if cuda else "cpu", (world // shard, shard),
                                mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type if cuda else "cpu", (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if cuda else torch.float32,
                              reduce_dtype=torch.float32)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = GPT(args.dim, args.layers, heads=4, seq=args.seq).to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)

    handle = None
    if args.preset != "none":
        config = fsdp_qcomm.QCommConfig.preset(args.preset, ranks_per_node=per_node)
        handle = fsdp_qcomm.enable(model, config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def state() -> dict:
        msd, osd = get_state_dict(model, opt)
        out = {"model": msd, "optim": osd, "step": torch.zeros((), dtype=torch.int64)}
        if handle is not None:
            out["qcomm"] = handle  # a Stateful: its RNG counters, qWD reference, residuals
        return out

    start = 0
    if args.resume:
        ckpt = state()
        dcp.load(ckpt, checkpoint_id=args.resume)
        set_state_dict(model, opt, model_state_dict=ckpt["model"], optim_state_dict=ckpt["optim"])
        start = int(ckpt["step"])

    text = "\n".join(topics.values()).encode()
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    for step in range(start, args.steps):
        x, y = batch(data, step, rank, args.batch, args.seq, device)
        loss = F.cross_entropy(model(x).float(), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0:
            print(f"step {step} loss {mean.item() / world:.6f}", flush=True)

    if args.save:
        ckpt = state()
        ckpt["step"] = torch.tensor(args.steps)
        dcp.save(ckpt, checkpoint_id=args.save)
    if handle is not None and rank == 0:
        stats = handle.stats()
        kinds = {k: v for k, v in stats.items() if isinstance(v, dict) and "calls" in v}
        s = stats["summary"]
        cross, base_cross = s["cross_node_bytes_per_step"], s["baseline_cross_node_bytes_per_step"]
        sent, base = s["sent_bytes_per_step"], s["baseline_bytes_per_step"]
        print(f"fsdp_qcomm {args.preset}, per step and rank, in the collectives it runs: "
              f"{cross:,.0f} bytes to other nodes where FSDP2's would send {base_cross:,.0f} "
              f"({cross / max(base_cross, 1):.3f}x); {sent:,.0f} in all against "
              f"{base:,.0f} ({sent / max(base, 1):.3f}x)")
        for kind, v in kinds.items():
            print(f"  {kind}: {v['calls']} calls, {v['bits_per_element']:.2f} bits/element")
        for note in stats["notes"]:
            print(f"  {note}")
    if handle is not None:
        handle.disable()


if __name__ == "__main__":
    main()

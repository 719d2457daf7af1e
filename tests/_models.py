"""Tiny modules shared by the FSDP tests (sizes chosen by each test: multiples of no group
size), and the instruments those tests read weights and bytes with."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


class MLPBlock(nn.Module):
    """Pre-norm residual MLP block."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class MLPNet(nn.Module):
    """``inp`` (5 -> 13), ``layers`` ``MLPBlock(13, 37)`` in ``blocks``, ``out`` (13 -> 1): the
    checkpoint tests' model, sharded per block and at the root."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 13)
        self.blocks = nn.ModuleList(MLPBlock(13, 37) for _ in range(layers))
        self.out = nn.Linear(13, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


class Block(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, 2, d // 2).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyLM(nn.Module):
    """Embedding tied to the output head; sizes are multiples of nothing in particular."""

    def __init__(self, vocab: int = 37, d: int = 22, hidden: int = 45, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight
        nn.init.normal_(self.emb.weight, std=0.1)  # tied: N(0, 1) would give huge logits

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def shard(model: TinyLM, raf: bool, mp: MixedPrecisionPolicy = MixedPrecisionPolicy()) -> None:
    for blk in model.blocks:
        fully_shard(blk, reshard_after_forward=raf, mp_policy=mp)
    fully_shard(model, reshard_after_forward=raf, mp_policy=mp)


def batch(step: int, rank: int, vocab: int = 37, b: int = 3, t: int = 9) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, vocab, (b, t + 1), generator=g)


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def train_step(loss: torch.Tensor, opt: torch.optim.Optimizer) -> float:
    """Backward, optimizer step, zero grads; the loss averaged over every rank."""
    loss.backward()
    opt.step()
    opt.zero_grad()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return mean.item() / dist.get_world_size()


class OptimizerContainer(torch.optim.Optimizer):
    """An optimizer over an inner one, as torchtitan's OptimizersContainer: its step hooks fire
    around the inner one's. ``fail``: its step raises after the inner step ran (a caller that
    catches it leaves the outer step never ended)."""

    def __init__(self, inner: torch.optim.Optimizer, fail: bool = False) -> None:
        self.inner = inner
        super().__init__([p for g in inner.param_groups for p in g["params"]], {})
        self.fail = fail

    def step(self, closure=None):
        self.inner.step()
        if self.fail:
            raise RuntimeError("after the inner step")


class Capture:
    """Weights each leaf module computes with, in forward and in backward."""

    def __init__(self, model: nn.Module) -> None:
        self.fwd: dict[str, torch.Tensor] = {}
        self.bwd: dict[str, torch.Tensor] = {}
        self.bwd_log: list[dict[str, torch.Tensor]] = []  # every backward capture, in order
        self._handles = []
        for name, mod in model.named_modules():
            if isinstance(mod, (nn.Linear, nn.LayerNorm, nn.Embedding)):
                self._handles.append(mod.register_forward_pre_hook(self._pre(name)))
                self._handles.append(mod.register_forward_hook(self._post(name)))

    @staticmethod
    def _params(mod: nn.Module, name: str) -> dict[str, torch.Tensor]:
        return {f"{name}.{p}": t.detach().clone() for p, t in mod.named_parameters(recurse=False)}

    def _pre(self, name):
        def hook(mod, args):
            self.fwd.update(self._params(mod, name))
        return hook

    def _post(self, name):
        # The hook on the leaf's input fires right after the leaf's backward, while its FSDP
        # unit is still unsharded (a hook on the output could run before FSDP's own
        # pre-backward when the output is the unit's output). Embeddings take integer input.
        def hook(mod, args, out):
            t = args[0] if args[0].requires_grad else out
            if t.requires_grad:
                t.register_hook(lambda g: self._backward(mod, name))
        return hook

    def _backward(self, mod: nn.Module, name: str) -> None:
        params = self._params(mod, name)
        self.bwd.update(params)
        self.bwd_log.append(params)

    def clear(self) -> None:
        self.fwd.clear()
        self.bwd.clear()
        self.bwd_log.clear()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


class GatherBytes:
    """Counts the bytes of every input handed to dist.all_gather_single (all_gather_into_tensor
    before torch 2.13)."""

    def __init__(self) -> None:
        self.sent = 0
        self.calls = 0
        self._name = ("all_gather_single" if hasattr(dist, "all_gather_single")
                      else "all_gather_into_tensor")
        self._orig = getattr(dist, self._name)

    def __enter__(self):
        def counting(output, input, *args, **kwargs):
            self.sent += input.numel() * input.element_size()
            self.calls += 1
            return self._orig(output, input, *args, **kwargs)

        setattr(dist, self._name, counting)
        return self

    def __exit__(self, *exc):
        setattr(dist, self._name, self._orig)


def units(model: nn.Module) -> list:
    """The FSDP parameter groups under ``model`` (one per ``fully_shard``-ed unit)."""
    groups = []
    for m in model.modules():
        if isinstance(m, FSDPModule):
            state = m._get_fsdp_state()  # torch 2.13+: a list; 2.9-2.12: one group or None
            one = getattr(state, "_fsdp_param_group", None)
            groups.extend(getattr(state, "_fsdp_param_groups", [one] if one is not None else []))
    return groups


def segments(group) -> list[int]:
    """The padded shard sizes of a group's parameters: the rows of its flat all-gather."""
    return [math.prod(fp.padded_sharded_param_size) for fp in group.fsdp_params]

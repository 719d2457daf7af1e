"""Fine-tuning with adapters (LoRA-style): frozen base weights and trainable low-rank adapters
in the same FSDP modules, and a module (the root: embedding, final norm) frozen whole. FSDP2
reduces only the gradients that exist; the hooks must follow it, leave every frozen weight
bit-unchanged on every rank, and send nothing for the frozen module once its first gather is
done (qWD's reference already holds it)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
from _models import TinyLM, batch, lm_loss, shard, train_step

import fsdp_qcomm
from fsdp_qcomm import QCommConfig
from fsdp_qcomm.testing import run_ranks

STEPS = 5


class LoRA(nn.Module):
    """``base(x) + x A^T B^T``, ``base`` frozen, ``B`` zero at the start."""

    def __init__(self, base: nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.base = base
        self.a = nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.b = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a.t()) @ self.b.t()


def _train(rank: int, world: int, preset, all_params: bool = False, **overrides) -> dict:
    torch.manual_seed(0)
    model = TinyLM()
    model.requires_grad_(False)
    for blk in model.blocks:
        blk.qkv, blk.fc1 = LoRA(blk.qkv), LoRA(blk.fc1)
    shard(model, True)
    frozen = {n: p.full_tensor().clone() for n, p in model.named_parameters()
              if not p.requires_grad}
    handle = fsdp_qcomm.enable(model, QCommConfig.preset(preset, ranks_per_node=1, **overrides)) \
        if preset else None
    opt = torch.optim.AdamW([p for p in model.parameters() if all_params or p.requires_grad],
                            lr=1e-2)
    losses = [train_step(lm_loss(model, batch(step, rank)), opt) for step in range(STEPS)]
    out = {
        "losses": losses,
        "frozen_unchanged": all(torch.equal(p.full_tensor(), frozen[n])
                                for n, p in model.named_parameters() if not p.requires_grad),
        "adapters": {n: p.full_tensor().sum().item() for n, p in model.named_parameters()
                     if p.requires_grad},
    }
    if handle is not None:
        out["root_modes"] = dict(next(i.all_gather.modes for i in handle._installs
                                      if i.name == ""))
        out["kinds"] = sorted(k for k, v in handle.stats().items()
                              if isinstance(v, dict) and v.get("calls"))
        handle.disable()
    return out


@functools.lru_cache(maxsize=1)
def _fsdp2() -> list:
    """FSDP2 alone on the same model and batches (once per test session)."""
    return run_ranks(_train, 2, None, timeout=300)


@pytest.mark.parametrize("preset,overrides,first,reused", [
    ("sdp4bit", {}, "qwd_full", "qwd_reuse"),
    ("qsdp", {}, "direct", None),
    ("qsdp", {"weight_reuse_unchanged": True}, "direct", "direct_reuse"),
], ids=["sdp4bit", "qsdp", "qsdp_reuse"])
def test_adapters_train_and_frozen_weights_stay_exact(preset, overrides, first, reused):
    """2 ranks, each its own node: the adapters train within 1% of FSDP2's loss, and identically
    on both ranks; every frozen weight is bit-unchanged. The frozen root's gathers (one forward,
    one backward per step): under qWD, or with ``weight_reuse_unchanged``, its weights are sent
    once and reused after; plain QSDP re-encodes them at every gather."""
    base = _fsdp2()
    res = run_ranks(_train, 2, preset, timeout=300, **overrides)
    for r in res:
        assert r["frozen_unchanged"]
        assert r["adapters"] == res[0]["adapters"]
        assert r["losses"] == res[0]["losses"]
    assert "grad_inter" in res[0]["kinds"], res[0]["kinds"]  # the adapters' gradients
    gap = (res[0]["losses"][-1] - base[0]["losses"][-1]) / base[0]["losses"][-1]
    assert abs(gap) < 0.01, gap
    modes = res[0]["root_modes"]
    if reused is None:
        assert modes == {first: 2 * STEPS}, modes
    else:
        assert modes == {first: 1, reused: 2 * STEPS - 1}, modes


@pytest.mark.parametrize("verify", [True, False], ids=["verified", "unverified"])
def test_frozen_weights_left_in_the_optimizer_are_sent_once(verify):
    """``AdamW(model.parameters())`` over the frozen weights too (a common fine-tuning loop):
    torch.optim skips a parameter without a gradient, so nothing changed and qWD sends the
    frozen root once, as when the optimizer holds the adapters only; same bits as that run."""
    only = run_ranks(_train, 2, "sdp4bit", timeout=300, verify_weight_writes=verify)
    res = run_ranks(_train, 2, "sdp4bit", timeout=300, all_params=True,
                    verify_weight_writes=verify)
    for r, o in zip(res, only):
        assert r["frozen_unchanged"]
        assert r["losses"] == o["losses"] and r["adapters"] == o["adapters"]
        assert r["root_modes"] == {"qwd_full": 1, "qwd_reuse": 2 * STEPS - 1}, r["root_modes"]

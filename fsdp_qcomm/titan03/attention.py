"""Attention that trains on CPUs: FlexAttention's masks, computed densely.

torchtitan 0.3's language models accept only flex / flex_flash / varlen attention. On a CPU,
FlexAttention has no backward, and the compiled ``create_block_mask`` that builds its masks takes
over a minute per process to compile. :class:`DenseMaskAttention` keeps FlexAttention's
interface (its config subclasses ``FlexAttention.Config``, so the trainer still builds the
packed-document causal masks for it, and its forward takes ``q_BLNH, k_BLNH, v_BLNH``, the names
spmd_types' ``local_map`` checks), turns the ``BlockMask``'s ``mask_mod`` into a dense boolean
mask (once per batch: every layer gets the same mask object) and runs
``scaled_dot_product_attention`` with it. Same result as FlexAttention; memory grows with
``seq_len**2``, which is fine at the sizes a CPU trains.

:func:`use_dense_attention` swaps it into a model config; :func:`eager_block_masks` makes
torchtitan build ``BlockMask`` objects without ``torch.compile``. The trainer applies both only
on hosts without an accelerator (``titan_common.cpu.cpu_fallback_needed``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask
from torchtitan.models.common import decoder
from torchtitan.models.common.attention import FlexAttention


class DenseMaskAttention(FlexAttention):
    """FlexAttention's interface, computed with a dense mask and SDPA."""

    @dataclass(kw_only=True, slots=True)
    class Config(FlexAttention.Config):
        pass

    # (BlockMask, dense mask): the layers of one forward share one BlockMask object
    _last: Optional[tuple[BlockMask, torch.Tensor]] = None

    @classmethod
    def dense_mask(cls, masks: BlockMask, q_len: int, kv_len: int,
                   device: torch.device) -> torch.Tensor:
        """``(B, 1, q_len, kv_len)`` booleans, True where a query may attend to a key."""
        last = cls._last
        if last is not None and last[0] is masks and last[1].shape[-2:] == (q_len, kv_len):
            return last[1]
        batch = masks.kv_num_blocks.shape[0]
        dense = create_mask(masks.mask_mod, batch, None, q_len, kv_len, device=device)
        cls._last = (masks, dense)
        return dense

    def forward(
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: BlockMask,
        score_mod: Any = None,
        scale: Optional[float] = None,
        enable_gqa: bool = False,
        out_transform: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if not isinstance(attention_masks, BlockMask):
            raise TypeError(
                f"attention_masks must be a BlockMask, got {type(attention_masks).__name__}"
            )
        if score_mod is not None:
            raise NotImplementedError(
                "DenseMaskAttention (the CPU attention of fsdp_qcomm.titan03) has no score_mod"
            )
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))  # (B, N, L, H)
        mask = self.dense_mask(attention_masks, q.shape[2], k.shape[2], q.device)
        if out_transform is None:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
            )
            return out.transpose(1, 2)
        # the caller wants the log-sum-exp of each row too (e.g. attention sinks)
        if enable_gqa:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = (q @ k.transpose(-2, -1)) * (scale if scale is not None else q.shape[-1] ** -0.5)
        scores = scores.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        out = torch.exp(scores - lse.unsqueeze(-1)) @ v
        return out_transform(out.transpose(1, 2), lse.transpose(1, 2))


def use_dense_attention(model_config: Any) -> int:
    """Replace every ``FlexAttention.Config`` in a model config by a
    :class:`DenseMaskAttention.Config` with the same settings; returns how many."""
    found = [(parent, attr, cfg) for _, cfg, parent, attr in model_config.traverse(
        FlexAttention.Config) if type(cfg) is FlexAttention.Config and parent is not None]
    for parent, attr, cfg in found:
        new = DenseMaskAttention.Config(**{f.name: getattr(cfg, f.name) for f in fields(cfg)
                                          if f.init})
        if isinstance(attr, int):
            parent[attr] = new
        else:
            setattr(parent, attr, new)
    return len(found)


def _eager_create_attention_mask(*args: Any, **kwargs: Any) -> BlockMask:
    return create_block_mask(*args, _compile=False, **kwargs)


def eager_block_masks() -> bool:
    """Make torchtitan's decoders build their ``BlockMask`` without ``torch.compile`` (which
    costs over a minute per process on a CPU, for a mask built in milliseconds). Idempotent;
    returns whether it changed anything now."""
    if decoder.create_attention_mask is _eager_create_attention_mask:
        return False
    decoder.create_attention_mask = _eager_create_attention_mask
    return True


__all__ = ["DenseMaskAttention", "eager_block_masks", "use_dense_attention"]

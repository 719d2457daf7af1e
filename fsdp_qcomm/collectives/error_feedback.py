"""Error feedback for quantized gradient hops: what one step's quantization lost, sent next step.

Classic error feedback (error compensation: Seide et al. 2014, "1-bit SGD"; Karimireddy et al.
2019, "Error feedback fixes SignSGD"; DeepSpeed's 1-bit Adam keeps one residual on the sending
side and one on the re-encoding side of its compressed all-reduce, as here). Each quantization
site keeps a residual ``e`` of the values it encodes; a call encodes ``t = x + e`` and keeps
``e <- t - decode(encode(t))``, the part of ``t`` the wire did not carry. Over ``T`` steps the
values delivered sum to ``sum(x) - e_T``: the accumulated error stays one quantization error
instead of growing like ``sqrt(T)``, which is what lets the width drop below 4 bits.

Why classic EF and not EF21 (Richtarik et al. 2021): EF21 sends compressed differences against
a running estimate of each worker's gradient, which needs that estimate at full size on every
sender *and* the aggregate at the receiver; in a reduce-scatter every rank is both, for every
row it sends, so its memory is at least the sender side of classic EF plus the receiver's. The
benchmark (``benchmarks/frontier.py``) measures whether the classic residual already closes the
gap at the widths that matter.

Sites (``FeedbackState`` keys; pipeline spans use views of one buffer per site):

* ``"a2a"``: the rows a rank sends in an all-to-all (its whole gradient in a one-level
  reduce-scatter, its shard's rows in HSDP's replica all-reduce);
* ``"requant"``: the partial sums a rank re-encodes for the next hop (hop 2 of the two-level
  reduce-scatter, the reduced row HSDP's replica all-reduce gathers).

Non-finite values: where the new residual is not finite (a quantization group that held
NaN/Inf), the previous residual is kept, so one bad step (skipped by the optimizer or a grad
scaler) cannot poison every later step; the finite groups of that step keep at most one
quantization step of its discarded gradient.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch


class FeedbackState:
    """The residuals of one module's gradient hops on this rank: one fp32 buffer per site,
    created (zero) on first use with the shape its collective computes (``*_feedback_shapes``),
    so a checkpoint template can be built before the first step."""

    def __init__(self) -> None:
        self.residuals: dict[str, torch.Tensor] = {}

    def buffer(self, site: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """The residual of ``site``; a zero one when missing or of another shape or device
        (for example after the module's layout changed)."""
        e = self.residuals.get(site)
        if e is None or tuple(e.shape) != tuple(shape) or e.device != torch.device(device):
            e = self.residuals[site] = torch.zeros(shape, dtype=torch.float32, device=device)
        return e

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.residuals.values())

    def clear(self) -> None:
        self.residuals.clear()


def compensated(
    e: torch.Tensor,
    x: torch.Tensor,
    encode: Callable[[torch.Tensor], torch.Tensor],
    decode: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``encode(x + e)``, updating the residual view ``e`` (same shape as ``x``) in place to
    ``(x + e) - decode(wire)`` where that is finite. ``decode`` returns the values the receivers
    will see for ``x``'s positions."""
    target = x.to(torch.float32) + e
    wire = encode(target)
    new = target.sub_(decode(wire))
    e.copy_(torch.where(torch.isfinite(new), new, e))
    return wire


Feedback = Optional[FeedbackState]

__all__ = ["Feedback", "FeedbackState", "compensated"]

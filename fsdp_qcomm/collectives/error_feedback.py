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

Decay (``FeedbackState.decay``, ``QCommConfig.grad_error_feedback_decay``): keep ``decay``
times the residual, dropping the rest of each step's error as no feedback would. Why: what
one step delivers is off by ``e_{t-1} - e_t``, about twice the variance of one rounding (far
more at 2 bits with stochastic rounding, whose error is as large as the values it rounds,
so the residual grows to several times the gradient: ``docs/lowbit.md``), and AdamW's second moment
takes that per-step noise in, shrinking its steps, while its first moment already averages the
noise over ~10 steps. A decay ``g`` cuts the per-step error to about ``1 + g^2`` roundings'
variance and the residual's growth loop by ``g^2`` (it stays bounded unless the rounding error
exceeds ``1 / g`` times what is rounded), and still carries ``g`` of each step's loss onward.

Non-finite values: where the new residual is not finite (a quantization group that held
NaN/Inf), the previous residual is kept, so one bad step (skipped by the optimizer or a grad
scaler) cannot poison every later step; the finite groups of that step keep at most one
quantization step of its discarded gradient. No host sync: ``torch.where`` on ``isfinite``.

Layouts (``ValueLayout``, ``MappedFeedback``). A residual value belongs to one value of the
reduced buffer, which belongs to one parameter. A caller whose buffers do not always hold the
same values (FSDP reduces only the parameters that have a gradient, so a module's buffer
holds a different subset of its parameters from one step to the next) keeps its residuals in
one *full* layout and passes ``MappedFeedback(state, layout)``: each call reads the residuals
of the values it holds from the full layout and writes them back there, and the residuals of
values it does not hold stay as they were. Each collective describes its sites (``Site``:
which values a buffer covers and whether it stores them Hadamard-rotated); a rotated site is
converted through position space, exact up to fp32 rounding, and only for calls whose layout
is not the full one. With ``scale`` (a loss scaler's current scale, a tensor read without a
host sync) the gradients a call reduces are ``scale`` times the true ones: the residuals are
kept divided by it (unscaled), so a scale change between steps leaves them in the right
units. Powers of two (``GradScaler``'s scales) make that exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Union

import torch

from ..codec.wire import hadamard_len


class FeedbackState:
    """The residuals of one module's gradient hops on this rank: one fp32 buffer per site,
    created (zero) on first use with the shape its collective computes (``*_feedback_shapes``),
    so a checkpoint template can be built before the first step.

    ``decay`` (``QCommConfig.grad_error_feedback_decay``, in (0, 1]): the fraction of each
    call's residual kept for the next call (``open_residuals`` applies it when the call is
    done); 1 is classic error feedback."""

    def __init__(self, decay: float = 1.0) -> None:
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 < decay <= 1:
            raise ValueError(f"FeedbackState decay must be a number in (0, 1], got {decay!r}")
        self.residuals: dict[str, torch.Tensor] = {}
        self.decay = float(decay)

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


@dataclass(frozen=True)
class ValueLayout:
    """Where the values of one call sit in the full layout its residuals are kept in: the
    call's values are the full layout's ranges ``[start, start + length)`` back to back, in
    ``ranges`` order; ``full`` is the full layout's length."""

    ranges: tuple[tuple[int, int], ...]
    full: int

    @property
    def size(self) -> int:
        return sum(n for _, n in self.ranges)

    @property
    def identity(self) -> bool:
        """The call holds the full layout, in order."""
        pos = 0
        for start, n in self.ranges:
            if n == 0:
                continue
            if start != pos:
                return False
            pos += n
        return pos == self.full


@dataclass(frozen=True)
class Site:
    """How one residual buffer (``shape``) covers the values of a call: rows of ``width``
    values, the call's values ``[lo, lo + width)`` (one row per destination; the buffer's
    columns past ``width`` are padding). ``rotated``: ``(a, b, off)`` spans whose values
    ``[a, b)`` of the window are stored 32-point-Hadamard-rotated (unnormalized, as the codec
    sends them) at columns ``[off, off + hadamard_len(b - a))``; empty: stored as values."""

    shape: tuple[int, ...]
    rows: int
    lo: int
    width: int
    rotated: tuple[tuple[int, int, int], ...] = ()

    def positions(self, buf: torch.Tensor) -> torch.Tensor:
        """``[rows, width]`` residual per value: a view of ``buf`` when not rotated."""
        v = buf.view(self.rows, -1)
        if not self.rotated:
            return v[:, :self.width]
        from ..codec.torch_codec import hadamard32

        out = torch.zeros(self.rows, self.width, dtype=torch.float32, device=buf.device)
        for a, b, off in self.rotated:
            end = min(b, self.width)
            if end > a:
                block = v[:, off:off + hadamard_len(b - a)].contiguous()
                out[:, a:end] = hadamard32(block)[:, :end - a] * (1.0 / 32)
        return out

    def native(self, pos: torch.Tensor) -> torch.Tensor:
        """The buffer holding ``pos`` (``[rows, width]``), zero in the padding."""
        buf = torch.zeros(self.shape, dtype=torch.float32, device=pos.device)
        v = buf.view(self.rows, -1)
        if not self.rotated:
            v[:, :self.width] = pos
            return buf
        from ..codec.torch_codec import hadamard32

        for a, b, off in self.rotated:
            n = hadamard_len(b - a)
            block = torch.zeros(self.rows, n, dtype=torch.float32, device=pos.device)
            end = min(b, self.width)
            if end > a:
                block[:, :end - a] = pos[:, a:end]
            v[:, off:off + n] = hadamard32(block)
        return buf


class MappedFeedback:
    """A module's residuals (``state``, in the full layout) as one call sees them: its values
    laid out by ``layout`` and, with ``scale``, reduced ``scale`` times too large (a loss
    scaler's scale; ``state`` then holds unscaled residuals)."""

    def __init__(self, state: FeedbackState, layout: ValueLayout,
                 scale: Optional[torch.Tensor] = None) -> None:
        self.state = state
        self.layout = layout
        self.scale = scale


Feedback = Union[FeedbackState, MappedFeedback, None]
Sites = Callable[[int], "dict[str, Site]"]


def _pairs(layout: ValueLayout, call: Site, full: Site) -> Iterator[tuple[int, int, int]]:
    """``(call column, full column, count)`` runs mapping a call site's columns to the full
    site's, for the values both windows cover."""
    p = 0
    for start, n in layout.ranges:
        t0 = max(0, call.lo - p, full.lo - start)
        t1 = min(n, call.lo + call.width - p, full.lo + full.width - start)
        if t1 > t0:
            yield p + t0 - call.lo, start + t0 - full.lo, t1 - t0
        p += n


def _nothing() -> None:
    return None


def _decayer(res: dict[str, torch.Tensor], decay: float) -> Callable[[], None]:
    """What scales the residuals a call just updated by ``decay`` (nothing at 1): only the
    values the call held, so a residual the call did not use is kept as it was."""
    if decay == 1.0:
        return _nothing

    def apply() -> None:
        for buf in res.values():
            buf.mul_(decay)

    return apply


def open_residuals(
    feedback: Feedback, sites: Sites, m: int, device: torch.device
) -> tuple[dict[str, torch.Tensor], Callable[[], None]]:
    """The residual buffer of each site of a call over ``m`` values (``sites(n)``: the
    collective's sites for ``n`` values), and the function to call once the call has updated
    them: it scales them by the state's ``decay`` and, with a ``MappedFeedback``, writes them
    back to the full layout (values the call does not hold keep their residuals). A plain
    ``FeedbackState`` is used as it is."""
    if feedback is None:
        return {}, _nothing
    if isinstance(feedback, FeedbackState):
        res = {s: feedback.buffer(s, g.shape, device) for s, g in sites(m).items()}
        return res, _decayer(res, feedback.decay)
    state, layout, scale = feedback.state, feedback.layout, feedback.scale
    if layout.size != m:
        raise ValueError(f"the feedback layout holds {layout.size} values, the call {m}")
    full_sites = sites(layout.full)
    full = {s: state.buffer(s, g.shape, device) for s, g in full_sites.items()}
    if layout.identity and scale is None:
        return full, _decayer(full, state.decay)
    if scale is not None:
        scale = scale.to(device=device, dtype=torch.float32)
    call_sites = sites(m)
    res: dict[str, torch.Tensor] = {}
    for s, g in call_sites.items():
        if layout.identity:  # same buffers, scaled: rotation commutes with the scale
            res[s] = full[s] * scale
            continue
        fpos = full_sites[s].positions(full[s])
        pos = torch.zeros(g.rows, g.width, dtype=torch.float32, device=device)
        for c, f, n in _pairs(layout, g, full_sites[s]):
            pos[:, c:c + n] = fpos[:, f:f + n]
        if scale is not None:
            pos.mul_(scale)
        res[s] = g.native(pos)

    decay = _decayer(res, state.decay)

    def write_back() -> None:
        decay()
        for s, g in call_sites.items():
            fs, buf = full_sites[s], full[s]
            if layout.identity:
                new = res[s] / scale
                buf.copy_(torch.where(torch.isfinite(new), new, buf))
                continue
            cpos = g.positions(res[s])
            if scale is not None:
                cpos = cpos / scale
            fpos = fs.positions(buf)
            for c, f, n in _pairs(layout, g, fs):
                fpos[:, f:f + n] = torch.where(torch.isfinite(cpos[:, c:c + n]),
                                               cpos[:, c:c + n], fpos[:, f:f + n])
            if fs.rotated:  # fpos is a copy: rotate it back
                buf.copy_(fs.native(fpos))

    return res, write_back


__all__ = ["Feedback", "FeedbackState", "MappedFeedback", "Site", "ValueLayout", "compensated",
           "open_residuals"]

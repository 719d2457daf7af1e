"""Error-feedback residuals of FSDP modules: their layout, loss-scaler units, checkpoints and
memory figures.

Layout. A reduction hook keeps its residuals in the module's *full* layout: every parameter
of the group, in ``fsdp_params`` order, each ``padded_shard_numel`` values wide (the buffer
FSDP reduces when every parameter has a gradient). FSDP reduces only the parameters that
have one, so each call maps its own layout into the full one (``call_feedback``:
``internals.reduction_params`` says which parameters the call holds): a parameter's residual
is only ever added to that parameter's values, and a parameter without a gradient keeps its
residual for the next step that has one. A call whose parameters cannot be known runs
without error feedback and leaves a note in the stats. When every parameter has a gradient
the residual buffers are used as they are: the same math and bytes as without this mapping.

Loss scaling. ``QCommHandle.attach_grad_scaler(scaler)`` makes every call read the scaler's
current scale (a tensor: no host sync) and keep the residuals divided by it, so they stay in
the gradients' true units when the scale changes between steps (``error_feedback``).

Checkpoints. Each rank's residuals are its own (what *its* encodings lost): they are saved as
plain copies in this rank's entry of ``QCommHandle.state_dict()``, which ``fsdp.checkpoint``
keys by rank and checks on load (same rank, world size, mesh and settings). A run without the
saved residuals starts them at zero.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.distributed.tensor import DTensor

from ..collectives.error_feedback import Feedback, FeedbackState, MappedFeedback, ValueLayout
from ..stats import CommStats
from . import internals as fsdp

ScaleSource = Callable[[], Optional[torch.Tensor]]


def shard_numel(group: Any) -> int:
    """Values of one rank's reduce-scatter output (and of its replica all-reduce) when every
    parameter of the group has a gradient."""
    return sum(fsdp.padded_shard_numel(fp) for fp in fsdp.fsdp_params(group))


def value_layout(group: Any, numel: int) -> Optional[ValueLayout]:
    """Where the values of the reduction FSDP is handing a hook right now (``numel`` per rank)
    sit in the group's full layout; None when its parameters cannot be known."""
    idx = fsdp.reduction_params(group, numel)
    if idx is None:
        return None
    sizes = [fsdp.padded_shard_numel(fp) for fp in fsdp.fsdp_params(group)]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return ValueLayout(tuple((starts[i], sizes[i]) for i in idx), sum(sizes))


def call_feedback(state: Optional[FeedbackState], group: Any, numel: int, stats: CommStats,
                  scale: Optional[ScaleSource], what: str) -> Feedback:
    """The residuals one reduction call of an FSDP hook works on (from inside the hook, on the
    thread FSDP called it on): ``state`` mapped to the call's layout, or None (no error
    feedback for this call, with a note) when the layout cannot be known."""
    if state is None:
        return None
    if group is None:  # a hook used without FSDP: its calls are the full layout
        return state
    layout = value_layout(group, numel)
    if layout is None:
        stats.note(f"error feedback skipped on {what} call(s): which parameters the reduction "
                   "holds could not be read from FSDP, so no residual was added or updated")
        return None
    return MappedFeedback(state, layout, scale() if scale is not None else None)


def scaler_scale(scaler: Any) -> ScaleSource:
    """What ``attach_grad_scaler`` reads: the current scale of a ``torch.amp.GradScaler`` (or
    FSDP's ``ShardedGradScaler``) as the tensor it keeps (``_scale``, updated in place by
    ``update()``), or None while the scaler is disabled or has not scaled a loss yet."""
    if not callable(getattr(scaler, "is_enabled", None)) or not hasattr(scaler, "_scale"):
        raise TypeError(
            f"attach_grad_scaler takes a torch.amp.GradScaler, got {type(scaler).__name__}"
        )

    def read() -> Optional[torch.Tensor]:
        if not scaler.is_enabled():
            return None
        return scaler._scale

    return read


def _buffers(hook: Any, group: Any) -> dict[str, torch.Tensor]:
    if hook is None or getattr(hook, "feedback", None) is None or not fsdp.fsdp_params(group):
        return {}
    device = fsdp.group_device(group)
    return {site: hook.feedback.buffer(site, shape, device)
            for site, shape in hook.feedback_shapes(shard_numel(group)).items()}


def residual_bytes(hook: Any, group: Any) -> int:
    """fp32 bytes of the residuals ``hook`` keeps on this rank in steady state."""
    if hook is None or getattr(hook, "feedback", None) is None:
        return 0
    shapes = hook.feedback_shapes(shard_numel(group))
    return 4 * sum(torch.Size(s).numel() for s in shapes.values())


def residual_buffers(hooks: dict[str, Any], group: Any) -> dict[str, torch.Tensor]:
    """``{"<hook>.<site>": live buffer}`` of this rank's residuals (for measuring memory)."""
    return {f"{name}.{site}": buf
            for name, hook in hooks.items() for site, buf in _buffers(hook, group).items()}


def residual_entries(hooks: dict[str, Any], group: Any) -> dict[str, torch.Tensor]:
    """``{"<hook>.<site>": flat copy}`` of this rank's residuals (for checkpoints)."""
    return {k: buf.detach().reshape(-1).clone()
            for k, buf in residual_buffers(hooks, group).items()}


def check_residuals(hooks: dict[str, Any], group: Any, entries: dict[str, Any],
                    label: str) -> None:
    """Raise ``ValueError`` unless every saved residual fits the buffer it would be loaded
    into (called before anything is loaded)."""
    for name, hook in hooks.items():
        for site, buf in _buffers(hook, group).items():
            saved = entries.get(f"{name}.{site}")
            if saved is None:
                continue
            local = saved.to_local() if isinstance(saved, DTensor) else saved
            if not isinstance(local, torch.Tensor) or local.numel() != buf.numel():
                got = local.numel() if isinstance(local, torch.Tensor) else type(local).__name__
                raise ValueError(
                    f"FSDP module {label!r}: the checkpoint's error-feedback residual "
                    f"{name}.{site} has {got} values on this rank, this run keeps "
                    f"{buf.numel()}; resume with the same mesh and grad settings, or drop "
                    "'grad_residuals' from the saved fsdp_qcomm state to start them at zero"
                )


def load_residuals(hooks: dict[str, Any], group: Any, entries: dict[str, Any], label: str) -> None:
    """Copy saved residuals into the hooks' buffers; without saved ones, start from zero."""
    check_residuals(hooks, group, entries, label)
    for name, hook in hooks.items():
        for site, buf in _buffers(hook, group).items():
            saved = entries.get(f"{name}.{site}")
            if saved is None:
                buf.zero_()
                continue
            local = saved.to_local() if isinstance(saved, DTensor) else saved
            buf.view(-1).copy_(local.reshape(-1))


__all__ = ["ScaleSource", "call_feedback", "check_residuals", "load_residuals",
           "residual_buffers", "residual_bytes", "residual_entries", "scaler_scale",
           "shard_numel", "value_layout"]

"""Gradient accumulation under HSDP: one all-reduce across replicas per optimizer step.

FSDP2 reduces each micro-batch's gradients as its backward ends. Under HSDP that is a
reduce-scatter inside the node and an all-reduce across replicas, the traffic that crosses
nodes, on every micro-batch, unless ``set_requires_all_reduce(False)`` is set: FSDP then keeps
adding the reduce-scatter outputs into one sharded buffer and all-reduces the sum once, at the
micro-batch where the flag is back on. (``set_requires_gradient_sync(False)`` would skip the
reduce-scatter too, but then every rank keeps its unsharded gradients until the last
micro-batch: ``world`` times the sharded gradient memory. Inside a node the reduce-scatter is
the cheap hop, so it stays.) The sum of the partial outputs all-reduced once is what K
all-reduces add up to: the gradients are FSDP's own, and a quantized replica hop quantizes one
sum instead of K parts. torchtitan (0.2.2 and 0.3) sets neither flag.

:class:`ReplicaSync` holds the schedule for the FSDP modules of torchtitan's model parts: each
adapter calls :meth:`~ReplicaSync.before_microbatch` before each micro-batch's forward (0.3: its
Trainer's ``forward_backward_step``; 0.2.2: a forward pre-hook on the model part, as its stock
Trainer cannot be subclassed from a train spec) and :meth:`~ReplicaSync.attach_optimizers` ties
the count to the optimizer steps: a step starts a new count, and a step with a sum still waiting
for its all-reduce (fewer micro-batches than the schedule expects, or a forward the count missed)
raises instead of stepping on gradients the replicas never combined.

Inactive (changes nothing) with one micro-batch per step, without a replica group of two or
more, and under pipeline parallelism, whose schedule sets FSDP's gradient sync itself on every
stage (``torch.distributed.pipelining``: off for all but the last pipeline micro-batch, then on
for the whole stage).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Optional

import torch

from ..fsdp import internals as fsdp
from ..fsdp.hsdp import is_isolated, original_replicate_group

logger = logging.getLogger(__name__)


def _fsdp_modules(model_parts: Iterable[torch.nn.Module]) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for part in model_parts for m in part.modules() if isinstance(m, FSDPModule)]


def _replicas(module: Any) -> int:
    """The largest replica group of the module's parameter groups (1 without HSDP)."""
    sizes = [1]
    for g in fsdp.param_groups(module):
        if g is not None:
            rep = original_replicate_group(g)
            sizes.append(rep.size() if rep is not None else 1)
    return max(sizes)


class ReplicaSync:
    """Skip FSDP's all-reduce across replicas on all but the last of ``microbatches``
    micro-batches of each optimizer step (see the module docstring).

    ``active`` says whether it does anything; ``why`` says why not (for the log)."""

    def __init__(self, model_parts: list[torch.nn.Module], microbatches: int, *,
                 pipelined: bool = False) -> None:
        self.modules = _fsdp_modules(model_parts)
        self.microbatches = max(1, int(microbatches))
        self.replicas = max((_replicas(m) for m in self.modules), default=1)
        self.why = ""
        if any(is_isolated(g) for m in self.modules for g in fsdp.param_groups(m)):
            self.why = ("DiLoCo: the replica groups train by themselves (FSDP's all-reduce "
                        "across replicas is isolated)")
        elif self.microbatches == 1:
            self.why = "one micro-batch per step"
        elif not self.modules:
            self.why = "no FSDP modules"
        elif self.replicas < 2:
            self.why = "no replica group (not HSDP)"
        elif pipelined:
            self.why = ("pipeline parallelism: the pipeline schedule sets FSDP's gradient sync "
                        "itself")
        self.active = not self.why
        self.seen = 0  # micro-batches of the current optimizer step
        self._hooks: list[Any] = []

    def describe(self) -> str:
        if self.active:
            return (f"HSDP all-reduce across {self.replicas} replicas: once per optimizer step, "
                    f"at the last of {self.microbatches} micro-batches "
                    "(set_requires_all_reduce(False) before the others)")
        return f"HSDP all-reduce across replicas: FSDP2's schedule ({self.why})"

    def _set(self, all_reduce: bool) -> None:
        for m in self.modules:
            m.set_requires_all_reduce(all_reduce, recurse=False)

    def start_step(self) -> None:
        """A new optimizer step begins: count its micro-batches from zero."""
        self.seen = 0
        if self.active:
            self._set(self.microbatches == 1)

    def before_microbatch(self) -> bool:
        """Call before each micro-batch's forward; returns whether this micro-batch
        all-reduces across replicas (always True when inactive)."""
        if not self.active:
            return True
        self.seen += 1
        last = self.seen >= self.microbatches
        self._set(last)
        return last

    def pending(self) -> list[str]:
        """FSDP modules holding a reduce-scatter sum that no all-reduce has consumed yet."""
        return [type(m).__name__ for m in self.modules
                for g in fsdp.param_groups(m)
                if g is not None and fsdp.partial_reduce_output(g) is not None]

    def check_before_step(self) -> None:
        if not self.active:
            return
        pending = self.pending()
        if pending:
            raise RuntimeError(
                f"fsdp_qcomm: an optimizer step after {self.seen} micro-batch(es), with the "
                f"all-reduce across replicas skipped on the last one ({len(pending)} FSDP "
                f"module(s) still hold their reduce-scatter sums; expected "
                f"{self.microbatches} micro-batches per step): the replicas' gradients were "
                "never combined. Every step must run the configured number of micro-batches "
                "through the model part's forward"
            )

    def attach_optimizers(self, optimizers: Any) -> None:
        """Check before and restart the count after every step of ``optimizers`` (a
        ``torch.optim.Optimizer``, such as torchtitan's ``OptimizersContainer``)."""
        if not self.active:
            return
        self._hooks.append(optimizers.register_step_pre_hook(
            lambda *_a, **_k: self.check_before_step()))
        self._hooks.append(optimizers.register_step_post_hook(
            lambda *_a, **_k: self.start_step()))

    def install_forward_hook(self, model_part: torch.nn.Module) -> None:
        """torchtitan 0.2.2: count micro-batches at the model part's training forwards (a
        forward with gradients enabled, in training mode; evaluation runs under no_grad)."""
        if not self.active:
            return

        def pre_forward(module: torch.nn.Module, _args: Any) -> None:
            if torch.is_grad_enabled() and module.training:
                if self.seen >= self.microbatches:  # a step the optimizer hooks did not see
                    self.seen = 0
                self.before_microbatch()

        self._hooks.append(model_part.register_forward_pre_hook(pre_forward))

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self.active:
            self._set(True)


def replica_sync_of(model_parts: Optional[Iterable[torch.nn.Module]]) -> Optional[ReplicaSync]:
    """The active :class:`ReplicaSync` an adapter attached to the model parts (None if none)."""
    from .comm_stats import attachment_of

    for att in attachment_of(model_parts):
        sync = getattr(att, "replica_sync", None)
        if sync is not None and sync.active:
            return sync
    return None


__all__ = ["ReplicaSync", "replica_sync_of"]

"""The outer step of one fragment on one rank: pseudo-gradient, all-reduce, optimizer, write.

``Fragment`` owns this rank's outer state for one fragment, laid out like its weights (the local
FSDP shards of the fragment's parameters, in order, one flat buffer):

* ``global_``: the start-of-round weights (fp32), identical on every replica;
* the outer optimizer over ``global_`` (by default ``torch.optim.SGD``, Nesterov momentum:
  its momentum buffer is one more flat fp32 buffer, identical on every replica);
* with error feedback, the residuals of this rank's encodings (``FeedbackState``; its own).

A sync: ``pseudo_gradient()`` (``global_ - local``, fp32), ``outer_all_reduce`` over the
replicas (the contribution-weighted mean, bit-identical on every replica), ``outer_step(avg)``
(the optimizer moves ``global_`` by it) and ``write(alpha)`` (the parameters become the new
``global_``, or ``lerp(global_, local, alpha)``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup, ReduceOp

from ..codec import RngKey
from ..collectives.error_feedback import FeedbackState
from ..collectives.replica_reduce import (
    all_reduce_plain,
    all_reduce_quantized,
    feedback_shapes,
    replica_key,
)
from ..config import QuantSpec
from ..stats import CommStats

OptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]

#: stats kinds: the pseudo-gradient all-reduce, the contribution weights (torchft), the
#: one-time copy of replica 0's weights (``init_sync``)
KIND = "outer_allreduce"
KIND_WEIGHT = "outer_weight"
KIND_INIT = "outer_init"
# Keys of the outer all-reduce never repeat the per-step replica all-reduce's streams.
_OUTER_SALT = 0x0D1


def outer_key(seed: int, sync: int, rank: int, fragment: int) -> RngKey:
    """The RNG key of sync ``sync``'s all-reduce of ``fragment`` on replica rank id ``rank``."""
    return replica_key(seed, sync, rank, fragment).fold(_OUTER_SALT)


class ParamRef:
    """A parameter by owner and attribute (read afresh each time: FSDP may swap the object)."""

    def __init__(self, name: str, module: nn.Module, attr: str) -> None:
        self.name = name
        self.module = module
        self.attr = attr

    @property
    def param(self) -> torch.Tensor:
        return getattr(self.module, self.attr)

    def local(self) -> torch.Tensor:
        """This rank's shard (a DTensor's local tensor; a plain tensor itself), detached but
        sharing storage and version counter with the parameter."""
        p = self.param
        local = p.to_local() if hasattr(p, "to_local") else p
        return local.detach()

    def shapes(self) -> tuple[list[int], list[int]]:
        """(local shape, global shape)."""
        p = self.param
        return list(self.local().shape), list(p.shape)


def default_optimizer(lr: float, momentum: float, nesterov: bool) -> OptimizerFactory:
    def build(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=nesterov)

    return build


class Fragment:
    """One fragment's outer state on this rank (see the module docstring)."""

    def __init__(self, index: int, refs: Sequence[ParamRef], factory: OptimizerFactory,
                 error_feedback: bool) -> None:
        self.index = index
        self.refs = list(refs)
        locals_ = [r.local() for r in self.refs]
        for r, t in zip(self.refs, locals_):
            if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                raise TypeError(
                    f"DiLoCo: parameter {r.name!r} is {t.dtype}; outer steps keep fp32 "
                    "start-of-round weights for float32/bfloat16/float16 parameters"
                )
        self.sizes = [t.numel() for t in locals_]
        self.numel = sum(self.sizes)
        self.device = locals_[0].device if locals_ else torch.device("cpu")
        self.global_ = self._flat(locals_)
        self._factory = factory
        self.optimizer = factory([self.global_])
        self._template_bytes: Optional[int] = None
        self.feedback = FeedbackState() if error_feedback else None

    # ---- the weights --------------------------------------------------------------------
    def _flat(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        if not tensors:
            return torch.zeros(0, dtype=torch.float32, device=self.device)
        return torch.cat([t.reshape(-1).to(torch.float32) for t in tensors])

    def _locals(self) -> list[torch.Tensor]:
        out = [r.local() for r in self.refs]
        for r, t, n in zip(self.refs, out, self.sizes):
            if t.numel() != n:
                raise RuntimeError(
                    f"DiLoCo: parameter {r.name!r} holds {t.numel()} values on this rank, its "
                    f"shard held {n}: the module is unsharded (call its reshard()) or was "
                    "re-sharded differently"
                )
        return out

    def local_flat(self) -> torch.Tensor:
        return self._flat(self._locals())

    def pseudo_gradient(self) -> torch.Tensor:
        """``global_ - local`` in a new fp32 buffer (what the all-reduce averages)."""
        return self.global_ - self.local_flat()

    @torch.no_grad()
    def write(self, alpha: float = 0.0) -> None:
        """Set the parameters to ``global_`` (``alpha`` > 0: to ``lerp(global_, local,
        alpha)``), through their local shards."""
        off = 0
        for local, n in zip(self._locals(), self.sizes):
            new = self.global_[off:off + n].view(local.shape)
            if alpha:
                new = torch.lerp(new, local.to(torch.float32), alpha)
            local.copy_(new)
            off += n

    @torch.no_grad()
    def write_flat(self, flat: torch.Tensor) -> None:
        """Set the parameters' local shards from one flat buffer (``local_flat`` order)."""
        off = 0
        for local, n in zip(self._locals(), self.sizes):
            local.copy_(flat[off:off + n].view(local.shape))
            off += n

    @torch.no_grad()
    def outer_step(self, avg: torch.Tensor) -> None:
        """One outer optimizer step of ``global_`` along the averaged pseudo-gradient."""
        self.global_.grad = avg
        try:
            self.optimizer.step()
        finally:
            self.global_.grad = None

    # ---- outer optimizer state (checkpoints) ------------------------------------------------
    def optimizer_state(self) -> tuple[dict[str, Any], bool]:
        """(the optimizer's per-parameter state, whether it exists yet). Before the first outer
        step it does not: then zeros shaped like it (a probe optimizer on a scratch buffer
        shows the shapes), so a checkpoint template always has the same entries."""
        state = self.optimizer.state.get(self.global_)
        if state:
            return dict(state), True
        scratch = torch.zeros_like(self.global_)
        scratch.grad = torch.zeros_like(scratch)
        probe = self._factory([scratch])
        probe.step()
        template = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v
                    for k, v in probe.state.get(scratch, {}).items()}
        return template, False

    def load_optimizer_state(self, state: dict[str, Any], present: bool) -> None:
        own = self.optimizer.state_dict()
        if present:
            own["state"] = {0: {k: v.clone() if isinstance(v, torch.Tensor) else v
                                for k, v in state.items()}}
        else:
            own["state"] = {}
        self.optimizer.load_state_dict(own)

    def optimizer_bytes(self) -> int:
        """Bytes of the optimizer's state (before its first step: of the state it will
        create, measured once on a probe)."""
        present = bool(self.optimizer.state.get(self.global_))
        if not present and self._template_bytes is not None:
            return self._template_bytes
        state, _ = self.optimizer_state()
        n = sum(v.numel() * v.element_size() for v in state.values()
                if isinstance(v, torch.Tensor))
        if not present:
            self._template_bytes = n
        return n

    # ---- error feedback --------------------------------------------------------------------
    def residuals(self, replicas: int, spec: Optional[QuantSpec],
                  hadamard: bool) -> dict[str, torch.Tensor]:
        """This rank's residual buffers for ``replicas`` replicas (zeros when new)."""
        if self.feedback is None or spec is None:
            return {}
        return {site: self.feedback.buffer(site, shape, self.device)
                for site, shape in feedback_shapes(self.numel, replicas, spec, hadamard).items()}

    def residual_bytes(self, replicas: int, spec: Optional[QuantSpec], hadamard: bool) -> int:
        if self.feedback is None or spec is None:
            return 0
        shapes = feedback_shapes(self.numel, replicas, spec, hadamard)
        return 4 * sum(torch.Size(s).numel() for s in shapes.values())


def outer_all_reduce(
    buf: torch.Tensor, weight: float, group: ProcessGroup, spec: Optional[QuantSpec],
    key: RngKey, *, hadamard: bool, feedback: Optional[FeedbackState], stats: CommStats,
    remote_peers: int, weighted: bool,
) -> float:
    """Replace ``buf`` (this replica's pseudo-gradient) by the contribution-weighted mean over
    ``group``, bit-identical on every replica, and return the summed weight. ``weight`` 0 sends
    zeros (and touches no residual). ``weighted``: all-reduce the weights first (one fp32
    value, unquantized: torchft replicas may heal); else every replica counts 1."""
    replicas = dist.get_world_size(group)
    total = float(replicas)
    if weighted:
        w = torch.tensor([float(weight)], dtype=torch.float32, device=buf.device)
        if replicas > 1:
            dist.all_reduce(w, op=ReduceOp.SUM, group=group)
            stats.record(KIND_WEIGHT, sent_bytes=4, recv_bytes=4, elements=0,
                         baseline_bytes=0, cross_node_bytes=4 * remote_peers)
        total = float(w.item())
    if weight == 0:
        buf.zero_()
    elif weight != 1.0:
        buf.mul_(weight)
    if spec is None:
        all_reduce_plain(buf, group, op=ReduceOp.SUM, stats=stats, kind=KIND,
                         remote_peers=remote_peers)
    else:
        all_reduce_quantized(buf, group, spec, key, hadamard=hadamard, op=ReduceOp.SUM,
                             stats=stats, kind=KIND, remote_peers=remote_peers,
                             feedback=feedback if weight else None)
    if total > 0:
        buf.div_(total)
    return total


__all__ = ["Fragment", "KIND", "KIND_INIT", "KIND_WEIGHT", "OptimizerFactory", "ParamRef",
           "default_optimizer", "outer_all_reduce", "outer_key"]

"""torchft: replica groups that drop out and rejoin, with fsdp-qcomm's quantized all-reduce.

torchft (``pip install fsdp-qcomm[ft]``, torchft 0.2) owns membership: a lighthouse forms a
quorum of the live replica groups, each group's ``Manager`` reconfigures its process group when
the quorum changes, heals a replica that is behind from an up-to-date one (the state registered
with ``register_state_dict_fn``) and votes whether a step commits. fsdp-qcomm owns the outer
step: its quantized all-reduce runs on the Manager's process group in place of torchft's FP8
one, and ``DiLoCo`` keeps the start-of-round weights and the outer optimizer.

What this module adds:

* ``ProcessGroupGloo`` (and ``ProcessGroupNCCL``, not run here): torchft's plus the
  single-tensor all-gather the quantized all-reduce uses (``all_gather_single`` /
  ``_allgather_base``, forwarded to the current inner group like torchft's other
  collectives) and a ``rank()`` that is the replica rank (torchft's wrapper reports 0
  everywhere). Pass it as ``Manager(pg=...)``.
* ``FTReplicas`` (``diloco.replicas.ReplicaGroup``; ``DiLoCo(replicas=manager)`` builds it):
  ``begin_sync`` is ``manager.start_quorum()`` (synchronous: ``use_async_quorum=False``),
  ``commit`` is ``manager.should_commit()`` after ``report_error`` of a failed all-reduce; a
  replica that healed in this quorum contributes weight 0 (it holds another replica's state, so
  its pseudo-gradient would count that one twice); residuals restart at every quorum change
  and are never transferred.

Start-up. ``DiLoCo``'s constructor runs one quorum. A replica that heals there from a replica
that has committed steps joins the sync that replica is in (weight 0, same fragment, merged
``delay`` inner steps later); otherwise every member of the quorum is starting: they pass a
one-value all-reduce (so that a replica serving its state to a healing one keeps serving until
that one has it) and commit once, so the quorum at the first sync point does not heal again
(torchft's ``init_sync`` heals replicas at step 0).
"""

from __future__ import annotations

from typing import Any, Hashable, Optional

import torch
import torch.distributed as dist
from torchft.process_group import ProcessGroupGloo as _FTGloo
from torchft.process_group import ProcessGroupNCCL as _FTNCCL

STATE_KEY = "fsdp_qcomm_diloco"


class _QCommCollectives:
    """What ``all_reduce_quantized`` needs beyond torchft's wrapper: the single-tensor
    all-gather (forwarded to the current inner group, inside torchft's run context like its
    other collectives) and the replica rank (the wrapper is built as rank 0 of 1)."""

    #: what ``FTReplicas`` checks (set it on a process group of your own that forwards
    #: ``all_gather_single`` and reports the replica rank)
    QCOMM_COLLECTIVES = True

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> Any:
        with self._run_context():
            return self._wrap_work(self.parent.all_gather_single(output, input, opts), opts)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> Any:
        with self._run_context():
            return self._wrap_work(self.parent._allgather_base(output, input, opts), opts)

    def rank(self) -> int:
        """The replica rank in the current quorum."""
        return self.parent.rank()


class ProcessGroupGloo(_QCommCollectives, _FTGloo):
    """``torchft.ProcessGroupGloo`` with the collectives ``all_reduce_quantized`` needs."""


class ProcessGroupNCCL(_QCommCollectives, _FTNCCL):
    """``torchft.ProcessGroupNCCL`` with the same additions (keeps torchft's abort on
    timeout). Not run here: these machines have no GPU."""


def _check_pg(pg: Any) -> None:
    if not getattr(pg, "QCOMM_COLLECTIVES", False):
        raise TypeError(
            f"DiLoCo over torchft needs the Manager's process group to be "
            f"fsdp_qcomm.diloco.ft.ProcessGroupGloo (got {type(pg).__name__}): torchft's "
            "wrapper forwards no single-tensor all-gather and reports rank 0 on every replica. "
            "Build the Manager with pg=fsdp_qcomm.diloco.ft.ProcessGroupGloo(timeout=...)"
        )


class FTReplicas:
    """The replicas of a torchft ``Manager`` (see the module docstring)."""

    def __init__(self, manager: Any) -> None:
        if getattr(manager, "_use_async_quorum", False):
            raise ValueError(
                "DiLoCo over torchft needs Manager(use_async_quorum=False): the quorum (and a "
                "heal) must finish before the pseudo-gradient is taken"
            )
        _check_pg(manager._pg)
        self.manager = manager
        self._engine: Any = None
        self._healed = False

    @property
    def group(self) -> Any:
        return self.manager._pg

    @property
    def background_group(self) -> Any:
        # The main thread runs no collective on it between a launch and its merge.
        return self.manager._pg

    @property
    def remote_peers(self) -> int:
        return max(self.size() - 1, 0)

    def size(self) -> int:
        return self.manager._pg.size()

    def rank(self) -> int:
        return self.manager._pg.rank()

    def start(self, engine: Any) -> Optional[float]:
        """``DiLoCo``'s start-up (module docstring): the contribution weight when joining a
        sync in progress, None when started fresh."""
        self._engine = engine
        self.manager.register_state_dict_fn(STATE_KEY, self._load, self._save)
        weight = self.begin_sync()
        if self._healed and self.manager.current_step() > 0:
            return weight
        if self.usable() and self.size() > 1:
            dist.all_reduce(torch.zeros(1, device=engine.device), group=self.group)
        self.commit(None)
        return None

    def begin_sync(self) -> float:
        self._healed = False
        self.manager.start_quorum()
        if self._healed or not self.manager.is_participating():
            return 0.0
        return 1.0

    def usable(self) -> bool:
        """False when the latest quorum (or a heal in it) failed: the process group may not
        be configured, so no collective is issued (torchft's own all-reduce returns a no-op
        work then) and the merge does not commit."""
        return self.manager.errored() is None

    def commit(self, error: Optional[BaseException]) -> bool:
        if error is not None:
            self.manager.report_error(error if isinstance(error, Exception)
                                      else RuntimeError(str(error)))
        return bool(self.manager.should_commit())

    def membership(self) -> Hashable:
        if self.manager._quorum_id < 0:  # no quorum yet: no process group either
            return None
        return (self.manager._quorum_id, self.size(), self.rank())

    @property
    def healed(self) -> bool:
        """This replica healed in the latest quorum."""
        return self._healed

    def _save(self) -> dict[str, Any]:
        return self._engine.ft_state_dict()

    def _load(self, state: dict[str, Any]) -> None:
        self._engine.ft_load_state_dict(state)
        self._healed = True


__all__ = ["FTReplicas", "ProcessGroupGloo", "ProcessGroupNCCL", "STATE_KEY"]

"""Learned level tables kept bit-identical on every rank of a process group.

One ``LevelSync`` serves one collective of one module (its weights or its gradients). Every
``refresh_every`` steps and on first use (with ``early_refreshes``, also at the powers of two
below ``refresh_every``: qWD's first differences are the bare optimizer update, later ones also
carry the previous step's rounding error; a table fitted to the first ones and kept 100 steps
rounds the later ones so coarsely that the reference drifts, measured with
``benchmarks/qwd_drift.py`` at 2 bits) each rank builds an int64 histogram of the
normalized values it is about to send (``codec.levels.histogram``, fp64, weighted by squared
group scales), the histograms are summed with one ``all_reduce``, group rank 0 fits the table
(``codec.levels.fit_levels``, fp64 numpy) and broadcasts its 2^b fp32 levels. Broadcasting
rather than fitting everywhere keeps the tables bit-identical whatever the all-reduce's
summation order or the machines' numpy builds do. Between refreshes the table is reused as is.

Cost per refresh: ``bins`` fp64 weights all-reduced plus ``4 * 2^b`` bytes broadcast, recorded
under the stats kind ``"levels_sync"`` (elements 0, baseline 0: pure overhead). Callers must
refresh on every rank at the same steps (SPMD), like any collective.

Checkpoints: ``checkpoint_state`` / ``load_checkpoint_state`` carry the table, the step it was
fitted at and the refresh count, so a resumed run refits at the steps the uninterrupted run
does and encodes with the same table in between (a run that lost the table would refit at its
first call, on other values, and send other bits).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch
import torch.distributed as dist

from ..codec.levels import DEFAULT_BINS, LEVELS_DTYPE, fit_levels, histogram, num_levels
from ..config import QuantSpec
from ..stats import CommStats

KIND = "levels_sync"


class LevelSync:
    """The current level table of one collective, refreshed every ``refresh_every`` steps."""

    def __init__(self, spec: QuantSpec, refresh_every: int, bins: int = DEFAULT_BINS,
                 early_refreshes: bool = False) -> None:
        bad_type = isinstance(refresh_every, bool) or not isinstance(refresh_every, int)
        if bad_type or refresh_every < 1:
            raise ValueError(f"refresh_every must be an int >= 1, got {refresh_every!r}")
        self.spec = spec
        self.refresh_every = refresh_every
        self.early_refreshes = early_refreshes
        self.bins = bins
        self.levels: Optional[torch.Tensor] = None
        self.refreshes = 0
        self._step: Optional[int] = None

    def due(self, step: int) -> bool:
        if self.levels is None:
            return True
        if step == self._step:
            return False
        early = (self.early_refreshes and 0 < step < self.refresh_every
                 and step & (step - 1) == 0)
        return early or step % self.refresh_every == 0

    def table(
        self,
        x: Union[torch.Tensor, Sequence[torch.Tensor]],
        group: Optional[dist.ProcessGroup],
        step: int,
        stats: Optional[CommStats] = None,
    ) -> torch.Tensor:
        """The table to encode ``x`` with at ``step``; refits it from every rank's ``x`` when
        due (collective then). ``x``: rows ``[..., n]`` or a list of such blocks of different
        lengths, grouped as they will be encoded (one wire row each)."""
        if self.due(step):
            self._refresh(x, group, stats)
            self._step = step
        assert self.levels is not None
        return self.levels

    def checkpoint_state(self, device: torch.device) -> dict[str, Any]:
        """The table (a copy), ``valid`` (0 before the first fit: the table is then zeros of
        the right size, so a checkpoint loader can use it as a template), the step it was
        fitted at (-1 before the first fit) and the number of refreshes so far."""
        if self.levels is None:
            table = torch.zeros(num_levels(self.spec), dtype=LEVELS_DTYPE, device=device)
            return {"table": table, "valid": 0, "step": -1, "refreshes": self.refreshes}
        return {"table": self.levels.detach().clone(), "valid": 1, "step": int(self._step),
                "refreshes": self.refreshes}

    def check_checkpoint_state(self, state: Any, what: str) -> None:
        """Raise ``ValueError`` naming ``what`` unless ``state`` is what ``checkpoint_state``
        returns for this table's bit width."""
        keys = ("table", "valid", "step", "refreshes")
        if not isinstance(state, dict) or any(k not in state for k in keys):
            raise ValueError(f"{what}: the saved level table state needs the entries {keys}")
        table, n = state["table"], num_levels(self.spec)
        if not isinstance(table, torch.Tensor) or table.numel() != n:
            size = table.numel() if isinstance(table, torch.Tensor) else type(table).__name__
            raise ValueError(f"{what}: the saved level table has {size} levels, this run's "
                             f"{self.spec.bits}-bit quantizer needs {n}")

    def load_checkpoint_state(self, state: dict[str, Any], device: torch.device) -> None:
        """Restore what ``checkpoint_state`` saved (``check_checkpoint_state`` first)."""
        self.refreshes = int(state["refreshes"])
        if not int(state["valid"]):
            self.levels, self._step = None, None
            return
        self.levels = state["table"].detach().to(device=device, dtype=LEVELS_DTYPE).clone()
        self._step = int(state["step"])

    def _refresh(
        self,
        x: Union[torch.Tensor, Sequence[torch.Tensor]],
        group: Optional[dist.ProcessGroup],
        stats: Optional[CommStats],
    ) -> None:
        blocks = [x] if isinstance(x, torch.Tensor) else list(x)
        if not blocks:
            raise ValueError("LevelSync needs at least one block of values to fit levels on")
        dev = blocks[0].device
        counts = torch.zeros(self.bins, dtype=torch.float64)
        for b in blocks:
            counts += histogram(b, self.spec, self.bins)
        counts = counts.to(dev)
        dist.all_reduce(counts, group=group)
        if dist.get_rank(group) == 0:
            levels = fit_levels(counts, self.spec).to(dev)
        else:
            levels = torch.empty(num_levels(self.spec), dtype=LEVELS_DTYPE, device=dev)
        dist.broadcast(levels, group=group, group_src=0)
        self.levels = levels
        self.refreshes += 1
        if stats is not None:
            nbytes = counts.nbytes + levels.nbytes
            stats.record(KIND, sent_bytes=nbytes, recv_bytes=nbytes, elements=0, baseline_bytes=0)


__all__ = ["KIND", "LevelSync"]

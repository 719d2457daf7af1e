"""Counters of what the hooks hand to the process group, per collective kind.

A collective records, per call, the bytes of the input it passes to ``torch.distributed``
(``sent_bytes``), the bytes of the output it receives into (``recv_bytes``), how many logical
values those bytes carry (``elements``), the bytes FSDP's own collective would have passed
for the same call (``baseline_bytes``), and how many of the bytes this rank sends are addressed
to ranks on other nodes (``cross_node_bytes``: what the slow inter-node link must carry for this
rank, whatever algorithm the process group uses), so ratios and bits per element come from the
same counts the tests check against the process group.

The ``summary`` adds what FSDP2's own collectives would have moved for the same calls, over all
kinds: ``baseline_bytes`` and ``baseline_cross_node_bytes`` (FSDP2's all-gather hands its shard
to every member, its reduce-scatter a ``1/W`` slice of its input to each, its all-reduce ``2/R``
of its buffer to each replica; the remote members' share crosses nodes). A collective done in
two hops (two-level gradients, the node-sharded reference's hop inside the node) records the
baseline on each hop's kind, so per-kind ratios read against FSDP2, but counts it once there.
Collectives left to FSDP2 (the gradients under a weights-only preset) are in neither figure.

Calls that send nothing (a weight gather that reuses unchanged weights, world size 1) count in
``calls`` and ``elements``, so ``bits_per_element`` is the average over every call, what the
collective costs per step; ``sending_calls`` / ``sending_elements`` count only the calls that
sent bytes, and ``sending_bits_per_element`` is the cost of one such call (the wire format's
bits per element, plus full-precision resends).
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass


@dataclass
class KindStats:
    calls: int = 0
    sent_bytes: int = 0
    recv_bytes: int = 0
    elements: int = 0
    baseline_bytes: int = 0
    cross_node_bytes: int = 0
    sending_calls: int = 0
    sending_elements: int = 0

    @property
    def bits_per_element(self) -> float:
        """Bits sent per element, averaged over every call (those that sent nothing too)."""
        return 8.0 * self.sent_bytes / self.elements if self.elements else 0.0

    @property
    def sending_bits_per_element(self) -> float:
        """Bits sent per element by the calls that sent something."""
        return 8.0 * self.sent_bytes / self.sending_elements if self.sending_elements else 0.0

    @property
    def ratio_vs_baseline(self) -> float:
        return self.sent_bytes / self.baseline_bytes if self.baseline_bytes else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["bits_per_element"] = self.bits_per_element
        d["sending_bits_per_element"] = self.sending_bits_per_element
        d["ratio_vs_baseline"] = self.ratio_vs_baseline
        return d


class CommStats:
    """Thread-safe accumulator shared by all hooks of one ``enable`` handle.

    ``count_step`` (called after every optimizer step over the model's parameters) counts a
    training step when a collective ran since the last counted one, so per-step figures are not
    diluted by steps that sent nothing of ours (for example the dummy step that
    ``torch.distributed.checkpoint`` runs to build optimizer state on load).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kinds: dict[str, KindStats] = {}
        self.notes: set[str] = set()
        self.steps = 0
        self._calls = 0
        self._calls_at_step = 0
        self._baseline = self._baseline_cross = 0

    def record(
        self, kind: str, *, sent_bytes: int, recv_bytes: int, elements: int, baseline_bytes: int,
        cross_node_bytes: int = 0, baseline_cross_node_bytes: int = 0,
        shares_baseline: bool = False,
    ) -> None:
        """One call. ``baseline_cross_node_bytes``: what FSDP2's collective would have sent to
        other nodes for it; ``shares_baseline``: another record of the same call (its other
        hop) counts the baseline in the summary."""
        with self._lock:
            if not shares_baseline:
                self._baseline += int(baseline_bytes)
                self._baseline_cross += int(baseline_cross_node_bytes)
            k = self._kinds.setdefault(kind, KindStats())
            k.calls += 1
            self._calls += 1
            k.sent_bytes += int(sent_bytes)
            k.recv_bytes += int(recv_bytes)
            k.elements += int(elements)
            k.baseline_bytes += int(baseline_bytes)
            k.cross_node_bytes += int(cross_node_bytes)
            if sent_bytes > 0:
                k.sending_calls += 1
                k.sending_elements += int(elements)

    def note(self, text: str) -> None:
        """Something the user should know (for example a module that fell back to FSDP's gather)."""
        with self._lock:
            self.notes.add(text)

    def count_step(self) -> None:
        with self._lock:
            if self._calls > self._calls_at_step:
                self.steps += 1
                self._calls_at_step = self._calls

    def snapshot(self) -> dict:
        """``{kind: {calls, sent_bytes, recv_bytes, elements, baseline_bytes, cross_node_bytes,
        sending_calls, sending_elements, bits_per_element, sending_bits_per_element,
        ratio_vs_baseline}, "summary": {...}, "notes": [...]}``. ``summary``: ``steps``
        (``count_step``); ``sent_bytes`` and ``cross_node_bytes`` over all kinds, and FSDP2's
        ``baseline_bytes`` and ``baseline_cross_node_bytes`` for the same calls (module
        docstring); each also per step (0.0 before the first counted step)."""
        with self._lock:
            out: dict = {k: v.as_dict() for k, v in sorted(self._kinds.items())}
            totals = {
                "sent_bytes": sum(v.sent_bytes for v in self._kinds.values()),
                "cross_node_bytes": sum(v.cross_node_bytes for v in self._kinds.values()),
                "baseline_bytes": self._baseline,
                "baseline_cross_node_bytes": self._baseline_cross,
            }
            steps = self.steps
            out["summary"] = {"steps": steps, **totals, **{
                f"{k}_per_step": v / steps if steps else 0.0 for k, v in totals.items()}}
            out["notes"] = sorted(self.notes)
            return out

    def reset(self) -> None:
        with self._lock:
            self._kinds.clear()
            self.steps = 0
            self._calls = self._calls_at_step = 0
            self._baseline = self._baseline_cross = 0


class TaggedStats:
    """A ``CommStats`` whose records go under ``<kind>:<tag>``: the collectives of parameter
    groups on another mesh than the model's own (MoE experts on their expert mesh) are counted
    apart from the dense ones, and everything else (notes, steps, snapshots) is the shared
    ``CommStats``'s."""

    def __init__(self, stats: CommStats, tag: str) -> None:
        self._stats = stats
        self.tag = tag

    def record(self, kind: str, **counts: int) -> None:
        self._stats.record(f"{kind}:{self.tag}", **counts)

    def __getattr__(self, name: str):
        return getattr(self._stats, name)


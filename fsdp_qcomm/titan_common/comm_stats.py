"""Communication figures from the fsdp_qcomm handles, for either torchtitan's metrics logger.

Both adapters' metrics processors hand their logging calls to a :class:`QCommRun`, which adds
``qcomm/*`` metrics (console, TensorBoard, W&B) for this rank. They are computed from the
cumulative counters of the ``fsdp_qcomm`` handles (``handle.stats()``), differenced between
logging steps and divided by the training steps in between (the handles' own count,
``stats()["summary"]["steps"]``: optimizer steps that followed traffic, so a resumed run, whose
checkpoint load runs a dummy optimizer step, divides correctly).

The counters are grouped by *collective* (:data:`COLLECTIVES`), each made of one or more stats
kinds:

* ``weight`` (``W``): the weight all-gather (``weight_allgather``);
* ``grad`` (``G``): the gradient reduce-scatter, one or two hops (``grad_intra``,
  ``grad_inter``; the hops of one call record the same baseline, so it is counted once);
* ``replica`` (``R``): HSDP's all-reduce of the reduced shards across replicas
  (``grad_replica``);
* ``levels`` (``L``): learned-level table refreshes (``levels_sync``; pure overhead, baseline 0);
* ``agreement`` (``A``): the change codes every rank agrees on before a root forward
  (``agreement``, ``verify_weight_writes``; a few bytes per module, pure overhead, baseline 0);
* ``tp_sync`` (``T``): under tensor parallelism, the TP-replicated parameters' reduced gradients
  averaged over their TP peers after a quantized reduction (``tp_peer_sync``, ``fsdp.tp_peers``;
  inside a node, pure overhead, baseline 0);
* ``weight_intra`` (``Wn``): the node-sharded qWD reference's second hop, an unquantized
  all-gather inside the node of the rebuilt slices (``weight_allgather_intra``): bytes that
  never leave a node, beyond FSDP2's own gather (which is the ``weight`` collective's
  baseline), so its baseline does not count in the total.

Per collective ``c`` that the handles measured:

* ``qcomm/<c>_bytes_per_step``, ``qcomm/<c>_recv_bytes_per_step``: bytes this rank handed to
  the process group and received (the library's ``sent_bytes`` / ``recv_bytes``);
* ``qcomm/<c>_baseline_bytes_per_step``: what FSDP2's own collective would have been handed for
  the same calls (``baseline_bytes``);
* ``qcomm/<c>_ratio_vs_unquantized`` = sent / baseline and ``qcomm/<c>_bits_per_elem`` = 8 x sent
  / elements FSDP would have sent (32.0 for a plain fp32 exchange; a qWD backward re-gather that
  reuses the reference sends 0 bits, so the weight figure averages forward and backward gathers);
* ``qcomm/<c>_sending_bits_per_elem``: the same per element of the calls that sent bytes (the
  wire format's cost of one exchange; a qWD gather of unchanged weights sends nothing);
* ``qcomm/<c>_<field>_per_step`` for any further counter the kinds record (for example
  ``cross_node_bytes``), and for byte counters ``qcomm/total_<field>_per_step`` summed over
  collectives;

plus ``qcomm/<kind>_bits_per_elem`` for every kind that carries values (the code width of each
gradient hop on the wire), and ``qcomm/total_ratio_vs_unquantized``.

Node-crossing bytes: ``qcomm/total_cross_node_bytes_per_step`` sums the measured collectives'
``cross_node_bytes``; ``qcomm/ref_<c>_crosses_nodes`` (1.0 or 0.0) says whether FSDP's group for
``c`` spans nodes (from the handles' node placement), so the console line's ``X-node`` figure can
say when a collective left to FSDP also crosses nodes, unmeasured.

A collective the handles do not replace (the gradients under a ``grad_scheme="none"`` preset,
HSDP's all-reduce until it is quantized) runs FSDP's own code: it is not measured, has no
per-collective figures, and the total ratio counts it at its reference size. A stats kind this
module does not know is not an error: it becomes a collective of its own (named after the
kind) and counts in the total, so a new collective of the library can never crash a run, nor
go uncounted.

The byte convention is the library's: the bytes of the input tensor passed to the collective
(for an all-gather this rank's shard, for a reduce-scatter all ``world`` rows, for an all-reduce
the shard). As an independent check, :func:`fsdp_reference` computes the same unquantized
baseline per step from the FSDP parameter groups (``qcomm/ref_*_bytes_per_step``); the tests
assert the two agree.

At the end rank 0 writes ``<dump_folder>/qcomm_summary.json`` (losses per logged step, figures,
the handles' final stats and gather modes, the resolved config), which the debug jobs and the
tests read. Nothing here imports torchtitan.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional

import torch

from ..fsdp import internals as fsdp
from ..fsdp.hsdp import original_replicate_group

logger = logging.getLogger(__name__)

#: attribute of each (parallelized) model part that carries its QCommAttachment
ATTACHMENT_ATTR = "_fsdp_qcomm"
SUMMARY_FILE = "qcomm_summary.json"


@dataclass
class QCommAttachment:
    """What ``install_qcomm`` leaves on a model part for the metrics and the checkpoint."""

    config: Any  # the resolved QCommConfig
    preset: str
    handle: Any = None  # what fsdp_qcomm.enable returned, None if not installed
    fsdp_modules: int = 0
    note: str = ""
    #: the adapter's ``accumulation.ReplicaSync`` (HSDP all-reduce once per optimizer step)
    replica_sync: Any = None


def attachment_of(model_parts: Iterable[torch.nn.Module] | None) -> list[QCommAttachment]:
    return [
        getattr(m, ATTACHMENT_ATTR)
        for m in (model_parts or [])
        if getattr(m, ATTACHMENT_ATTR, None) is not None
    ]


# --------------------------------------------------------------------------- collectives
@dataclass(frozen=True)
class Collective:
    """One collective the figures are grouped by, and the stats kinds it records under."""

    name: str  # figure prefix: qcomm/<name>_bytes_per_step
    tag: str  # console tag
    kinds: tuple[str, ...]
    #: every kind records the same baseline for one call (the hops of one reduce-scatter):
    #: count it once (the largest total), not summed
    shared_baseline: bool = False
    #: the Reference field pair that says what FSDP's own collective hands over per step
    reference: Optional[str] = None
    #: False: a hop FSDP2 does not have (its recorded baseline is its own bytes), so its
    #: baseline neither counts in the total nor gives a ratio
    counts_baseline: bool = True


COLLECTIVES: tuple[Collective, ...] = (
    Collective("weight", "W", ("weight_allgather",), reference="weight"),
    Collective("grad", "G", ("grad_intra", "grad_inter"), shared_baseline=True,
               reference="grad"),
    Collective("replica", "R", ("grad_replica",), reference="replica"),
    Collective("levels", "L", ("levels_sync",)),
    Collective("agreement", "A", ("agreement",)),
    Collective("weight_intra", "Wn", ("weight_allgather_intra",), counts_baseline=False),
    Collective("tp_sync", "T", ("tp_peer_sync",)),
)
_BY_KIND = {k: c for c in COLLECTIVES for k in c.kinds}
_BASE_FIELDS = {
    "calls": "calls", "sent_bytes": "sent", "recv_bytes": "recv", "elements": "elements",
    "baseline_bytes": "baseline",
}
#: top-level entries of ``handle.stats()`` that are not stats kinds
NOT_KINDS = ("notes", "summary")
_warned_kinds: set[str] = set()


def collective_of(kind: str) -> Collective:
    """The collective a stats kind belongs to; an unknown kind is a collective of its own. A
    kind tagged with a mesh (``weight_allgather:efsdp``: a parameter group on another mesh than
    the model's, as MoE experts; ``stats.TaggedStats``) belongs to the tagged copy of its
    collective (``weight:efsdp``, console tag ``W:efsdp``), figured like it and apart from it."""
    c = _BY_KIND.get(kind)
    if c is not None:
        return c
    base, _, tag = kind.partition(":")
    if tag and base in _BY_KIND:
        c = _BY_KIND[base]
        return dataclasses.replace(c, name=f"{c.name}:{tag}", tag=f"{c.tag}:{tag}",
                                   kinds=tuple(f"{k}:{tag}" for k in c.kinds))
    if kind not in _warned_kinds:
        _warned_kinds.add(kind)
        logger.warning(
            f"qcomm: stats kind {kind!r} is not one fsdp_qcomm.titan_common.comm_stats groups "
            "(weights, gradients, replicas, levels, agreement, tp_sync); it is logged as a "
            "collective of "
            "its own and counted in the total"
        )
    return Collective(kind, kind, (kind,))


def collective_named(name: str) -> Collective:
    """The collective whose figures are ``qcomm/<name>_*`` (an unknown kind's own name, or a
    mesh-tagged copy of a known collective)."""
    c = next((c for c in COLLECTIVES if c.name == name), None)
    if c is not None:
        return c
    base, _, tag = name.partition(":")
    known = next((c for c in COLLECTIVES if c.name == base), None)
    if tag and known is not None:
        return collective_of(f"{known.kinds[0]}:{tag}")
    return collective_of(name)


def _counter(value: Any) -> Optional[float]:
    """A cumulative counter (an int) as a float; None for anything else: the library's floats
    (``bits_per_element``, ``ratio_vs_baseline``, ...) are ratios of counters, recomputed per
    interval here, never summed."""
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return float(value)


def _counts_a_call(name: str) -> bool:
    """Counters that hops sharing one call each hold in full (not parts of a sum)."""
    return name == "baseline" or name.endswith(("calls", "elements"))


def split_stats(stats: Mapping) -> dict[str, dict[str, float]]:
    """Cumulative counters of one ``handle.stats()`` snapshot, grouped for the figures.

    Returns ``{collective name: {"calls", "sent", "recv", "elements", "baseline", <extra
    counters>...}}`` for the collectives the handle recorded, plus ``{"kind:<kind>": {"sent",
    "elements"}}`` per kind (for per-hop bits). Counters (int fields) add up over a
    collective's kinds, except that hops sharing a baseline count it once (the largest), and so
    their calls and elements. Extra counters a kind records (``cross_node_bytes``,
    ``sending_calls``, ``sending_elements``, ...) are kept under their own names; float fields
    (the library's ratios) and anything else are ignored. :data:`NOT_KINDS` are skipped.
    """
    out: dict[str, dict[str, float]] = {}
    for kind in sorted(k for k in stats if k not in NOT_KINDS):
        entry = stats[kind]
        if not isinstance(entry, Mapping):
            continue
        c = collective_of(kind)
        counters = out.setdefault(c.name, {})
        mine: dict[str, float] = {}
        for key, value in entry.items():
            v = _counter(value)
            if v is None:
                continue
            mine[_BASE_FIELDS.get(key, key)] = v
        for name, v in mine.items():
            shared = c.shared_baseline and _counts_a_call(name)
            counters[name] = max(counters.get(name, 0.0), v) if shared else (
                counters.get(name, 0.0) + v
            )
        out[f"kind:{kind}"] = {"sent": mine.get("sent", 0.0),
                               "elements": mine.get("elements", 0.0)}
    return out


def _add(a: dict[str, dict[str, float]], b: dict[str, dict[str, float]]) -> dict:
    out = {k: dict(v) for k, v in a.items()}
    for k, fields in b.items():
        mine = out.setdefault(k, {})
        for f, v in fields.items():
            mine[f] = mine.get(f, 0.0) + v
    return out


def flatten_counters(counters: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """``{"weight_sent": ..., "grad_calls": ..., "grad_intra_sent": ...}`` for the summary file."""
    flat: dict[str, float] = {}
    for k, fields in counters.items():
        prefix = k[len("kind:"):] if k.startswith("kind:") else k
        for f, v in fields.items():
            flat[f"{prefix}_{f}"] = v
    return dict(sorted(flat.items()))


def _ordered(names: Iterable[str]) -> list[Collective]:
    """Known collectives in their fixed order, then unknown ones by name."""
    names = set(names)
    known = [c for c in COLLECTIVES if c.name in names]
    return known + [collective_named(n) for n in sorted(names - {c.name for c in known})]


# --------------------------------------------------------------------------- reference
@dataclass
class Reference:
    """Unquantized FSDP2 collective input bytes of one rank per training step."""

    weight_bytes: float = 0.0
    weight_elements: float = 0.0
    grad_bytes: float = 0.0
    grad_elements: float = 0.0
    replica_bytes: float = 0.0  # HSDP: the all-reduce of the reduced shard across replicas
    replica_elements: float = 0.0
    groups: int = 0
    world_size: int = 1  # of the shard group
    replicas: int = 1
    #: collectives ("weight", "grad", "replica") whose FSDP group spans nodes (empty when the
    #: node placement is unknown)
    crossing: frozenset = frozenset()
    #: bytes FSDP2's own collectives would send to ranks on other nodes per step, with every
    #: collective in fp32 and under MixedPrecisionPolicy(bf16, fp32) (bf16 gathers, fp32
    #: reductions: torchtitan's default), by the library's convention (a gather sends the
    #: shard to each remote member, a reduce-scatter the rows of remote members, an all-reduce
    #: 2 (R - 1) / R of the buffer); 0 when the node placement is unknown
    cross_node_fp32_bytes: float = 0.0
    cross_node_bf16_fp32_bytes: float = 0.0

    def add(self, other: "Reference") -> "Reference":
        summed = {f.name: getattr(self, f.name) + getattr(other, f.name)
                  for f in dataclasses.fields(self) if f.name.endswith(("_bytes", "_elements"))}
        return Reference(
            **summed, groups=self.groups + other.groups,
            world_size=max(self.world_size, other.world_size),
            replicas=max(self.replicas, other.replicas),
            crossing=self.crossing | other.crossing,
        )

    def bytes_of(self, collective: Collective) -> float:
        return getattr(self, f"{collective.reference}_bytes") if collective.reference else 0.0

    def itemsize_of(self, collective: Collective) -> Optional[float]:
        """Bytes per element FSDP's own collective would send (None: no reference)."""
        if not collective.reference:
            return None
        elems = getattr(self, f"{collective.reference}_elements")
        return self.bytes_of(collective) / elems if elems else None


def _dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def fsdp_reference(model_parts: Iterable[torch.nn.Module], microbatches: int = 1,
                   ranks_per_node: Optional[int] = None) -> Reference:
    """Sum :class:`Reference` over every FSDP parameter group of ``model_parts``.

    Per group of padded shard size ``s`` elements on ``W`` ranks, with ``m`` microbatches: the
    all-gather is handed ``s`` elements in ``param_dtype``, ``m`` times in forward plus ``m``
    times in backward if the group reshards after forward (``W / r * s`` elements over the
    post-forward group of ``r`` ranks with ``reshard_after_forward=r``); the reduce-scatter is
    handed ``W * s`` elements in ``reduce_dtype``, ``m`` times; under HSDP the replica
    all-reduce is handed the ``s`` reduced elements, ``m`` times (FSDP all-reduces every
    microbatch unless ``set_requires_all_reduce(False)``, in which case it does so once per
    step; once per step too when an adapter's active ``accumulation.ReplicaSync`` is attached
    to the parts). Node-crossing bytes need the node size: the parts' handles', else
    ``ranks_per_node``. Reads FSDP2 internals; dtypes are final only after FSDP's lazy init
    (the first forward), so call it after the first step.
    """
    from torch.distributed.fsdp import FSDPModule

    model_parts = list(model_parts)
    atts = attachment_of(model_parts)
    once = any(getattr(a.replica_sync, "active", False) for a in atts)
    rpn = next((h.placement.ranks_per_node for h in (a.handle for a in atts)
                if h is not None and getattr(h, "placement", None) is not None), ranks_per_node)
    ref = Reference()
    seen: set[int] = set()
    for part in model_parts:
        for module in part.modules():
            if not isinstance(module, FSDPModule):
                continue
            for group in fsdp.param_groups(module):
                # fully_shard([a, b]) makes a and b share one state and one param group
                if group is None or not fsdp.fsdp_params(group) or id(group) in seen:
                    continue
                seen.add(id(group))
                ref = ref.add(_group_reference(group, microbatches, once, rpn))
    return ref


def _spans_nodes(pg, rpn: Optional[int]) -> bool:
    if pg is None or rpn is None:
        return False
    return len({r // rpn for r in torch.distributed.get_process_group_ranks(pg)}) > 1


def _remote_members(pg, rpn: Optional[int]) -> int:
    """Members of ``pg`` on another node than this rank (0 when the placement is unknown)."""
    if pg is None or rpn is None:
        return 0
    me = torch.distributed.get_rank() // rpn
    return sum(1 for r in torch.distributed.get_process_group_ranks(pg) if r // rpn != me)


def _group_reference(group, microbatches: int, once: bool = False,
                     rpn: Optional[int] = None) -> Reference:
    # the replica group FSDP would all-reduce over (fsdp_qcomm swaps in a group of one rank)
    replica = original_replicate_group(group)
    crossing = {name for name, pg in (("weight", fsdp.shard_group(group)),
                                      ("grad", fsdp.reduce_scatter_group(group)),
                                      ("replica", replica)) if _spans_nodes(pg, rpn)}
    ref = Reference(groups=1, world_size=fsdp.shard_group(group).size(),
                    replicas=replica.size() if replica is not None else 1,
                    crossing=frozenset(crossing))
    world = ref.world_size
    # the group re-gathers in backward iff it reshards after forward: with
    # reshard_after_forward=<int> over the smaller post-forward group, W / r times the shard
    regathers = microbatches if fsdp.reshards_after_forward(group) else 0
    post = fsdp.post_forward_group(group)
    all_reduces = 1 if once or not fsdp.all_reduce_grads(group) else microbatches
    remote = (_remote_members(fsdp.shard_group(group), rpn),
              _remote_members(fsdp.reduce_scatter_group(group), rpn),
              _remote_members(replica, rpn) if ref.replicas > 1 else 0)
    remote_post = remote[0] if post is None else _remote_members(post, rpn)
    for fp in fsdp.fsdp_params(group):
        numel = fsdp.padded_shard_numel(fp)
        post_numel = numel if post is None else numel * world // post.size()
        gathered = microbatches * numel + regathers * post_numel
        _, pdt, rdt = fsdp.param_dtypes(fp)
        for attr, wsize, gsize in (("cross_node_fp32_bytes", 4, 4),
                                   ("cross_node_bf16_fp32_bytes", 2, 4)):
            cross = ((microbatches * numel * remote[0] + regathers * post_numel * remote_post)
                     * wsize + microbatches * numel * gsize * remote[1]
                     + (2 * all_reduces * numel * gsize * remote[2] / ref.replicas
                        if ref.replicas > 1 else 0.0))
            setattr(ref, attr, getattr(ref, attr) + cross)
        ref.weight_elements += gathered
        ref.weight_bytes += gathered * _dtype_size(pdt)
        ref.grad_elements += microbatches * world * numel
        ref.grad_bytes += microbatches * world * numel * _dtype_size(rdt)
        if ref.replicas > 1:
            ref.replica_elements += all_reduces * numel
            ref.replica_bytes += all_reduces * numel * _dtype_size(rdt)
    return ref


# --------------------------------------------------------------------------- per-step figures
class CommTracker:
    """Turns cumulative counters into per-step figures between two logging steps."""

    def __init__(self) -> None:
        self.last_steps = 0  # training steps counted at the previous interval's end
        self.last_counters: dict[str, dict[str, float]] = {}
        self.total_counters: dict[str, dict[str, float]] = {}
        self.reference: Reference | None = None
        self.last_step = 0  # the training step of the last logging call

    @staticmethod
    def read_counters(attachments: list[QCommAttachment]) -> dict | None:
        handles = [a.handle for a in attachments if a.handle is not None]
        if not handles:
            return None
        total: dict[str, dict[str, float]] = {}
        for h in handles:
            total = _add(total, split_stats(h.stats()))
        return total

    def rebase(self, model_parts: list[torch.nn.Module]) -> None:
        """Make the current counters the start of the next interval (drop traffic since)."""
        counters = self.read_counters(attachment_of(model_parts))
        if counters is not None:
            self.last_counters = counters
            self.total_counters = counters

    def figures(
        self, step: int, training_steps: int, model_parts: list[torch.nn.Module],
        microbatches: int,
    ) -> dict[str, float]:
        attachments = attachment_of(model_parts)
        if self.reference is None:
            self.reference = fsdp_reference(model_parts, microbatches)
        ref = self.reference
        steps = max(1, training_steps - self.last_steps)
        self.last_steps = training_steps
        self.last_step = step
        out: dict[str, float] = {
            "qcomm/installed": float(any(a.handle is not None for a in attachments)),
            "qcomm/microbatches": float(microbatches),
            "qcomm/ref_weight_bytes_per_step": ref.weight_bytes,
            "qcomm/ref_grad_bytes_per_step": ref.grad_bytes,
        }
        if ref.replicas > 1:
            out["qcomm/ref_replica_bytes_per_step"] = ref.replica_bytes
        if ref.crossing:
            out["qcomm/ref_cross_node_fp32_bytes_per_step"] = ref.cross_node_fp32_bytes
            out["qcomm/ref_cross_node_bf16_fp32_bytes_per_step"] = ref.cross_node_bf16_fp32_bytes
        for c in COLLECTIVES:
            if c.reference and ref.bytes_of(c) > 0:
                out[f"qcomm/ref_{c.name}_crosses_nodes"] = float(c.reference in ref.crossing)
        counters = self.read_counters(attachments)
        if counters is None:
            return out
        prev = self.last_counters
        self.last_counters = self.total_counters = counters
        delta = {k: _per_step(v, prev.get(k, {}), steps) for k, v in counters.items()}
        measured = [k for k in delta if not k.startswith("kind:")]
        sent_total = base_total = 0.0
        extra_totals: dict[str, float] = {}
        for c in COLLECTIVES:  # FSDP's own collectives count at their reference size
            if c.name not in measured and ref.bytes_of(c) > 0:
                sent_total += ref.bytes_of(c)
                base_total += ref.bytes_of(c)
        for c in _ordered(measured):
            d = delta[c.name]
            sent, base = d.get("sent", 0.0), d.get("baseline", 0.0)
            if not c.counts_baseline:
                base = 0.0
            sent_total += sent
            base_total += base
            out[f"qcomm/{c.name}_bytes_per_step"] = sent
            out[f"qcomm/{c.name}_recv_bytes_per_step"] = d.get("recv", 0.0)
            out[f"qcomm/{c.name}_baseline_bytes_per_step"] = base
            if base > 0:
                out[f"qcomm/{c.name}_ratio_vs_unquantized"] = sent / base
            # elements FSDP would have sent: the baseline in the reference's dtype, or, for a
            # collective without a reference, the elements the kinds say they carried
            itemsize = ref.itemsize_of(c)
            elems = base / itemsize if itemsize and base > 0 else d.get("elements", 0.0)
            if elems > 0:
                out[f"qcomm/{c.name}_bits_per_elem"] = 8.0 * sent / elems
            if d.get("sending_elements", 0.0) > 0:  # the cost of one call that sent bytes
                out[f"qcomm/{c.name}_sending_bits_per_elem"] = 8.0 * sent / d["sending_elements"]
            for f, v in d.items():
                if f not in _BASE_FIELDS.values():
                    out[f"qcomm/{c.name}_{f}_per_step"] = v
                    if f.endswith("_bytes"):  # bytes add up across collectives; counts do not
                        extra_totals[f] = extra_totals.get(f, 0.0) + v
        for k, d in delta.items():
            if k.startswith("kind:") and d.get("elements", 0.0) > 0:
                out[f"qcomm/{k[5:]}_bits_per_elem"] = 8.0 * d["sent"] / d["elements"]
        for f, v in extra_totals.items():
            out[f"qcomm/total_{f}_per_step"] = v
        if base_total > 0:
            out["qcomm/total_ratio_vs_unquantized"] = sent_total / base_total
        return out


def _per_step(now: Mapping[str, float], before: Mapping[str, float], steps: int) -> dict:
    # a counter below its previous value was reset (handle.reset_stats()): count from zero
    return {
        f: (v - before.get(f, 0.0) if v >= before.get(f, 0.0) else v) / steps
        for f, v in now.items()
    }


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f}{unit}" if unit != "B" else f"{n:.0f}B"
        n /= 1024
    return f"{n}"


def format_figures(fig: Mapping[str, float]) -> str:
    """One console line: bytes per step, bits per element and ratio, per collective."""
    if not fig.get("qcomm/installed"):
        refs = " ".join(
            f"{c.tag} {_fmt_bytes(fig[f'qcomm/ref_{c.name}_bytes_per_step'])}/step"
            for c in COLLECTIVES if f"qcomm/ref_{c.name}_bytes_per_step" in fig
        )
        return f"qcomm: not installed (FSDP2 reference: {refs})"
    names = {k[len("qcomm/"):-len("_bytes_per_step")] for k in fig
             if k.endswith("_bytes_per_step") and not k.startswith(("qcomm/ref_", "qcomm/total_"))
             and f"{k[:-len('_bytes_per_step')]}_baseline_bytes_per_step" in fig}
    own = {c.name for c in COLLECTIVES if fig.get(f"qcomm/ref_{c.name}_bytes_per_step", 0) > 0}
    parts = []
    for c in _ordered(names | own):
        if c.name not in names:
            parts.append(f"{c.tag} FSDP's own")
            continue
        p = f"qcomm/{c.name}"
        base = fig.get(f"{p}_baseline_bytes_per_step", 0.0)
        s = f"{c.tag} {_fmt_bytes(fig[f'{p}_bytes_per_step'])}/step"
        if not c.counts_baseline:
            s += " (inside nodes)"
            parts.append(s)
            continue
        s += f" of {_fmt_bytes(base)}" if base > 0 else " (overhead)"
        if f"{p}_bits_per_elem" in fig:
            s += f" {fig[f'{p}_bits_per_elem']:.2f}b/el"
            sending = fig.get(f"{p}_sending_bits_per_elem")
            if sending is not None and abs(sending - fig[f"{p}_bits_per_elem"]) > 5e-3:
                s += f" ({sending:.2f}b/el per exchange that sent)"  # 0-byte re-gathers aside
        hops = [
            f"{k[len(c.name) + 1:] if k.startswith(c.name + '_') else k} "
            f"{fig[f'qcomm/{k}_bits_per_elem']:.2f}b"
            for k in c.kinds if len(c.kinds) > 1 and f"qcomm/{k}_bits_per_elem" in fig
        ]
        if hops:
            s += " (" + ", ".join(hops) + ")"
        if f"{p}_ratio_vs_unquantized" in fig:
            s += f" x{fig[f'{p}_ratio_vs_unquantized']:.3f}"
        parts.append(s)
    cross = fig.get("qcomm/total_cross_node_bytes_per_step")
    if cross is not None:  # bytes this rank sent to other nodes, per optimizer step
        s = f"X-node {_fmt_bytes(cross)}/step"
        unmeasured = [c.tag for c in COLLECTIVES
                      if fig.get(f"qcomm/ref_{c.name}_crosses_nodes") and c.name not in names]
        if unmeasured:
            s += f" + FSDP's own {'/'.join(unmeasured)}"
        parts.append(s)
    tot = fig.get("qcomm/total_ratio_vs_unquantized")
    mb = int(fig.get("qcomm/microbatches", 1))
    return ("qcomm: " + (f"[{mb} microbatches/step] " if mb > 1 else "") + "  ".join(parts)
            + (f"  total x{tot:.3f}" if tot is not None else ""))


# --------------------------------------------------------------------------- one run's record
def counted_steps(handles: Iterable[Any]) -> int:
    """Training steps the handles counted (``stats()["summary"]["steps"]``; the largest, for
    pipeline stages with one handle each)."""
    return max((int(h.stats()["summary"]["steps"]) for h in handles), default=0)


@dataclass
class QCommRun:
    """What a metrics processor of either torchtitan version keeps about the hooks: figures at
    every logging step, held-out losses, and the summary file rank ``summary_rank`` writes at
    the end. ``microbatches``: FSDP passes per optimizer step, for the FSDP reference: the
    gradient-accumulation steps (a pipeline schedule reduces once per schedule step and, with
    torchtitan's ``reshard_after_forward`` off under pipeline parallelism, gathers once too;
    with it on, a stage gathers about once per pipeline microbatch plus once, which the
    reference undercounts). ``summary_rank``:
    the rank torchtitan logs metrics on (``metrics_rank``): under pipeline parallelism the first
    of the last stage, which alone holds the loss."""

    microbatches: int = 1
    summary_rank: int = 0
    tracker: CommTracker = field(default_factory=CommTracker)
    history: list = field(default_factory=list)
    validation: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.microbatches = max(1, self.microbatches)
        self.t_start = self.t_last = time.perf_counter()
        self.step_last = 0
        self.steps_counted_last = 0

    def figures(self, step: int, model_parts: list[torch.nn.Module] | None) -> dict[str, float]:
        """The ``qcomm/*`` figures of the interval ending at this logging step."""
        counted = counted_steps(_live_handles(model_parts))
        fig = self.tracker.figures(step, counted, model_parts or [], self.microbatches)
        now = time.perf_counter()
        self._step_time = (now - self.t_last) / max(1, counted - self.steps_counted_last)
        self.t_last, self.step_last, self.steps_counted_last = now, step, counted
        return fig

    def record(self, step: int, loss: float, grad_norm: float, fig: Mapping[str, float]) -> str:
        """Keep this logging step's loss and figures; returns the console line."""
        self.history.append(
            {"step": step, "loss": float(loss), "grad_norm": float(grad_norm),
             "step_time_s": getattr(self, "_step_time", 0.0), **fig}
        )
        return format_figures(fig)

    def record_validation(self, step: int, loss: float, model_parts) -> None:
        self.validation.append({"step": step, "loss": float(loss)})
        # Validation gathers weights too; when it follows a logging step directly, start the
        # next interval after it so that per-step training figures stay exact.
        if step == self.tracker.last_step:
            self.tracker.rebase(model_parts or [])

    def summary(self, model_parts, model: str, flavor: str) -> dict[str, Any]:
        atts = attachment_of(model_parts)
        handles = _live_handles(model_parts)
        ref = self.tracker.reference
        cfg = atts[0].config if atts else None
        cum = self.tracker.total_counters
        return {
            "model": model,
            "flavor": flavor,
            "preset": atts[0].preset if atts else None,
            "qcomm_config": dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else repr(cfg),
            "installed": bool(handles),
            "notes": sorted(
                {a.note for a in atts if a.note} | {n for h in handles for n in h.stats()["notes"]}
            ),
            "fsdp_modules": sum(a.fsdp_modules for a in atts),
            "hooked_modules": sum(len(h.module_names) for h in handles),
            "world_size": ref.world_size if ref else None,
            "replicas": ref.replicas if ref else None,
            "microbatches": self.microbatches,
            "steps_logged": [h["step"] for h in self.history],
            "loss": [h["loss"] for h in self.history],
            "history": self.history,
            "validation": self.validation,
            "reference_bytes_per_step": (
                {"weights": ref.weight_bytes, "grads": ref.grad_bytes,
                 "replicas": ref.replica_bytes} if ref else None
            ),
            "measured_cumulative": flatten_counters(cum) if cum else None,
            "handle_stats": [h.stats() for h in handles],
            "gather_modes": _sum_counts(h.gather_modes() for h in handles),
            "training_steps": counted_steps(handles),
            "last_step": self.step_last,
            "wall_time_s": time.perf_counter() - self.t_start,
        }

    def close(self, dump_folder: str, model_parts, model: str, flavor: str) -> Optional[str]:
        """Rank ``summary_rank`` writes the summary file (if anything was logged); returns its
        path."""
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if rank != self.summary_rank or not self.history:
            return None
        path = os.path.join(dump_folder, SUMMARY_FILE)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.summary(model_parts, model, flavor), f, indent=2)
        return path


def metrics_rank(pp: int, world_size: int, schedule: str) -> int:
    """The rank torchtitan logs metrics on (its ``_get_metrics_rank``, the same in 0.2.2 and
    0.3) with ``pp`` pipeline stages over ``world_size`` ranks: 0, or under pipeline
    parallelism the first rank of the last stage, where the loss is computed; 0 again for the
    V-shaped schedule, whose last stage is on rank 0."""
    if pp <= 1 or schedule == "ZBVZeroBubble":
        return 0
    return world_size // pp * (pp - 1)


def _live_handles(model_parts) -> list[Any]:
    return [a.handle for a in attachment_of(model_parts) if a.handle is not None]


def _sum_counts(dicts: Iterable[Mapping[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return dict(sorted(out.items()))


__all__ = [
    "ATTACHMENT_ATTR", "COLLECTIVES", "Collective", "CommTracker", "QCommAttachment", "QCommRun",
    "NOT_KINDS", "Reference", "SUMMARY_FILE", "attachment_of", "collective_named",
    "collective_of", "counted_steps", "flatten_counters", "format_figures", "fsdp_reference",
    "metrics_rank", "split_stats",
]

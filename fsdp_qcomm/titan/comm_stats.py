"""Communication figures for torchtitan's metrics logger.

Each logging step, :class:`QCommMetricsProcessor` adds ``qcomm/*`` metrics (console, TensorBoard,
W&B) for this rank, computed from the cumulative counters of the ``fsdp_qcomm`` handles
(``handle.stats()``), differenced between logging steps and divided by the optimizer steps in
between (counted from the training-mode forwards of the first model part, ``StepCounter``, so
a resumed run divides correctly):

* ``qcomm/weight_bytes_per_step``, ``qcomm/grad_bytes_per_step``: bytes this rank handed to the
  process group (the library's ``sent_bytes``: weights = ``weight_allgather``; gradients =
  ``grad_intra`` + ``grad_inter``, the two hops of the two-level scheme);
* ``qcomm/{weight,grad}_baseline_bytes_per_step``: what FSDP2's own collectives would have been
  handed for the same calls (``baseline_bytes``; the two gradient hops record the same
  baseline for one reduce-scatter, so it is counted once, not summed);
* ``qcomm/{weight,grad}_ratio_vs_unquantized`` = sent / baseline, and
  ``qcomm/total_ratio_vs_unquantized``;
* ``qcomm/{weight,grad}_bits_per_elem``: 8 x sent / elements FSDP would have sent (32.0 for a
  plain fp32 exchange; a qWD backward re-gather that reuses the reference sends 0 bits, so the
  weight figure averages forward and backward gathers);
* ``qcomm/grad_{intra,inter}_bits_per_elem``: the code width of each gradient hop on the wire.

The byte convention is the library's: the bytes of the input tensor passed to the collective
(for an all-gather this rank's shard, for a reduce-scatter all ``world`` rows). As an independent
check, :func:`fsdp_reference` computes the same unquantized baseline per step from the FSDP
parameter groups (``qcomm/ref_*_bytes_per_step``); the tests assert the two agree.

A collective the handles do not replace (the gradients under a ``grad_scheme="none"`` preset)
runs FSDP's own code: it is not measured, its figures are not logged, and the total ratio
counts it at its reference size (which is what stock FSDP2 sends).

At ``close()`` rank 0 writes ``<dump_folder>/qcomm_summary.json`` (losses per logged step,
figures, the handles' final stats and gather modes, the resolved config), which the main job
and the tests read.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.tools.logging import logger

from ..fsdp import internals as fsdp

#: attribute of each (parallelized) model part that carries its QCommAttachment
ATTACHMENT_ATTR = "_fsdp_qcomm"
SUMMARY_FILE = "qcomm_summary.json"


@dataclass
class QCommAttachment:
    """What the parallelize wrapper leaves on a model part for the metrics processor."""

    config: Any  # the resolved QCommConfig
    preset: str
    handle: Any = None  # what fsdp_qcomm.enable returned, None if not installed
    fsdp_modules: int = 0
    note: str = ""


def attachment_of(model_parts: Iterable[torch.nn.Module] | None) -> list[QCommAttachment]:
    return [
        getattr(m, ATTACHMENT_ATTR)
        for m in (model_parts or [])
        if getattr(m, ATTACHMENT_ATTR, None) is not None
    ]


# --------------------------------------------------------------------------- reference
@dataclass
class Reference:
    """Unquantized FSDP2 collective input bytes of one rank per optimizer step."""

    weight_bytes: float = 0.0
    weight_elements: float = 0.0
    grad_bytes: float = 0.0
    grad_elements: float = 0.0
    groups: int = 0
    world_size: int = 1

    def add(self, other: "Reference") -> "Reference":
        return Reference(
            self.weight_bytes + other.weight_bytes,
            self.weight_elements + other.weight_elements,
            self.grad_bytes + other.grad_bytes,
            self.grad_elements + other.grad_elements,
            self.groups + other.groups,
            max(self.world_size, other.world_size),
        )


def _dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def fsdp_reference(model_parts: Iterable[torch.nn.Module], microbatches: int = 1) -> Reference:
    """Sum :class:`Reference` over every FSDP parameter group of ``model_parts``.

    Per group of padded shard size ``s`` elements on ``W`` ranks, with ``m`` microbatches: the
    all-gather is handed ``s`` elements in ``param_dtype``, ``m`` times in forward plus ``m``
    times in backward if the group reshards after forward; the reduce-scatter is handed
    ``W * s`` elements in ``reduce_dtype``, ``m`` times. Reads FSDP2 internals; dtypes are final
    only after FSDP's lazy init (the first forward), so call it after the first step.
    """
    from torch.distributed.fsdp import FSDPModule

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
                ref = ref.add(_group_reference(group, microbatches))
    return ref


def _group_reference(group, microbatches: int) -> Reference:
    ref = Reference(groups=1, world_size=fsdp.shard_group(group).size())
    world = ref.world_size
    # the group re-gathers in backward iff it reshards after forward
    gathers = microbatches * (2 if fsdp.reshards_after_forward(group) else 1)
    for fp in fsdp.fsdp_params(group):
        numel = fsdp.padded_shard_numel(fp)
        _, pdt, rdt = fsdp.param_dtypes(fp)
        ref.weight_elements += gathers * numel
        ref.weight_bytes += gathers * numel * _dtype_size(pdt)
        ref.grad_elements += microbatches * world * numel
        ref.grad_bytes += microbatches * world * numel * _dtype_size(rdt)
    return ref


# --------------------------------------------------------------------------- measured
WEIGHT_KIND = "weight_allgather"
GRAD_KINDS = ("grad_intra", "grad_inter", "grad_replica")
_FIELDS = ("calls", "sent_bytes", "recv_bytes", "elements", "baseline_bytes")


def split_stats(stats: Mapping) -> dict[str, float]:
    """Cumulative counters of one ``handle.stats()`` snapshot, grouped for the figures.

    Keys (present only for the kinds the handle recorded): ``weight_{calls,sent,recv,elements,
    baseline}``; ``grad_{calls,sent,recv,baseline}`` with sent/recv summed over both hops and the
    baseline counted once (every hop of one reduce-scatter records the same baseline, so the
    larger of the two totals is the reduce-scatters' baseline); ``grad_intra_{sent,elements}``,
    ``grad_inter_{sent,elements}``. Raises ValueError on a kind it does not know, so that a
    new collective cannot silently go uncounted.
    """
    unknown = sorted(k for k in stats if k not in ("notes", "summary", WEIGHT_KIND)
                     and k not in GRAD_KINDS)
    if unknown:
        raise ValueError(
            f"handle.stats() has collective kinds {unknown} that fsdp_qcomm.titan.comm_stats "
            f"does not know (known: {WEIGHT_KIND}, {', '.join(GRAD_KINDS)}); extend split_stats"
        )
    out: dict[str, float] = {}

    def field(kind: str, name: str) -> float:
        return float(stats[kind][name])

    if WEIGHT_KIND in stats:
        out["weight_calls"] = field(WEIGHT_KIND, "calls")
        out["weight_sent"] = field(WEIGHT_KIND, "sent_bytes")
        out["weight_recv"] = field(WEIGHT_KIND, "recv_bytes")
        out["weight_elements"] = field(WEIGHT_KIND, "elements")
        out["weight_baseline"] = field(WEIGHT_KIND, "baseline_bytes")
    hops = [k for k in GRAD_KINDS if k in stats]
    if hops:
        out["grad_calls"] = max(field(k, "calls") for k in hops)
        out["grad_sent"] = sum(field(k, "sent_bytes") for k in hops)
        out["grad_recv"] = sum(field(k, "recv_bytes") for k in hops)
        out["grad_baseline"] = max(field(k, "baseline_bytes") for k in hops)
        for k in hops:
            out[f"{k}_sent"] = field(k, "sent_bytes")
            out[f"{k}_elements"] = field(k, "elements")
    return out


def _add(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: a.get(k, 0.0) + b.get(k, 0.0) for k in set(a) | set(b)}


class StepCounter:
    """Counts training steps by the training-mode forwards of the first model part.

    torchtitan logs every ``log_freq`` steps and a resumed run starts at the checkpoint's step,
    so the logged step numbers alone do not say how many steps the handles' counters cover.
    Optimizer step hooks cannot count them either: loading a checkpoint's optimizer state runs
    a dummy ``optimizer.step()`` (``torch.distributed.checkpoint``'s ``_init_optim_state``).
    Each training step runs ``microbatches`` forwards with grad enabled in training mode;
    validation runs in eval mode under ``no_grad`` and is not counted.
    """

    def __init__(self, microbatches: int) -> None:
        self.microbatches = max(1, microbatches)
        self.forwards = 0
        self._handle = None

    def watch(self, model_parts: list[torch.nn.Module] | None) -> None:
        if self._handle is None and model_parts:
            self._handle = model_parts[0].register_forward_pre_hook(self._pre_forward)

    def _pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        if module.training and torch.is_grad_enabled():
            self.forwards += 1

    @property
    def steps(self) -> int:
        return self.forwards // self.microbatches

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


class CommTracker:
    """Turns cumulative counters into per-step figures between two logging steps."""

    def __init__(self) -> None:
        self.last_steps = 0  # optimizer steps counted at the previous interval's end
        self.last_counters: dict[str, float] = {}
        self.total_counters: dict[str, float] = {}
        self.reference: Reference | None = None
        self.last_step = 0  # the training step of the last logging call

    @staticmethod
    def read_counters(attachments: list[QCommAttachment]) -> dict[str, float] | None:
        handles = [a.handle for a in attachments if a.handle is not None]
        if not handles:
            return None
        total: dict[str, float] = {}
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
        self, step: int, optimizer_steps: int, model_parts: list[torch.nn.Module],
        microbatches: int,
    ) -> dict[str, float]:
        attachments = attachment_of(model_parts)
        if self.reference is None:
            self.reference = fsdp_reference(model_parts, microbatches)
        ref = self.reference
        steps = max(1, optimizer_steps - self.last_steps)
        self.last_steps = optimizer_steps
        self.last_step = step
        out: dict[str, float] = {
            "qcomm/installed": float(any(a.handle is not None for a in attachments)),
            "qcomm/ref_weight_bytes_per_step": ref.weight_bytes,
            "qcomm/ref_grad_bytes_per_step": ref.grad_bytes,
        }
        counters = self.read_counters(attachments)
        if counters is None:
            return out
        prev = self.last_counters
        self.last_counters = self.total_counters = counters
        # a counter below its previous value was reset (handle.reset_stats()): count from zero
        delta = {
            k: (v - prev.get(k, 0.0) if v >= prev.get(k, 0.0) else v) / steps
            for k, v in counters.items()
        }
        sent_total = base_total = 0.0
        for kind, ref_bytes, ref_elems in (
            ("weight", ref.weight_bytes, ref.weight_elements),
            ("grad", ref.grad_bytes, ref.grad_elements),
        ):
            if f"{kind}_sent" not in delta:  # FSDP's own collective: not measured
                sent_total += ref_bytes
                base_total += ref_bytes
                continue
            sent, base = delta[f"{kind}_sent"], delta[f"{kind}_baseline"]
            sent_total += sent
            base_total += base
            out[f"qcomm/{kind}_bytes_per_step"] = sent
            out[f"qcomm/{kind}_recv_bytes_per_step"] = delta[f"{kind}_recv"]
            out[f"qcomm/{kind}_baseline_bytes_per_step"] = base
            if base > 0:
                out[f"qcomm/{kind}_ratio_vs_unquantized"] = sent / base
                # elements FSDP would have sent: the baseline in the reference's dtype
                itemsize = ref_bytes / ref_elems if ref_elems else 4.0
                out[f"qcomm/{kind}_bits_per_elem"] = 8.0 * sent * itemsize / base
        for hop in GRAD_KINDS:
            elems = delta.get(f"{hop}_elements", 0.0)
            if elems > 0:
                out[f"qcomm/{hop}_bits_per_elem"] = 8.0 * delta[f"{hop}_sent"] / elems
        if base_total > 0:
            out["qcomm/total_ratio_vs_unquantized"] = sent_total / base_total
        return out


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f}{unit}" if unit != "B" else f"{n:.0f}B"
        n /= 1024
    return f"{n}"


def format_figures(fig: Mapping[str, float]) -> str:
    """One console line: bytes per step, bits per element and ratio, per collective."""
    if not fig.get("qcomm/installed"):
        return (
            "qcomm: not installed (FSDP2 reference: W "
            f"{_fmt_bytes(fig['qcomm/ref_weight_bytes_per_step'])}/step G "
            f"{_fmt_bytes(fig['qcomm/ref_grad_bytes_per_step'])}/step)"
        )
    parts = []
    for kind, tag in (("weight", "W"), ("grad", "G")):
        if f"qcomm/{kind}_bytes_per_step" not in fig:
            parts.append(f"{tag} FSDP's own")
            continue
        s = (
            f"{tag} {_fmt_bytes(fig[f'qcomm/{kind}_bytes_per_step'])}/step of "
            f"{_fmt_bytes(fig[f'qcomm/{kind}_baseline_bytes_per_step'])}"
        )
        if f"qcomm/{kind}_bits_per_elem" in fig:
            s += f" {fig[f'qcomm/{kind}_bits_per_elem']:.2f}b/el"
        hops = [
            f"{hop[5:]} {fig[f'qcomm/{hop}_bits_per_elem']:.2f}b"
            for hop in GRAD_KINDS if kind == "grad" and f"qcomm/{hop}_bits_per_elem" in fig
        ]
        if hops:
            s += " (" + ", ".join(hops) + ")"
        if f"qcomm/{kind}_ratio_vs_unquantized" in fig:
            s += f" x{fig[f'qcomm/{kind}_ratio_vs_unquantized']:.3f}"
        parts.append(s)
    tot = fig.get("qcomm/total_ratio_vs_unquantized")
    return "qcomm: " + "  ".join(parts) + (f"  total x{tot:.3f}" if tot is not None else "")


# --------------------------------------------------------------------------- the processor
class QCommMetricsProcessor(MetricsProcessor):
    """torchtitan's MetricsProcessor plus ``qcomm/*`` figures and a JSON summary."""

    def __init__(self, job_config, parallel_dims, tag: str | None = None) -> None:
        super().__init__(job_config, parallel_dims, tag)
        self.tracker = CommTracker()
        self.microbatches = self._microbatches(job_config, parallel_dims)
        self.step_counter = StepCounter(self.microbatches)
        self.step_counter.watch(self.model_parts)
        self.history: list[dict[str, float]] = []
        self.validation: list[dict[str, float]] = []
        self.t_start = time.perf_counter()
        self.t_last = self.t_start
        self.step_last = 0
        self.steps_counted_last = 0

    @property
    def model_parts(self) -> list[torch.nn.Module] | None:
        return self.__dict__.get("_model_parts")

    @model_parts.setter
    def model_parts(self, parts: list[torch.nn.Module] | None) -> None:
        # torchtitan's Trainer assigns the model parts after building the processor
        self.__dict__["_model_parts"] = parts
        if "step_counter" in self.__dict__:
            self.step_counter.watch(parts)

    @staticmethod
    def _microbatches(job_config, parallel_dims) -> int:
        gbs = job_config.training.global_batch_size
        lbs = job_config.training.local_batch_size
        if gbs <= 0:
            return 1
        # as in torchtitan's Trainer: the "batch" mesh spans the data-parallel ranks
        degree = parallel_dims.get_mesh("batch").size() if parallel_dims.dp_enabled else 1
        return max(1, gbs // (lbs * degree))

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        counted = self.step_counter.steps
        fig = self.tracker.figures(step, counted, self.model_parts or [], self.microbatches)
        now = time.perf_counter()
        step_time = (now - self.t_last) / max(1, counted - self.steps_counted_last)
        self.t_last, self.step_last, self.steps_counted_last = now, step, counted
        merged = dict(extra_metrics or {})
        merged.update(fig)
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=merged)
        logger.info(format_figures(fig))
        self.history.append(
            {"step": step, "loss": float(global_avg_loss), "grad_norm": float(grad_norm),
             "step_time_s": step_time, **fig}
        )

    def log_validation(self, loss, step, extra_metrics=None):
        super().log_validation(loss, step, extra_metrics=extra_metrics)
        self.validation.append({"step": step, "loss": float(loss)})
        # Validation gathers weights too; when it follows a logging step directly, start the
        # next interval after it so that per-step training figures stay exact.
        if step == self.tracker.last_step:
            self.tracker.rebase(self.model_parts or [])

    def summary(self) -> dict[str, Any]:
        atts = attachment_of(self.model_parts)
        ref = self.tracker.reference
        cfg = atts[0].config if atts else None
        return {
            "model": self.job_config.model.name,
            "flavor": self.job_config.model.flavor,
            "preset": atts[0].preset if atts else None,
            "qcomm_config": dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else repr(cfg),
            "installed": any(a.handle is not None for a in atts),
            "notes": sorted(
                {a.note for a in atts if a.note}
                | {n for a in atts if a.handle is not None for n in a.handle.stats()["notes"]}
            ),
            "fsdp_modules": sum(a.fsdp_modules for a in atts),
            "hooked_modules": sum(
                len(a.handle.module_names) for a in atts if a.handle is not None
            ),
            "world_size": ref.world_size if ref else None,
            "microbatches": self.microbatches,
            "steps_logged": [h["step"] for h in self.history],
            "loss": [h["loss"] for h in self.history],
            "history": self.history,
            "validation": self.validation,
            "reference_bytes_per_step": (
                {"weights": ref.weight_bytes, "grads": ref.grad_bytes} if ref else None
            ),
            "measured_cumulative": self.tracker.total_counters or None,
            "handle_stats": [a.handle.stats() for a in atts if a.handle is not None],
            "gather_modes": _sum_counts(
                a.handle.gather_modes() for a in atts if a.handle is not None
            ),
            "optimizer_steps": self.step_counter.steps,
            "last_step": self.step_last,
            "wall_time_s": time.perf_counter() - self.t_start,
        }

    def close(self) -> None:
        try:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            if rank == 0 and self.history:
                path = os.path.join(self.job_config.job.dump_folder, SUMMARY_FILE)
                os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
                with open(path, "w") as f:
                    json.dump(self.summary(), f, indent=2)
                logger.info(f"qcomm: wrote {path}")
        finally:
            self.step_counter.remove()
            super().close()


def _sum_counts(dicts: Iterable[Mapping[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return dict(sorted(out.items()))


def build_qcomm_metrics_processor(job_config, parallel_dims, model_args=None, tag=None):
    return QCommMetricsProcessor(job_config, parallel_dims, tag)

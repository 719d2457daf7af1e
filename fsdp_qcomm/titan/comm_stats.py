"""Communication figures for torchtitan's metrics logger.

Each logging step, :class:`QCommMetricsProcessor` adds ``qcomm/*`` metrics (console, TensorBoard,
W&B) computed from two sources:

* **measured**: the cumulative byte counters of the ``fsdp_qcomm`` handles
  (``handle.stats()``), differenced between logging steps and divided by the steps in between;
* **reference**: what stock FSDP2 would send per optimizer step *from this rank* for the same
  model, sharding and dtypes, computed from the FSDP parameter groups (:func:`fsdp_reference`).
  Per FSDP group of padded shard size ``s`` elements on ``W`` ranks, with ``m`` microbatches:
  all-gather sends ``(W-1) * s`` elements in ``param_dtype``, ``m`` times in forward plus ``m``
  times in backward if the group reshards after forward; reduce-scatter sends ``(W-1) * s``
  elements in ``reduce_dtype``, ``m`` times. (This is what a ring or a direct exchange sends;
  HSDP's replicate all-reduce is not counted.)

From these: bytes/step (weights = all-gather side, grads = reduce-scatter side), bits per
element ``8 * measured_bytes / reference_elements`` (so baseline fp32 reads 32.0 and 4-bit
codes plus one fp32 scale per 2048 read ~4.016), and ratio ``measured / reference``. The
figures are this rank's (ranks are symmetric under FSDP); no extra collective is issued.

Without handles (``fsdp_qcomm.enable`` unavailable, or a single process) only the reference
figures and ``qcomm/installed = 0`` are logged: measured numbers are never made up.

At ``close()`` rank 0 writes ``<dump_folder>/qcomm_summary.json`` (losses per logged step,
reference and measured bytes, the resolved config), which the main job and the tests read.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch

from torchtitan.components.metrics import MetricsProcessor
from torchtitan.tools.logging import logger

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
    """Unquantized FSDP2 traffic sent by one rank per optimizer step."""

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

    Reads FSDP2 internals (``_get_fsdp_state()._fsdp_param_group``); dtypes are final only
    after FSDP's lazy init (the first forward), so call it after the first step.
    """
    from torch.distributed.fsdp import FSDPModule

    ref = Reference()
    seen: set[int] = set()
    for part in model_parts:
        for module in part.modules():
            if not isinstance(module, FSDPModule):
                continue
            for group in _param_groups(module):
                # fully_shard([a, b]) makes a and b share one state and one param group
                if group is None or not group.fsdp_params or id(group) in seen:
                    continue
                seen.add(id(group))
                ref = ref.add(_group_reference(group, microbatches))
    return ref


def _param_groups(module) -> list:
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)  # newer torch: per-param meshes
    if groups is not None:
        return list(groups)
    return [state._fsdp_param_group]


def _group_reference(group, microbatches: int) -> Reference:
    ref = Reference(groups=1, world_size=group.mesh_info.shard_mesh_size)
    world = ref.world_size
    # the group re-gathers in backward iff it reshards after forward
    gathers = microbatches * (2 if group.post_forward_mesh_info is not None else 1)
    for fp in group.fsdp_params:
        numel = fp.padded_sharded_param_size.numel()
        orig = getattr(fp, "orig_dtype", None) or fp.sharded_param.dtype
        pdt = getattr(fp, "param_dtype", None) or orig
        rdt = getattr(fp, "reduce_dtype", None) or pdt
        elems = (world - 1) * numel
        ref.weight_elements += gathers * elems
        ref.weight_bytes += gathers * elems * _dtype_size(pdt)
        ref.grad_elements += microbatches * elems
        ref.grad_bytes += microbatches * elems * _dtype_size(rdt)
    return ref


# --------------------------------------------------------------------------- measured
_WEIGHT_WORDS = ("all_gather", "allgather", "gather", "weight", "param")
_GRAD_WORDS = ("reduce_scatter", "reducescatter", "reduce", "grad", "all_to_all", "alltoall")
_SENT_WORDS = ("bytes_sent", "sent", "send")
_RECV_WORDS = ("bytes_received", "bytes_recv", "received", "recv")


def _flatten(d: Mapping, prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in d.items():
        key = f"{prefix}/{k}" if prefix else str(k)
        if isinstance(v, Mapping):
            out.update(_flatten(v, key))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key] = float(v)
    return out


def split_stats(stats: Mapping) -> dict[str, float] | None:
    """Map one ``handle.stats()`` dict to cumulative ``{weights,grads}_{sent,received}`` bytes.

    ASSUMED FORMAT (to confirm when ``fsdp_qcomm.enable`` lands; this is the one place to
    adapt): ``{kind: {"bytes_sent": int, "bytes_received": int, ...}}`` with cumulative
    counters, ``kind`` naming the collective ("all_gather" -> weights; "reduce_scatter",
    "all_to_all*", "grad*" -> grads). Flat keys like ``"all_gather_bytes_sent"`` work too.
    Returns None if no counter could be classified.
    """
    out = {"weights_sent": 0.0, "weights_received": 0.0, "grads_sent": 0.0, "grads_received": 0.0}
    found = False
    for key, value in _flatten(stats).items():
        k = key.lower()
        direction = (
            "received" if any(w in k for w in _RECV_WORDS)
            else "sent" if any(w in k for w in _SENT_WORDS)
            else None
        )
        if direction is None:
            continue
        if any(w in k for w in _GRAD_WORDS):
            kind = "grads"
        elif any(w in k for w in _WEIGHT_WORDS):
            kind = "weights"
        else:
            continue
        out[f"{kind}_{direction}"] += value
        found = True
    return out if found else None


class CommTracker:
    """Turns cumulative counters into per-step figures between two logging steps."""

    def __init__(self) -> None:
        self.last_step = 0
        self.last_counters: dict[str, float] | None = None
        self.total_counters: dict[str, float] = {}
        self.reference: Reference | None = None
        self.warned = False

    def read_counters(self, attachments: list[QCommAttachment]) -> dict[str, float] | None:
        total: dict[str, float] = {}
        any_handle = False
        for att in attachments:
            if att.handle is None:
                continue
            any_handle = True
            split = split_stats(att.handle.stats())
            if split is None:
                if not self.warned:
                    logger.warning(
                        "qcomm: handle.stats() returned no counters this module understands; "
                        "see fsdp_qcomm.titan.comm_stats.split_stats"
                    )
                    self.warned = True
                return None
            for k, v in split.items():
                total[k] = total.get(k, 0.0) + v
        return total if any_handle else None

    def rebase(self, model_parts: list[torch.nn.Module]) -> None:
        """Make the current counters the start of the next interval (drop traffic since)."""
        counters = self.read_counters(attachment_of(model_parts))
        if counters is not None:
            self.last_counters = counters
            self.total_counters = counters

    def figures(
        self, step: int, model_parts: list[torch.nn.Module], microbatches: int
    ) -> dict[str, float]:
        attachments = attachment_of(model_parts)
        if self.reference is None:
            self.reference = fsdp_reference(model_parts, microbatches)
        ref = self.reference
        steps = max(1, step - self.last_step)
        self.last_step = step
        out: dict[str, float] = {
            "qcomm/installed": float(any(a.handle is not None for a in attachments)),
            "qcomm/ref_weight_bytes_per_step": ref.weight_bytes,
            "qcomm/ref_grad_bytes_per_step": ref.grad_bytes,
        }
        counters = self.read_counters(attachments)
        if counters is None:
            return out
        prev = self.last_counters or {k: 0.0 for k in counters}
        self.last_counters = counters
        delta = {}
        for k, v in counters.items():
            d = v - prev.get(k, 0.0)
            delta[k] = v if d < 0 else d  # a counter reset: count from zero
        self.total_counters = counters
        for kind, rb, re in (
            ("weight", ref.weight_bytes, ref.weight_elements),
            ("grad", ref.grad_bytes, ref.grad_elements),
        ):
            sent = delta[f"{kind}s_sent"] / steps
            out[f"qcomm/{kind}_bytes_per_step"] = sent
            out[f"qcomm/{kind}_recv_bytes_per_step"] = delta[f"{kind}s_received"] / steps
            if re > 0:
                out[f"qcomm/{kind}_bits_per_elem"] = 8.0 * sent / re
            if rb > 0:
                out[f"qcomm/{kind}_ratio_vs_unquantized"] = sent / rb
        ref_total = ref.weight_bytes + ref.grad_bytes
        if ref_total > 0:
            out["qcomm/total_ratio_vs_unquantized"] = (
                out["qcomm/weight_bytes_per_step"] + out["qcomm/grad_bytes_per_step"]
            ) / ref_total
        return out


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f}{unit}" if unit != "B" else f"{n:.0f}B"
        n /= 1024
    return f"{n}"


def format_figures(fig: Mapping[str, float]) -> str:
    ref = (
        f"ref W {_fmt_bytes(fig['qcomm/ref_weight_bytes_per_step'])}/step "
        f"G {_fmt_bytes(fig['qcomm/ref_grad_bytes_per_step'])}/step"
    )
    if "qcomm/weight_bytes_per_step" not in fig:
        return f"qcomm: not installed (reference only: {ref})"
    parts = []
    for kind, tag in (("weight", "W"), ("grad", "G")):
        s = f"{tag} {_fmt_bytes(fig[f'qcomm/{kind}_bytes_per_step'])}/step"
        if f"qcomm/{kind}_bits_per_elem" in fig:
            s += f" {fig[f'qcomm/{kind}_bits_per_elem']:.2f}b/el"
        if f"qcomm/{kind}_ratio_vs_unquantized" in fig:
            s += f" x{fig[f'qcomm/{kind}_ratio_vs_unquantized']:.3f}"
        parts.append(s)
    tot = fig.get("qcomm/total_ratio_vs_unquantized")
    return "qcomm: " + "  ".join(parts) + (f"  total x{tot:.3f}" if tot is not None else "") + (
        f"  ({ref})"
    )


# --------------------------------------------------------------------------- the processor
class QCommMetricsProcessor(MetricsProcessor):
    """torchtitan's MetricsProcessor plus ``qcomm/*`` figures and a JSON summary."""

    def __init__(self, job_config, parallel_dims, tag: str | None = None) -> None:
        super().__init__(job_config, parallel_dims, tag)
        self.tracker = CommTracker()
        self.history: list[dict[str, float]] = []
        self.validation: list[dict[str, float]] = []
        self.t_start = time.perf_counter()
        self.t_last = self.t_start
        self.step_last = 0
        self.microbatches = self._microbatches(job_config, parallel_dims)

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
        fig = self.tracker.figures(step, self.model_parts or [], self.microbatches)
        now = time.perf_counter()
        step_time = (now - self.t_last) / max(1, step - self.step_last)
        self.t_last, self.step_last = now, step
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
            "notes": sorted({a.note for a in atts if a.note}),
            "fsdp_modules": sum(a.fsdp_modules for a in atts),
            "world_size": ref.world_size if ref else None,
            "microbatches": self.microbatches,
            "steps_logged": [h["step"] for h in self.history],
            "loss": [h["loss"] for h in self.history],
            "history": self.history,
            "validation": self.validation,
            "reference_bytes_per_step": (
                {"weights": ref.weight_bytes, "grads": ref.grad_bytes} if ref else None
            ),
            "measured_cumulative_bytes": self.tracker.total_counters or None,
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
            super().close()


def build_qcomm_metrics_processor(job_config, parallel_dims, model_args=None, tag=None):
    return QCommMetricsProcessor(job_config, parallel_dims, tag)

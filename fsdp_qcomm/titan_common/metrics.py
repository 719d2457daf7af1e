"""The part of a qcomm metrics processor that is the same in both torchtitan versions.

Each adapter's processor is ``class QCommMetricsProcessor(QCommMetricsMixin,
<that torchtitan's MetricsProcessor>)``: torchtitan's ``log``, ``log_validation`` and ``close``
keep their signatures across 0.2.2 and 0.3, so this mixin adds the ``qcomm/*`` figures to every
logging call, prints the ``qcomm:`` console line, keeps held-out losses and writes the summary
file at ``close``. The adapter supplies :meth:`qcomm_run_info` and calls :meth:`init_qcomm`.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from . import diloco
from .comm_stats import QCommRun

logger = logging.getLogger(__name__)


class QCommMetricsMixin:
    """Adds the ``qcomm/*`` figures to a torchtitan ``MetricsProcessor`` (see module doc)."""

    qcomm: QCommRun
    model_parts: Optional[list[torch.nn.Module]]  # set by torchtitan's Trainer

    def init_qcomm(self, microbatches: int = 1, summary_rank: int = 0) -> None:
        """Call at the end of the processor's ``__init__``; ``summary_rank``: the rank that
        writes the summary file (``comm_stats.metrics_rank``)."""
        self.qcomm = QCommRun(microbatches, summary_rank=summary_rank)

    def set_microbatches(self, microbatches: int) -> None:
        """FSDP passes per optimizer step, for the FSDP reference: the gradient-accumulation
        steps. Not times the pipeline microbatches: under pipeline parallelism torch's schedule
        reduces once per schedule step and torchtitan keeps each stage gathered through it."""
        self.qcomm.microbatches = max(1, microbatches)

    def qcomm_run_info(self) -> tuple[str, str, str]:
        """(dump folder, model name, flavor) for the summary file."""
        raise NotImplementedError

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        fig = self.qcomm.figures(step, self.model_parts)
        driver = diloco.driver_of(self.model_parts)
        if driver is not None:  # DiLoCo's outer all-reduce (``[diloco] enable``)
            fig.update(driver.figures())
        super().log(step, global_avg_loss, global_max_loss, grad_norm,  # type: ignore[misc]
                    extra_metrics={**(extra_metrics or {}), **fig})
        logger.info(self.qcomm.record(step, global_avg_loss, grad_norm, fig)
                    + diloco.format_figures(fig))

    def log_validation(self, loss, step, extra_metrics: Any = None):
        super().log_validation(loss, step, extra_metrics=extra_metrics)  # type: ignore[misc]
        self.qcomm.record_validation(step, loss, self.model_parts)

    def close(self) -> None:
        driver = diloco.driver_of(self.model_parts)
        if driver is not None:
            driver.close()
        try:
            path = self.qcomm.close(*self._summary_args())
            if path:
                logger.info(f"qcomm: wrote {path}")
        finally:
            super().close()  # type: ignore[misc]

    def _summary_args(self) -> tuple:
        folder, model, flavor = self.qcomm_run_info()
        return folder, self.model_parts, model, flavor


__all__ = ["QCommMetricsMixin"]

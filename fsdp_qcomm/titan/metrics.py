"""torchtitan 0.2.2's metrics processor plus the ``qcomm/*`` figures
(``titan_common.metrics``): the ``gpt_qcomm`` train spec's ``build_metrics_processor_fn``."""

from __future__ import annotations

from torchtitan.components.metrics import MetricsProcessor

from fsdp_qcomm.titan_common.comm_stats import metrics_rank
from fsdp_qcomm.titan_common.metrics import QCommMetricsMixin


def accumulation_steps(job_config, parallel_dims) -> int:
    """Forward/backward passes per optimizer step, as torchtitan 0.2.2's Trainer computes its
    ``gradient_accumulation_steps``: the global batch over the local batch times the
    data-parallel degree (the "batch" mesh)."""
    gbs = job_config.training.global_batch_size
    lbs = job_config.training.local_batch_size
    if gbs <= 0:
        return 1
    degree = parallel_dims.get_mesh("batch").size() if parallel_dims.dp_enabled else 1
    return max(1, gbs // (lbs * degree))


class QCommMetricsProcessor(QCommMetricsMixin, MetricsProcessor):
    """torchtitan's MetricsProcessor plus ``qcomm/*`` figures and a JSON summary."""

    def __init__(self, job_config, parallel_dims, tag: str | None = None) -> None:
        super().__init__(job_config, parallel_dims, tag)
        self.init_qcomm(accumulation_steps(job_config, parallel_dims), metrics_rank(
            parallel_dims.pp, parallel_dims.world_size,
            job_config.parallelism.pipeline_parallel_schedule))

    def qcomm_run_info(self) -> tuple[str, str, str]:
        m = self.job_config.model
        return self.job_config.job.dump_folder, m.name, m.flavor


def build_qcomm_metrics_processor(job_config, parallel_dims, model_args=None, tag=None):
    return QCommMetricsProcessor(job_config, parallel_dims, tag)


__all__ = ["QCommMetricsProcessor", "accumulation_steps", "build_qcomm_metrics_processor"]

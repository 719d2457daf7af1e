"""torchtitan 0.2.2's metrics processor plus the ``qcomm/*`` figures
(``titan_common.metrics``): the ``gpt_qcomm`` train spec's ``build_metrics_processor_fn``."""

from __future__ import annotations

from torchtitan.components.metrics import MetricsProcessor

from fsdp_qcomm.titan_common.metrics import QCommMetricsMixin


class QCommMetricsProcessor(QCommMetricsMixin, MetricsProcessor):
    """torchtitan's MetricsProcessor plus ``qcomm/*`` figures and a JSON summary."""

    def __init__(self, job_config, parallel_dims, tag: str | None = None) -> None:
        super().__init__(job_config, parallel_dims, tag)
        self.init_qcomm(self._microbatches(job_config, parallel_dims))

    @staticmethod
    def _microbatches(job_config, parallel_dims) -> int:
        gbs = job_config.training.global_batch_size
        lbs = job_config.training.local_batch_size
        if gbs <= 0:
            return 1
        # as in torchtitan's Trainer: the "batch" mesh spans the data-parallel ranks
        degree = parallel_dims.get_mesh("batch").size() if parallel_dims.dp_enabled else 1
        return max(1, gbs // (lbs * degree))

    def qcomm_run_info(self) -> tuple[str, str, str]:
        m = self.job_config.model
        return self.job_config.job.dump_folder, m.name, m.flavor


def build_qcomm_metrics_processor(job_config, parallel_dims, model_args=None, tag=None):
    return QCommMetricsProcessor(job_config, parallel_dims, tag)


__all__ = ["QCommMetricsProcessor", "build_qcomm_metrics_processor"]

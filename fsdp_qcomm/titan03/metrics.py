"""torchtitan 0.3's metrics processor plus the ``qcomm/*`` figures (``titan_common.metrics``).

:class:`~fsdp_qcomm.titan03.trainer.QCommTrainer` makes its config's ``metrics`` a
:class:`QCommMetricsProcessor.Config` and tells the processor the training step's microbatches
and the model's name once it knows them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from torchtitan.components.metrics import MetricsProcessor

from fsdp_qcomm.titan_common.comm_stats import metrics_rank
from fsdp_qcomm.titan_common.metrics import QCommMetricsMixin


class QCommMetricsProcessor(QCommMetricsMixin, MetricsProcessor):
    """torchtitan's MetricsProcessor plus ``qcomm/*`` figures and a JSON summary."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        @classmethod
        def from_base(cls, base: MetricsProcessor.Config) -> "QCommMetricsProcessor.Config":
            """The same settings as a plain ``MetricsProcessor.Config``."""
            if isinstance(base, cls):
                return base
            return cls(**{f.name: getattr(base, f.name) for f in fields(base) if f.init})

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.dump_folder = kwargs.get("dump_folder", "./outputs")
        self.run_name = ("", "")
        dims = self.parallel_dims
        self.init_qcomm(summary_rank=metrics_rank(dims.pp, dims.world_size,
                                                  kwargs.get("pp_schedule", "1F1B")))

    def qcomm_run_info(self) -> tuple[str, str, str]:
        return (self.dump_folder, *self.run_name)


__all__ = ["QCommMetricsProcessor"]

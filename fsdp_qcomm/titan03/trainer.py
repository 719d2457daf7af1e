"""torchtitan 0.3's ``Trainer`` with fsdp_qcomm's hooks: :class:`QCommTrainer`.

Its nested :class:`QCommTrainer.Config` adds the ``qcomm`` section (generated from
``QCommConfig``, the same as torchtitan 0.2.2's ``[qcomm]``: ``--qcomm.preset sdp4bit``,
``--qcomm.weight_bits 8``, ...) and makes ``metrics`` the processor that logs the ``qcomm/*``
figures. ``config.build()`` constructs the trainer, which before torchtitan's own ``__init__``

1. on hosts without an accelerator, points torchtitan at the CPU and gloo
   (``titan_common.cpu``) and swaps FlexAttention for :class:`DenseMaskAttention`, built from
   eager masks (``attention.py``): FlexAttention has no backward on CPUs;
2. adds the offline datasets and resolves ``fsdp_qcomm:pystdlib_bpe<N>`` tokenizer paths
   (``titan_common.data``), and checks the tokenizer fits the model's vocabulary;
3. wraps the model spec's ``parallelize_fn`` so that every model part it returns (every
   pipeline stage) gets ``install_qcomm`` with the resolved section;

and after it, adds the handles' state to the checkpoint (key ``"qcomm"``; a resumed run
continues bit for bit) and tells the metrics processor the step's microbatches. The
``diloco`` section (``titan_common.diloco``) parses and validates as on 0.2.2, but
``--diloco.enable`` is refused on 0.3 (see ``Config.__post_init__``). Under HSDP with
gradient accumulation, ``train_step`` and ``forward_backward_step`` skip FSDP's all-reduce
across replicas on all but the last micro-batch of each optimizer step
(``titan_common/accumulation.py``): one node-crossing all-reduce per step, as with one
micro-batch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from torchtitan.config import TrainingConfig
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from fsdp_qcomm.titan03.attention import eager_block_masks, use_dense_attention
from fsdp_qcomm.titan03.metrics import QCommMetricsProcessor
from fsdp_qcomm.titan_common import cpu, data
from fsdp_qcomm.titan_common.accumulation import ReplicaSync
from fsdp_qcomm.titan_common.checkpoint import add_handles_state
from fsdp_qcomm.titan_common.comm_stats import attachment_of
from fsdp_qcomm.titan_common.diloco import DiLoCoSection
from fsdp_qcomm.titan_common.install import install_qcomm
from fsdp_qcomm.titan_common.section import QComm


class QCommTrainer(Trainer):
    """torchtitan's Trainer plus the ``qcomm`` section (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        qcomm: QComm = field(default_factory=QComm)
        """fsdp_qcomm's quantized collectives: a QCommConfig preset and field overrides"""

        diloco: DiLoCoSection = field(default_factory=DiLoCoSection)
        """DiLoCo across the dp_replicate replica groups (fsdp_qcomm.diloco): enable and
        DiLoCoConfig overrides (sync_every, fragments, outer_lr, outer_momentum, bits, ...)"""

        metrics: QCommMetricsProcessor.Config = field(  # pyrefly: ignore [bad-override]
            default_factory=QCommMetricsProcessor.Config
        )
        training: TrainingConfig = field(
            default_factory=lambda: TrainingConfig(disable_cuda_graphs=True)
        )
        """torchtitan's training section; CUDA graphs off (the hooks run Python per call)"""

        @classmethod
        def from_trainer_config(
            cls, base: Trainer.Config, preset: str = "baseline", **overrides: Any
        ) -> "QCommTrainer.Config":
            """Any torchtitan recipe (a ``Trainer.Config``, e.g. llama3's ``llama3_8b()``) with
            the hooks: the same settings plus ``qcomm`` = ``preset`` with ``overrides``, CUDA
            graphs off, and the qcomm metrics processor."""
            values = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
            values["training"] = dataclasses.replace(base.training, disable_cuda_graphs=True)
            values["metrics"] = QCommMetricsProcessor.Config.from_base(base.metrics)
            return cls(**values, qcomm=QComm(preset=preset, **overrides))

        def __post_init__(self) -> None:
            Trainer.Config.__post_init__(self)  # (zero-argument super() fails with slots)
            if not self.training.disable_cuda_graphs:
                raise ValueError(
                    "fsdp_qcomm's hooks run Python on every collective (byte counters, the qWD "
                    "reference, learned levels), which CUDA graph replay skips; set "
                    "--training.disable_cuda_graphs"
                )
            if self.diloco.enable:
                raise ValueError(
                    "diloco.enable is not wired for torchtitan 0.3: hiding dp_replicate from its "
                    "parallelize function (what the 0.2.2 adapter does) fails in torch 2.15's "
                    "fully_shard ('Parameter ... has spmd_types annotation on axis default_pg, "
                    "which is neither a non-FSDP storage-mesh axis nor contained in the FSDP DP "
                    "mesh'). Use torchtitan 0.2.2 (fsdp_qcomm.titan, [diloco]) or "
                    "fsdp_qcomm.diloco.DiLoCo directly"
                )

    def __init__(self, config: Config) -> None:
        if cpu.cpu_fallback_needed():
            cpu.patch_torchtitan_for_cpu()
            swapped = use_dense_attention(config.model_spec.model)
            eager_block_masks()
            logger.info(f"qcomm: no accelerator: torchtitan runs on CPU with gloo; "
                        f"{swapped} FlexAttention modules use dense masks")
        data.register_datasets()
        config.hf_assets_path = data.resolve_hf_assets_path(config.hf_assets_path)
        spec = config.model_spec
        vocab = getattr(spec.model, "vocab_size", None)
        if vocab is not None:
            data.check_tokenizer_fits(config.hf_assets_path, vocab,
                                      f"model {spec.name} {spec.flavor!r}", warn=logger.warning)
        config.metrics = QCommMetricsProcessor.Config.from_base(config.metrics)
        section = config.qcomm
        qcfg = section.resolve()
        parallelize = spec.parallelize_fn

        def parallelize_with_qcomm(model, **kwargs):
            model = parallelize(model, **kwargs)
            install_qcomm([model], qcfg, preset=section.preset, overrides=section.overrides())
            return model

        config.model_spec = dataclasses.replace(spec, parallelize_fn=parallelize_with_qcomm)
        super().__init__(config)
        states = getattr(self.checkpointer, "states", None)  # none when checkpoints are off
        if states is not None:
            add_handles_state(states, self.model_parts)
        self.metrics_processor.run_name = (spec.name, spec.flavor)
        self.metrics_processor.set_microbatches(
            self.gradient_accumulation_steps * self.num_pipeline_parallel_microbatches)
        self.replica_sync = ReplicaSync(self.model_parts, self.gradient_accumulation_steps,
                                        pipelined=self.parallel_dims.pp_enabled)
        self.replica_sync.attach_optimizers(self.optimizers)
        for att in attachment_of(self.model_parts):
            att.replica_sync = self.replica_sync
        logger.info(f"qcomm: {self.replica_sync.describe()}")

    def train_step(self, data_iterator):
        self.replica_sync.start_step()
        return super().train_step(data_iterator)

    def forward_backward_step(self, **kwargs):
        # one call per gradient accumulation step (pipeline micro-batches go inside it)
        self.replica_sync.before_microbatch()
        return super().forward_backward_step(**kwargs)


__all__ = ["QCommTrainer"]

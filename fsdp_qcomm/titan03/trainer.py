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
continues bit for bit) and tells the metrics processor the step's microbatches. Under HSDP with
gradient accumulation, ``train_step`` and ``forward_backward_step`` skip FSDP's all-reduce
across replicas on all but the last micro-batch of each optimizer step
(``titan_common/accumulation.py``): one node-crossing all-reduce per step, as with one
micro-batch.

DiLoCo (``--diloco.enable``, the ``diloco`` section of ``titan_common.diloco``): the replica
groups are ``dp_replicate``. Hiding that dimension from the parallelize function, as the 0.2.2
adapter does, fails in torch 2.15's ``fully_shard`` (0.3 annotates the parameters with
spmd_types over the whole data-parallel storage mesh: "Parameter ... has spmd_types annotation
on axis ..., which is neither a non-FSDP storage-mesh axis nor contained in the FSDP DP
mesh"). So torchtitan builds its usual HSDP model, and the wrapped parallelize function then
isolates its replica groups (``titan_common.diloco.isolate_for_diloco``, before
``install_qcomm``): FSDP's all-reduce across replicas becomes a local no-op and each replica
group trains exactly as FSDP over ``dp_shard`` alone, with the loss normalized by the replica
group's own valid tokens (``ReplicaTokens``, in ``train_step`` / ``forward_backward_step``).
After torchtitan's ``__init__`` the driver hooks the optimizers container
(``install_diloco``: the engine is built at the first step, stepped after each) and the
checkpoint gets the ``"diloco"`` entry (``DiLoCoState``, loaded through ``wrap_dcp_load``), so
a resume continues the round bit for bit. Refused with DiLoCo: pipeline, tensor, context and
expert parallelism (``check_layout``).
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
from fsdp_qcomm.titan_common.checkpoint import (
    add_diloco_state,
    add_handles_state,
    wrap_dcp_load,
)
from fsdp_qcomm.titan_common.comm_stats import attachment_of
from fsdp_qcomm.titan_common.diloco import (
    WIRED_FOR,
    DiLoCoSection,
    ReplicaTokens,
    check_layout,
    install_diloco,
    isolate_for_diloco,
)
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
            if self.diloco.enable and self.parallelism.pipeline_parallel_degree > 1:
                raise ValueError(f"diloco.enable with pipeline parallelism: {WIRED_FOR}")

    def __init__(self, config: Config) -> None:
        if cpu.cpu_fallback_needed():
            cpu.patch_torchtitan_for_cpu()
            swapped = use_dense_attention(config.model_spec.model)
            eager_block_masks()
            logger.info(f"qcomm: {cpu.fallback_reason()}: torchtitan runs on CPU with gloo; "
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
        dl_config = config.diloco.resolve()  # None unless --diloco.enable
        parallelize = spec.parallelize_fn
        isolations: list = []

        def parallelize_with_qcomm(model, **kwargs):
            if dl_config is not None:
                check_layout(kwargs["parallel_dims"])  # before building anything
            model = parallelize(model, **kwargs)
            if dl_config is not None:  # before install_qcomm: it then sees one replica
                isolations.append(isolate_for_diloco(model, kwargs["parallel_dims"]))
            install_qcomm([model], qcfg, preset=section.preset, overrides=section.overrides(),
                          **section.module_choice())
            return model

        config.model_spec = dataclasses.replace(spec, parallelize_fn=parallelize_with_qcomm)
        super().__init__(config)
        isolation = next((i for i in isolations if i is not None), None)
        self.replica_tokens = None  # DiLoCo: the loss normalized by the replica group's tokens
        if isolation is not None:
            from torchtitan.components.loss import IGNORE_INDEX

            self.replica_tokens = ReplicaTokens(isolation.shard_group, IGNORE_INDEX)
        self.diloco_driver = install_diloco(
            self.model_parts, self.optimizers, self.parallel_dims, dl_config,
            group=isolation.replica_group if isolation is not None else None)
        states = getattr(self.checkpointer, "states", None)  # none when checkpoints are off
        if states is not None:
            add_handles_state(states, self.model_parts)
            entry = add_diloco_state(states, self.model_parts, self.optimizers)
            if entry is not None:
                wrap_dcp_load(self.checkpointer, entry)
        self.metrics_processor.run_name = (spec.name, spec.flavor)
        # FSDP's passes per optimizer step: one per gradient-accumulation step, pipeline or not
        # (torch's pipeline schedules reduce once per schedule step, and torchtitan keeps the
        # stages gathered through it: reshard_after_forward is off under pipeline parallelism)
        self.metrics_processor.set_microbatches(self.gradient_accumulation_steps)
        self.replica_sync = ReplicaSync(self.model_parts, self.gradient_accumulation_steps,
                                        pipelined=self.parallel_dims.pp_enabled)
        self.replica_sync.attach_optimizers(self.optimizers)
        for att in attachment_of(self.model_parts):
            att.replica_sync = self.replica_sync
        logger.info(f"qcomm: {self.replica_sync.describe()}")

    def train_step(self, data_iterator):
        self.replica_sync.start_step()
        if self.replica_tokens is not None:  # DiLoCo: count the step's tokens as drawn
            data_iterator = self.replica_tokens.start_step(data_iterator)
        return super().train_step(data_iterator)

    def forward_backward_step(self, **kwargs):
        # one call per gradient accumulation step (pipeline micro-batches go inside it)
        self.replica_sync.before_microbatch()
        if self.replica_tokens is not None:
            return self.replica_tokens.forward_backward(super().forward_backward_step, kwargs)
        return super().forward_backward_step(**kwargs)


__all__ = ["QCommTrainer"]

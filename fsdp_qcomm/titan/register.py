"""torchtitan 0.2.2 plug-in: ``[experimental] custom_import = "fsdp_qcomm.titan.register"``.

Importing this module (torchtitan does it at the top of ``Trainer.__init__``, before it picks
the device) does four things, none of which edits torchtitan's files:

1. on hosts without an accelerator, points torchtitan at the CPU and gloo
   (``titan_common/cpu.py``);
2. adds the offline datasets ``pystdlib``, ``pystdlib_val``, ``text``, ``jsonl``
   (``titan_common/data.py``);
3. registers the train spec ``gpt_qcomm`` (flavors in ``models.py``): llama3's model and
   components, plus

   * ``build_tokenizer_fn`` that accepts ``hf_assets_path = "fsdp_qcomm:pystdlib_bpe<N>"``;
   * ``parallelize_fn`` = torchtitan's ``parallelize_llama``, then ``install_qcomm``
     (``fsdp_qcomm.enable``) with the ``[qcomm]`` config, and, under HSDP with gradient
     accumulation, one all-reduce across replicas per optimizer step
     (``titan_common/accumulation.py``: a forward pre-hook on the model part counts the
     micro-batches; ``build_optimizers_fn`` ties the count to the optimizer steps);
   * ``build_metrics_processor_fn`` that logs ``qcomm/*`` figures (``metrics.py``);
4. makes torchtitan checkpoints save and load the handles' state under ``"qcomm"``
   (``checkpoint.py``), so a resumed run continues bit for bit;
5. with ``[diloco] enable = true``, trains the ``dp_replicate`` replica groups by themselves
   (FSDP over ``dp_shard`` only) and syncs them with DiLoCo after the optimizer steps
   (``titan_common/diloco.py``).

Use it together with ``[job] custom_config_module = "fsdp_qcomm.titan.config"`` (the
``[qcomm]`` section); without that module the spec runs the "baseline" preset.
"""

from __future__ import annotations

import torch
from torchtitan.components.loss import build_cross_entropy_loss
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import build_optimizers
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.components.validate import build_validator
from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.hf_datasets.text_datasets import build_text_dataloader
from torchtitan.models.llama3 import parallelize_llama
from torchtitan.models.llama3.model.model import Transformer
from torchtitan.protocols import train_spec as train_spec_module
from torchtitan.protocols.train_spec import TrainSpec
from torchtitan.tools.logging import logger

from fsdp_qcomm.titan import config as qcomm_config
from fsdp_qcomm.titan.checkpoint import patch_checkpoint_manager
from fsdp_qcomm.titan.metrics import accumulation_steps, build_qcomm_metrics_processor
from fsdp_qcomm.titan.models import GPT_FLAVORS
from fsdp_qcomm.titan_common import cpu, data
from fsdp_qcomm.titan_common import diloco as diloco_section
from fsdp_qcomm.titan_common.accumulation import ReplicaSync
from fsdp_qcomm.titan_common.comm_stats import attachment_of
from fsdp_qcomm.titan_common.install import install_qcomm

TRAIN_SPEC_NAME = "gpt_qcomm"


def parallelize_gpt_qcomm(model: torch.nn.Module, parallel_dims, job_config) -> torch.nn.Module:
    """torchtitan's llama3 parallelization, then the qcomm hooks (``install_qcomm``).

    Called once per model part (pipeline stages call it per stage). Parameters are still on
    the meta device here: torchtitan materializes and initializes them afterwards.
    """
    dl_config = diloco_section.resolve(job_config)
    if dl_config is None:
        model = parallelize_llama(model, parallel_dims, job_config)
    else:
        model = diloco_section.parallelize_for_diloco(parallelize_llama, model, parallel_dims,
                                                      job_config)
        setattr(model, _DILOCO_CONFIG_ATTR, dl_config)
    section = qcomm_config.section_of(job_config)
    if section is None:
        logger.warning(
            "qcomm: no [qcomm] section (set [job] custom_config_module = "
            "'fsdp_qcomm.titan.config'); using the baseline preset"
        )
        section = qcomm_config.QComm()
    atts = install_qcomm([model], section.resolve(), preset=section.preset,
                         overrides=section.overrides(), **section.module_choice())
    # torchtitan 0.2.2's Trainer runs gradient_accumulation_steps forward/backward passes per
    # optimizer step and never skips FSDP's all-reduce across replicas: count them here
    sync = ReplicaSync([model], accumulation_steps(job_config, parallel_dims),
                       pipelined=parallel_dims.pp_enabled)
    sync.install_forward_hook(model)
    for att in atts:
        att.replica_sync = sync
    logger.info(f"qcomm: {sync.describe()}")
    return model


_DILOCO_CONFIG_ATTR = "_fsdp_qcomm_diloco_config"


def build_optimizers_qcomm(model_parts, optimizer_config, parallel_dims, *args, **kwargs):
    """torchtitan's ``build_optimizers``, with each model part's ``ReplicaSync`` tied to their
    steps, then the DiLoCo hooks when ``[diloco] enable`` (the config was left on the model
    part by ``parallelize_gpt_qcomm``)."""
    optimizers = build_optimizers(model_parts, optimizer_config, parallel_dims, *args, **kwargs)
    for att in attachment_of(model_parts):
        sync = getattr(att, "replica_sync", None)
        if sync is not None:
            sync.attach_optimizers(optimizers)
    configs = {getattr(m, _DILOCO_CONFIG_ATTR, None) for m in model_parts} - {None}
    if configs:
        diloco_section.install_diloco(model_parts, optimizers, parallel_dims, configs.pop())
    return optimizers


def build_tokenizer(job_config) -> HuggingFaceTokenizer:
    """torchtitan's HF tokenizer, also accepting ``fsdp_qcomm:pystdlib_bpe<N>`` paths."""
    path = data.resolve_hf_assets_path(job_config.model.hf_assets_path)
    return HuggingFaceTokenizer(path)


def get_train_spec() -> TrainSpec:
    return TrainSpec(
        model_cls=Transformer,
        model_args=GPT_FLAVORS,
        parallelize_fn=parallelize_gpt_qcomm,
        pipelining_fn=pipeline_llm,
        build_optimizers_fn=build_optimizers_qcomm,
        build_lr_schedulers_fn=build_lr_schedulers,
        build_dataloader_fn=build_text_dataloader,
        build_tokenizer_fn=build_tokenizer,
        build_loss_fn=build_cross_entropy_loss,
        build_validator_fn=build_validator,
        build_metrics_processor_fn=build_qcomm_metrics_processor,
        state_dict_adapter=None,
    )


def register() -> None:
    """Apply the CPU patches, add the datasets and the train spec (idempotent)."""
    if cpu.patch_torchtitan_for_cpu():
        logger.info(f"qcomm: {cpu.fallback_reason()}: torchtitan patched to run on CPU with "
                    "gloo")
    data.register_datasets()
    patch_checkpoint_manager()
    if TRAIN_SPEC_NAME not in train_spec_module._extra_train_specs:
        train_spec_module.register_train_spec(TRAIN_SPEC_NAME, get_train_spec())


register()

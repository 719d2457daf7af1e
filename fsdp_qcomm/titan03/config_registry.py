"""Recipes for torchtitan 0.3: ``--module fsdp_qcomm.titan03 --config <name>``.

The torchtitan 0.2.2 TOML recipes in ``recipes/`` as plain functions returning a
:class:`~fsdp_qcomm.titan03.trainer.QCommTrainer.Config`, with the same models and
hyper-parameters (``titan_common.shapes``): ``debug_baseline`` (the CPU-sized debug GPT) and
``gpt_<size>_baseline`` for the GPT-3 sizes 125M, 350M, 1p3B (1.3B), 2p7B, 6p7B and 13B; each
scheme is that function with another ``qcomm`` preset (``debug_sdp4bit`` = ``debug_baseline``
with ``sdp4bit``, and so on). Any recipe runs any scheme with ``--qcomm.preset <name>``, and
any field can be overridden: ``--qcomm.weight_bits 8``, ``--training.steps 100``.
"""

from __future__ import annotations

from torchtitan.components import optimizer as _optimizer
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.optimizer import LRSchedulersContainer
from torchtitan.components.validate import Validator
from torchtitan.config import DebugConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

from fsdp_qcomm.titan03 import models
from fsdp_qcomm.titan03.metrics import QCommMetricsProcessor
from fsdp_qcomm.titan03.trainer import QCommTrainer
from fsdp_qcomm.titan_common import shapes
from fsdp_qcomm.titan_common.section import QComm
from fsdp_qcomm.titan_common.shapes import (
    ADAMW,
    DEBUG,
    DEBUG_SCHEMES,
    GPT_SHAPES,
    MIN_LR_FACTOR,
    PAPER_RUN,
    PAPER_SCHEMES,
    PAPER_SIZES,
    PAPER_STEPS,
    PAPER_WARMUP,
    TOKENIZER,
)

# Only recipe functions here may be public lower-case callables: torchtitan lists those as the
# module's configs.
Config = QCommTrainer.Config


def _common(flavor: str, *, lr: float, warmup: int, steps: int, local_batch: int,
            global_batch: int, seq_len: int, precision: str, log_freq: int, tensorboard: bool,
            validate: bool, val_freq: int, val_steps: int, ckpt_interval: int,
            activation_checkpoint, name: str, seed=None) -> Config:
    spec = models.gpt_model_spec(flavor)
    return Config(
        model_spec=spec,
        hf_assets_path=TOKENIZER,
        dump_folder=f"./outputs/{name}",
        # Not torchtitan's ChunkedLossWrapper: calling lm_head from the loss, after the model's
        # forward has resharded the [norm, lm_head] FSDP group, gathers that group a second
        # time every step (the largest group: 23% of GPT-125M's weights)
        loss=CrossEntropyLoss.Config(global_vocab_size=GPT_SHAPES[flavor].vocab_size),
        optimizer=_optimizer.default_adamw(lr=lr, **ADAMW),
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=warmup, decay_type="cosine", min_lr_factor=MIN_LR_FACTOR),
        training=TrainingConfig(
            local_batch_size=local_batch, global_batch_size=global_batch, seq_len=seq_len,
            steps=steps, max_norm=1.0, mixed_precision_param=precision,
            mixed_precision_reduce="float32", disable_cuda_graphs=True,
        ),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="pystdlib"),
        parallelism=ParallelismConfig(data_parallel_shard_degree=-1),
        activation_checkpoint=activation_checkpoint,
        metrics=QCommMetricsProcessor.Config(log_freq=log_freq, enable_tensorboard=tensorboard),
        validator=Validator.Config(
            enable=validate, freq=val_freq, steps=val_steps,
            dataloader=HuggingFaceTextDataLoader.Config(dataset="pystdlib_val", infinite=False),
        ),
        checkpoint=CheckpointManager.Config(enable=False, interval=ckpt_interval),
        debug=DebugConfig(seed=seed),
        qcomm=QComm(preset="baseline"),
    )


def _with_scheme(config: Config, scheme: str) -> Config:
    """``config`` with the ``qcomm`` preset ``scheme`` (the other ``qcomm`` fields kept) and
    its own output folder."""
    overrides = config.qcomm.overrides()
    if config.model_spec.flavor == DEBUG.flavor:  # the CPU recipes: see debug_baseline
        overrides.pop("grad_overlap", None)
        if shapes.debug_overlaps(scheme):
            overrides["grad_overlap"] = True
    old = config.qcomm.preset
    config.qcomm = QComm(preset=scheme, **overrides)
    if config.dump_folder.endswith(f"_{old}"):
        config.dump_folder = config.dump_folder[: -len(old)] + scheme
    return config


# --------------------------------------------------------------------------- the debug GPT
def debug_baseline() -> Config:
    """Debug GPT (~3M weights, vocabulary 8192) on the built-in offline corpus: trains on a
    2-core CPU (fp32, gloo) in a few minutes with 4 processes x 4 x 128 tokens. The 4 processes
    count as 2 "nodes" x 2 ranks (``qcomm.ranks_per_node=2``) so that two-level gradient
    schemes run both hops; the schemes with quantized gradients reduce them on a background
    thread while backward goes on (``grad_overlap``, docs/cpu_path.md)."""
    d = DEBUG
    config = _common(
        d.flavor, lr=d.lr, warmup=d.warmup, steps=d.steps, local_batch=d.local_batch,
        global_batch=-1, seq_len=d.seq_len, precision="float32", log_freq=d.log_freq,
        tensorboard=False, validate=True, val_freq=d.val_freq, val_steps=d.val_steps,
        ckpt_interval=500, activation_checkpoint=None, name="debug_baseline", seed=d.seed,
    )
    config.qcomm = QComm(preset="baseline", ranks_per_node=d.ranks_per_node)
    return config


def debug_sdp4bit() -> Config:
    return _with_scheme(debug_baseline(), "sdp4bit")


def debug_qsdp() -> Config:
    return _with_scheme(debug_baseline(), "qsdp")


def debug_zeropp() -> Config:
    return _with_scheme(debug_baseline(), "zeropp")


def debug_qw4() -> Config:
    return _with_scheme(debug_baseline(), "qw4")


# --------------------------------------------------------------------------- an MoE model
def _moe(scheme: str) -> Config:
    """torchtitan's DeepSeek-V3 debug model (8 routed experts, 2 shared, 5 MoE layers, vocabulary
    2048) with expert parallelism 2 on the 4 CPU ranks (2 "nodes" x 2, ``ranks_per_node=2``):
    the experts of each MoE block are sharded over their own expert-data-parallel mesh
    (``ShardPlacementResult``), the dense weights over all 4 ranks, and fsdp_qcomm installs
    each group's collectives (docs/moe.md). The built-in corpus with its 2048-token tokenizer,
    fp32 parameters (the grouped expert matmuls run in bf16, as torchtitan writes them), 20
    steps of 4 x 128 tokens per rank, from the debug GPT's seed."""
    from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel

    base = deepseek_v3_debugmodel()
    config = Config.from_trainer_config(base, scheme, ranks_per_node=DEBUG.ranks_per_node)
    config.hf_assets_path = "fsdp_qcomm:pystdlib_bpe2048"
    config.dataloader = HuggingFaceTextDataLoader.Config(dataset="pystdlib")
    config.loss = CrossEntropyLoss.Config(global_vocab_size=2048)
    config.training = TrainingConfig(local_batch_size=4, seq_len=128, steps=20,
                                     mixed_precision_param="float32",
                                     mixed_precision_reduce="float32", disable_cuda_graphs=True)
    config.parallelism = ParallelismConfig(data_parallel_shard_degree=-1,
                                           expert_parallel_degree=2)
    config.activation_checkpoint = None
    config.checkpoint = CheckpointManager.Config(enable=False)
    config.debug = DebugConfig(seed=DEBUG.seed)  # as the debug GPT: the same run every time
    config.metrics = QCommMetricsProcessor.Config(log_freq=5)
    config.dump_folder = f"./outputs/debug_moe_{scheme}"
    if shapes.debug_overlaps(scheme):
        config.qcomm = QComm(preset=scheme, ranks_per_node=DEBUG.ranks_per_node,
                             grad_overlap=True)
    return config


def debug_moe_baseline() -> Config:
    return _moe("baseline")


def debug_moe_sdp4bit() -> Config:
    return _moe("sdp4bit")


# --------------------------------------------------------------------------- GPT-3 sizes
_AC = {"none": lambda: None, "selective": SelectiveAC.Config, "full": FullAC.Config}


def _paper(size: str) -> Config:
    """GPT ``size`` (GPT-3 shapes): 80k steps of 0.5M-2M tokens at sequence length 2048, bf16
    compute, fp32 gradient reduction. The built-in corpus is only for smoke tests at these
    sizes: point ``--dataloader.dataset jsonl --dataloader.dataset_path '/data/*.jsonl'`` and
    ``--hf_assets_path`` (at most 50304 tokens) at real data."""
    s = PAPER_SIZES[size]
    r = PAPER_RUN
    return _common(
        size, lr=s.lr, warmup=PAPER_WARMUP, steps=PAPER_STEPS, local_batch=s.local_batch,
        global_batch=s.global_batch, seq_len=s.seq_len, precision="bfloat16",
        log_freq=r.log_freq, tensorboard=True, validate=False, val_freq=r.val_freq,
        val_steps=r.val_steps, ckpt_interval=r.checkpoint_interval,
        activation_checkpoint=_AC[s.ac](), name=f"gpt_{size}_baseline",
    )


def gpt_125M_baseline() -> Config:
    return _paper("125M")


def gpt_125M_sdp4bit() -> Config:
    return _with_scheme(gpt_125M_baseline(), "sdp4bit")


def gpt_125M_qsdp() -> Config:
    return _with_scheme(gpt_125M_baseline(), "qsdp")


def gpt_125M_zeropp() -> Config:
    return _with_scheme(gpt_125M_baseline(), "zeropp")


def gpt_350M_baseline() -> Config:
    return _paper("350M")


def gpt_350M_sdp4bit() -> Config:
    return _with_scheme(gpt_350M_baseline(), "sdp4bit")


def gpt_350M_qsdp() -> Config:
    return _with_scheme(gpt_350M_baseline(), "qsdp")


def gpt_350M_zeropp() -> Config:
    return _with_scheme(gpt_350M_baseline(), "zeropp")


def gpt_1p3B_baseline() -> Config:
    return _paper("1.3B")


def gpt_1p3B_sdp4bit() -> Config:
    return _with_scheme(gpt_1p3B_baseline(), "sdp4bit")


def gpt_1p3B_qsdp() -> Config:
    return _with_scheme(gpt_1p3B_baseline(), "qsdp")


def gpt_1p3B_zeropp() -> Config:
    return _with_scheme(gpt_1p3B_baseline(), "zeropp")


def gpt_2p7B_baseline() -> Config:
    return _paper("2.7B")


def gpt_2p7B_sdp4bit() -> Config:
    return _with_scheme(gpt_2p7B_baseline(), "sdp4bit")


def gpt_2p7B_qsdp() -> Config:
    return _with_scheme(gpt_2p7B_baseline(), "qsdp")


def gpt_2p7B_zeropp() -> Config:
    return _with_scheme(gpt_2p7B_baseline(), "zeropp")


def gpt_6p7B_baseline() -> Config:
    return _paper("6.7B")


def gpt_6p7B_sdp4bit() -> Config:
    return _with_scheme(gpt_6p7B_baseline(), "sdp4bit")


def gpt_6p7B_qsdp() -> Config:
    return _with_scheme(gpt_6p7B_baseline(), "qsdp")


def gpt_6p7B_zeropp() -> Config:
    return _with_scheme(gpt_6p7B_baseline(), "zeropp")


def gpt_13B_baseline() -> Config:
    return _paper("13B")


def gpt_13B_sdp4bit() -> Config:
    return _with_scheme(gpt_13B_baseline(), "sdp4bit")


def gpt_13B_qsdp() -> Config:
    return _with_scheme(gpt_13B_baseline(), "qsdp")


def gpt_13B_zeropp() -> Config:
    return _with_scheme(gpt_13B_baseline(), "zeropp")


#: each TOML recipe of recipes/ (torchtitan 0.2.2) -> the function here that mirrors it
TOML_COUNTERPARTS: dict[str, str] = {
    **{f"debug_{sch}.toml": f"debug_{sch}" for sch in DEBUG_SCHEMES},
    **{f"gpt_{size}_{sch}.toml": f"gpt_{size.replace('.', 'p')}_{sch}"
       for size in PAPER_SIZES for sch in PAPER_SCHEMES},
}

#: recipe functions of torchtitan 0.3 only (no TOML recipe of 0.2.2 mirrors them)
ONLY_03: tuple[str, ...] = ("debug_moe_baseline", "debug_moe_sdp4bit")

__all__ = ["ONLY_03", "TOML_COUNTERPARTS"]

"""The GPT models and training set-ups of the recipes, for either torchtitan version.

The network is torchtitan's llama3 decoder (pre-norm, RoPE, SwiGLU, RMSNorm, untied output
layer) with the shapes of the GPT-3 paper (Brown et al. 2020, Table 2.1), which the SDP4Bit and
QSDP experiments use. Differences from GPT-3 and why they do not matter here:

* SwiGLU with hidden size ~8d/3 (rounded up to ``multiple_of``) has the same weight count as
  GPT's 4d GELU MLP (3 * d * 8d/3 = 2 * d * 4d), so layer sizes, and hence the bytes FSDP
  moves, match the paper's models.
* The output layer is not tied to the embedding (torchtitan shards them as separate FSDP
  units), so each flavor has one extra ``vocab x d`` matrix: "125M" has ~163M weights.
* RoPE (theta 10000, no Llama-3.1 frequency scaling) instead of learned positions.
* The GPT-3 table lists 1.3B with 24 heads and 13B with d_model 5140; neither divides evenly
  (24*128 != 2048, 5140/40 is not an integer). We use Megatron-LM's shapes, as SDP4Bit does:
  1.3B = 16 heads of 128, 13B = d_model 5120 with 40 heads of 128.
* Vocabulary 50304 (GPT-2's 50257 padded to a multiple of 128, as in Megatron-LM) for the paper
  sizes, whatever the tokenizer; only the ``tiny`` and ``debug`` flavors use the small built-in
  BPE vocabulary. A tokenizer larger than the model's vocabulary is rejected at startup.

Training hyper-parameters of the paper sizes follow GPT-3 (learning rates, batches of
0.5M/1M/2M tokens at sequence length 2048) and SDP4Bit's 80k iterations with 1% warm-up and
cosine decay. Per-GPU micro-batch sizes and activation checkpointing are starting points for
80 GB GPUs, not tuned values.
"""

from __future__ import annotations

from dataclasses import dataclass

GPT_VOCAB_SIZE = 50304
DEBUG_VOCAB_SIZE = 8192
#: the built-in offline tokenizer (``data.py``) of the recipes
TOKENIZER = f"fsdp_qcomm:pystdlib_bpe{DEBUG_VOCAB_SIZE}"


@dataclass(frozen=True)
class GPTShape:
    n_layers: int
    dim: int
    n_heads: int
    vocab_size: int = GPT_VOCAB_SIZE
    multiple_of: int = 256  # the SwiGLU hidden size is rounded up to a multiple of this
    rope_theta: float = 10000.0
    max_seq_len: int = 2048

    @property
    def ffn_hidden(self) -> int:
        hidden = int(2 * 4 * self.dim / 3)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def param_count(self) -> int:
        """Weights of the llama3 decoder of this shape (computed, not instantiated)."""
        d, L, V = self.dim, self.n_layers, self.vocab_size
        attn = 4 * d * d  # wq, wk, wv, wo (no grouped-query attention)
        ffn = 3 * d * self.ffn_hidden
        norms = 2 * d
        return L * (attn + ffn + norms) + 2 * V * d + d


def _small(n_layers: int, dim: int, n_heads: int) -> GPTShape:
    return GPTShape(n_layers, dim, n_heads, vocab_size=DEBUG_VOCAB_SIZE, multiple_of=64)


#: flavor -> shape. "debug" trains on a 2-core CPU; "tiny" is for tests; the rest are GPT-3's.
GPT_SHAPES: dict[str, GPTShape] = {
    "tiny": _small(2, 64, 4),
    "debug": _small(4, 128, 4),
    "125M": GPTShape(12, 768, 12),
    "350M": GPTShape(24, 1024, 16),
    "1.3B": GPTShape(24, 2048, 16),
    "2.7B": GPTShape(32, 2560, 32),
    "6.7B": GPTShape(32, 4096, 32),
    "13B": GPTShape(40, 5120, 40),
}

#: The GPT-3 paper sizes (recipes exist for these and for "debug").
PAPER_FLAVORS = ("125M", "350M", "1.3B", "2.7B", "6.7B", "13B")


@dataclass(frozen=True)
class Size:
    """How a paper size trains."""

    lr: float
    global_batch: int  # sequences of seq_len tokens
    local_batch: int
    ac: str  # activation checkpointing: "none", "selective" (per op) or "full"
    seq_len: int = 2048


PAPER_SIZES: dict[str, Size] = {
    "125M": Size(6.0e-4, 256, 16, "none"),
    "350M": Size(3.0e-4, 256, 8, "none"),
    "1.3B": Size(2.0e-4, 512, 8, "selective"),
    "2.7B": Size(1.6e-4, 512, 4, "selective"),
    "6.7B": Size(1.2e-4, 1024, 2, "full"),
    "13B": Size(1.0e-4, 1024, 1, "full"),
}
assert tuple(PAPER_SIZES) == PAPER_FLAVORS

PAPER_STEPS = 80_000
PAPER_WARMUP = PAPER_STEPS // 100


@dataclass(frozen=True)
class PaperRun:
    """Logging, validation and checkpoint cadence of the paper-size recipes."""

    log_freq: int = 10
    val_freq: int = 1000
    val_steps: int = 50
    checkpoint_interval: int = 1000


PAPER_RUN = PaperRun()


@dataclass(frozen=True)
class Debug:
    """The CPU debug job: 4 processes x 4 x 128 tokens, fp32, ~0.7 s/step on 2 cores."""

    flavor: str = "debug"
    steps: int = 300
    local_batch: int = 4
    seq_len: int = 128
    lr: float = 3e-3
    warmup: int = 20
    log_freq: int = 10
    val_freq: int = 100
    val_steps: int = 10  # fixed count: every rank must run the same number of batches
    #: 4 processes on one host as 2 "nodes" x 2 ranks, so that two-level gradient schemes
    #: run both hops
    ranks_per_node: int = 2
    seed: int = 0


DEBUG = Debug()

#: AdamW settings of every recipe (GPT-3's)
ADAMW = dict(eps=1e-8, weight_decay=0.1)
MIN_LR_FACTOR = 0.1

#: schemes with a recipe per paper size; the debug model gets DEBUG_SCHEMES
PAPER_SCHEMES = ("baseline", "sdp4bit", "qsdp", "zeropp")
DEBUG_SCHEMES = ("baseline", "sdp4bit", "qsdp", "zeropp", "qw4")


def debug_overlaps(scheme: str) -> bool:
    """The debug recipes run on CPU: overlap quantized gradient reductions with backward
    (``grad_overlap``), which needs a quantized gradient scheme."""
    from fsdp_qcomm.config import QCommConfig

    return QCommConfig.preset(scheme).grad_scheme != "none"


__all__ = [
    "ADAMW", "DEBUG", "DEBUG_SCHEMES", "DEBUG_VOCAB_SIZE", "Debug", "GPTShape", "GPT_SHAPES",
    "GPT_VOCAB_SIZE", "MIN_LR_FACTOR", "PAPER_FLAVORS", "PAPER_RUN", "PAPER_SCHEMES", "PAPER_SIZES",
    "PAPER_STEPS", "PAPER_WARMUP", "PaperRun", "Size", "TOKENIZER", "debug_overlaps",
]

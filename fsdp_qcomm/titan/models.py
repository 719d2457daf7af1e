"""GPT-style model flavors for the ``gpt_qcomm`` train spec.

The network is torchtitan's llama3 ``Transformer`` (pre-norm decoder, RoPE, SwiGLU, RMSNorm,
untied output layer) with the shapes of the GPT-3 paper (Brown et al. 2020, Table 2.1), which
the SDP4Bit and QSDP experiments use. Differences from GPT-3 and why they do not matter here:

* SwiGLU with hidden size ~8d/3 (rounded up to ``multiple_of``) has the same weight count as
  GPT's 4d GELU MLP (3 * d * 8d/3 = 2 * d * 4d), so layer sizes, and hence the bytes FSDP
  moves, match the paper's models.
* The output layer is not tied to the embedding (torchtitan shards them as separate FSDP
  units), so each flavor has one extra ``vocab x d`` matrix: "125M" has ~163M weights.
* RoPE without Llama-3.1 frequency scaling (``scaling_factor=1``) instead of learned positions.
* The GPT-3 table lists 1.3B with 24 heads and 13B with d_model 5140; neither divides evenly
  (24*128 != 2048, 5140/40 is not an integer). We use Megatron-LM's shapes, as SDP4Bit does:
  1.3B = 16 heads of 128, 13B = d_model 5120 with 40 heads of 128.
* Vocabulary 50304 (GPT-2's 50257 padded to a multiple of 128, as in Megatron-LM) for the paper
  sizes, whatever the tokenizer; only the ``debug*`` flavors use the small built-in BPE
  vocabulary. A tokenizer larger than the model's vocabulary is rejected at startup.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torchtitan.models.llama3.model.args import RoPEScalingArgs, TransformerModelArgs
from torchtitan.tools.logging import logger

GPT_VOCAB_SIZE = 50304
DEBUG_VOCAB_SIZE = 8192


@dataclass
class GPTModelArgs(TransformerModelArgs):
    """llama3 args with GPT defaults and a tokenizer/vocabulary consistency check."""

    rope_theta: float = 10000.0
    rope_scaling_args: RoPEScalingArgs = dataclasses.field(
        default_factory=lambda: RoPEScalingArgs(scaling_factor=1.0)
    )
    max_seq_len: int = 2048

    def update_from_config(self, job_config, **kwargs) -> None:
        super().update_from_config(job_config, **kwargs)
        # llama3 sizes the RoPE table to training.seq_len; a longer validation.seq_len would
        # trip an assertion inside the first validation forward.
        val = getattr(job_config, "validation", None)
        if val is not None and val.enable and val.seq_len > self.max_seq_len:
            self.max_seq_len = val.seq_len
        from fsdp_qcomm.titan.data import tokenizer_vocab_size

        try:
            tok_vocab = tokenizer_vocab_size(job_config.model.hf_assets_path)
        except (OSError, ValueError) as e:  # no readable tokenizer: nothing to compare
            logger.warning(f"gpt_qcomm: cannot read the tokenizer's vocabulary size: {e}")
            tok_vocab = None
        if tok_vocab is not None and tok_vocab > self.vocab_size:
            raise ValueError(
                f"tokenizer at {job_config.model.hf_assets_path!r} has {tok_vocab} tokens but "
                f"model flavor {job_config.model.flavor!r} has vocab_size {self.vocab_size}; "
                "use a smaller tokenizer or a flavor with a larger vocabulary"
            )


def _gpt(n_layers: int, dim: int, n_heads: int, **kw) -> GPTModelArgs:
    kw.setdefault("vocab_size", GPT_VOCAB_SIZE)
    kw.setdefault("multiple_of", 256)
    return GPTModelArgs(dim=dim, n_layers=n_layers, n_heads=n_heads, **kw)


#: flavor -> args. "debug" trains on a 2-core CPU; "tiny" is for tests; the rest are GPT-3's.
GPT_FLAVORS: dict[str, GPTModelArgs] = {
    "tiny": _gpt(2, 64, 4, vocab_size=DEBUG_VOCAB_SIZE, multiple_of=64),
    "debug": _gpt(4, 128, 4, vocab_size=DEBUG_VOCAB_SIZE, multiple_of=64),
    "125M": _gpt(12, 768, 12),
    "350M": _gpt(24, 1024, 16),
    "1.3B": _gpt(24, 2048, 16),
    "2.7B": _gpt(32, 2560, 32),
    "6.7B": _gpt(32, 4096, 32),
    "13B": _gpt(40, 5120, 40),
}

#: The GPT-3 paper sizes (recipes are generated for these).
PAPER_FLAVORS = ("125M", "350M", "1.3B", "2.7B", "6.7B", "13B")


def count_params(args: GPTModelArgs) -> int:
    """Weights of the llama3 Transformer built from ``args`` (computed, not instantiated)."""
    d, L, V = args.dim, args.n_layers, args.vocab_size
    hidden = int(2 * 4 * d / 3)
    if args.ffn_dim_multiplier is not None:
        hidden = int(args.ffn_dim_multiplier * hidden)
    hidden = args.multiple_of * ((hidden + args.multiple_of - 1) // args.multiple_of)
    n_kv = args.n_kv_heads or args.n_heads
    head = d // args.n_heads
    attn = d * d * 2 + 2 * d * n_kv * head  # wq, wo, wk, wv
    ffn = 3 * d * hidden
    norms = 2 * d
    return L * (attn + ffn + norms) + 2 * V * d + d

"""GPT-style model flavors for the ``gpt_qcomm`` train spec (torchtitan 0.2.2).

torchtitan 0.2.2's llama3 ``Transformer`` with the shapes of ``titan_common.shapes`` (GPT-3's
layer shapes; see that module for how they differ from GPT-3).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torchtitan.models.llama3.model.args import RoPEScalingArgs, TransformerModelArgs
from torchtitan.tools.logging import logger

from fsdp_qcomm.titan_common.data import check_tokenizer_fits
from fsdp_qcomm.titan_common.shapes import GPT_SHAPES, PAPER_FLAVORS, GPTShape


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
        check_tokenizer_fits(
            job_config.model.hf_assets_path, self.vocab_size,
            f"model flavor {job_config.model.flavor!r}", warn=logger.warning,
        )


def gpt_args(shape: GPTShape) -> GPTModelArgs:
    return GPTModelArgs(
        dim=shape.dim, n_layers=shape.n_layers, n_heads=shape.n_heads,
        vocab_size=shape.vocab_size, multiple_of=shape.multiple_of,
        rope_theta=shape.rope_theta, max_seq_len=shape.max_seq_len,
    )


#: flavor -> args (``titan_common.shapes.GPT_SHAPES``)
GPT_FLAVORS: dict[str, GPTModelArgs] = {name: gpt_args(s) for name, s in GPT_SHAPES.items()}

__all__ = ["GPTModelArgs", "GPT_FLAVORS", "PAPER_FLAVORS", "gpt_args"]

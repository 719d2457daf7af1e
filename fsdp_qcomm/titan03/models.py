"""GPT model specs for torchtitan 0.3: its llama3 decoder with the shapes of
``titan_common.shapes`` (GPT-3's layer shapes; see that module for how they differ from
GPT-3), initialized as torchtitan's llama3 models are."""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch.nn as nn
from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.config_utils import (
    get_attention_config,
    make_ffn_config,
    make_gqa_config,
)
from torchtitan.models.common.param_init import depth_scaled_std
from torchtitan.models.llama3 import parallelize_llama
from torchtitan.models.llama3.model import Llama3Model, Llama3TransformerBlock
from torchtitan.protocols.model_spec import ModelSpec

from fsdp_qcomm.titan_common.shapes import GPT_SHAPES, GPTShape

MODEL_NAME = "gpt_qcomm"

_LINEAR_INIT = {"weight": partial(nn.init.trunc_normal_, std=0.02), "bias": nn.init.zeros_}
_NORM_INIT = {"weight": nn.init.ones_}
_EMBEDDING_INIT = {"weight": partial(nn.init.normal_, std=1.0)}


def _depth_init(layer_id: int) -> dict[str, Callable]:
    std = depth_scaled_std(0.02, layer_id)
    return {"weight": partial(nn.init.trunc_normal_, std=std), "bias": nn.init.zeros_}


def _output_init(dim: int) -> dict[str, Callable]:
    s = dim**-0.5
    return {"weight": partial(nn.init.trunc_normal_, std=s, a=-3 * s, b=3 * s),
            "bias": nn.init.zeros_}


def gpt_config(shape: GPTShape, attn_backend: str = "flex") -> Llama3Model.Config:
    """The llama3 decoder config of one GPT shape (fused QKV, RoPE without scaling)."""
    d, V = shape.dim, shape.vocab_size
    rope = ComplexRoPE.Config(dim=shape.head_dim, max_seq_len=shape.max_seq_len,
                              theta=shape.rope_theta, scaling="none")
    layers = [
        Llama3TransformerBlock.Config(
            attention_norm=RMSNorm.Config(normalized_shape=d, param_init=_NORM_INIT),
            ffn_norm=RMSNorm.Config(normalized_shape=d, param_init=_NORM_INIT),
            attention=make_gqa_config(
                dim=d, n_heads=shape.n_heads, wqkv_param_init=_LINEAR_INIT,
                wo_param_init=_depth_init(i), inner_attention=get_attention_config(attn_backend),
                fuse_qkv=True, rope=rope,
            ),
            feed_forward=make_ffn_config(
                dim=d, hidden_dim=shape.ffn_hidden, w1_param_init=_LINEAR_INIT,
                w2w3_param_init=_depth_init(i),
            ),
        )
        for i in range(shape.n_layers)
    ]
    return Llama3Model.Config(
        dim=d, vocab_size=V,
        tok_embeddings=Embedding.Config(num_embeddings=V, embedding_dim=d,
                                        param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=d, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=d, out_features=V, param_init=_output_init(d)),
        layers=layers,
    )


def gpt_model_spec(flavor: str, attn_backend: str = "flex") -> ModelSpec:
    """``ModelSpec`` of a GPT flavor (``titan_common.shapes.GPT_SHAPES``): llama3's
    parallelization and pipelining; the trainer adds the hooks."""
    if flavor not in GPT_SHAPES:
        raise ValueError(f"unknown GPT flavor {flavor!r}; known: {', '.join(GPT_SHAPES)}")
    return ModelSpec(
        name=MODEL_NAME, flavor=flavor, model=gpt_config(GPT_SHAPES[flavor], attn_backend),
        parallelize_fn=parallelize_llama, pipelining_fn=pipeline_llm,
        post_optimizer_build_fn=None, state_dict_adapter=None,
    )


__all__ = ["MODEL_NAME", "gpt_config", "gpt_model_spec"]

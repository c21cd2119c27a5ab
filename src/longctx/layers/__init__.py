"""Building blocks of the GPT: attention (qkv projection, RoPE, GQA), SwiGLU MLP, RMSNorm, rotary embeddings."""

from __future__ import annotations

from longctx.layers.attention import CoreAttentionFn, SelfAttention, default_core_attention
from longctx.layers.mlp import SwiGLUMLP
from longctx.layers.norms import RMSNorm
from longctx.layers.rotary import RotaryEmbedding, apply_rotary

__all__ = [
    "CoreAttentionFn",
    "SelfAttention",
    "default_core_attention",
    "SwiGLUMLP",
    "RMSNorm",
    "RotaryEmbedding",
    "apply_rotary",
]

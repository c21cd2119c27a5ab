"""Rotary position embeddings (RoPE, Su et al. 2021) in the rotate-half form of GPT-NeoX, Llama and Megatron.

Positions are explicit: `RotaryEmbedding(position_ids)` returns cos/sin for any positions, so a sequence
shard (context parallelism; zigzag shards are not contiguous) rotates with its *global* positions.
"""

from __future__ import annotations

import torch
from torch import nn

from longctx.ops.pointwise import rotary


class RotaryEmbedding(nn.Module):
    """cos and sin tables for positions ``position_ids``.

    Args:
        dim: rotary dimension (the head dim; must be even).
        base: the theta of RoPE (Megatron's ``rotary_base``).
    """

    def __init__(self, dim: int, base: float = 10000.0) -> None:
        super().__init__()
        if dim % 2:
            raise ValueError(f"rotary dimension must be even, got {dim}")
        self.dim = dim
        self.base = base
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        # Not a buffer that is saved: recomputed exactly from (dim, base), so checkpoints stay small.
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids (S,) or (B, S) int -> cos, sin of shape (S, dim) or (B, S, dim), float32."""
        freqs = position_ids.to(torch.float32)[..., None] * self.inv_freq  # (..., S, dim/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (..., S, dim)
        return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, H, S, D) by cos/sin of shape (S, D) or (B, S, D); computed in float32, returned in x's dtype
    (one kernel each way on a GPU: `longctx.ops.pointwise.rotary`)."""
    return rotary(x, cos, sin)

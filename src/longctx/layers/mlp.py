"""The SwiGLU feed-forward block of Llama and PaLM (Shazeer, "GLU Variants Improve Transformer", 2020)."""

from __future__ import annotations

import torch
from torch import nn

from longctx.ops.pointwise import swiglu


class SwiGLUMLP(nn.Module):
    """``linear_fc2(silu(x W_gate) * (x W_up))``.

    Megatron stores the gate and up projections as one ``linear_fc1`` of width ``2 * ffn_hidden_size``
    (gate first, then up); so do we, so one matmul serves both.

    Args:
        hidden_size: model width h.
        ffn_hidden_size: width of the gated intermediate activation.
        bias: add biases to both linears (Megatron's ``add_bias_linear``).
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, bias: bool = False) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(hidden_size, 2 * ffn_hidden_size, bias=bias)
        self.linear_fc2 = nn.Linear(ffn_hidden_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # linear_fc1: (B, S, 2F) = [gate, up], not held by a local: without autograd it is freed before linear_fc2
        return self.linear_fc2(swiglu(self.linear_fc1(x)))  # (B, S, h); silu(gate) * up in one kernel on a GPU

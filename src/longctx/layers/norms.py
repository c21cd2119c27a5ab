"""RMSNorm (Zhang & Sennrich, 2019), as in Llama and Megatron's ``normalization="RMSNorm"``."""

from __future__ import annotations

import torch
from torch import nn

from longctx.ops.pointwise import rms_norm


class RMSNorm(nn.Module):
    """``y = x / sqrt(mean(x^2) + eps) * weight``, computed in float32 (float64 for float64 x), returned in x's dtype.

    Args:
        hidden_size: size of the last dimension.
        eps: added to the mean square (Megatron's ``layernorm_epsilon``).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)  # one kernel each way on a GPU (longctx.ops.pointwise)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"

"""The one rule for the precision partial results are kept in: float64 for float64 inputs (the oracle's precision,
as the float64 tests compare), float32 for every other dtype (float32, bfloat16, float16: softmax statistics,
log-sum-exp, gradients summed over blocks or ranks, normalisation and loss accumulators)."""

from __future__ import annotations

import torch

__all__ = ["accumulation_dtype"]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32

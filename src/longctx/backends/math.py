"""The `math` backend: the dense reference, differentiable through PyTorch autograd."""

from __future__ import annotations

import torch

from longctx.backends.base import AttnInputs, Backend
from longctx.masks import Band
from longctx.reference.naive import naive_attention


class MathBackend(Backend):
    name = "math"
    family = "reference"
    description = "dense reference (memory quadratic in sequence length)"

    def not_supported_reasons(self, inp: AttnInputs) -> list[str]:
        return []

    def run(
        self, q, k, v, *, scale: float, band: Band, return_lse: bool, deterministic=False, block_mask=None, softcap=0.0
    ):
        mask = None if block_mask is None else block_mask.dense_mask(q.device)
        out, lse = naive_attention(q, k, v, scale=scale, band=band, mask=mask, softcap=softcap)
        if lse.dtype != torch.float64:
            lse = lse.float()
        return out, lse

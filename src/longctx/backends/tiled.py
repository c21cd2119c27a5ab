"""The `tiled` backend: FlashAttention in plain PyTorch (CPU and GPU), memory linear in sequence length."""

from __future__ import annotations

from longctx.backends.base import AttnInputs, Backend
from longctx.masks import Band
from longctx.reference.tiled import DEFAULT_BLOCK, tiled_attention
from longctx.reference.tiled_sparse import tiled_block_sparse


class TiledBackend(Backend):
    name = "tiled"
    family = "flash"
    description = "FlashAttention algorithm in plain PyTorch (tiled online softmax, recomputing backward)"

    def not_supported_reasons(self, inp: AttnInputs) -> list[str]:
        return []  # any device, dtype, GQA, band, and every block mask

    def run(
        self, q, k, v, *, scale: float, band: Band, return_lse: bool, deterministic=False, block_mask=None, softcap=0.0
    ):
        if block_mask is not None:
            return tiled_block_sparse(q, k, v, scale=scale, band=band, block_mask=block_mask, softcap=softcap)
        return tiled_attention(
            q, k, v, scale=scale, band=band, block_q=DEFAULT_BLOCK, block_k=DEFAULT_BLOCK, softcap=softcap
        )

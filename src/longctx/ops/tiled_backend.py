"""The `tiled` backend: FlashAttention in plain PyTorch (CPU and GPU), memory linear in sequence length."""

from __future__ import annotations

from longctx.dispatch import AttnInputs, Backend, register_backend
from longctx.masks import Band
from longctx.reference.tiled import DEFAULT_BLOCK, tiled_attention


class TiledBackend(Backend):
    name = "tiled"
    family = "flash"
    description = "FlashAttention algorithm in plain PyTorch (tiled online softmax, recomputing backward)"

    def not_supported_reasons(self, inp: AttnInputs) -> list[str]:
        reasons = []
        if inp.block_mask:
            from longctx.ops import sparse_support

            reasons += sparse_support.tiled_block_mask_reasons(inp)
        return reasons

    def run(self, q, k, v, *, scale: float, band: Band, return_lse: bool, deterministic=False, block_mask=None):
        if block_mask is not None:
            from longctx.ops import sparse_support

            return sparse_support.tiled_block_sparse(q, k, v, scale=scale, band=band, block_mask=block_mask)
        return tiled_attention(q, k, v, scale=scale, band=band, block_q=DEFAULT_BLOCK, block_k=DEFAULT_BLOCK)


register_backend(TiledBackend())

"""Masks, in one place: which keys each query sees.

- `band`: `Band` (lo <= j - i <= hi), the one causal / sliding-window rule every backend shares, and
  `normalize_window` (flash-attn's ``window_size``).
- `mask_mods`: FlexAttention's ``mask_mod(b, h, q_idx, kv_idx) -> bool`` contract, its algebra (`and_masks`,
  `or_masks`) and the ready-made masks (causal, sliding window, documents, prefix-LM, local + global), which carry
  an analytic rule (`DocBand`) the kernels evaluate in registers.
- `block_mask`: the `BlockMask` structure (per block: empty, full or partial; the lists the kernels walk).
- `build`: `block_mask(mask_mod, B, H, Sq, Sk)`, the builder.
- `catalogue`: the named masks of long-context training (`make_mask`, `mask_names`, `MaskCase`), each with its
  mask_mod, block mask, dense definition and kept area; shared by `longctx bench suite` and the tests.
"""

from __future__ import annotations

from longctx.masks.band import Band, TileKind, flash_window, normalize_window
from longctx.masks.block_mask import BlockMask
from longctx.masks.build import block_mask
from longctx.masks.catalogue import CATALOGUE, SEEDED_MASKS, MaskCase, doc_lengths, make_mask, mask_names
from longctx.masks.mask_mods import (
    DocBand,
    MaskMod,
    and_masks,
    causal_mask,
    document_mask,
    full_mask,
    local_global_mask,
    or_masks,
    prefix_lm_mask,
    sliding_window_mask,
)

__all__ = [
    "Band",
    "TileKind",
    "flash_window",
    "normalize_window",
    "BlockMask",
    "block_mask",
    "DocBand",
    "MaskMod",
    "and_masks",
    "or_masks",
    "full_mask",
    "causal_mask",
    "sliding_window_mask",
    "document_mask",
    "prefix_lm_mask",
    "local_global_mask",
    "CATALOGUE",
    "SEEDED_MASKS",
    "MaskCase",
    "doc_lengths",
    "make_mask",
    "mask_names",
]

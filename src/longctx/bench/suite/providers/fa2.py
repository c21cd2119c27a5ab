"""``fa2``: FlashAttention-2 as built into PyTorch's SDPA (full and causal)."""

from __future__ import annotations

from longctx.bench.suite.providers._sdpa import SDPAProvider


class FA2(SDPAProvider):
    name = "fa2"
    kernel = "FLASH_ATTENTION"


PROVIDER = FA2()

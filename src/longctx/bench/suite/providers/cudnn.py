"""``cudnn``: cuDNN's fused attention through SDPA (full and causal)."""

from __future__ import annotations

from longctx.bench.suite.providers._sdpa import SDPAProvider


class CuDNN(SDPAProvider):
    name = "cudnn"
    kernel = "CUDNN_ATTENTION"
    min_capability = (9, 0)  # PyTorch enables cuDNN attention from Hopper on


PROVIDER = CuDNN()

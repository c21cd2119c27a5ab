"""``math``: the dense reference (S x S scores in memory; capped by memory)."""

from __future__ import annotations

import torch

from longctx.bench.suite.case import KernelCase
from longctx.bench.suite.providers.base import Provider
from longctx.bench.suite.providers.longctx_auto import longctx_fn

CPU_BYTES = 2 << 30


class Math(Provider):
    name = "math"
    family = "reference"

    def supports(self, case: KernelCase) -> str | None:
        # scores, probabilities and their gradients in float32: about 4 S x S tensors per head, plus the mask
        need = 4 * 4 * case.B * case.Hq * case.S * case.S + case.S * case.S
        if case.device.startswith("cuda"):
            have = 0.6 * torch.cuda.mem_get_info()[0]
        else:
            have = CPU_BYTES
        if need > have:
            return f"capped: needs ~{need / 2**30:.1f} GiB for S x S scores, {have / 2**30:.1f} GiB allowed"
        return None

    def build(self, case: KernelCase):
        return longctx_fn(case, "math")[0]


PROVIDER = Math()

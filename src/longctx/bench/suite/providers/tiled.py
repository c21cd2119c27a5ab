"""``tiled``: longctx's FlashAttention in plain PyTorch (any device; loops in Python, so capped in length)."""

from __future__ import annotations

from longctx.bench.suite.case import KernelCase
from longctx.bench.suite.providers.base import Provider
from longctx.bench.suite.providers.longctx_auto import longctx_fn

MAX_S_CUDA = 4096  # the Python loop over blocks: minutes per call beyond
MAX_S_CPU = 2048


class Tiled(Provider):
    name = "tiled"
    family = "reference"

    def supports(self, case: KernelCase) -> str | None:
        cap = MAX_S_CUDA if case.device.startswith("cuda") else MAX_S_CPU
        return None if cap >= case.S else f"capped at S <= {cap} (plain-PyTorch loops)"

    def build(self, case: KernelCase):
        return longctx_fn(case, "tiled")[0]


PROVIDER = Tiled()

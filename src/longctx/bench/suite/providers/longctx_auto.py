"""``longctx_auto``: ``longctx.attention`` as a user calls it (causal/window for band masks, else a block mask)."""

from __future__ import annotations

import longctx
from longctx.bench.suite.case import KernelCase
from longctx.bench.suite.providers.base import Provider


def longctx_fn(case: KernelCase, backend: str):
    """``fn(q, k, v)`` calling ``longctx.attention`` with ``backend``: the band's causal/window arguments when the
    mask is a band, its block mask otherwise (built before the timing)."""
    if case.mask.band is not None:
        kw = case.mask.attention_kwargs()
    else:
        kw = {"block_mask": case.block_mask()}
    scale = case.scale
    return lambda q, k, v: longctx.attention(q, k, v, scale=scale, backend=backend, **kw), kw


class LongctxAuto(Provider):
    name = "longctx_auto"
    family = "longctx"

    def build(self, case: KernelCase):
        return longctx_fn(case, "auto")[0]

    def backend(self, case, q, k, v) -> str:
        kw = longctx_fn(case, "auto")[1]
        return longctx.explain(q, k, v, scale=case.scale, **kw).backend.name


PROVIDER = LongctxAuto()

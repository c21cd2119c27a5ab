"""``longctx_triton``: longctx's dense Triton kernels, pinned (full, causal and sliding-window masks)."""

from __future__ import annotations

import longctx
from longctx.bench.suite.case import KernelCase, Unsupported
from longctx.bench.suite.providers.base import Provider, needs_cuda
from longctx.bench.suite.providers.longctx_auto import longctx_fn


class LongctxTriton(Provider):
    name = "longctx_triton"
    family = "longctx"
    pinned = "triton"

    def supports(self, case: KernelCase) -> str | None:
        if case.mask.band is None:
            return f"the dense kernels take causal/window bands only; {case.mask.name} needs a block mask"
        return needs_cuda(case)

    def build(self, case: KernelCase):
        return longctx_fn(case, self.pinned)[0]

    def backend(self, case, q, k, v) -> str:
        kw = longctx_fn(case, self.pinned)[1]
        try:
            return longctx.explain(q, k, v, scale=case.scale, backend=self.pinned, **kw).backend.name
        except ValueError as e:  # a pinned backend that cannot run these inputs says why
            raise Unsupported(str(e).splitlines()[0]) from None


PROVIDER = LongctxTriton()

"""``longctx_triton_sparse``: longctx's block-sparse Triton kernels, pinned, on every mask (as a block mask)."""

from __future__ import annotations

import longctx
from longctx.bench.suite.case import KernelCase, Unsupported
from longctx.bench.suite.providers.base import Provider, needs_cuda


class LongctxTritonSparse(Provider):
    name = "longctx_triton_sparse"
    family = "longctx"

    def supports(self, case: KernelCase) -> str | None:
        return needs_cuda(case)

    def build(self, case: KernelCase):
        bm, scale = case.block_mask(), case.scale
        return lambda q, k, v: longctx.attention(q, k, v, scale=scale, backend="triton_sparse", block_mask=bm)

    def backend(self, case, q, k, v) -> str:
        try:
            longctx.explain(q, k, v, scale=case.scale, backend="triton_sparse", block_mask=case.block_mask())
        except ValueError as e:
            raise Unsupported(str(e).splitlines()[0]) from None
        return "triton_sparse"


PROVIDER = LongctxTritonSparse()

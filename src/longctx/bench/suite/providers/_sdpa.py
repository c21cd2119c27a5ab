"""What the cuDNN and FlashAttention-2 providers share: SDPA pinned to one of its kernels."""

from __future__ import annotations

import torch

from longctx.bench.suite.case import KernelCase
from longctx.bench.suite.providers.base import Provider, needs_cuda, sdpa_band


class SDPAProvider(Provider):
    """``F.scaled_dot_product_attention`` under ``sdpa_kernel(<kernel>)``: full and causal masks only (SDPA has
    no window argument; a dense ``attn_mask`` would run another kernel, or none)."""

    kernel = ""
    min_capability = (8, 0)

    def supports(self, case: KernelCase) -> str | None:
        reason = needs_cuda(case) or sdpa_band(case)[0]
        if reason:
            return reason
        cap = torch.cuda.get_device_capability()
        if cap < self.min_capability:
            return f"needs compute capability >= {self.min_capability}, got {cap}"
        if case.torch_dtype not in (torch.float16, torch.bfloat16):
            return f"dtype {case.dtype} is not float16/bfloat16"
        return None

    def build(self, case: KernelCase):
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        which = getattr(SDPBackend, self.kernel)
        is_causal = sdpa_band(case)[1]
        scale, gqa = case.scale, case.Hq != case.Hkv

        def fn(q, k, v):
            with sdpa_kernel(which):
                return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=gqa)

        return fn

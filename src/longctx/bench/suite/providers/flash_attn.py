"""``flash_attn``: the flash-attn package (Dao-AILab), when it is installed: full, causal and sliding-window masks
through ``flash_attn_func`` and packed documents (full or causal) through ``flash_attn_varlen_func``."""

from __future__ import annotations

import importlib.util

import torch

from longctx.bench.suite.case import KernelCase
from longctx.bench.suite.providers.base import Provider, needs_cuda


class FlashAttnPackage(Provider):
    name = "flash_attn"
    family = "peer"

    def supports(self, case: KernelCase) -> str | None:
        reason = needs_cuda(case)
        if reason:
            return reason
        if importlib.util.find_spec("flash_attn") is None:
            return "the flash_attn package is not installed"
        if case.torch_dtype not in (torch.float16, torch.bfloat16):
            return f"dtype {case.dtype} is not float16/bfloat16"
        m = case.mask
        if m.band is None and m.name not in ("document", "causal_document"):
            return f"flash_attn takes windows and packed documents, not {m.name}"
        if m.band is not None and m.band.lo is not None and m.band.hi is None:
            return "a window bounded on the left only"
        return None

    def build(self, case: KernelCase):
        from flash_attn import flash_attn_func, flash_attn_varlen_func

        m, scale = case.mask, case.scale
        if m.band is not None:
            lo, hi = m.band.lo, m.band.hi
            causal = hi == 0
            window = (-1 if lo is None else -lo, -1 if (hi is None or causal) else hi)

            def fn(q, k, v):  # (B, H, S, D) -> flash-attn's (B, S, H, D) views
                out = flash_attn_func(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                    softmax_scale=scale, causal=causal, window_size=window,
                )  # fmt: skip
                return out.transpose(1, 2)

            return fn
        L = torch.tensor((0,) + m.doc_lengths, dtype=torch.int64)
        cu = torch.cumsum(L, 0).to(torch.int32).to(case.device)
        mx, causal, B = max(m.doc_lengths), m.causal, case.B

        def fn_varlen(q, k, v):  # batch 1 packed: (S, H, D) per tensor
            assert B == 1, "packed documents: batch 1"
            out = flash_attn_varlen_func(
                q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu, mx, mx,
                softmax_scale=scale, causal=causal,
            )  # fmt: skip
            return out.transpose(0, 1)[None]

        return fn_varlen


PROVIDER = FlashAttnPackage()

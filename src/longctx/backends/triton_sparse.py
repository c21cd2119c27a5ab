"""The `triton_sparse` backend: block-sparse masks and packed documents on longctx's Triton kernels."""

from __future__ import annotations

import torch

from longctx import switches
from longctx.backends.base import AttnInputs, Backend
from longctx.launchers import runtime
from longctx.masks import Band
from longctx.ops.sparse import triton_sparse_attention
from longctx.reference import tiled_sparse


class TritonSparseBackend(Backend):
    name = "triton_sparse"
    family = "flash"
    description = "block-sparse / packed-document FlashAttention in Triton (walks only the kept blocks)"

    def available(self) -> tuple[bool, str]:
        err = runtime._triton_import_error()
        return (err is None, err or "")

    def not_supported_reasons(self, inp: AttnInputs) -> list[str]:
        reasons = []
        if not (inp.block_mask or inp.varlen):
            reasons.append("serves only block-sparse masks and packed documents (dense calls go to 'triton')")
        if inp.device.type == "cuda":
            if inp.capability is not None and inp.capability < (8, 0):
                reasons.append(f"needs compute capability >= 8.0, got {inp.capability}")
            if inp.dtype == torch.float32 and not switches.tf32():
                reasons.append("float32 would run in tf32; cast to bfloat16/float16 or set LONGCTX_TRITON_TF32=1")
        elif inp.device.type == "cpu" and runtime._interpret():
            if not inp.pinned:
                reasons.append("CPU tensors run only in the Triton interpreter; pin backend='triton_sparse'")
        else:
            reasons.append(f"needs CUDA tensors (got {inp.device.type})")
        if inp.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            reasons.append(f"dtype {inp.dtype} is not supported; use float16 or bfloat16")
        if inp.dtype == torch.bfloat16 and inp.device.type == "cpu":
            reasons.append("the Triton interpreter has no bfloat16")
        if not 1 <= inp.head_dim <= 256:
            reasons.append(f"head_dim must be in [1, 256], got {inp.head_dim}")
        if not inp.band.is_dense and (inp.block_mask or inp.varlen):  # else the first reason says it all
            reasons.append(
                "causal=/window= together with block_mask: put them into the mask instead "
                "(e.g. and_masks(mask_mod, causal_mask)) for triton_sparse"
            )
        return reasons

    def run(
        self, q, k, v, *, scale: float, band: Band, return_lse: bool, deterministic=False, block_mask=None, softcap=0.0
    ):
        if block_mask is None:
            raise ValueError("the triton_sparse backend needs a block_mask; dense attention runs on 'triton'")
        if block_mask.block_size % 16 or not band.is_dense:
            # kernels need 16 | block_size; fall back to the plain-PyTorch block-sparse path
            return tiled_sparse.tiled_block_sparse(
                q, k, v, scale=scale, band=band, block_mask=block_mask, softcap=softcap
            )
        deterministic = deterministic or switches.deterministic()  # LONGCTX_DETERMINISTIC=1
        out, lse = triton_sparse_attention(
            q, k, v, scale=scale, block_mask=block_mask, deterministic=deterministic, softcap=softcap
        )
        return out, lse

"""The `triton` backend: longctx's dense FlashAttention kernels (what they take, and the call)."""

from __future__ import annotations

import torch

from longctx import switches
from longctx.backends.base import AttnInputs, Backend
from longctx.launchers.runtime import _interpret, _triton_import_error
from longctx.masks import Band
from longctx.ops.flash import triton_attention


class TritonBackend(Backend):
    name = "triton"
    family = "flash"
    description = (
        "longctx's FlashAttention-2 kernels in Triton (GQA, bands; deterministic bwd on request); on Hopper, bands "
        "where measured faster through the block-sparse kernels"
    )

    def available(self) -> tuple[bool, str]:
        err = _triton_import_error()
        return (err is None, err or "")

    def not_supported_reasons(self, inp: AttnInputs) -> list[str]:
        reasons = []
        if inp.device.type == "cuda":
            if inp.capability is not None and inp.capability < (8, 0):
                reasons.append(f"needs compute capability >= 8.0 (Ampere or newer), got {inp.capability}")
            if inp.dtype == torch.float32 and not switches.tf32():
                reasons.append(
                    "float32 inputs are refused: the kernels would compute them in tf32 (~1e-3 relative error); "
                    "cast to bfloat16/float16, or set LONGCTX_TRITON_TF32=1 to accept the tf32 path"
                )
        elif inp.device.type == "cpu" and _interpret():
            if not inp.pinned:
                reasons.append(
                    "CPU tensors run only in the Triton interpreter (slow, for tests); pin backend='triton' to use it"
                )
        else:
            reasons.append(
                f"needs CUDA tensors (got {inp.device.type}); CPU only under TRITON_INTERPRET=1 with backend pinned"
            )
        if inp.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            reasons.append(f"dtype {inp.dtype} is not supported; use float16 or bfloat16")
        if inp.dtype == torch.bfloat16 and inp.device.type == "cpu":
            reasons.append("the Triton interpreter has no bfloat16; use float16 or float32 on the CPU")
        if not 1 <= inp.head_dim <= 256:
            reasons.append(f"head_dim must be in [1, 256], got {inp.head_dim}")
        if inp.block_mask:
            reasons.append("block-sparse masks are not supported by the triton backend")
        if inp.varlen:
            reasons.append("packed variable-length input (cu_seqlens) is not supported by the triton backend")
        return reasons

    def run(
        self, q, k, v, *, scale: float, band: Band, return_lse: bool, deterministic=False, block_mask=None, softcap=0.0
    ):
        if block_mask is not None:
            raise ValueError("the triton backend does not support block_mask; use backend='auto'")
        deterministic = deterministic or switches.deterministic()  # LONGCTX_DETERMINISTIC=1
        out, lse = triton_attention(q, k, v, scale=scale, band=band, deterministic=deterministic, softcap=softcap)
        return out, (lse if return_lse else None)

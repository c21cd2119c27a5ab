"""The user switches: the environment variables a user may set, read here only, at every call.

- ``LONGCTX_ATTN_BACKEND=<name>``: pin a backend (same as ``backend=<name>``).
- ``LONGCTX_FLASH_ATTN=0`` / ``NVTE_FLASH_ATTN=0``: switch off longctx's own flash kernels (triton, triton_sparse,
  tiled).
- ``LONGCTX_FUSED_ATTN=0`` / ``NVTE_FUSED_ATTN=0``: switch off cuDNN fused attention (``sdpa_cudnn``).
- ``LONGCTX_FUSED_POINTWISE=0``: RMSNorm, rotary embeddings and SwiGLU in torch's unfused ops instead of one kernel
  each way (`longctx.ops.pointwise`).
- ``LONGCTX_DETERMINISTIC=1``: every backward of longctx's kernels without atomics (bitwise repeatable).
- ``LONGCTX_TRITON_TF32=1``: float32 inputs accepted by the Triton kernels, their products in tf32.

The NVTE names are Transformer Engine's, so a job script written for it keeps its meaning. What the kernels choose
beyond these (tiles, which kernel for which input) is not a user switch: `longctx.tuning`.
"""

from __future__ import annotations

import os

__all__ = ["pinned_backend", "flash_disabled", "fused_disabled", "fused_pointwise_disabled", "deterministic", "tf32"]

_ON = ("1", "true", "on", "yes")
_OFF = ("0", "false", "off", "no")


def _off(*names: str) -> str | None:
    """``"NAME=value"`` of the first of ``names`` set to an off value, or None."""
    for name in names:
        val = os.environ.get(name)
        if val is not None and val.strip().lower() in _OFF:
            return f"{name}={val}"
    return None


def pinned_backend() -> str | None:
    """The backend named by LONGCTX_ATTN_BACKEND, or None (unset, empty or "auto")."""
    name = os.environ.get("LONGCTX_ATTN_BACKEND", "").strip()
    return None if name in ("", "auto") else name


def flash_disabled() -> str | None:
    """``"LONGCTX_FLASH_ATTN=0"`` (or the NVTE name) when longctx's flash kernels are switched off, else None."""
    return _off("LONGCTX_FLASH_ATTN", "NVTE_FLASH_ATTN")


def fused_disabled() -> str | None:
    """``"LONGCTX_FUSED_ATTN=0"`` (or the NVTE name) when cuDNN fused attention is switched off, else None."""
    return _off("LONGCTX_FUSED_ATTN", "NVTE_FUSED_ATTN")


def fused_pointwise_disabled() -> str | None:
    """``"LONGCTX_FUSED_POINTWISE=0"`` when the fused RMSNorm / rotary / SwiGLU kernels are switched off, else None."""
    return _off("LONGCTX_FUSED_POINTWISE")


def deterministic() -> bool:
    """LONGCTX_DETERMINISTIC: every backward of longctx's kernels bitwise repeatable."""
    return os.environ.get("LONGCTX_DETERMINISTIC", "0").strip().lower() in _ON


def tf32() -> bool:
    """LONGCTX_TRITON_TF32: float32 inputs accepted by the Triton kernels, computed in tf32."""
    return os.environ.get("LONGCTX_TRITON_TF32", "0").strip().lower() in _ON

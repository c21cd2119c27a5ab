"""The public attention functions: validate the inputs, dispatch to a backend, call it.

- `core`: `attention` (the (B, H, S, D) interface), `explain`, `flash_attn_func` (flash-attn's (B, S, H, D) one)
  and its packed forms.
- `varlen`: `flash_attn_varlen_func` and its packed forms, packed documents (flash-attn's varlen interface).
"""

from __future__ import annotations

from longctx.api.core import (
    attention,
    explain,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    validate,
)
from longctx.api.varlen import (
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)

__all__ = [
    "attention",
    "explain",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "validate",
]

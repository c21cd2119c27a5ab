"""longctx: train transformers on long sequences within the memory of the GPUs you have.

import longctx
out = longctx.attention(q, k, v, causal=True)          # (B, H, S, D), best backend for the inputs
print(longctx.explain(q, k, v, causal=True))            # which backend, and why not the others
out = longctx.flash_attn_func(q, k, v, causal=True)     # flash-attn's (B, S, H, D) interface
"""

from __future__ import annotations

import importlib

from longctx.api import attention, explain, flash_attn_func
from longctx.masks import Band

__version__ = "0.1.0"

# Heavier parts load on first use: `import longctx` stays cheap.
_LAZY = {
    "GPT": "longctx.models.gpt",
    "GPTConfig": "longctx.models.gpt",
    "BlockMask": "longctx.masks",
    "block_mask": "longctx.masks",
    "flash_attn_varlen_func": "longctx.api.varlen",
    "flash_attn_varlen_kvpacked_func": "longctx.api.varlen",
    "flash_attn_varlen_qkvpacked_func": "longctx.api.varlen",
    "flash_attn_kvpacked_func": "longctx.api.core",
    "flash_attn_qkvpacked_func": "longctx.api.core",
    "linear_cross_entropy": "longctx.layers.loss",
    "plan": "longctx.memory.plan",
    "distributed": "longctx.distributed",
}


def backends() -> list[str]:
    """Names of the registered attention backends, in auto-selection order."""
    from longctx.dispatch import backend_names

    return backend_names()


def __getattr__(name: str):
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name])
        return module if name == "distributed" else getattr(module, name)
    raise AttributeError(f"module 'longctx' has no attribute {name!r}")


__all__ = [
    "attention",
    "explain",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "linear_cross_entropy",
    "plan",
    "backends",
    "Band",
    "BlockMask",
    "block_mask",
    "GPT",
    "GPTConfig",
    "distributed",
    "__version__",
]

"""The providers of ``longctx bench suite``, one file each; adding one is a file and a line in `REGISTRY`.

A provider module defines ``PROVIDER``, an instance of `longctx.bench.suite.providers.base.Provider`. Modules are
imported when first asked for, so a CPU run never imports what only a GPU provider needs.
"""

from __future__ import annotations

import importlib

from longctx.bench.suite.providers.base import Provider

__all__ = ["REGISTRY", "Provider", "get_provider", "provider_names"]

# name -> module defining PROVIDER, in report order (longctx's first, then the peers, then the references)
REGISTRY: dict[str, str] = {
    "longctx_auto": "longctx.bench.suite.providers.longctx_auto",
    "longctx_triton": "longctx.bench.suite.providers.longctx_triton",
    "longctx_triton_sparse": "longctx.bench.suite.providers.longctx_triton_sparse",
    "cudnn": "longctx.bench.suite.providers.cudnn",
    "fa2": "longctx.bench.suite.providers.fa2",
    "flex": "longctx.bench.suite.providers.flex",
    "flash_attn": "longctx.bench.suite.providers.flash_attn",
    "tiled": "longctx.bench.suite.providers.tiled",
    "math": "longctx.bench.suite.providers.math_ref",
}


def provider_names() -> list[str]:
    return list(REGISTRY)


def get_provider(name: str) -> Provider:
    """The provider registered as ``name`` (ValueError listing the registry otherwise)."""
    if name not in REGISTRY:
        raise ValueError(f"unknown provider {name!r}; expected one of {', '.join(REGISTRY)}")
    return importlib.import_module(REGISTRY[name]).PROVIDER

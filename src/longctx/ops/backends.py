"""Registers every backend with the dispatcher (imported lazily by `longctx.dispatch`)."""

from __future__ import annotations

from longctx.ops import (
    math_backend,  # noqa: F401
    tiled_backend,  # noqa: F401
)

"""Registers every backend with the dispatcher (imported lazily by `longctx.dispatch`).

Order of registration does not matter; the auto-selection order is `longctx.dispatch._PRIORITY`.
"""

from __future__ import annotations

import longctx.ops.math_backend  # noqa: F401
import longctx.ops.sdpa  # noqa: F401
import longctx.ops.tiled_backend  # noqa: F401
from longctx.ops import (
    triton_flash,  # noqa: F401
    triton_sparse,  # noqa: F401
)

"""The launchers as `torch.library` ops with autograd and fake implementations, so `torch.compile` traces a
model through them and a selective-recompute policy can name them: `flash` (dense), `sparse` (block masks).

The ops are defined with the low-level `torch.library.Library` API rather than ``torch.library.custom_op``: a
``custom_op`` wraps its kernel so that its first call imports ``torch._dynamo``, seconds of Python imports in front of
the first attention call of every process, whether or not the model is compiled.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

LIB = torch.library.Library("longctx", "DEF")


def define(name: str, schema: str, impl: Callable, fake: Callable) -> None:
    """Define ``longctx::<name>`` with ``schema``, its kernel for every device and its fake (meta) implementation."""
    LIB.define(name + schema)
    LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"longctx::{name}", fake, lib=LIB)

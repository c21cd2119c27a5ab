"""One real training step on the CPU for the memory model's tests: what the shape-only trace must equal."""

from __future__ import annotations

from unittest import mock

import torch


def real_step_peak(model, x: torch.Tensor) -> int:
    """Peak bytes of live tensors during one bf16-autocast forward and backward of ``model`` on tokens ``x``, on the
    CPU, with the attention kernels' twin wherever a layer resolves launchers and the position-wise kernels' twins (as
    the trace runs it)."""
    import longctx.layers.attention as attention_layer
    from longctx.memory import model as memory_model
    from longctx.memory.measure import peak_live_bytes
    from longctx.ops import pointwise

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, labels=x)
        loss.backward()

    with (
        mock.patch.object(attention_layer, "resolve_launchers", lambda *a, **k: memory_model._TwinLaunchers),
        pointwise.twins(),
    ):
        return peak_live_bytes(step)

"""torch.compile traces a function that calls longctx.attention without a graph break."""

from __future__ import annotations

import pytest
import torch

import longctx


@pytest.mark.parametrize("backend", ["auto", "tiled", "math"])
def test_fullgraph_compile(backend):
    torch._dynamo.reset()
    q = torch.randn(1, 4, 40, 16, requires_grad=True)
    k = torch.randn(1, 2, 40, 16, requires_grad=True)
    v = torch.randn(1, 2, 40, 16, requires_grad=True)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(q, k, v):
        return longctx.attention(q, k, v, causal=True, window=(8, 0), backend=backend)

    out = f(q, k, v)
    out.square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref = longctx.attention(q, k, v, causal=True, window=(8, 0), backend="math")
    ref.square().sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for g, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(g, t.grad, rtol=1e-5, atol=1e-5)

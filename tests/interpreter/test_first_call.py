"""The first attention call of a process imports no compiler machinery: the `torch.library` ops run their kernels
without ``torch._dynamo`` (which ``torch.library.custom_op`` imports at an op's first call, seconds of imports in
front of the first training step). Runs in a subprocess under TRITON_INTERPRET=1, dense and block-sparse."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.interpreter
pytest.importorskip("triton")

_PROGRAM = textwrap.dedent(
    """
    import sys
    import torch
    import longctx
    q = torch.randn(1, 2, 40, 16, requires_grad=True)
    out = longctx.attention(q, q, q, causal=True, backend="triton")
    out.sum().backward()
    ids = torch.tensor([0] * 20 + [1] * 20)
    bm = longctx.block_mask(longctx.masks.document_mask(ids), None, None, 40, 40, block_size=16)
    out = longctx.attention(q, q, q, block_mask=bm, backend="triton_sparse")
    out.sum().backward()
    assert torch.isfinite(q.grad).all()
    print("dynamo" if "torch._dynamo" in sys.modules else "no dynamo")
    """
)


def test_first_call_does_not_import_dynamo():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", _PROGRAM], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "no dynamo"

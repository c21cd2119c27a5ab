"""GPU lane: every CUDA backend (tiled, SDPA peers, Flex) against the float64 oracle; auto's routing."""

from __future__ import annotations

import pytest
import torch

import longctx
from longctx.cli.commands import error_vs_oracle, failing
from longctx.dispatch import AttnInputs, get_backend, reasons_for
from longctx.masks import Band

CASES = [
    # (B, Hq, Hkv, Sq, Sk, D, causal, window)
    (2, 8, 8, 1023, 1023, 64, False, None),
    (1, 8, 2, 1025, 1025, 128, True, None),
    (1, 4, 1, 333, 1025, 96, True, None),
    (1, 4, 4, 600, 600, 64, False, (64, 16)),
    (1, 8, 2, 100, 173, 64, True, None),  # grouped heads, causal, Sq != Sk (`longctx check`'s case)
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("backend", ["tiled", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "flex"])
def test_backend_against_oracle(backend, case, dtype):
    B, Hq, Hkv, Sq, Sk, D, causal, window = case
    g = torch.Generator().manual_seed(0)
    q, do = (torch.randn(B, Hq, Sq, D, generator=g).to("cuda", dtype) for _ in range(2))
    k, v = (torch.randn(B, Hkv, Sk, D, generator=g).to("cuda", dtype) for _ in range(2))
    band = Band.from_args(Sq, Sk, causal, window)
    be = get_backend(backend)
    with_lse = not reasons_for(be, AttnInputs.from_tensors(q, k, band=band, return_lse=True, needs_grad=True))
    if reasons := reasons_for(be, AttnInputs.from_tensors(q, k, band=band, needs_grad=True)):
        pytest.skip(f"{backend} declares it cannot run this case: {reasons}")

    def run(a, b, c):
        res = longctx.attention(a, b, c, causal=causal, window=window, backend=backend, return_lse=with_lse)
        return res if with_lse else (res, None)

    ours, pt = error_vs_oracle(q, k, v, do, run, scale=D**-0.5, band=band, with_lse=with_lse)
    assert not failing(ours, pt, dtype), f"{backend}: errors {ours} vs PyTorch {pt} (None: no lse returned)"


def test_auto_never_routes_bottom_right_causal_to_sdpa():
    q = torch.randn(1, 8, 100, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, 300, 64, device="cuda", dtype=torch.bfloat16)
    choice = longctx.explain(q, k, k, causal=True)
    assert not choice.backend.name.startswith("sdpa")
    out = longctx.attention(q, k, k, causal=True)
    ref = longctx.attention(q, k, k, causal=True, backend="math")
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)

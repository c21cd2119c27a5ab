"""attention, flash_attn_func and flash_attn_varlen_func follow torch.autocast as SDPA does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import longctx
from longctx.api.core import follow_autocast

_GEN = torch.Generator().manual_seed(0)


def _qkv(B: int = 2, Hq: int = 4, Hkv: int = 2, S: int = 37, D: int = 40) -> tuple[torch.Tensor, ...]:
    # q and k in float32 (as after RoPE), v in bfloat16 (as out of an autocast linear)
    q = torch.randn(B, Hq, S, D, generator=_GEN)
    k = torch.randn(B, Hkv, S, D, generator=_GEN)
    v = torch.randn(B, Hkv, S, D, generator=_GEN).bfloat16()
    return q, k, v


def _leaves(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_() for t in ts]


def test_mixed_dtypes_under_autocast_equal_the_cast_inputs():
    q, k, v = _qkv()
    do = torch.randn(2, 4, 37, 40, generator=_GEN).bfloat16()
    a = _leaves(q, k, v)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = longctx.attention(*a, causal=True)
    assert out.dtype == torch.bfloat16
    out.backward(do)
    b = _leaves(q, k, v)
    ref = longctx.attention(*(t.bfloat16() for t in b), causal=True)
    ref.backward(do)
    assert torch.equal(out, ref)
    for x, y in zip(a, b):
        assert x.grad.dtype == x.dtype  # gradients come back in each input's own dtype
        assert torch.equal(x.grad, y.grad)


def test_autocast_matches_sdpa_under_autocast():
    q, k, v = _qkv(Hkv=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = longctx.attention(q, k, v, causal=True)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    err_ref = (ref.double() - exact).abs().max().item()
    assert ref.dtype == out.dtype == torch.bfloat16
    assert (out.double() - exact).abs().max().item() <= 2 * err_ref + 1e-3


def test_backend_arithmetic_not_lowered_by_autocast():
    """The attention runs as one op: the tiled backend's float32 accumulation stays float32 inside autocast."""
    q, k, v = (t.bfloat16() for t in _qkv())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = longctx.attention(q, k, v, backend="tiled")
    assert torch.equal(got, longctx.attention(q, k, v, backend="tiled"))


def test_mixed_dtypes_outside_autocast_still_raise():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="share one dtype"):
        longctx.attention(q, k, v)
    with pytest.raises(TypeError, match="share one dtype"):
        longctx.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False), pytest.raises(TypeError, match="share one"):
        longctx.attention(q, k, v)


def test_float64_is_left_alone():
    q, k, v = (t.double() for t in _qkv())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = longctx.attention(q, k, v)
    assert out.dtype == torch.float64
    q2, k2, v2, _ = follow_autocast(q, k, v)
    assert q2 is q and k2 is k and v2 is v


def test_flash_attn_func_under_autocast():
    q, k, v = (t.transpose(1, 2) for t in _qkv())  # (B, S, H, D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, lse, _ = longctx.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    ref, ref_lse, _ = longctx.flash_attn_func(
        q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True, return_attn_probs=True
    )
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)


def test_flash_attn_varlen_func_under_autocast():
    lens = [5, 17, 9]
    T = sum(lens)
    cu = torch.tensor([0, 5, 22, 31], dtype=torch.int32)
    q = torch.randn(T, 4, 24, generator=_GEN)
    k = torch.randn(T, 2, 24, generator=_GEN)
    v = torch.randn(T, 2, 24, generator=_GEN).bfloat16()
    a = _leaves(q, k, v)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = longctx.flash_attn_varlen_func(*a, cu, cu, max(lens), max(lens), causal=True)
    out.float().sum().backward()
    b = _leaves(q, k, v)
    ref = longctx.flash_attn_varlen_func(*(t.bfloat16() for t in b), cu, cu, max(lens), max(lens), causal=True)
    ref.float().sum().backward()
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)
    for x, y in zip(a, b):
        assert torch.equal(x.grad, y.grad)
    with pytest.raises(TypeError, match="share one dtype"):
        longctx.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens))

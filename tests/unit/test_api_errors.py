"""Bad input gets a clear ValueError or TypeError that names the problem."""

from __future__ import annotations

import pytest
import torch

import longctx


def qkv(B=1, Hq=4, Hkv=2, Sq=8, Sk=8, D=16, dtype=torch.float32):
    return (
        torch.randn(B, Hq, Sq, D, dtype=dtype),
        torch.randn(B, Hkv, Sk, D, dtype=dtype),
        torch.randn(B, Hkv, Sk, D, dtype=dtype),
    )


def test_wrong_rank():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="4 dimensions"):
        longctx.attention(q[0], k, v)


def test_mismatched_batch():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="batch"):
        longctx.attention(q.expand(2, -1, -1, -1), k, v)


def test_mismatched_head_dim():
    q, _, _ = qkv(D=16)
    _, k, v = qkv(D=32)
    with pytest.raises(ValueError, match="head_dim"):
        longctx.attention(q, k, v)


def test_heads_not_multiple():
    q, k, v = qkv(Hq=6, Hkv=4)
    with pytest.raises(ValueError, match="multiple"):
        longctx.attention(q, k, v)


def test_k_v_different_lengths():
    q, k, _ = qkv(Sk=8)
    _, _, v = qkv(Sk=9)
    with pytest.raises(ValueError, match="same shape"):
        longctx.attention(q, k, v)


def test_mixed_dtypes():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="dtype"):
        longctx.attention(q.double(), k, v)


def test_mixed_devices():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="device"):
        longctx.attention(q.to("meta"), k, v)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.complex64])
def test_unsupported_dtypes(dtype):
    q = torch.ones(1, 1, 4, 8, dtype=dtype)
    with pytest.raises(TypeError, match="dtype"):
        longctx.attention(q, q, q)


def test_non_tensor():
    _, k, v = qkv()
    with pytest.raises(TypeError, match="torch.Tensor"):
        longctx.attention([[1.0]], k, v)


@pytest.mark.parametrize("window", [(-2, 0), (0, -5), (3,), "3,3", (1.5, 0)])
def test_bad_window(window):
    q, k, v = qkv()
    with pytest.raises((ValueError, TypeError), match="window"):
        longctx.attention(q, k, v, window=window)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_scale(scale):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="finite"):
        longctx.attention(q, k, v, scale=scale)


def test_scale_wrong_type():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="scale"):
        longctx.attention(q, k, v, scale="0.1")


def test_unknown_backend():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="unknown attention backend 'fastest'"):
        longctx.attention(q, k, v, backend="fastest")


def test_causal_must_be_bool():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="causal"):
        longctx.attention(q, k, v, causal="yes")


def test_pinned_backend_that_cannot_run_raises_with_reasons():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="sdpa_flash.*cannot run.*CUDA"):
        longctx.attention(q, k, v, backend="sdpa_flash")


def test_flash_attn_func_bad_rank():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="batch, seq, heads, head_dim"):
        longctx.flash_attn_func(q[0], k, v)

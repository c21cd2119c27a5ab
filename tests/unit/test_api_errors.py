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


def test_flash_attn_func_unsupported_arguments():
    q, k, v = (t.transpose(1, 2) for t in qkv())
    f = longctx.flash_attn_func
    with pytest.raises(ValueError, match=r"dropout_p=0.1 is not supported.*pass dropout_p=0.0"):
        f(q, k, v, 0.1)
    with pytest.raises(ValueError, match=r"softcap must be 0.0 \(off\) or a finite positive cap.*got -50.0"):
        f(q, k, v, 0.0, None, True, (-1, -1), -50.0)
    with pytest.raises(TypeError, match=r"softcap must be a real number.*got 'x'"):
        f(q, k, v, softcap="x")
    with pytest.raises(ValueError, match=r"alibi_slopes is not supported \(got a Tensor\).*pass alibi_slopes=None"):
        f(q, k, v, alibi_slopes=torch.zeros(4))
    with pytest.raises(ValueError, match=r"kv must be a tensor of shape \(batch, seqlen_k, 2, heads_k, head_dim\)"):
        longctx.flash_attn_kvpacked_func(q, k)
    with pytest.raises(ValueError, match=r"qkv must be a tensor of shape \(batch, seqlen, 3, heads, head_dim\)"):
        longctx.flash_attn_qkvpacked_func(q)


# -- flags, windows and block masks of attention ------------------------------------------------------------


@pytest.mark.parametrize("name", ["deterministic", "return_lse"])
@pytest.mark.parametrize("value", ["yes", 1, None])
def test_bool_flags_must_be_bools_like_causal(name, value):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=rf"{name} must be True or False, got .* pass {name}=bool"):
        longctx.attention(q, k, v, **{name: value})
    with pytest.raises(TypeError, match=r"causal must be True or False, got 1 \(int\)"):
        longctx.attention(q, k, v, causal=1)


def test_causal_with_a_window_to_the_right_is_flash_attns_causal_window():
    """As flash-attn: causal=True takes the window's right side as 0 (tests/unit/test_flash_window.py checks values)."""
    q, k, v = qkv()
    ref = longctx.attention(q, k, v, causal=True, window=(4, 0))
    for window in [(4, 3), (4, -1), (4, 10**6)]:
        torch.testing.assert_close(longctx.attention(q, k, v, causal=True, window=window), ref, rtol=0, atol=0)


def test_block_mask_must_be_a_block_mask():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"block_mask must be a longctx.BlockMask .*got 'causal'.*pass causal=True"):
        longctx.attention(q, k, v, block_mask="causal")
    with pytest.raises(TypeError, match="block_mask must be a longctx.BlockMask"):
        longctx.explain(q, k, v, block_mask=torch.ones(8, 8, dtype=torch.bool))


def test_explain_gives_no_block_mask_reason_without_a_block_mask():
    q, k, v = qkv()
    text = str(longctx.explain(q, k, v, causal=True))
    assert "triton_sparse" in text and "together with block_mask" not in text


# -- mask_mods ---------------------------------------------------------------------------------------------------


def test_mask_mod_of_the_wrong_shape_is_named():
    def rows(b, h, q, kv):
        return (q >= kv).any(1)  # reduced over the keys: (n,) instead of (n, m)

    with pytest.raises(ValueError, match=r"mask_mod 'rows' returned shape \(64,\) .*expected the broadcast shape"):
        longctx.block_mask(rows, None, None, 64, 64, block_size=16, device="cpu")


def test_mask_mod_of_shape_one_is_not_taken_as_all_visible():
    def one(b, h, q, kv):
        return torch.tensor([True])

    with pytest.raises(ValueError, match=r"mask_mod 'one' returned shape \(1,\)"):
        longctx.block_mask(one, None, None, 64, 64, block_size=16, device="cpu")


def test_mask_mod_with_python_if_gets_a_hint():
    def with_if(b, h, q, kv):
        if q >= kv:
            return torch.tensor(True)
        return torch.tensor(False)

    with pytest.raises(TypeError, match=r"mask_mod 'with_if' uses Python control flow.*torch.where"):
        longctx.block_mask(with_if, None, None, 64, 64, block_size=16, device="cpu")


def test_mask_mod_returning_numbers_is_named():
    with pytest.raises(TypeError, match=r"must return a bool tensor .*got torch.int64"):
        longctx.block_mask(lambda b, h, q, kv: q - kv, None, None, 64, 64, block_size=16, device="cpu")


def test_mask_mods_that_ignore_an_index_still_broadcast():
    bm = longctx.block_mask(lambda b, h, q, kv: q >= 0, None, None, 64, 64, block_size=16, device="cpu")
    assert bool(bm.dense_mask().all())  # (n, 1): every key visible to every query


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_block_mask_on_cuda_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match=r"device='cuda'\): CUDA is not available.*device='cpu'"):
        longctx.block_mask(lambda b, h, q, kv: q >= kv, None, None, 64, 64, device="cuda")


# -- token ids in the GPT ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [32, 1000, -1])
def test_token_ids_outside_the_vocabulary_are_named(bad):
    from longctx.models.gpt import GPT, GPTConfig

    model = GPT(GPTConfig.preset("demo", seq_length=16))
    tokens = torch.randint(1, 32, (2, 16))
    tokens[0, 0], tokens[0, 1], tokens[1, 5] = 1, 31, bad
    with pytest.raises(
        ValueError, match=rf"must be in \[0, vocab_size=32\), got ids from {min(bad, 1)} to {max(bad, 31)}"
    ):
        model(tokens)

"""CPU lane: the math and tiled backends against the float64 oracle (the FlashAttention rule)."""

from __future__ import annotations

import pytest
import torch

import longctx
from longctx.cli.commands import error_vs_oracle, failing
from longctx.masks import Band
from longctx.reference.naive import naive_attention
from longctx.reference.tiled import tiled_backward, tiled_forward


def _inputs(B, Hq, Hkv, Sq, Sk, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Sq, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, Sk, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, Sk, D, generator=g).to(dtype)
    do = torch.randn(B, Hq, Sq, D, generator=g).to(dtype)
    return q, k, v, do


def _assert_rule(ours, pt, dtype, what=""):
    assert None not in ours.values(), f"{what}: a quantity was not compared: {ours}"
    assert not failing(ours, pt, dtype), f"{what}: errors {ours} vs PyTorch {pt}"


CASES = [
    # (B, Hq, Hkv, Sq, Sk, D, causal, window)
    (2, 4, 4, 17, 17, 40, False, None),  # MHA, odd length, head dim 40
    (1, 6, 2, 113, 113, 72, True, None),  # GQA, causal, head dim 72
    (1, 4, 1, 64, 200, 32, True, None),  # MQA, causal with Sq < Sk
    (1, 4, 2, 200, 64, 32, True, None),  # causal with Sq > Sk: the first rows see nothing
    (1, 2, 2, 150, 150, 16, False, (20, -1)),  # one-sided window (left only)
    (1, 2, 1, 150, 170, 16, False, (-1, 10)),  # one-sided window (right only)
    (1, 4, 2, 180, 180, 24, False, (25, 7)),  # two-sided window
    (1, 2, 2, 190, 150, 16, True, (30, 0)),  # causal sliding window, Sq > Sk
    (1, 2, 1, 1, 1, 16, False, None),  # length 1
    (1, 2, 1, 1, 129, 16, True, None),  # one query, many keys
    (1, 1, 1, 1025, 1025, 16, True, None),  # length 1025: partial last tile
]


@pytest.mark.parametrize("backend", ["tiled", "math"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}_H{}-{}_S{}-{}_D{}_c{}_w{}".format(*c))
def test_fp32_against_oracle(backend, case):
    B, Hq, Hkv, Sq, Sk, D, causal, window = case
    q, k, v, do = _inputs(B, Hq, Hkv, Sq, Sk, D, torch.float32, seed=hash(case) % 1000)
    band = Band.from_args(Sq, Sk, causal, window)

    def run(a, b, c):
        return longctx.attention(a, b, c, causal=causal, window=window, backend=backend, return_lse=True)

    ours, pt = error_vs_oracle(q, k, v, do, run, scale=D**-0.5, band=band)
    _assert_rule(ours, pt, torch.float32, f"{backend} {case}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[6]], ids=["gqa_causal", "causal_sq_gt_sk", "window"])
def test_half_precision_tiled(dtype, case):
    B, Hq, Hkv, Sq, Sk, D, causal, window = case
    q, k, v, do = _inputs(B, Hq, Hkv, Sq, Sk, D, dtype, seed=7)
    band = Band.from_args(Sq, Sk, causal, window)

    def run(a, b, c):
        return longctx.attention(a, b, c, causal=causal, window=window, backend="tiled", return_lse=True)

    ours, pt = error_vs_oracle(q, k, v, do, run, scale=D**-0.5, band=band)
    _assert_rule(ours, pt, dtype, f"tiled {dtype} {case}")
    out = run(q, k, v)[0]
    assert out.dtype == dtype


def test_float64_is_exact_and_lse_float64():
    q, k, v, _ = _inputs(1, 4, 2, 70, 90, 24, torch.float64, seed=3)
    out, lse = longctx.attention(q, k, v, causal=True, backend="tiled", return_lse=True)
    ref, ref_lse = naive_attention(q, k, v, scale=24**-0.5, band=Band.from_args(70, 90, True))
    assert lse.dtype == torch.float64 and out.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", ["tiled", "math"])
def test_fully_masked_rows_give_zero_and_minus_inf(backend):
    # Sq > Sk with causal: rows 0 .. Sq - Sk - 1 see no key.
    Sq, Sk = 40, 10
    q, k, v, do = _inputs(1, 2, 1, Sq, Sk, 16, torch.float32, seed=5)
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    out, lse = longctx.attention(q, k, v, causal=True, backend=backend, return_lse=True)
    dead = slice(0, Sq - Sk)
    assert torch.all(out[:, :, dead] == 0)
    assert torch.all(torch.isneginf(lse[:, :, dead]))
    assert torch.isfinite(lse[:, :, Sq - Sk :]).all()
    out.backward(do)
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.all(q.grad[:, :, dead] == 0)


def test_window_that_hides_everything():
    # left=0, right=0 with Sq=Sk sees only the diagonal; shifting the diagonal out of range masks all.
    q, k, v, _ = _inputs(1, 1, 1, 8, 8, 16, torch.float32, seed=9)
    band = Band(lo=100, hi=None)  # every key is at least 100 positions after its query: none exists
    out, lse = tiled_forward(q, k, v, scale=0.25, band=band)
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))
    dq, dk, dv = tiled_backward(torch.randn_like(out), q, k, v, out, lse, scale=0.25, band=band)
    assert torch.all(dq == 0) and torch.all(dk == 0) and torch.all(dv == 0)


def test_nan_stays_in_its_row():
    q, k, v, _ = _inputs(1, 2, 2, 33, 33, 16, torch.float32, seed=11)
    q[0, 1, 5, 3] = float("nan")
    for backend in ("tiled", "math"):
        out = longctx.attention(q, k, v, backend=backend)
        assert torch.isnan(out[0, 1, 5]).all(), backend
        mask = torch.ones_like(out, dtype=torch.bool)
        mask[0, 1, 5] = False
        assert torch.isfinite(out[mask]).all(), backend


def test_empty_inputs():
    for shape_q, shape_k in [((0, 2, 5, 8), (0, 2, 5, 8)), ((1, 2, 0, 8), (1, 2, 5, 8))]:
        q = torch.randn(*shape_q, requires_grad=True)
        k = torch.randn(*shape_k)
        v = torch.randn(*shape_k)
        out, lse = longctx.attention(q, k, v, return_lse=True)
        assert out.shape == shape_q and lse.shape == shape_q[:3]
    # Sk = 0: every row sees nothing.
    q = torch.randn(1, 2, 3, 8)
    out, lse = longctx.attention(q, torch.randn(1, 2, 0, 8), torch.randn(1, 2, 0, 8), return_lse=True)
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))


def test_tiled_skips_masked_tiles():
    S, blk = 1024, 128
    q, k, v, _ = _inputs(1, 1, 1, S, S, 16, torch.float32, seed=1)
    stats: dict = {}
    tiled_forward(q, k, v, scale=1.0, band=Band.from_args(S, S, causal=True), block_q=blk, block_k=blk, stats=stats)
    n = S // blk
    assert stats["tiles"] == n * (n + 1) // 2 and stats["tiles_total"] == n * n
    stats = {}
    tiled_forward(q, k, v, scale=1.0, band=Band.from_args(S, S, True, (127, 0)), block_q=blk, block_k=blk, stats=stats)
    assert stats["tiles"] == 2 * n - 1  # the diagonal tile and the one to its left


def test_lse_gradient():
    q, k, v, _ = _inputs(1, 2, 1, 30, 45, 16, torch.float64, seed=2)
    grads = []
    for backend in ("tiled", "math"):
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        out, lse = longctx.attention(qq, kk, vv, causal=True, backend=backend, return_lse=True)
        (out.square().sum() + lse.sum()).backward()
        grads.append((qq.grad, kk.grad, vv.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_flash_attn_func_layout_and_views():
    B, S, H, Hkv, D = 2, 37, 4, 2, 16
    q = torch.randn(B, S, H, D, requires_grad=True)
    k = torch.randn(B, S, Hkv, D, requires_grad=True)
    v = torch.randn(B, S, Hkv, D, requires_grad=True)
    out, lse, probs = longctx.flash_attn_func(q, k, v, causal=True, window_size=(8, 0), return_attn_probs=True)
    ref, ref_lse = longctx.attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, window=(8, 0), return_lse=True
    )
    assert out.shape == (B, S, H, D) and lse.shape == (B, H, S) and probs is None
    torch.testing.assert_close(out, ref.transpose(1, 2))
    torch.testing.assert_close(lse, ref_lse)
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape
    with pytest.raises(ValueError, match="dropout"):
        longctx.flash_attn_func(q, k, v, dropout_p=0.1)


def test_flash_attn_func_signature_and_positional_binding():
    """flash-attn >= 2.6's positional order: softcap after window_size, then alibi_slopes, deterministic,
    return_attn_probs."""
    import inspect

    params = list(inspect.signature(longctx.flash_attn_func).parameters)
    assert params[:11] == [
        "q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes",
        "deterministic", "return_attn_probs",
    ]  # fmt: skip
    q, k, v = (torch.randn(2, 11, 2, 8, dtype=torch.float64) for _ in range(3))
    pos = longctx.flash_attn_func(q, k, v, 0.0, None, True, (-1, -1), 0.0, None, False, True)
    kw = longctx.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    torch.testing.assert_close(pos[0], kw[0])
    torch.testing.assert_close(pos[1], kw[1])
    out = longctx.flash_attn_func(q, k, v, 0.0, None, True, (-1, -1), 0.0)
    torch.testing.assert_close(out, kw[0])


@pytest.mark.parametrize("backend", ["tiled", "math"])
def test_flash_attn_func_output_is_contiguous(backend):
    B, S, H, D = 2, 13, 3, 8
    q, k, v = (torch.randn(B, S, H, D, dtype=torch.float64) for _ in range(3))
    out = longctx.flash_attn_func(q, k, v, causal=True, backend=backend)
    assert out.shape == (B, S, H, D) and out.is_contiguous()
    assert out.view(B, S, H * D).shape == (B, S, H * D)


def _fwd_bwd(fn, tensors):
    g = torch.Generator().manual_seed(9)
    ts = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*ts)
    (out * torch.randn(out.shape, generator=g, dtype=out.dtype)).sum().backward()
    return out, [t.grad for t in ts]


@pytest.mark.parametrize("backend", ["tiled", "math"])
def test_flash_attn_packed_forms_match_unpacked(backend):
    """qkv (B, S, 3, H, D) and kv (B, Sk, 2, Hkv, D) are read as views; gradients reach the packed tensor."""
    B, S, Sk, H, Hkv, D = 2, 13, 17, 4, 2, 8
    g = torch.Generator().manual_seed(1)
    kw = dict(causal=True, backend=backend)
    qkv = torch.randn(B, S, 3, H, D, generator=g, dtype=torch.float64)
    out_p, (g_qkv,) = _fwd_bwd(lambda t: longctx.flash_attn_qkvpacked_func(t, 0.0, None, True, backend=backend), [qkv])
    out_u, g_u = _fwd_bwd(lambda a, b, c: longctx.flash_attn_func(a, b, c, **kw), qkv.unbind(2))
    assert out_p.is_contiguous()
    torch.testing.assert_close(out_p, out_u, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_qkv, torch.stack(g_u, 2), rtol=1e-12, atol=1e-12)
    q = torch.randn(B, S, H, D, generator=g, dtype=torch.float64)
    kv = torch.randn(B, Sk, 2, Hkv, D, generator=g, dtype=torch.float64)
    out_p, (g_q, g_kv) = _fwd_bwd(lambda a, b: longctx.flash_attn_kvpacked_func(a, b, **kw), [q, kv])
    out_u, g_u = _fwd_bwd(lambda a, b, c: longctx.flash_attn_func(a, b, c, **kw), [q, *kv.unbind(2)])
    torch.testing.assert_close(out_p, out_u, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_q, g_u[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_kv, torch.stack(g_u[1:], 2), rtol=1e-12, atol=1e-12)


def test_default_scale_is_inverse_sqrt_d():
    q, k, v, _ = _inputs(1, 1, 1, 9, 9, 25, torch.float64, seed=4)
    a = longctx.attention(q, k, v, backend="tiled")
    b = longctx.attention(q, k, v, backend="tiled", scale=0.2)
    torch.testing.assert_close(a, b)

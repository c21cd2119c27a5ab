"""Attention logit softcapping (Gemma 2): ``s -> softcap * tanh(s / softcap)`` of the scaled scores, before the mask.

Every path is compared with an oracle written here from the definition (float64, the cap applied to explicit scores,
K/V repeated per query head, the mask as a dense boolean matrix): the references (`naive`, `tiled`, `tiled_sparse`),
the `math` and `tiled` backends through `longctx.attention`, packed documents through `flash_attn_varlen_func`, block
masks, and the flash-attn forms. Outputs, lse and the gradients of q, k, v.
"""

from __future__ import annotations

import math

import pytest
import torch

import longctx
from longctx.backends.base import AttnInputs
from longctx.dispatch import get_backend
from longctx.masks import Band, and_masks, causal_mask, document_mask, sliding_window_mask
from longctx.reference.naive import naive_attention
from longctx.reference.tiled import tiled_attention
from longctx.reference.tiled_sparse import tiled_block_sparse


def oracle(q, k, v, *, scale, softcap, keep=None):
    """float64 ``(out, lse)`` from the definition; keep: (Sq, Sk) or broadcastable bool, True = visible."""
    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # (B, Hq, Sk, D)
    s = (q @ k.transpose(-1, -2)) * scale  # (B, Hq, Sq, Sk)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    return p @ v, lse


def inputs(B, Hq, Hkv, Sq, Sk, D, dtype=torch.float64, seed=0, spread=3.0):
    """Scores of a few units (spread): the cap of the tests (2 to 5) bends them visibly."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Sq, D, generator=g, dtype=torch.float64) * spread
    k = torch.randn(B, Hkv, Sk, D, generator=g, dtype=torch.float64) * spread
    v = torch.randn(B, Hkv, Sk, D, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def compare(fn, q, k, v, *, scale, softcap, keep, tol):
    """Run ``fn(q, k, v) -> (out, lse)`` with gradients and compare out, lse, dq, dk, dv with the oracle."""
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = fn(qg, kg, vg)
    do = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    w = torch.randn(lse.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def loss(o, lse_):
        return (o.double() * do).sum() + (torch.where(torch.isfinite(lse_), lse_, 0).double() * w).sum()

    grads = torch.autograd.grad(loss(out, lse), (qg, kg, vg))
    q6, k6, v6 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ro, rl = oracle(q6, k6, v6, scale=scale, softcap=softcap, keep=keep)
    rgrads = torch.autograd.grad(loss(ro, rl), (q6, k6, v6))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), (ro, rl, *rgrads)):
        a, b = a.detach().double(), b.detach().double()
        fin = torch.isfinite(b)
        assert torch.equal(torch.isfinite(a), fin), f"{name}: -inf pattern differs from the oracle"
        err = (a[fin] - b[fin]).abs().max().item() if fin.any() else 0.0
        assert err <= tol * max(1.0, b[fin].abs().max().item()), f"{name}: error {err:.2e}"


BANDS = {
    "dense": dict(),
    "causal": dict(causal=True),
    "window": dict(window=(5, 3)),
    "causal_window": dict(causal=True, window=(6, 0)),
}


@pytest.mark.parametrize("band_name", list(BANDS))
@pytest.mark.parametrize("shape", [(2, 4, 2, 19, 27, 8), (1, 3, 1, 30, 17, 16), (1, 2, 2, 1, 9, 8)])
@pytest.mark.parametrize("path", ["naive", "tiled", "math_backend", "tiled_backend"])
def test_dense_paths_float64(band_name, shape, path):
    B, Hq, Hkv, Sq, Sk, D = shape
    q, k, v = inputs(*shape)
    scale, cap = 1 / math.sqrt(D), 4.0
    kw = BANDS[band_name]
    band = Band.from_args(Sq, Sk, causal=kw.get("causal", False), window=kw.get("window"))
    keep = band.mask(0, Sq, 0, Sk, device=torch.device("cpu"))
    fns = {
        "naive": lambda a, b, c: naive_attention(a, b, c, scale=scale, band=band, softcap=cap),
        # small tiles: boundary (masked) and inner tiles both occur
        "tiled": lambda a, b, c: tiled_attention(a, b, c, scale=scale, band=band, block_q=8, block_k=4, softcap=cap),
        "math_backend": lambda a, b, c: longctx.attention(a, b, c, **kw, softcap=cap, backend="math", return_lse=True),
        "tiled_backend": lambda a, b, c: longctx.attention(
            a, b, c, **kw, softcap=cap, backend="tiled", return_lse=True
        ),
    }
    compare(fns[path], q, k, v, scale=scale, softcap=cap, keep=keep, tol=1e-10)


@pytest.mark.parametrize("backend", ["math", "tiled"])
def test_float32_and_custom_scale(backend):
    q, k, v = inputs(2, 4, 2, 33, 33, 16, dtype=torch.float32)
    fn = lambda a, b, c: longctx.attention(  # noqa: E731
        a, b, c, causal=True, scale=0.3, softcap=2.5, backend=backend, return_lse=True
    )
    keep = Band.from_args(33, 33, causal=True).mask(0, 33, 0, 33, device=torch.device("cpu"))
    compare(fn, q, k, v, scale=0.3, softcap=2.5, keep=keep, tol=2e-5)


def _block_masks(S):
    return {
        "causal": and_masks(causal_mask, causal_mask),
        "sliding": and_masks(causal_mask, sliding_window_mask(7)),
        "documents": and_masks(causal_mask, document_mask(torch.tensor([0] * 11 + [1] * 9 + [2] * (S - 20)))),
    }


@pytest.mark.parametrize("mask_name", ["causal", "sliding", "documents"])
@pytest.mark.parametrize("path", ["tiled_sparse", "tiled_backend", "math_backend"])
def test_block_masks(mask_name, path):
    S, D = 37, 8
    q, k, v = inputs(1, 4, 2, S, S, D)
    mod = _block_masks(S)[mask_name]
    bm = longctx.block_mask(mod, None, None, S, S, block_size=16, device="cpu")
    keep = bm.dense_mask(torch.device("cpu"))
    scale, cap = 1 / math.sqrt(D), 3.0
    fns = {
        "tiled_sparse": lambda a, b, c: tiled_block_sparse(
            a, b, c, scale=scale, band=Band(), block_mask=bm, softcap=cap
        ),
        "tiled_backend": lambda a, b, c: longctx.attention(
            a, b, c, block_mask=bm, softcap=cap, backend="tiled", return_lse=True
        ),
        "math_backend": lambda a, b, c: longctx.attention(
            a, b, c, block_mask=bm, softcap=cap, backend="math", return_lse=True
        ),
    }
    compare(fns[path], q, k, v, scale=scale, softcap=cap, keep=keep, tol=1e-10)


def _doc_keep(cu_q, cu_k, causal, window):
    """(total_q, total_k) visibility of packed documents, bottom-right aligned within each document."""
    Tq, Tk = cu_q[-1], cu_k[-1]
    keep = torch.zeros(Tq, Tk, dtype=torch.bool)
    for d in range(len(cu_q) - 1):
        lq, lk = cu_q[d + 1] - cu_q[d], cu_k[d + 1] - cu_k[d]
        if lq and lk:
            band = Band.from_args(lq, lk, causal=causal, window=window)
            m = band.mask(0, lq, 0, lk, device=torch.device("cpu"))  # None: every pair visible
            keep[cu_q[d] : cu_q[d + 1], cu_k[d] : cu_k[d + 1]] = True if m is None else m
    return keep


@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (-1, -1)), (True, (4, 0))])
@pytest.mark.parametrize("backend", ["tiled", "math"])
def test_varlen_documents(causal, window, backend):
    cu_q, cu_k = [0, 7, 7, 20, 31], [0, 9, 12, 25, 31]  # an empty query document; Lq != Lk
    Hq, Hkv, D = 4, 2, 8
    g = torch.Generator().manual_seed(3)
    q = torch.randn(cu_q[-1], Hq, D, generator=g, dtype=torch.float64) * 3
    k = torch.randn(cu_k[-1], Hkv, D, generator=g, dtype=torch.float64) * 3
    v = torch.randn(cu_k[-1], Hkv, D, generator=g, dtype=torch.float64)
    cq, ck = torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32)
    cap = 2.0

    def fn(a, b, c):  # (1, H, T, D) views in, (out, lse) out in the same layout
        out, lse, _ = longctx.flash_attn_varlen_func(
            a[0].transpose(0, 1), b[0].transpose(0, 1), c[0].transpose(0, 1), cq, ck, 13, 13,
            causal=causal, window_size=window, softcap=cap, return_attn_probs=True, backend=backend, block_size=16,
        )  # fmt: skip
        return out.transpose(0, 1)[None], lse[None]

    q4, k4, v4 = (t.transpose(0, 1)[None] for t in (q, k, v))  # (1, H, T, D)
    keep = _doc_keep(cu_q, cu_k, causal, window)
    compare(fn, q4, k4, v4, scale=1 / math.sqrt(D), softcap=cap, keep=keep, tol=1e-10)


# -- softcap = 0 is off, large caps approach no cap -------------------------------------------------------------


@pytest.mark.parametrize("backend", ["math", "tiled"])
def test_zero_softcap_is_bitwise_no_softcap(backend):
    q, k, v = inputs(1, 4, 2, 21, 21, 8, dtype=torch.float32)
    a = longctx.attention(q, k, v, causal=True, backend=backend, return_lse=True)
    b = longctx.attention(q, k, v, causal=True, backend=backend, return_lse=True, softcap=0.0)
    c = longctx.attention(q, k, v, causal=True, backend=backend, return_lse=True, softcap=0)
    for x, y, z in zip(a, b, c):
        assert torch.equal(x, y) and torch.equal(x, z)


def test_softcap_changes_the_result_and_large_caps_approach_none():
    q, k, v = inputs(1, 2, 2, 16, 16, 8)
    base = longctx.attention(q, k, v, backend="math")
    capped = longctx.attention(q, k, v, backend="math", softcap=1.0)
    loose = longctx.attention(q, k, v, backend="math", softcap=1e6)
    assert (capped - base).abs().max() > 1e-2
    assert (loose - base).abs().max() < 1e-8


# -- the flash-attn functions --------------------------------------------------------------------------------------


def _bshd(*shape, dtype=torch.float64):
    return tuple(t.transpose(1, 2) for t in inputs(*shape, dtype=dtype))  # (B, S, H, D) views


def test_flash_attn_func_softcap_positional_and_keyword():
    q, k, v = _bshd(2, 4, 2, 17, 17, 8)
    ref = longctx.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, softcap=3.0)
    ref = ref.transpose(1, 2)
    # flash-attn's positional order: dropout_p, softmax_scale, causal, window_size, softcap
    pos = longctx.flash_attn_func(q, k, v, 0.0, None, True, (-1, -1), 3.0)
    kw = longctx.flash_attn_func(q, k, v, causal=True, softcap=3.0)
    torch.testing.assert_close(pos, ref, rtol=0, atol=0)
    torch.testing.assert_close(kw, ref, rtol=0, atol=0)
    assert not torch.allclose(kw, longctx.flash_attn_func(q, k, v, causal=True))


def test_packed_forms_pass_softcap():
    q, k, v = _bshd(1, 2, 2, 13, 13, 8)
    ref = longctx.flash_attn_func(q, k, v, causal=True, softcap=2.0)
    qkv = torch.stack((q, k, v), dim=2)  # (B, S, 3, H, D)
    torch.testing.assert_close(longctx.flash_attn_qkvpacked_func(qkv, causal=True, softcap=2.0), ref, rtol=0, atol=0)
    kv = torch.stack((k, v), dim=2)  # (B, S, 2, H, D)
    torch.testing.assert_close(longctx.flash_attn_kvpacked_func(q, kv, 0.0, None, True, (-1, -1), 2.0), ref)
    cu = torch.tensor([0, 13], dtype=torch.int32)
    out = longctx.flash_attn_varlen_qkvpacked_func(qkv[0], cu, 13, causal=True, softcap=2.0)
    torch.testing.assert_close(out, ref[0], rtol=1e-12, atol=1e-12)
    out = longctx.flash_attn_varlen_kvpacked_func(q[0], kv[0], cu, cu, 13, 13, 0.0, None, True, (-1, -1), 2.0)
    torch.testing.assert_close(out, ref[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bad", [-1.0, -1e-9, float("nan"), float("inf"), float("-inf")])
def test_bad_softcap_values_raise_value_error(bad):
    q, k, v = inputs(1, 2, 2, 8, 8, 8)
    with pytest.raises(ValueError, match=r"softcap must be 0.0 \(off\) or a finite positive cap.*got"):
        longctx.attention(q, k, v, softcap=bad)
    with pytest.raises(ValueError, match=r"longctx.flash_attn_func: softcap must be"):
        longctx.flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), softcap=bad)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"flash_attn_varlen_func: softcap must be"):
        longctx.flash_attn_varlen_func(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu, 8, 8,
                                       softcap=bad)  # fmt: skip


@pytest.mark.parametrize("bad", ["50", None, True, torch.tensor(2.0)])
def test_non_number_softcap_raises_type_error(bad):
    q, k, v = inputs(1, 2, 2, 8, 8, 8)
    with pytest.raises(TypeError, match="softcap must be a real number"):
        longctx.attention(q, k, v, softcap=bad)


# -- which backends serve it: explain() --------------------------------------------------------------------------


def _cuda_inputs(**kw):
    return AttnInputs(torch.device("cuda"), torch.bfloat16, 1, 8, 8, 1024, 1024, 128, Band(), capability=(9, 0), **kw)


@pytest.mark.parametrize("name", ["sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "flex"])
def test_sdpa_and_flex_refuse_softcap_with_a_reason(name):
    be = get_backend(name)
    assert not any("softcap" in r for r in be.not_supported_reasons(_cuda_inputs()))
    reasons = be.not_supported_reasons(_cuda_inputs(softcap=30.0))
    assert any("softcap" in r and "30.0" in r for r in reasons), reasons


@pytest.mark.parametrize("name", ["triton", "triton_sparse", "tiled", "math"])
def test_longctx_backends_serve_softcap(name):
    be = get_backend(name)
    for kw in (dict(), dict(block_mask=True), dict(varlen=True, block_mask=True)):
        assert be.not_supported_reasons(_cuda_inputs(softcap=30.0, **kw)) == be.not_supported_reasons(
            _cuda_inputs(**kw)
        )


def test_explain_shows_the_softcap_reasons():
    q, k, v = inputs(1, 2, 2, 8, 8, 8, dtype=torch.float32)
    choice = longctx.explain(q, k, v, causal=True, softcap=50.0)
    assert choice.backend.name == "tiled"
    for name in ("sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "flex"):
        assert any("softcapping" in r for r in choice.rejected[name]), choice.rejected[name]
    assert "softcapping" in str(choice)
    assert not any("softcap" in r for r in longctx.explain(q, k, v, causal=True).rejected["sdpa_cudnn"])


def test_pinned_sdpa_with_softcap_raises_naming_it():
    q, k, v = inputs(1, 2, 2, 8, 8, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match="sdpa_flash.*cannot run.*softcap"):
        longctx.attention(q, k, v, softcap=5.0, backend="sdpa_flash")


# -- transformers: Gemma 2's attn_logit_softcapping ---------------------------------------------------------------


def test_gemma2_attn_logit_softcapping_matches_eager():
    transformers = pytest.importorskip("transformers")
    import longctx.integrations.transformers  # noqa: F401  (registers attn_implementation="longctx")

    def logits(cap, impl):
        cfg = transformers.Gemma2Config(
            vocab_size=101, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=12, max_position_embeddings=64, sliding_window=5,
            query_pre_attn_scalar=20, attn_logit_softcapping=cap, final_logit_softcapping=None,
        )  # fmt: skip
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl).eval()
        with torch.no_grad():
            return model(input_ids=torch.arange(22).reshape(2, 11) * 4 % 101).logits

    # a random tiny model's scores are small: a cap of 0.01 bends them
    ours = logits(0.01, "longctx")
    torch.testing.assert_close(ours, logits(0.01, "eager"), rtol=1e-4, atol=1e-4)
    assert (ours - logits(None, "eager")).abs().max() > 1e-3  # the cap changes the model

"""flash_attn_varlen_func: packed documents against a per-document float64 oracle (CPU lane)."""

from __future__ import annotations

import pytest
import torch

import longctx
from longctx.masks import Band
from longctx.reference.naive import naive_attention


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def _reference(q, k, v, lq, lk, causal, window, scale):
    """Per document (B, H, S, D) oracle in float64; returns out (total_q, Hq, D), lse (Hq, total_q)."""
    cq, ck = _cu(lq).tolist(), _cu(lk).tolist()
    outs, lses = [], []
    for d in range(len(lq)):
        qd = q[cq[d] : cq[d + 1]].permute(1, 0, 2)[None]
        kd = k[ck[d] : ck[d + 1]].permute(1, 0, 2)[None]
        vd = v[ck[d] : ck[d + 1]].permute(1, 0, 2)[None]
        if lk[d] == 0:
            o = torch.zeros_like(qd[0].permute(1, 0, 2)) + 0 * qd.sum()
            outs.append(o)
            lses.append(torch.full((q.shape[1], lq[d]), float("-inf"), dtype=q.dtype))
            continue
        o, l = naive_attention(qd, kd, vd, scale=scale, band=Band.from_args(lq[d], lk[d], causal, window))
        outs.append(o[0].permute(1, 0, 2))
        lses.append(l[0])
    return torch.cat(outs), torch.cat(lses, 1)


CASES = {
    "lengths_with_1": ([1, 37, 1, 70, 5], [1, 37, 1, 70, 5]),
    "longer_than_tile": ([90, 3, 41], [90, 3, 41]),
    "many_tiny": ([1, 2, 3, 1, 1, 4, 2, 2, 1, 3, 5, 1, 2, 1, 1, 3], [1, 2, 3, 1, 1, 4, 2, 2, 1, 3, 5, 1, 2, 1, 1, 3]),
    "sq_ne_sk": ([1, 40, 70, 5, 0, 33], [3, 20, 70, 9, 4, 1]),
    "zero_key_docs": ([4, 7, 3, 9, 2], [0, 11, 0, 5, 0]),
}


def _run(name, causal, window, dtype, hq=4, hkv=2, d=16, bs=16):
    lq, lk = CASES[name]
    g = torch.Generator().manual_seed(len(name) + 7 * causal)
    q = torch.randn(sum(lq), hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(sum(lk), hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(sum(lk), hkv, d, generator=g, dtype=torch.float64)
    go = torch.randn(q.shape, generator=g, dtype=torch.float64)
    scale = d**-0.5

    def fwd_bwd(fn, dt):
        a, b, c = (t.to(dt).requires_grad_() for t in (q, k, v))
        out, lse = fn(a, b, c)
        grads = torch.autograd.grad((out.double() * go).sum(), (a, b, c))
        return [out.double(), lse.double(), *[x.double() for x in grads]]

    ref = fwd_bwd(lambda a, b, c: _reference(a, b, c, lq, lk, causal, window, scale), torch.float64)
    low = fwd_bwd(lambda a, b, c: _reference(a, b, c, lq, lk, causal, window, scale), dtype)

    def ours_fn(a, b, c):
        out, lse, none = longctx.flash_attn_varlen_func(
            a,
            b,
            c,
            _cu(lq),
            _cu(lk),
            max(lq),
            max(lk),
            causal=causal,
            window_size=window,
            return_attn_probs=True,
            block_size=bs,
            backend="tiled",
        )
        assert none is None
        return out, lse

    ours = fwd_bwd(ours_fn, dtype)
    floor = 1e-12 if dtype == torch.float64 else 1e-5
    for nm, o, r, lo in zip(["out", "lse", "dq", "dk", "dv"], ours, ref, low):
        if nm == "lse":
            assert torch.equal(torch.isinf(o), torch.isinf(r)), "rows with no key must have lse -inf"
            fin = torch.isfinite(r)
            o, r, lo = o[fin], r[fin], lo[fin]
        assert torch.isfinite(o).all(), nm
        err = (o - r).abs().max().item() if o.numel() else 0.0
        base = (lo - r).abs().max().item() if o.numel() else 0.0
        assert err <= 2 * base + floor, f"{nm}: {err:.3g} vs {base:.3g}"


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (6, 2)), (True, (9, -1))])
def test_varlen_float64(name, causal, window):
    _run(name, causal, window, torch.float64)


@pytest.mark.parametrize("name", ["sq_ne_sk", "many_tiny"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_low_precision_mqa(name, dtype):
    _run(name, True, (-1, -1), dtype, hq=3, hkv=1, d=8)


def test_varlen_math_backend_and_tiled_agree():
    lq = [5, 17, 30]
    q = torch.randn(sum(lq), 2, 8, dtype=torch.float64)
    k = torch.randn(sum(lq), 2, 8, dtype=torch.float64)
    v = torch.randn(sum(lq), 2, 8, dtype=torch.float64)
    a = longctx.flash_attn_varlen_func(q, k, v, _cu(lq), _cu(lq), 30, 30, causal=True, backend="math")
    b = longctx.flash_attn_varlen_func(q, k, v, _cu(lq), _cu(lq), 30, 30, causal=True)
    assert a.shape == (52, 2, 8) and torch.allclose(a, b, atol=1e-12)


def test_varlen_work_is_proportional_to_documents():
    from longctx.api.varlen import varlen_block_mask

    lengths = [64] * 32  # 2048 tokens
    cu = _cu(lengths).tolist()
    bm = varlen_block_mask(cu, cu, causal=True, window=(-1, -1), block_size=64, device=torch.device("cpu"))
    assert int((bm.block_kind != 0).sum()) == 32  # one diagonal block per document, never 32 x 32


def test_varlen_bad_inputs():
    q = torch.randn(10, 2, 8)
    k = torch.randn(10, 2, 8)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    f = longctx.flash_attn_varlen_func
    with pytest.raises(TypeError, match="int32"):
        f(q, k, k, cu.long(), cu, 6, 6)
    with pytest.raises(ValueError, match="start at 0"):
        f(q, k, k, torch.tensor([1, 4, 10], dtype=torch.int32), cu, 6, 6)
    with pytest.raises(ValueError, match="non-decreasing"):
        f(q, k, k, torch.tensor([0, 6, 4, 10], dtype=torch.int32), torch.tensor([0, 4, 6, 10], dtype=torch.int32), 6, 6)
    with pytest.raises(ValueError, match="must equal the number of packed tokens"):
        f(q, k, k, torch.tensor([0, 4, 9], dtype=torch.int32), cu, 6, 6)
    with pytest.raises(ValueError, match="max_seqlen"):
        f(q, k, k, cu, cu, 5, 6)
    with pytest.raises(ValueError, match="same number of documents"):
        f(q, k, k, cu, torch.tensor([0, 10], dtype=torch.int32), 6, 10)
    with pytest.raises(ValueError, match="1-D"):
        f(q, k, k, cu[None], cu, 6, 6)
    with pytest.raises(ValueError, match="3 dimensions"):
        f(q[None], k, k, cu, cu, 6, 6)
    with pytest.raises(ValueError, match="dropout_p=0.1 is not supported.*pass dropout_p=0.0"):
        f(q, k, k, cu, cu, 6, 6, dropout_p=0.1)
    with pytest.raises(ValueError, match="softcap"):
        f(q, k, k, cu, cu, 6, 6, 0.0, None, False, (-1, -1), -30.0)
    with pytest.raises(ValueError, match="alibi_slopes is not supported.*pass alibi_slopes=None"):
        f(q, k, k, cu, cu, 6, 6, alibi_slopes=torch.zeros(2))
    with pytest.raises(ValueError, match="block_table.*not supported.*pass block_table=None"):
        f(q, k, k, cu, cu, 6, 6, block_table=torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="multiple"):
        f(torch.randn(10, 3, 8), k, k, cu, cu, 6, 6)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="device"):
            f(q, k, k, cu.cuda(), cu, 6, 6)


def test_varlen_reads_cu_seqlens_once_per_tensor(monkeypatch):
    """The same cu_seqlens in every layer: one host copy (a device sync on GPUs), not one per call; an in-place
    change is seen (it bumps the tensor's version), including one that makes it invalid."""
    reads = []
    orig_tolist = torch.Tensor.tolist

    def counting_tolist(self):
        if self is cu:  # host copies of the cu_seqlens tensor itself
            reads.append(self.numel())
        return orig_tolist(self)

    q = torch.randn(10, 2, 8, dtype=torch.float64)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    f = longctx.flash_attn_varlen_func
    first = f(q, q, q, cu, cu, 6, 6, causal=True)
    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    for _ in range(3):
        torch.testing.assert_close(f(q, q, q, cu, cu, 6, 6, causal=True), first)
    assert reads == []  # validated values reused
    cu[1] = 6  # in place: documents of 6 and 4 tokens now
    out = f(q, q, q, cu, cu, 6, 6, causal=True)
    assert reads == [3]
    ref, _ = _reference(q, q, q, [6, 4], [6, 4], True, (-1, -1), q.shape[-1] ** -0.5)
    torch.testing.assert_close(out, ref)
    cu[1] = 11  # now decreasing: caught although the tensor was validated before
    with pytest.raises(ValueError, match="non-decreasing"):
        f(q, q, q, cu, cu, 11, 11)


@pytest.mark.parametrize("backend", ["tiled", "math"])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_zero_length_documents(backend, causal):
    """Documents with no keys (a repeated entry in cu_seqlens_k), first, inside and last: their queries give
    output 0, lse -inf and zero gradients; the other documents are unaffected."""
    lq, lk = [3, 6, 4, 5], [0, 8, 0, 0]
    g = torch.Generator().manual_seed(3)
    q = torch.randn(sum(lq), 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(sum(lk), 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(sum(lk), 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    out, lse, _ = longctx.flash_attn_varlen_func(
        q, k, v, _cu(lq), _cu(lk), 6, 8, causal=causal, return_attn_probs=True, backend=backend, block_size=4
    )
    (out * torch.randn(out.shape, generator=g, dtype=torch.float64)).sum().backward()
    empty = torch.cat([torch.arange(0, 3), torch.arange(9, 18)])  # the queries of documents 0, 2 and 3
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    assert bool((lse[:, empty] == float("-inf")).all())
    assert torch.equal(q.grad[empty], torch.zeros_like(q.grad[empty]))
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    ref, ref_lse = _reference(q.detach(), k.detach(), v.detach(), lq, lk, causal, (-1, -1), 8**-0.5)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse[:, 3:9], ref_lse[:, 3:9])


def _packed_grads(fn, tensors):
    g = torch.Generator().manual_seed(11)
    ts = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*ts)
    (out * torch.randn(out.shape, generator=g, dtype=out.dtype)).sum().backward()
    return out, [t.grad for t in ts]


@pytest.mark.parametrize("backend", ["tiled", "math"])
def test_varlen_packed_forms_match_unpacked(backend):
    lq, lk = [5, 17, 9], [7, 17, 3]
    g = torch.Generator().manual_seed(2)
    kw = dict(causal=True, backend=backend, block_size=8)
    # qkv (total, 3, H, D): q, k, v are views sharing cu_seqlens
    qkv = torch.randn(sum(lq), 3, 4, 8, generator=g, dtype=torch.float64)
    cu = _cu(lq)
    out_p, (g_qkv,) = _packed_grads(
        lambda t: longctx.flash_attn_varlen_qkvpacked_func(t, cu, 17, 0.0, None, True, backend=backend, block_size=8),
        [qkv],
    )
    out_u, g_u = _packed_grads(
        lambda a, b, c: longctx.flash_attn_varlen_func(a, b, c, cu, cu, 17, 17, **kw), qkv.unbind(1)
    )
    torch.testing.assert_close(out_p, out_u, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_qkv, torch.stack(g_u, 1), rtol=1e-12, atol=1e-12)
    # kv (total_k, 2, Hkv, D) with GQA and Lq != Lk
    q = torch.randn(sum(lq), 4, 8, generator=g, dtype=torch.float64)
    kv = torch.randn(sum(lk), 2, 2, 8, generator=g, dtype=torch.float64)
    cq, ck = _cu(lq), _cu(lk)
    out_p, (g_q, g_kv) = _packed_grads(
        lambda a, b: longctx.flash_attn_varlen_kvpacked_func(a, b, cq, ck, 17, 17, **kw), [q, kv]
    )
    out_u, g_u = _packed_grads(
        lambda a, b, c: longctx.flash_attn_varlen_func(a, b, c, cq, ck, 17, 17, **kw), [q, *kv.unbind(1)]
    )
    torch.testing.assert_close(out_p, out_u, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_q, g_u[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_kv, torch.stack(g_u[1:], 1), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"qkv must be a tensor of shape \(total, 3, heads, head_dim\)"):
        longctx.flash_attn_varlen_qkvpacked_func(q, cu, 17)


def test_varlen_signature_is_flash_attns():
    """Positional order as in flash-attn >= 2.6: softcap after window_size, block_table last."""
    import inspect

    params = list(inspect.signature(longctx.flash_attn_varlen_func).parameters)
    assert params[:16] == [
        "q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dropout_p",
        "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes", "deterministic", "return_attn_probs",
        "block_table",
    ]  # fmt: skip
    lq = [5, 9]
    q = torch.randn(14, 2, 8, dtype=torch.float64)
    cu = _cu(lq)
    pos = longctx.flash_attn_varlen_func(q, q, q, cu, cu, 9, 9, 0.0, None, True, (-1, -1), 0.0, None, False, True, None)
    kw = longctx.flash_attn_varlen_func(q, q, q, cu, cu, 9, 9, causal=True, return_attn_probs=True)
    torch.testing.assert_close(pos[0], kw[0])
    torch.testing.assert_close(pos[1], kw[1])
    assert pos[0].is_contiguous()

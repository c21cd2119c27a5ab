"""GPU lane of block-sparse attention and packed documents: triton_sparse (and tiled on CUDA) against the
float64 oracle with the equivalent dense mask, and against FlexAttention (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

import longctx
import longctx.masks as bsm
from longctx.reference.naive import naive_attention


def _errors(q, k, v, do, run, mask, scale):
    """Max-abs errors of run and of PyTorch in q's dtype against the float64 oracle: out, lse, dq, dk, dv."""

    def grads(fn, dt):
        a, b, c = (t.detach().to(dt).requires_grad_() for t in (q, k, v))
        out, lse = fn(a, b, c)
        out.backward(do.to(out.dtype))
        fin = torch.isfinite(lse)
        return [
            out.double(),
            torch.where(fin, lse.double(), 0.0),
            a.grad.double(),
            b.grad.double(),
            c.grad.double(),
        ], fin

    ref, fin_ref = grads(
        lambda a, b, c: naive_attention(a, b, c, scale=scale, mask=mask, upcast=torch.float64), torch.float64
    )
    low, _ = grads(lambda a, b, c: naive_attention(a, b, c, scale=scale, mask=mask, upcast=q.dtype), q.dtype)
    ours, fin = grads(run, q.dtype)
    assert torch.equal(fin, fin_ref), "rows with no visible key differ"
    names = ("out", "lse", "dq", "dk", "dv")
    return {n: (o - r).abs().max().item() for n, o, r in zip(names, ours, ref)}, {
        n: (lo - r).abs().max().item() for n, lo, r in zip(names, low, ref)
    }


def _check(q, k, v, bm, backend="triton_sparse"):
    g = torch.Generator(device="cuda").manual_seed(1)
    do = torch.randn(q.shape, device="cuda", generator=g, dtype=q.dtype)
    scale = q.shape[-1] ** -0.5
    run = lambda a, b, c: longctx.attention(a, b, c, block_mask=bm, backend=backend, return_lse=True)
    ours, pt = _errors(q, k, v, do, run, bm.dense_mask(), scale)
    for n in ours:
        assert ours[n] <= 2 * pt[n] + 2e-3, f"{backend} {n}: {ours[n]:.3e} vs PyTorch {pt[n]:.3e}"


def _inputs(B, Hq, Hkv, Sq, Sk, D, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, device="cuda", generator=g, dtype=torch.float32).to(dtype)
    return mk(B, Hq, Sq, D), mk(B, Hkv, Sk, D), mk(B, Hkv, Sk, D)


def _docs(S, seed=0, lo=1, hi=300):
    g = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < S:
        lengths.append(int(torch.randint(lo, hi + 1, (1,), generator=g)))
    lengths[-1] -= sum(lengths) - S
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)), lengths


MASKS = {
    "causal": lambda S: bsm.causal_mask,
    "sliding_200": lambda S: bsm.sliding_window_mask(200),
    "docs_causal": lambda S: bsm.document_mask(_docs(S)[0].cuda()) & bsm.causal_mask,
    "tiny_docs": lambda S: bsm.document_mask(_docs(S, 1, 1, 5)[0].cuda()),
    "prefix_lm": lambda S: bsm.prefix_lm_mask(333),
    "local_global": lambda S: bsm.local_global_mask(100, 17),
    "general": lambda S: lambda b, h, q, kv: ((q * 31 + kv * 17) % 7 != 0) & (kv <= q + 50),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(MASKS))
def test_triton_sparse_masks_against_oracle(name, dtype):
    S = 1000
    bm = longctx.block_mask(MASKS[name](S), None, None, S, S, block_size=128, device="cuda")
    q, k, v = _inputs(2, 8, 2, S, S, 64, dtype)
    _check(q, k, v, bm)


@pytest.mark.parametrize("density", [0.1, 0.5])
def test_triton_sparse_random_layout_per_head(density):
    g = torch.Generator().manual_seed(2)
    layout = (torch.rand(4, 9, 9, generator=g) < density).cuda()
    bm = longctx.BlockMask.from_layout(layout, 128, 1100, 1100)
    q, k, v = _inputs(1, 4, 4, 1100, 1100, 128, torch.bfloat16)
    _check(q, k, v, bm)


def test_triton_sparse_per_head_general_mask_sq_ne_sk_empty_rows():
    mm = lambda b, h, q, kv: ((q + 2 * kv + h) % 5 != 0) & (q % 13 != 4) & (kv < 400 + 100 * h)
    bm = longctx.block_mask(mm, None, 4, 300, 777, block_size=64, device="cuda")
    q, k, v = _inputs(1, 4, 1, 300, 777, 96, torch.float16)
    _check(q, k, v, bm)


def test_tiled_on_cuda_block_mask():
    S = 500
    bm = longctx.block_mask(bsm.sliding_window_mask(100), None, None, S, S, block_size=64, device="cuda")
    q, k, v = _inputs(1, 2, 1, S, S, 64, torch.bfloat16)
    _check(q, k, v, bm, backend="tiled")


def test_auto_picks_triton_sparse_for_block_masks():
    S = 256
    bm = longctx.block_mask(bsm.causal_mask, None, None, S, S, device="cuda")
    q, k, v = _inputs(1, 2, 2, S, S, 64, torch.bfloat16)
    assert longctx.explain(q, k, v, block_mask=bm).backend.name == "triton_sparse"
    assert longctx.explain(q, k, v).backend.name != "triton_sparse"


@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (-1, -1)), (False, (64, 32))])
def test_varlen_gpu_against_per_document_oracle(causal, window):
    from longctx.masks import Band

    lq = [1, 700, 3, 129, 1, 400, 50]
    lk = [1, 650, 9, 129, 5, 300, 80]
    cu = lambda L: torch.tensor([0] + torch.tensor(L).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(3)
    mk = lambda *s: torch.randn(*s, device="cuda", generator=g).to(torch.bfloat16)
    q, k, v = mk(sum(lq), 8, 128), mk(sum(lk), 2, 128), mk(sum(lk), 2, 128)
    do = mk(sum(lq), 8, 128)

    def per_doc(a, b, c, up):
        cq, ck = cu(lq).tolist(), cu(lk).tolist()
        outs = []
        for d in range(len(lq)):
            qd = a[cq[d] : cq[d + 1]].permute(1, 0, 2)[None]
            kd = b[ck[d] : ck[d + 1]].permute(1, 0, 2)[None]
            vd = c[ck[d] : ck[d + 1]].permute(1, 0, 2)[None]
            band = Band.from_args(lq[d], lk[d], causal, window)
            outs.append(naive_attention(qd, kd, vd, scale=128**-0.5, band=band, upcast=up)[0][0].permute(1, 0, 2))
        return torch.cat(outs)

    def grads(fn, dt):
        a, b, c = (t.detach().to(dt).requires_grad_() for t in (q, k, v))
        out = fn(a, b, c)
        out.backward(do.to(out.dtype))
        return [out.double(), a.grad.double(), b.grad.double(), c.grad.double()]

    ref = grads(lambda a, b, c: per_doc(a, b, c, torch.float64), torch.float64)
    low = grads(lambda a, b, c: per_doc(a, b, c, torch.bfloat16), torch.bfloat16)
    f = longctx.flash_attn_varlen_func
    ours = grads(
        lambda a, b, c: f(a, b, c, cu(lq), cu(lk), 700, 650, causal=causal, window_size=window), torch.bfloat16
    )
    for n, o, r, lo in zip(("out", "dq", "dk", "dv"), ours, ref, low):
        e, b = (o - r).abs().max().item(), (lo - r).abs().max().item()
        assert e <= 2 * b + 2e-3, f"varlen {n}: {e:.3e} vs {b:.3e}"


@pytest.mark.parametrize("name", ["sliding_200", "docs_causal", "general"])
def test_against_flex_attention(name):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    S = 1024
    mm = MASKS[name](S)
    bm = longctx.block_mask(mm, None, None, S, S, device="cuda")
    fbm = create_block_mask(mm, None, None, S, S, device="cuda")
    q, k, v = _inputs(1, 4, 4, S, S, 64, torch.bfloat16, seed=4)
    do = torch.randn_like(q)

    def grads(fn):
        a, b, c = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = fn(a, b, c)
        out.backward(do)
        return [out.float(), a.grad.float(), b.grad.float(), c.grad.float()]

    ours = grads(lambda a, b, c: longctx.attention(a, b, c, block_mask=bm, backend="triton_sparse"))
    flex = grads(lambda a, b, c: flex_attention(a, b, c, block_mask=fbm))
    ref = grads(
        lambda a, b, c: naive_attention(a.double(), b.double(), c.double(), scale=64**-0.5, mask=bm.dense_mask())[0]
    )
    for n, o, f, r in zip(("out", "dq", "dk", "dv"), ours, flex, ref):
        eo, ef = (o - r).abs().max().item(), (f - r).abs().max().item()
        assert eo <= 2 * ef + 2e-3, f"{name} {n}: ours {eo:.3e} vs flex {ef:.3e}"


def test_mask_build_64k_counts_the_documents_area():
    """A 64K-token causal-documents mask built on the GPU keeps exactly the documents' causal triangles (its build
    time is a benchmark figure: `longctx bench masks`, not a test threshold)."""
    S = 65536
    ids, lengths = _docs(S, 0, 512, 8192)
    mm = bsm.document_mask(ids.cuda()) & bsm.causal_mask
    bm = longctx.block_mask(mm, None, None, S, S, device="cuda")
    area = sum(L * (L + 1) // 2 for L in lengths)
    assert bm.kept_fraction() == pytest.approx(area / S**2, rel=1e-12)


@pytest.mark.parametrize("name", ["docs_causal", "general"])
def test_fullgraph_compile_block_mask(name):
    """torch.compile(fullgraph=True) (inductor) traces longctx.attention(block_mask=...) through the ops."""
    torch._dynamo.reset()
    S = 700
    bm = longctx.block_mask(MASKS[name](S), None, None, S, S, block_size=128, device="cuda")
    q, k, v = (t.requires_grad_() for t in _inputs(1, 4, 2, S, S, 64, torch.bfloat16, seed=6))

    @torch.compile(fullgraph=True)
    def f(q, k, v):
        return longctx.attention(q, k, v, block_mask=bm) * 2.0

    res = []
    for fn in (f, lambda a, b, c: longctx.attention(a, b, c, block_mask=bm, backend="triton_sparse") * 2.0):
        out = fn(q, k, v)
        res.append((out.float(), *(g.float() for g in torch.autograd.grad(out.float().square().sum(), (q, k, v)))))
    for n, a, b in zip(("out", "dq", "dk", "dv"), *res):
        assert (a - b).abs().max().item() <= 1e-2 * max(1.0, b.abs().max().item()), n


@pytest.mark.parametrize("name", ["docs_causal", "general", "layout"])
def test_triton_sparse_kernels_against_oracle(name):
    """The Triton kernels (the warp-specialised ones, which D=128 on Hopper takes by default, switched off;
    tests/gpu/test_hopper_block_sparse.py tests those), ragged S, GQA, D=128 so that the forward's descriptor
    loads are taken."""
    from longctx import tuning

    with tuning.override(sparse_ws=False, sparse_ws_bwd=False):
        _triton_sparse_against_oracle(name)


def _triton_sparse_against_oracle(name):
    S = 1000
    if name == "layout":
        layout = (torch.rand(4, 8, 8, generator=torch.Generator().manual_seed(3)) < 0.4).cuda()
        bm = longctx.BlockMask.from_layout(layout, 128, S, S)
    else:
        bm = longctx.block_mask(MASKS[name](S), None, None, S, S, block_size=128, device="cuda")
    q, k, v = _inputs(1, 4, 2, S, S, 128, torch.bfloat16, seed=8)
    _check(q, k, v, bm)

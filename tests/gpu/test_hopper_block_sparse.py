"""GPU tests of the warp-specialised block-sparse kernels (`kernels.flash_sparse_ws`, Gluon; Hopper only, skipped
elsewhere): against the float64 oracle with the equivalent dense mask (the 2x-of-PyTorch rule of
test_sparse_gpu.py), with a spy on the launchers so that a test fails if the inputs fell back to the Triton
kernels."""

from __future__ import annotations

import pytest
import torch

import longctx
from longctx import tuning
from longctx.launchers import sparse as ts
from tests.gpu.test_block_sparse_kernels import MASKS, _check, _inputs

pytestmark = pytest.mark.hopper


@pytest.fixture
def spy(monkeypatch, count_calls):
    """``spy()``: the warp-specialised launches so far, {"fwd": n, "bwd": m} (the D=256 dK / dV kernel's launcher
    counted as a backward; a compile failure noted by an earlier test is forgotten)."""
    monkeypatch.setattr(ts, "_WS_BROKEN", set())
    fwd, bwd, wide = (
        count_calls(ts, "_forward_ws"),
        count_calls(ts, "_backward_ws"),
        count_calls(ts, "_backward_ws_d256"),
    )
    return lambda: {"fwd": len(fwd), "bwd": len(bwd) + len(wide)}


def _block_mask(name, Sq, Sk, block_size=128, H=None):
    return longctx.block_mask(MASKS[name](max(Sq, Sk)), None, H, Sq, Sk, block_size=block_size, device="cuda")


@pytest.mark.parametrize("S", [1024, 1000])  # block-aligned (no bounds masks on full blocks) and ragged
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("name", list(MASKS))
def test_ws_masks_against_oracle(name, D, S, spy):
    bm = _block_mask(name, S, S)
    q, k, v = _inputs(2, 8, 2, S, S, D, torch.bfloat16, seed=11)
    _check(q, k, v, bm)
    assert spy() == {"fwd": 1, "bwd": 1}


@pytest.mark.parametrize("name", ["docs_causal", "general", "local_global"])
def test_ws_float16_mha(name, spy):
    bm = _block_mask(name, 777, 777)
    q, k, v = _inputs(1, 4, 4, 777, 777, 128, torch.float16, seed=12)
    _check(q, k, v, bm)
    assert spy() == {"fwd": 1, "bwd": 1}


@pytest.mark.parametrize("S", [1024, 1100])
@pytest.mark.parametrize("density", [0.1, 0.5])
def test_ws_random_layout_per_head_with_empty_rows(density, S, spy):
    g = torch.Generator().manual_seed(5)
    nb = -(-S // 128)
    layout = torch.rand(4, nb, nb, generator=g) < density
    layout[1, 2] = False  # a query block that sees nothing: output 0, lse -inf, no gradient
    layout[2, :, 3] = False  # a kv block nobody sees: dK = dV = 0
    bm = longctx.BlockMask.from_layout(layout.cuda(), 128, S, S)
    q, k, v = _inputs(1, 4, 4, S, S, 128, torch.bfloat16, seed=13)
    _check(q, k, v, bm)
    assert spy() == {"fwd": 1, "bwd": 1}


@pytest.mark.parametrize("D", [64, 256])
@pytest.mark.parametrize("name", ["docs_causal", "general"])
def test_ws_block_size_256(name, D, spy):
    """Several CTA tiles per mask block (forward: 2 query tiles and 2 key sub-tiles; backward: 4 query tiles)."""
    bm = _block_mask(name, 1300, 1300, block_size=256)
    q, k, v = _inputs(1, 4, 2, 1300, 1300, D, torch.bfloat16, seed=14)
    _check(q, k, v, bm)
    assert spy() == {"fwd": 1, "bwd": 1}


@pytest.mark.parametrize("D", [64, 256])
def test_ws_per_head_general_mask_sq_ne_sk_empty_rows(D, spy):
    mm = lambda b, h, q, kv: ((q + 2 * kv + h) % 5 != 0) & (q % 13 != 4) & (kv < 400 + 100 * h)
    bm = longctx.block_mask(mm, None, 4, 300, 777, block_size=128, device="cuda")
    q, k, v = _inputs(1, 4, 1, 300, 777, D, torch.float16, seed=15)
    _check(q, k, v, bm)
    assert spy() == {"fwd": 1, "bwd": 1}


def test_ws_varlen_sq_ne_sk(spy):
    """Packed documents through flash_attn_varlen_func (causal bottom-right per document, GQA)."""
    from tests.gpu.test_block_sparse_kernels import test_varlen_gpu_against_per_document_oracle

    test_varlen_gpu_against_per_document_oracle(True, (-1, -1))
    assert spy()["fwd"] >= 1 and spy()["bwd"] >= 1


def test_deterministic_backward_keeps_the_triton_kernels(spy):
    bm = _block_mask("docs_causal", 1024, 1024)
    q, k, v = (t.requires_grad_() for t in _inputs(1, 4, 2, 1024, 1024, 128, torch.bfloat16, seed=16))
    grads = []
    for det in (True, False):
        out = longctx.attention(q, k, v, block_mask=bm, backend="triton_sparse", deterministic=det)
        grads.append(torch.autograd.grad(out.float().square().sum(), (q, k, v)))
    assert spy() == {"fwd": 2, "bwd": 1}
    for a, b in zip(*grads):
        assert (a.float() - b.float()).abs().max().item() <= 2e-2 * max(1.0, b.float().abs().max().item())


@pytest.mark.parametrize("name", ["sliding_200", "docs_causal", "general"])
def test_ws_agrees_with_the_triton_kernels_at_4k(name, spy):
    """A longer sequence (many kv blocks per query block, deep rings) against the Triton kernels of the same
    backend (tested against the oracle in test_sparse_gpu.py)."""
    S = 4096
    bm = _block_mask(name, S, S)
    q, k, v = (t.requires_grad_() for t in _inputs(1, 8, 2, S, S, 128, torch.bfloat16, seed=17))
    do = torch.randn_like(q)
    res = []
    for off in (None, False):
        with tuning.override(sparse_ws=off, sparse_ws_bwd=off):
            out = longctx.attention(q, k, v, block_mask=bm, backend="triton_sparse")
            res.append((out.float(), *(g.float() for g in torch.autograd.grad(out, (q, k, v), do))))
    assert spy() == {"fwd": 1, "bwd": 1}
    for n, a, b in zip(("out", "dq", "dk", "dv"), *res):
        err = (a - b).abs().max().item()
        assert err <= 2e-2 * max(1.0, b.abs().max().item()), f"{n}: {err:.3e}"


@pytest.mark.parametrize("name,S", [("docs_causal", 1000), ("general", 1024), ("tiny_docs", 1024)])
def test_ws_work_ordered_schedule(name, S, spy):
    """The persistent CTAs in `_schedule`'s order on masks with items of very uneven work (S=1000: the forward's
    output rows past Sq clipped by the copy engine): the oracle's results."""
    bm = _block_mask(name, S, S)
    q, k, v = _inputs(2, 8, 2, S, S, 128, torch.bfloat16, seed=18)
    _check(q, k, v, bm)
    assert spy() == {"fwd": 1, "bwd": 1}


@pytest.mark.parametrize("D", [64, 128])
def test_ws_persistent_more_items_than_sms_gqa(D, spy):
    """Many more work items than SMs (every CTA takes tickets until they run out), GQA, per-head random layouts
    with empty rows and columns and rows of one and two blocks, against the Triton kernels (a forward item's Q
    buffer is freed once its output has left through it)."""
    S, Hq, Hkv = 4096, 16, 4
    n = S // 128
    lay = torch.rand(Hq, n, n, generator=torch.Generator().manual_seed(3)) < 0.3
    lay[:, 5] = False
    lay[:, :, 7] = False
    lay[:, 9] = False
    lay[:, 9, 3] = True
    lay[:, 11] = False
    lay[:, 11, 20:22] = True
    bm = longctx.BlockMask.from_layout(lay.cuda(), 128, S, S)
    q, k, v = (t.requires_grad_() for t in _inputs(2, Hq, Hkv, S, S, D, torch.bfloat16, seed=19))
    do = torch.randn_like(q)
    res = []
    for off in (None, False):
        with tuning.override(sparse_ws=off, sparse_ws_bwd=off):
            out = longctx.attention(q, k, v, block_mask=bm, backend="triton_sparse")
            res.append((out.float(), *(g.float() for g in torch.autograd.grad(out, (q, k, v), do))))
    assert spy() == {"fwd": 1, "bwd": 1}
    assert 2 * (S // 128) * Hq > 4 * torch.cuda.get_device_properties(0).multi_processor_count
    for nm, a, b in zip(("out", "dq", "dk", "dv"), *res):
        err = (a - b).abs().max().item()
        assert err <= 2e-2 * max(1.0, b.abs().max().item()), f"{nm}: {err:.3e}"


# Dense bands the tuning rule hands to the block-sparse kernels (`tuning.band_via_sparse`): at D=128 the forward at
# any band, the backward without grouped heads; Sq != Sk (bottom-right causal), windows, two-sided windows, a ring
# step's shifted band with rows that see nothing; float32 gradients and dlse as context parallelism asks for them.
BAND_CASES = [
    (1000, 1000, (None, 0)), (300, 2100, (None, 1800)), (2048, 2048, (-511, 0)), (1100, 900, (-77, 130)),
    (1024, 1024, (None, -600)),
]  # fmt: skip


@pytest.mark.parametrize("sq,sk,band", BAND_CASES, ids=str)
@pytest.mark.parametrize("hq,hkv", [(8, 2), (4, 4)], ids=str)
def test_dense_bands_taken_by_the_block_sparse_kernels(sq, sk, band, hq, hkv, spy):
    from longctx.launchers import flash as tf
    from longctx.masks import Band
    from longctx.reference.naive import naive_attention

    g = torch.Generator(device="cuda").manual_seed(sq + sk)
    q = torch.randn(2, hq, sq, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(2, hkv, sk, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    do = torch.randn_like(q)
    band, scale = Band(*band), 128**-0.5
    res = {}
    for routed in (True, False):
        with tuning.override(band_sparse=None if routed else False):
            out, lse = tf.triton_forward(q, k, v, scale=scale, band=band)
            dlse = torch.where(torch.isfinite(lse), 0.5, 0.0)
            grads = tf.triton_backward(
                do, q, k, v, out, lse, scale=scale, band=band, dlse=dlse, grad_dtype=torch.float32
            )
        res[routed] = (out, lse, *grads)
        # the rule's launches in the first pass, none more with the rule switched off
        assert spy() == {"fwd": 1, "bwd": int(hq == hkv)}, "the block-sparse kernels did not take the band as ruled"
    ref, ref_lse = naive_attention(q, k, v, scale=scale, band=band, upcast=torch.float64)
    fin = torch.isfinite(ref_lse)
    for routed in (True, False):
        out, lse = res[routed][:2]
        assert torch.equal(torch.isfinite(lse), fin) and torch.all(out[~fin] == 0)
        assert float((out.double() - ref).abs().max()) < 2e-2
        assert float((lse[fin].double() - ref_lse[fin]).abs().max()) < 1e-3
    for a, b in zip(res[True][2:], res[False][2:]):
        assert a.dtype == torch.float32 and torch.isfinite(a).all()
        assert float((a - b).abs().max()) <= 2e-2 * float(b.abs().max()) + 1e-3

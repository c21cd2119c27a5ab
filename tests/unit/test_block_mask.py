"""Block-sparse masks (longctx.block_mask / BlockMask) and the tiled backend's block-sparse path (CPU lane)."""

from __future__ import annotations

import pytest
import torch

import longctx
import longctx.masks as bsm
from longctx.masks import Band
from longctx.reference.naive import naive_attention


def _grid(mm, b=0, h=0, sq=100, sk=100):
    return mm(torch.tensor(b), torch.tensor(h), torch.arange(sq)[:, None], torch.arange(sk)[None, :]).expand(sq, sk)


def _inputs(B, Hq, Hkv, Sq, Sk, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Sq, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    k = torch.randn(B, Hkv, Sk, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    v = torch.randn(B, Hkv, Sk, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    return q, k, v


def _fwd_bwd(fn, q, k, v, go, gl):
    out, lse = fn(q, k, v)
    finite = torch.isfinite(lse)
    loss = (out.double() * go).sum() + (torch.where(finite, lse, 0).double() * gl).sum()
    grads = torch.autograd.grad(loss, (q, k, v))
    return [out.double(), torch.where(finite, lse, 0).double(), *[g.double() for g in grads]], finite


def check_against_oracle(q, k, v, bm, *, band=Band(), backend="tiled"):
    """FlashAttention rule: error <= 2 * error of PyTorch in q's dtype + floor, for out, lse, dq, dk, dv."""
    scale = q.shape[-1] ** -0.5
    mask = bm.dense_mask()
    g = torch.Generator().manual_seed(1)
    go = torch.randn(q.shape, generator=g, dtype=torch.float64)
    gl = torch.randn(q.shape[:-1], generator=g, dtype=torch.float64)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, fin_ref = _fwd_bwd(
        lambda a, b, c: naive_attention(a, b, c, scale=scale, band=band, mask=mask), q64, k64, v64, go, gl
    )
    low, _ = _fwd_bwd(lambda a, b, c: naive_attention(a, b, c, scale=scale, band=band, mask=mask), q, k, v, go, gl)
    ours, fin = _fwd_bwd(
        lambda a, b, c: (
            longctx.attention(
                a, b, c, block_mask=bm, causal=False, backend=backend, return_lse=True, window=None, scale=scale
            )
            if band.is_dense
            else _with_band(a, b, c, bm, band, backend, scale)
        ),
        q,
        k,
        v,
        go,
        gl,
    )
    assert torch.equal(fin, fin_ref), "rows with no visible key must have lse -inf exactly where the oracle has"
    names = ["out", "lse", "dq", "dk", "dv"]
    floor = 1e-12 if q.dtype == torch.float64 else 1e-5
    for name, o, r, lo in zip(names, ours, ref, low):
        assert torch.isfinite(o).all(), f"{name} has non-finite values"
        err = (o - r).abs().max().item()
        base = (lo - r).abs().max().item()
        assert err <= 2 * base + floor, f"{name}: error {err:.3g} vs PyTorch's {base:.3g}"


def _with_band(q, k, v, bm, band, backend, scale):
    from longctx.dispatch import get_backend

    return get_backend(backend).run(q, k, v, scale=scale, band=band, return_lse=True, block_mask=bm)


READY = {
    "causal": lambda S: bsm.causal_mask,
    "sliding": lambda S: bsm.sliding_window_mask(23),
    "docs_causal": lambda S: (
        bsm.document_mask(torch.tensor([0] * 1 + [1] * 40 + [2] * 3 + [3] * (S - 44))) & bsm.causal_mask
    ),
    "docs": lambda S: bsm.document_mask(torch.tensor([0] * 5 + [1] * (S - 30) + [2] * 25)),
    "prefix_lm": lambda S: bsm.prefix_lm_mask(37),
    "local_global": lambda S: bsm.local_global_mask(9, 5),
}


@pytest.mark.parametrize("name", list(READY))
@pytest.mark.parametrize("bs", [16, 32])
def test_ready_made_blocks_match_mask_mod(name, bs):
    S = 113
    mm = READY[name](S)
    bm = longctx.block_mask(mm, None, None, S, S, block_size=bs, device="cpu")
    assert bm.analytic is not None
    dense = _grid(mm, sq=S, sk=S)
    assert torch.equal(bm.dense_mask()[0, 0], dense)
    # the general path (plain callable) must classify every block identically
    gen = longctx.block_mask(mm.fn, None, None, S, S, block_size=bs, device="cpu")
    assert gen.analytic is None and torch.equal(gen.block_kind, bm.block_kind)
    assert torch.equal(gen.dense_mask()[0, 0], dense)
    assert abs(bm.kept_fraction() - dense.double().mean().item()) < 1e-12
    # classification is exact: empty blocks have no visible entry, full blocks no masked one
    nq, nk = bm.num_blocks
    for qb in range(nq):
        for kb in range(nk):
            tile = dense[qb * bs : qb * bs + bs, kb * bs : kb * bs + bs]
            kind = int(bm.block_kind[0, 0, qb, kb])
            assert kind == (1 if tile.all() else 0 if not tile.any() else 2)


def test_lists_and_transposed_lists_agree():
    S, bs = 200, 16
    mm = bsm.MaskMod(lambda b, h, q, kv: ((q * 7 + kv * 3 + h) % 5 != 0) & (kv <= q + 40))
    bm = longctx.block_mask(mm, 2, 3, S, S, block_size=bs, device="cpu")
    kind = bm.block_kind
    for b in range(2):
        for h in range(3):
            for qb in range(bm.num_blocks[0]):
                n = int(bm.kv_num_blocks[b, h, qb])
                assert bm.kv_indices[b, h, qb, :n].tolist() == (kind[b, h, qb] == 2).nonzero().flatten().tolist()
                n = int(bm.full_kv_num_blocks[b, h, qb])
                assert bm.full_kv_indices[b, h, qb, :n].tolist() == (kind[b, h, qb] == 1).nonzero().flatten().tolist()
            for kb in range(bm.num_blocks[1]):
                n = int(bm.q_num_blocks[b, h, kb])
                assert bm.q_indices[b, h, kb, :n].tolist() == (kind[b, h, :, kb] == 2).nonzero().flatten().tolist()
                n = int(bm.full_q_num_blocks[b, h, kb])
                assert bm.full_q_indices[b, h, kb, :n].tolist() == (kind[b, h, :, kb] == 1).nonzero().flatten().tolist()


@pytest.mark.parametrize("name", list(READY))
def test_tiled_ready_made_against_oracle(name):
    S = 113
    bm = longctx.block_mask(READY[name](S), None, None, S, S, block_size=32, device="cpu")
    q, k, v = _inputs(2, 4, 2, S, S, 24, torch.float32, seed=hash(name) % 1000)
    check_against_oracle(q, k, v, bm)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_tiled_per_head_mask_rows_with_nothing_visible_gqa(dtype):
    # per-head and per-batch mask with some query rows that see nothing, Sq != Sk, GQA (4 q heads on 1 kv head)
    Sq, Sk = 70, 97

    def mm(b, h, q, kv):
        return ((q + kv + h + b) % 3 == 0) & (q % 11 != 3) & (kv < 60 + 10 * h)

    bm = longctx.block_mask(mm, 2, 4, Sq, Sk, block_size=16, device="cpu")
    assert bm.block_kind.shape[:2] == (2, 4)
    q, k, v = _inputs(2, 4, 1, Sq, Sk, 16, dtype)
    check_against_oracle(q, k, v, bm)


@pytest.mark.parametrize("density", [0.1, 0.5])
def test_tiled_random_layout(density):
    g = torch.Generator().manual_seed(3)
    layout = torch.rand(2, 6, 7, generator=g) < density  # per head
    bm = longctx.BlockMask.from_layout(layout, 16, seq_len_q=90, seq_len_kv=100)
    assert bm.kv_num_blocks.sum() == 0  # only full blocks
    dense = bm.dense_mask()[0]
    assert torch.equal(dense, layout.repeat_interleave(16, 1).repeat_interleave(16, 2)[:, :90, :100])
    q, k, v = _inputs(1, 2, 2, 90, 100, 8, torch.float32)
    check_against_oracle(q, k, v, bm)


def test_tiled_block_mask_with_band_and_math_backend_agree():
    S = 80
    bm = longctx.block_mask(bsm.local_global_mask(10, 3), None, None, S, S, block_size=16, device="cpu")
    q, k, v = _inputs(1, 2, 2, S, S, 8, torch.float64)
    check_against_oracle(q, k, v, bm, band=Band(hi=0))
    a = longctx.attention(q, k, v, block_mask=bm, backend="math")
    b = longctx.attention(q, k, v, block_mask=bm, backend="tiled")
    assert torch.allclose(a, b, atol=1e-12)


def test_tiled_skips_empty_blocks():
    S, bs = 256, 32
    bm = longctx.block_mask(bsm.sliding_window_mask(32), None, None, S, S, block_size=bs, device="cpu")
    n = int((bm.block_kind != 0).sum())
    assert n == 8 + 7  # the diagonal and one block below it
    calls = []
    orig = torch.matmul

    def counting(a, b, *args, **kw):
        calls.append(1)
        return orig(a, b, *args, **kw)

    q, k, v = _inputs(1, 1, 1, S, S, 8, torch.float32)
    torch.matmul = counting
    try:
        longctx.attention(q, k, v, block_mask=bm, backend="tiled")
    finally:
        torch.matmul = orig
    assert len(calls) == 2 * n


def test_repr_density_and_sparsity():
    bm = longctx.block_mask(bsm.causal_mask, None, None, 64, 64, block_size=16, device="cpu")
    r = repr(bm)
    assert "full=6" in r and "partial=4" in r and "empty=6" in r and "analytic" in r
    assert abs(bm.block_density() - 10 / 16) < 1e-12 and abs(bm.sparsity - 37.5) < 1e-9
    assert abs(bm.kept_fraction() - (64 * 65 / 2) / 64**2) < 1e-12


def test_and_masks_keep_fast_path_and_or_masks_general():
    ids = torch.tensor([0] * 30 + [1] * 34)
    m = bsm.and_masks(bsm.document_mask(ids), bsm.sliding_window_mask(8))
    assert m.analytic is not None and m.analytic.lo == -7 and m.analytic.hi == 0
    bm = longctx.block_mask(m, None, None, 64, 64, block_size=16, device="cpu")
    assert torch.equal(bm.dense_mask()[0, 0], _grid(m, sq=64, sk=64))
    o = bsm.or_masks(bsm.causal_mask, bsm.prefix_lm_mask(3))
    assert o.analytic is None
    bo = longctx.block_mask(o, None, None, 64, 64, block_size=16, device="cpu")
    assert torch.equal(bo.dense_mask()[0, 0], _grid(o, sq=64, sk=64))


def test_batched_document_ids():
    ids = torch.stack([torch.tensor([0] * 20 + [1] * 28), torch.tensor([0] * 5 + [1] * 43)])
    mm = bsm.document_mask(ids) & bsm.causal_mask
    bm = longctx.block_mask(mm, 2, None, 48, 48, block_size=16, device="cpu")
    assert bm.block_kind.shape[0] == 2
    for b in range(2):
        assert torch.equal(bm.dense_mask()[b, 0], _grid(mm, b=b, sq=48, sk=48))
    q, k, v = _inputs(2, 2, 1, 48, 48, 8, torch.float32)
    check_against_oracle(q, k, v, bm)


def test_bad_inputs():
    bm = longctx.block_mask(lambda b, h, q, kv: q >= kv + h, None, 2, 64, 64, block_size=16, device="cpu")
    q, k, v = _inputs(1, 4, 2, 64, 64, 8, torch.float32)
    with pytest.raises(ValueError, match="heads"):
        longctx.attention(q, k, v, block_mask=bm)
    bm = longctx.block_mask(bsm.causal_mask, None, None, 64, 32, block_size=16, device="cpu")
    with pytest.raises(ValueError, match="Sq=64, Sk=32"):
        longctx.attention(q, k, v, block_mask=bm)
    bm = longctx.block_mask(lambda b, h, q, kv: q >= kv + b, 3, None, 64, 64, block_size=16, device="cpu")
    q2, k2, v2 = _inputs(2, 4, 2, 64, 64, 8, torch.float32)
    with pytest.raises(ValueError, match="batch"):
        longctx.attention(q2, k2, v2, block_mask=bm)
    with pytest.raises(TypeError, match="callable"):
        longctx.block_mask("causal", None, None, 64, 64)
    with pytest.raises(TypeError, match="bool tensor"):
        longctx.block_mask(lambda b, h, q, kv: q - kv, None, None, 64, 64, device="cpu")
    with pytest.raises(ValueError, match="block_size"):
        longctx.block_mask(bsm.causal_mask, None, None, 64, 64, block_size=0)
    with pytest.raises(ValueError, match="window"):
        bsm.sliding_window_mask(0)
    with pytest.raises(ValueError, match="does not match"):
        longctx.BlockMask.from_layout(torch.ones(3, 3, dtype=torch.bool), 16, seq_len_q=100)
    with pytest.raises(ValueError, match="length"):
        longctx.block_mask(bsm.document_mask(torch.zeros(10, dtype=torch.long)), None, None, 64, 64, device="cpu")


def _interval_cases():
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor([1, 7, 30, 12]))
    for lo, hi in [(None, 0), (None, None), (-5, 0), (-3, 2), (2, 5)]:
        yield f"docs[{lo},{hi}]", bsm.DocBand(q_doc=ids, k_doc=ids, lo=lo, hi=hi), 50, 50
        yield f"band[{lo},{hi}]", bsm.DocBand(lo=lo, hi=hi), 37, 53
    # Sq != Sk per document, bottom-right aligned positions (the varlen rule)
    qlen, klen = torch.tensor([3, 10, 1]), torch.tensor([5, 10, 4])
    qd, kd = torch.repeat_interleave(torch.arange(3), qlen), torch.repeat_interleave(torch.arange(3), klen)
    qs, ks = torch.cumsum(qlen, 0) - qlen, torch.cumsum(klen, 0) - klen
    qp, kp = torch.arange(14) - qs[qd] + (klen - qlen)[qd], torch.arange(19) - ks[kd]
    yield "varlen causal", bsm.DocBand(q_doc=qd, k_doc=kd, q_pos=qp, k_pos=kp, hi=0), 14, 19
    yield "varlen window", bsm.DocBand(q_doc=qd, k_doc=kd, q_pos=qp, k_pos=kp, lo=-2, hi=0), 14, 19
    # a query document with no keys
    yield "missing doc", bsm.DocBand(q_doc=torch.tensor([0, 0, 1, 1, 2, 2]), k_doc=torch.tensor([0, 0, 2, 2])), 6, 4
    two = torch.stack([ids, torch.repeat_interleave(torch.arange(2), torch.tensor([25, 25]))])
    yield "per-batch docs", bsm.DocBand(q_doc=two, k_doc=two, hi=0), 50, 50


@pytest.mark.parametrize("name,rule,sq,sk", list(_interval_cases()), ids=[c[0] for c in _interval_cases()])
def test_docband_intervals_match_the_rule(name, rule, sq, sk):
    """`DocBand.intervals` (what MASK_KIND 3 kernels test): per query the keys it sees, per key the queries that
    see it, each exactly the rule's visible set."""
    row_lo, col_lo, row_hi, col_hi = rule.intervals(sq, sk, "cpu")
    qd, kd, qp, kp = rule.tensors(sq, sk, "cpu")
    qi, kj = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    for b in range(qd.shape[0]):
        ref = rule.visible(qd[b][:, None], kd[b][None, :], qp[b][:, None], kp[b][None, :], qi, kj)
        assert torch.equal((kj >= row_lo[b][:, None]) & (kj <= row_hi[b][:, None]), ref)
        assert torch.equal((qi >= col_lo[b][None, :]) & (qi <= col_hi[b][None, :]), ref)


def test_docband_intervals_only_where_the_rule_is_one():
    """Interleaved documents or global tokens keep the general rule (kernel mask_kind 1); packed documents and
    bands take the intervals (mask_kind 3)."""
    assert (
        bsm.DocBand(q_doc=torch.tensor([0, 1, 0, 1]), k_doc=torch.tensor([0, 1, 0, 1]), hi=0).intervals(4, 4, "cpu")
        is None
    )
    assert bsm.DocBand(hi=0, kv_global=2).intervals(8, 8, "cpu") is None
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor([100, 200, 212]))
    packed = longctx.block_mask(bsm.document_mask(ids) & bsm.causal_mask, None, None, 512, 512, block_size=128)
    assert packed.kernel_meta()[3] == 3
    lg = longctx.block_mask(bsm.local_global_mask(64, 16), None, None, 512, 512, block_size=128)
    assert lg.kernel_meta()[3] == 1


def test_band_block_mask_is_the_band():
    """The mask the dense launchers hand to the block-sparse kernels: every element as `Band` says, for causal,
    bottom-right causal, windows and shifted bands with rows that see nothing."""
    from longctx.masks import Band
    from longctx.masks.build import band_block_mask

    cases = [
        (150, 150, Band(None, 0)), (40, 300, Band(None, 260)), (300, 300, Band(-20, 0)), (130, 257, Band(-30, 25)),
        (256, 256, Band(None, -130)), (100, 150, Band(-500, 500)),
    ]  # fmt: skip
    for sq, sk, band in cases:
        bm = band_block_mask(band, sq, sk, 128, torch.device("cpu"))
        assert torch.equal(bm.dense_mask(), band.dense_mask(sq, sk)[None, None]), band


def test_kept_band_masks_are_bounded_by_their_size(monkeypatch):
    from longctx.launchers import sparse

    monkeypatch.setattr(sparse, "_BAND_MASKS", type(sparse._BAND_MASKS)())
    monkeypatch.setattr(sparse, "_BAND_MASKS_BLOCKS", 20)  # blocks in all: 16 (512 x 512) + 4 (256 x 256)
    cpu = torch.device("cpu")
    a = sparse.band_mask(512, 512, None, 0, cpu)
    assert sparse.band_mask(512, 512, None, 0, cpu) is a  # kept: every layer takes the same mask
    b = sparse.band_mask(256, 256, -10, 0, cpu)
    assert list(sparse._BAND_MASKS.values()) == [a, b]
    c = sparse.band_mask(256, 256, -20, 0, cpu)  # 24 blocks: the oldest goes
    assert list(sparse._BAND_MASKS.values()) == [b, c]
    big = sparse.band_mask(1024, 1024, None, 0, cpu)  # larger than the bound alone: kept, the others go
    assert list(sparse._BAND_MASKS.values()) == [big]

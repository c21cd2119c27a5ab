"""The mask catalogue (`longctx.masks.catalogue`): every generator's mask_mod, block mask, band and kept area
against its dense definition, on lengths that cut the last block."""

from __future__ import annotations

import pytest
import torch

from longctx.masks import CATALOGUE, SEEDED_MASKS, Band, doc_lengths, make_mask, mask_names
from longctx.reference.naive import naive_attention

# small parameters so that every feature of a mask shows at these lengths (documents of several blocks, windows
# shorter than S, blocks of the block-causal mask inside documents)
PARAMS = {"window": 37, "block": 24, "global_tokens": 9, "block_size": 32, "cap": 300}
LENGTHS = (1, 113, 1000)


def _mask_mod_dense(m) -> torch.Tensor:
    S = m.S
    q, k = torch.arange(S)[:, None], torch.arange(S)[None, :]
    return m.mask_mod(torch.tensor(0), torch.tensor(0), q, k).expand(S, S)


@pytest.mark.parametrize("S", LENGTHS)
@pytest.mark.parametrize("name", mask_names())
def test_generator_agrees_with_dense_definition(name, S):
    m = make_mask(name, S, seed=3, **PARAMS)
    dense = m.dense()
    assert dense.shape == (S, S) and dense.dtype == torch.bool
    assert torch.equal(_mask_mod_dense(m), dense), "mask_mod"
    bm = m.block_mask("cpu")
    assert torch.equal(bm.dense_mask()[0, 0], dense), "block mask"
    assert m.kept_area() == int(dense.sum()), "kept area"
    assert abs(bm.kept_fraction() - m.kept_fraction()) < 1e-12
    if m.band is not None:
        assert torch.equal(m.band.dense_mask(S, S), dense), "band"
        kw = m.attention_kwargs()
        assert Band.from_args(S, S, causal=kw.get("causal", False), window=kw.get("window")) == m.band
    if m.causal:
        assert not dense.triu(1).any()
    if m.doc_lengths is not None:
        assert sum(m.doc_lengths) == S and min(m.doc_lengths) >= 1
        assert max(m.doc_lengths) <= PARAMS["cap"]


def test_masks_are_what_their_names_say():
    """Spot checks of the definitions themselves, on hand-made cases (the dense definitions are the oracle above)."""
    S = 1000
    sq = make_mask("share_question", S, seed=0, cap=300, answers=2)
    d = sq.dense()
    first = sq.doc_lengths[0]
    qn = first // 4
    a1 = (first - qn + 1) // 2
    assert d[qn + a1, qn - 1] and d[qn + a1, qn + a1]  # the second answer sees the question and itself
    assert not d[qn + a1, qn]  # ... but not the first answer
    cb = make_mask("causal_blockwise", S, seed=0, cap=300)
    d = cb.dense()
    last0 = S - cb.doc_lengths[-1]
    assert d[S - 1, 0] and d[last0, 0] and not d[cb.doc_lengths[0], 0]
    pl = make_mask("prefix_lm_document", S, seed=0, cap=300).dense()
    assert pl[0, 1]  # a prefix token sees the next one
    bc = make_mask("block_causal_document", S, seed=0, cap=300, block=24).dense()
    assert bc[0, 23] and not bc[0, 24]
    gs = make_mask("global_sliding_window", S, window=37, global_tokens=9).dense()
    assert gs[999, 0] and gs[0, 999] and gs[500, 536] and not gs[500, 537]
    bs = make_mask("block_sparse_30", 4096, block_size=128)
    assert abs(bs.kept_fraction() - 0.3) < 0.03


@pytest.mark.parametrize("name", sorted(SEEDED_MASKS))
def test_seeds_give_different_documents_and_the_same_seed_the_same(name):
    a, b, c = (make_mask(name, 4096, seed=s) for s in (0, 1, 0))
    assert a.doc_lengths != b.doc_lengths and a.doc_lengths == c.doc_lengths
    assert a.kept_area() != b.kept_area()


def test_doc_lengths_are_long_tailed_and_capped():
    L = torch.tensor(doc_lengths(1 << 20, seed=0, cap=1 << 18), dtype=torch.float64)
    assert int(L.sum()) == 1 << 20 and int(L.max()) <= 1 << 18
    med, mean = float(L.median()), float(L.mean())
    assert 700 < med < 1400  # the median of the law
    assert mean > 1.5 * med  # a long tail pulls the mean above the median
    assert float(L.max()) > 10 * med
    assert doc_lengths(65536, seed=0)[:5] == doc_lengths(65536, seed=0)[:5]
    assert max(doc_lengths(65536, seed=2)) <= 65536 // 4  # default cap: a quarter of S


def test_analytic_masks_build_without_a_dense_pass():
    """The document masks with positions (prefix-LM per document, block-causal) keep longctx's analytic rule, so the
    builder classifies them in O(blocks); the general masks store tiles."""
    for name in ("causal_document", "prefix_lm_document", "block_causal_document", "causal_sliding_window"):
        assert make_mask(name, 512, seed=0).block_mask("cpu").analytic is not None, name
    for name in ("share_question", "causal_blockwise"):
        assert make_mask(name, 512, seed=0).block_mask("cpu").tiles is not None, name


def test_attention_with_a_catalogue_mask_matches_the_dense_oracle():
    """One mask end to end: longctx.attention with the catalogue's block mask equals the float64 oracle on the dense
    definition (the benchmark's FLOPs count exactly the pairs attention computes)."""
    import longctx

    m = make_mask("prefix_lm_document", 300, seed=1, cap=100)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 300, 16, generator=g, dtype=torch.float64) for _ in range(3))
    out = longctx.attention(q, k, v, block_mask=m.block_mask("cpu"), backend="tiled")
    ref, _ = naive_attention(q, k, v, scale=16**-0.5, band=Band(), mask=m.dense())
    torch.testing.assert_close(out, ref)


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="unknown mask 'causual'.*causal"):
        make_mask("causual", 128)
    with pytest.raises(ValueError, match="window must be >= 1"):
        make_mask("sliding_window", 128, window=0)
    with pytest.raises(ValueError, match="density must be in"):
        make_mask("block_sparse_10", 128, density=1.5)
    with pytest.raises(TypeError, match="S must be an int"):
        make_mask("causal", 12.0)
    with pytest.raises(ValueError, match="not a band"):
        make_mask("causal_document", 128).attention_kwargs()
    assert set(CATALOGUE) == set(mask_names()) and len(CATALOGUE) >= 15

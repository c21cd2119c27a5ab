"""The Band: one rule for causal and window masks, at element, tile and matrix granularity."""

from __future__ import annotations

import itertools

import pytest
import torch

from longctx.masks import Band, TileKind


def _rule(i, j, Sq, Sk, causal, left, right):
    off = Sk - Sq
    ok = True
    if causal:
        ok &= j <= i + off
    if left >= 0:
        ok &= j >= i + off - left
    if right >= 0 and not causal:
        ok &= j <= i + off + right
    return ok


@pytest.mark.parametrize(
    "Sq,Sk,causal,window",
    [(5, 5, True, None), (3, 7, True, None), (7, 3, True, None), (6, 6, False, (2, 1)), (4, 9, True, (3, 0))],
)
def test_dense_mask_matches_the_documented_rule(Sq, Sk, causal, window):
    band = Band.from_args(Sq, Sk, causal, window)
    left, right = window or (-1, -1)
    m = band.dense_mask(Sq, Sk)
    for i, j in itertools.product(range(Sq), range(Sk)):
        assert bool(m[i, j]) == _rule(i, j, Sq, Sk, causal, left, right), (i, j)


def test_tile_kind_agrees_with_elements():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        Sq, Sk = (int(x) for x in torch.randint(1, 40, (2,), generator=g))
        lo = None if torch.rand(1, generator=g) < 0.3 else int(torch.randint(-30, 30, (1,), generator=g))
        hi = None if torch.rand(1, generator=g) < 0.3 else int(torch.randint(-30, 30, (1,), generator=g))
        band = Band(lo, hi)
        m = band.dense_mask(Sq, Sk)
        qs = int(torch.randint(0, Sq, (1,), generator=g))
        ks = int(torch.randint(0, Sk, (1,), generator=g))
        qe, ke = min(Sq, qs + 7), min(Sk, ks + 5)
        sub = m[qs:qe, ks:ke]
        kind = band.tile_kind(qs, qe, ks, ke)
        expected = TileKind.EMPTY if not sub.any() else TileKind.FULL if sub.all() else TileKind.PARTIAL
        assert kind == expected, (band, qs, qe, ks, ke)
        k0, k1 = band.key_range(qs, qe, Sk)
        cols = sub.any(0).nonzero().flatten() + ks
        if len(cols):
            assert k0 <= int(cols.min()) and int(cols.max()) < k1
        assert abs(band.kept_fraction(Sq, Sk) - float(m.double().mean())) < 1e-12


def test_shifted_band_is_the_global_rule_in_local_indices():
    S = 24
    band = Band.from_args(S, S, causal=True, window=(5, 0))
    full = band.dense_mask(S, S)
    for qs, ks in [(8, 0), (0, 8), (16, 8), (8, 16)]:
        local = band.shifted(qs - ks).dense_mask(8, 8)
        assert torch.equal(local, full[qs : qs + 8, ks : ks + 8])


def test_within_unbounds_only_the_sides_a_call_never_reaches():
    """`Band.within(Sq, Sk)`: the same mask of the call's Sq x Sk scores, with a side that masks nothing unbounded
    (so a window as wide as the sequence reaches the backends as plain causal, or as no mask)."""
    for Sq, Sk in [(5, 5), (3, 7), (7, 3), (1, 6)]:
        for lo in [None, *range(-Sq - 2, 3)]:
            for hi in [None, *range(-2, Sk + 2)]:
                band = Band(lo, hi)
                narrowed = band.within(Sq, Sk)
                assert torch.equal(narrowed.dense_mask(Sq, Sk), band.dense_mask(Sq, Sk)), (Sq, Sk, lo, hi)
                if lo is not None and lo > -(Sq - 1) and not band.is_empty:
                    assert narrowed.lo == lo
                if hi is not None and hi < Sk - 1 and not band.is_empty:
                    assert narrowed.hi == hi
    # transformers' call for a sliding-window model at a length no longer than the window: plain causal
    assert Band.from_args(4096, 4096, causal=True, window=(4095, 4095)).within(4096, 4096) == Band(None, 0)
    assert Band.from_args(8, 8, causal=True, window=(3, 3)).within(8, 8) == Band(-3, 0)


def test_attention_takes_a_window_as_wide_as_the_sequence_as_none():
    from longctx.api.core import _resolve

    q = torch.randn(1, 2, 16, 8)
    _, band, _ = _resolve(q, q, q, True, (15, 15), None, "auto", False, False, None)
    assert band == Band(None, 0)
    _, band, _ = _resolve(q, q, q, False, (15, 15), None, "auto", False, False, None)
    assert band.is_dense
    _, band, _ = _resolve(q, q, q, True, (14, 14), None, "auto", False, False, None)
    assert band == Band(-14, 0)

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

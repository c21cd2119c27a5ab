"""Block planning and lse merging shared by the context-parallel methods.

A rank's local sequence is a list of chunks ``(local_start, length, global_start)`` (`sharding.local_chunks`).
Attention between a local query chunk at global position ``qs`` and a key chunk at ``ks`` is an ordinary
attention call with the global band shifted by ``qs - ks`` (`Band.shifted`). `plan_calls` classifies every
(query chunk, key chunk) pair with `Band.tile_kind`, drops the pairs the mask removes entirely and fuses pairs
that need no mask into as few launcher calls as possible (under zigzag causal a remote step is one call).

Packed documents (`Documents`): the mask is "same document, and the band in document-local positions". Every
chunk is cut at the document boundaries into pieces that lie in one document; a query piece meets only the key
pieces of its own document, each pair an ordinary band call (document offsets cancel: both sides of a pair are
in one document, so ``j - i`` is the same in global and in document positions). The calls are cached: every
layer and both passes reuse them.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

import torch

from longctx.masks import Band, TileKind

__all__ = [
    "Call",
    "Documents",
    "plan_calls",
    "gather_calls",
    "doc_token_areas",
    "merge_into",
    "merge_partial",
    "accumulate",
    "Cover",
]

Chunk = tuple[int, int, int]  # (local_start, length, global_start)


@dataclass(frozen=True)
class Call:
    """One launcher call: local queries [q0, q1) against local keys [k0, k1) of the current K/V, with ``band``."""

    q0: int
    q1: int
    k0: int
    k1: int
    band: Band


@dataclass(frozen=True)
class Documents:
    """Packed documents: key j is visible to query i iff both lie in one document and ``band`` (lo <= j - i <= hi)
    holds. ``cu``: 0, then the cumulative document lengths (flash-attn's cu_seqlens), ending at the total."""

    cu: tuple[int, ...]
    band: Band

    def doc_of(self, pos: int) -> int:
        """The document holding global position ``pos`` (zero-length documents hold nothing)."""
        return bisect.bisect_right(self.cu, pos) - 1

    def pieces(self, chunks: list[Chunk]) -> list[tuple[int, int, int, int]]:
        """The chunks cut at document boundaries: ``(local_start, length, global_start, doc)``, in local order."""
        out = []
        for ls, n, g in chunks:
            pos = g
            while pos < g + n:
                d = self.doc_of(pos)
                end = min(g + n, self.cu[d + 1])
                out.append((ls + pos - g, end - pos, pos, d))
                pos = end
        return out


Mask = Band | Documents


def plan_calls(band: Mask, q_chunks: list[Chunk], k_chunks: list[Chunk]) -> list[Call]:
    """The launcher calls that compute attention of the local queries against one rank's K/V chunks."""
    if isinstance(band, Documents):
        return list(_doc_calls(band, tuple(q_chunks), tuple(k_chunks)))
    nq, nk = len(q_chunks), len(k_chunks)
    kinds = [[band.shifted(qg - kg).tile_kind(0, qn, 0, kn) for (_, kn, kg) in k_chunks] for (_, qn, qg) in q_chunks]
    q_all = (q_chunks[0][0], q_chunks[-1][0] + q_chunks[-1][1])
    k_all = (k_chunks[0][0], k_chunks[-1][0] + k_chunks[-1][1])
    dense = Band()
    if all(kd is TileKind.FULL for row in kinds for kd in row):
        return [Call(*q_all, *k_all, dense)]
    calls: list[Call] = []
    done = [[kinds[i][j] is TileKind.EMPTY for j in range(nk)] for i in range(nq)]
    if nq > 1:  # a key chunk that every query chunk sees entirely: one call with all the queries
        for j, (kl, kn, _) in enumerate(k_chunks):
            if all(kinds[i][j] is TileKind.FULL for i in range(nq)):
                calls.append(Call(*q_all, kl, kl + kn, dense))
                for i in range(nq):
                    done[i][j] = True
    if nk > 1:  # a query chunk that sees every key chunk entirely: one call with all the keys
        for i, (ql, qn, _) in enumerate(q_chunks):
            if all(kinds[i][j] is TileKind.FULL and not done[i][j] for j in range(nk)):
                calls.append(Call(ql, ql + qn, *k_all, dense))
                for j in range(nk):
                    done[i][j] = True
    for i, (ql, qn, qg) in enumerate(q_chunks):
        for j, (kl, kn, kg) in enumerate(k_chunks):
            if not done[i][j]:
                b = dense if kinds[i][j] is TileKind.FULL else band.shifted(qg - kg)
                calls.append(Call(ql, ql + qn, kl, kl + kn, b))
    return calls


@functools.lru_cache(maxsize=4096)
def _doc_calls(docs: Documents, q_chunks: tuple[Chunk, ...], k_chunks: tuple[Chunk, ...]) -> tuple[Call, ...]:
    by_doc: dict[int, list[tuple[int, int, int]]] = {}
    for kl, kn, kg, d in docs.pieces(list(k_chunks)):
        by_doc.setdefault(d, []).append((kl, kn, kg))
    dense, calls = Band(), []
    for ql, qn, qg, d in docs.pieces(list(q_chunks)):
        for kl, kn, kg in by_doc.get(d, ()):
            b = docs.band.shifted(qg - kg)
            kind = b.tile_kind(0, qn, 0, kn)
            if kind is not TileKind.EMPTY:
                calls.append(Call(ql, ql + qn, kl, kl + kn, dense if kind is TileKind.FULL else b))
    return tuple(calls)


@functools.lru_cache(maxsize=1024)
def _gather_calls(mask: Mask, q_chunks: tuple[Chunk, ...], seq_total: int) -> tuple[Call, ...]:
    if isinstance(mask, Documents):
        band = mask.band
        pieces = [(ql, qn, qg, mask.cu[d], mask.cu[d + 1]) for ql, qn, qg, d in mask.pieces(list(q_chunks))]
    else:
        band = mask
        pieces = [(ql, qn, qg, 0, seq_total) for ql, qn, qg in q_chunks]
    calls = []
    for ql, qn, qg, lo, hi in pieces:
        b = band.shifted(qg)  # queries at qg, keys at 0
        k0, k1 = b.key_range(0, qn, seq_total)
        k0, k1 = max(k0, lo), min(k1, hi)
        if k1 <= k0:
            continue
        b = b.shifted(-k0)  # keys now start at k0
        if b.tile_kind(0, qn, 0, k1 - k0) is TileKind.FULL:
            b = Band()
        calls.append(Call(ql, ql + qn, k0, k1, b))
    return tuple(calls)


def gather_calls(mask: Mask, q_chunks: list[Chunk], seq_total: int) -> list[Call]:
    """The launcher calls of the local query chunks against the whole (gathered) K/V; k0/k1 index the whole
    sequence. One call per chunk (per document piece with `Documents`), over the keys its mask can reach; the
    calls' query rows are disjoint."""
    return list(_gather_calls(mask, tuple(q_chunks), seq_total))


def doc_token_areas(cu: list[int] | tuple[int, ...], band: Band) -> torch.Tensor:
    """Per token of the packed sequence, how many keys it sees (same document, ``band`` in document positions):
    int64 (total,). The row sums of the mask, in O(total)."""
    cu_t = torch.tensor(list(cu), dtype=torch.int64)
    lengths = cu_t[1:] - cu_t[:-1]
    doc = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    pos = torch.arange(int(cu_t[-1])) - cu_t[:-1][doc]  # document-local position
    length = lengths[doc]
    hi = length - 1 if band.hi is None else torch.minimum(length - 1, pos + band.hi)
    lo = torch.zeros_like(pos) if band.lo is None else (pos + band.lo).clamp_min(0)
    return (hi - lo + 1).clamp_min(0)


def merge_into(out_acc: torch.Tensor, lse_acc: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """Merge a partial result into the accumulators, in place, in the accumulators' precision.

    ``lse = logaddexp(lse_acc, lse_b)``; ``out = exp(lse_acc - lse) out_acc + exp(lse_b - lse) out_b``. Rows
    that have seen no key on either side (both lse -inf) stay at output 0 and lse -inf.
    out_acc (B, H, S, D), lse_acc (B, H, S): slices of the accumulators; out_b, lse_b: a launcher's result.
    Two passes over the (B, H, S, D) accumulator (a scale in place, then a multiply-add that reads ``out_b`` in
    its own dtype); the lse arithmetic is on (B, H, S), D times smaller.
    """
    lse_b = lse_b.to(lse_acc.dtype)
    new = torch.logaddexp(lse_acc, lse_b)
    safe = new.masked_fill(new == float("-inf"), 0.0)
    w_a = torch.exp(lse_acc - safe).unsqueeze(-1)
    w_b = torch.exp(lse_b - safe).unsqueeze(-1)
    out_acc.mul_(w_a).addcmul_(out_b, w_b)
    lse_acc.copy_(new)


class Cover:
    """The ranges of a sequence axis written so far, so that a first write copies instead of adding.

    Accumulators start from ``torch.empty``: a write to a range nobody wrote copies its partial result in (one
    pass instead of a zero fill and an add); the untouched parts of a range written partly before are first
    filled with the neutral value; `gaps` lists what no call wrote, to be filled at the end.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.done: list[tuple[int, int]] = []

    def _gaps(self, a: int, b: int) -> list[tuple[int, int]]:
        out, pos = [], a
        for x, y in sorted(self.done):
            if y <= pos or x >= b:
                continue
            if x > pos:
                out.append((pos, x))
            pos = max(pos, y)
        if pos < b:
            out.append((pos, b))
        return out

    def claim(self, a: int, b: int) -> tuple[bool, list[tuple[int, int]]]:
        """Mark [a, b) written; returns (whole range was untouched, its untouched parts otherwise)."""
        g = self._gaps(a, b)
        self.done.append((a, b))
        return g == [(a, b)], g

    def gaps(self) -> list[tuple[int, int]]:
        return self._gaps(0, self.n)


def accumulate(acc: torch.Tensor, claim: tuple[bool, list[tuple[int, int]]], a: int, b: int, val) -> None:
    """``acc[:, :, a:b] += val`` where acc starts empty; ``claim``: `Cover.claim(a, b)` of acc's cover."""
    fresh, gaps = claim
    if fresh:
        acc[:, :, a:b].copy_(val)
        return
    for x, y in gaps:
        acc[:, :, x:y].zero_()
    acc[:, :, a:b].add_(val)


def merge_partial(out_acc: torch.Tensor, lse_acc: torch.Tensor, cover: Cover, a: int, b: int, out_b, lse_b) -> None:
    """`merge_into` for the local query rows [a, b) of accumulators that start empty (see `Cover`)."""
    fresh, gaps = cover.claim(a, b)
    if fresh:
        out_acc[:, :, a:b].copy_(out_b)
        lse_acc[:, :, a:b].copy_(lse_b)
        return
    for x, y in gaps:
        out_acc[:, :, x:y].zero_()
        lse_acc[:, :, x:y].fill_(float("-inf"))
    merge_into(out_acc[:, :, a:b], lse_acc[:, :, a:b], out_b, lse_b)

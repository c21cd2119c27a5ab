"""Block planning and lse merging shared by the context-parallel methods.

A rank's local sequence is a list of chunks ``(local_start, length, global_start)`` (`sharding.local_chunks`).
Attention between a local query chunk at global position ``qs`` and a key chunk at ``ks`` is an ordinary
attention call with the global band shifted by ``qs - ks`` (`Band.shifted`). `plan_calls` classifies every
(query chunk, key chunk) pair with `Band.tile_kind`, drops the pairs the mask removes entirely and fuses pairs
that need no mask into as few launcher calls as possible (under zigzag causal a remote step is one call).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longctx.masks import Band, TileKind

__all__ = ["Call", "plan_calls", "merge_into", "merge_partial", "accumulate", "Cover"]

Chunk = tuple[int, int, int]  # (local_start, length, global_start)


@dataclass(frozen=True)
class Call:
    """One launcher call: local queries [q0, q1) against local keys [k0, k1) of the current K/V, with ``band``."""

    q0: int
    q1: int
    k0: int
    k1: int
    band: Band


def plan_calls(band: Band, q_chunks: list[Chunk], k_chunks: list[Chunk]) -> list[Call]:
    """The launcher calls that compute attention of the local queries against one rank's K/V chunks."""
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

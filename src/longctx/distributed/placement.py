"""Where each token of a packed sequence goes: the dispatcher's planning, without processes.

Every rank holds ``total / P`` tokens (the rest of the model is balanced by tokens), and the attention each rank
computes is the mask area of its query rows (visible (query, key) pairs: same document and band,
`blocks.doc_token_areas`). Attention needs no communication for a document kept whole on one rank, so:

- a document is placed **whole** on one rank where it fits; only a document longer than a shard, or one whose area
  alone would unbalance the ranks, is **split** into pieces of ``chunk_size`` tokens (from its start);
- the items (whole documents and pieces) are dealt largest area first, each to the least loaded rank with room for
  it (LPT under a token capacity); an item no rank has room for is cut to fill the rank with the most room (the
  only other place a document is cut);
- if the most loaded rank ends above ``(1 + tolerance)`` x the mean, its largest whole document is split and the
  deal is redone (a few rounds at most: a handful of large documents is what unbalances a deal).

A mix whose documents all fit and balance needs no attention communication at all; a long document is spread in
pieces and balanced like the chunks of a dense sequence. A rank's tokens are kept in global order, adjacent runs
merged (a `sharding.ChunkLayout`).

`plan_needs` lists, for every pair of ranks, the token ranges of one some query of the other can see: what the
dispatcher's "p2p" method moves.
"""

from __future__ import annotations

import bisect
import heapq

from longctx.distributed.blocks import Documents, needed_ranges
from longctx.distributed.sharding import ChunkLayout
from longctx.masks import Band, normalize_window

__all__ = ["plan_layout", "plan_needs", "default_chunk_size", "doc_band", "range_area", "TOLERANCE"]

# The largest max / mean area per rank a deal is accepted at before a whole document is split for balance: a split
# document costs its pieces' K/V on the wire, an imbalance costs the slowest rank's extra attention.
TOLERANCE = 0.08
# Rounds of "split the most loaded rank's largest whole document, deal again" at most.
MAX_ROUNDS = 4

Range = tuple[int, int]  # (global_start, length)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def default_chunk_size(tokens_per_rank: int) -> int:
    """The piece size of split documents when none is given: a divisor of the tokens per rank, a multiple of 128
    (a kernel tile) giving at least 16 pieces per shard where one exists (pieces of a sixteenth of a shard balance a
    split document within a few percent), else at least 4; else the largest divisor giving at least 8."""
    divs = _divisors(tokens_per_rank)
    for min_chunks in (16, 4):
        good = [c for c in divs if c % 128 == 0 and tokens_per_rank // c >= min_chunks]
        if good:
            return max(good)
    good = [c for c in divs if tokens_per_rank // c >= 8]
    return max(good) if good else 1


def doc_band(causal: bool, window: tuple[int, int]) -> Band:
    """The band inside a document (queries and keys of one document: no offset), as flash_attn_varlen_func."""
    return Band.from_args(1, 1, causal=causal, window=window)


def _check_sizes(total: int, world: int, chunk_size: object) -> tuple[int, int]:
    if world < 1 or total == 0 or total % world != 0:
        raise ValueError(
            f"the packed sequence has {total} tokens, which must be a positive multiple of the context-parallel size "
            f"({world}): every rank holds the same number of tokens; pad it (e.g. append a padding document, "
            f"cu_seqlens + [{-(-max(total, 1) // world) * world}])"
        )
    n = total // world
    if chunk_size is None:
        return n, default_chunk_size(n)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size must be an int, got {type(chunk_size).__name__} ({chunk_size!r})")
    if chunk_size < 1:
        raise ValueError(
            f"chunk_size ({chunk_size}) must be a positive number of tokens (the pieces a split document is cut "
            f"into), e.g. {default_chunk_size(n)}, or leave chunk_size=None"
        )
    return n, chunk_size


def _tri(a: int, b: int) -> int:
    """sum of p for p in [a, b)."""
    return (a + b - 1) * (b - a) // 2 if b > a else 0


def range_area(band: Band, length: int, a: int, b: int) -> int:
    """The mask area of the query rows [a, b) of a document of ``length`` tokens (document positions), in O(1):
    row p sees the keys [max(0, p + lo), min(length - 1, p + hi)] (lo <= 0 <= hi for every band of a document)."""
    if b <= a:
        return 0
    cap = length - 1
    if band.hi is None:
        right = (b - a) * cap
    else:  # sum of min(p + hi, cap): p + hi below cap up to m
        m = min(max(cap - band.hi, a), b)
        right = (m - a) * band.hi + _tri(a, m) + (b - m) * cap
    if band.lo is None:
        left = 0
    else:  # sum of max(p + lo, 0): 0 up to m
        m = min(max(-band.lo, a), b)
        left = (b - m) * band.lo + _tri(m, b)
    return right - left + (b - a)


def _deal(items: list[tuple[int, int, int]], world: int, n: int, area_of) -> tuple[list[list[Range]], list[int]]:
    """LPT under a capacity of ``n`` tokens a rank: ``items`` (-area, -length, start), largest area first;
    ``area_of(start, length)`` the area of a cut piece. Returns (per-rank (start, length) ranges, per-rank area)."""
    cap = [n] * world
    load = [0] * world
    got: list[list[Range]] = [[] for _ in range(world)]
    heap = [(0, r) for r in range(world)]  # (load, rank) of the ranks with room left
    for neg_area, neg_len, start in items:
        area, length = -neg_area, -neg_len
        while length > 0:
            skipped = []
            chosen = None
            while heap:
                ld, r = heapq.heappop(heap)
                if cap[r] >= length:
                    chosen = r
                    break
                skipped.append((ld, r))
            if chosen is None:  # no rank has room for it whole: the one with the most room takes a piece
                chosen = max(skipped, key=lambda x: (cap[x[1]], -x[1]))[1]
                skipped = [x for x in skipped if x[1] != chosen]
            take = min(length, cap[chosen])
            piece = area if take == length else area_of(start, take)
            got[chosen].append((start, take))
            cap[chosen] -= take
            load[chosen] += piece
            for x in skipped:
                heapq.heappush(heap, x)
            if cap[chosen] > 0:
                heapq.heappush(heap, (load[chosen], chosen))
            start, length, area = start + take, length - take, area - piece
    return got, load


def _mend_cuts(
    got: list[list[Range]], load: list[int], docs: dict[int, int], area: dict[int, int], split, area_of
) -> None:
    """Make whole, where tokens allow, the documents `_deal` cut for lack of room: a document cut in two, piece
    ``a`` on rank A and piece ``b`` on rank B, becomes whole on A when A holds whole documents (one or two) of
    exactly ``len(b)`` tokens to give B in exchange (or the same the other way round). In place."""
    where: dict[int, list[tuple[int, int, int]]] = {}  # cut document start -> [(rank, start, length)]
    starts = sorted(docs)
    for r, ranges in enumerate(got):
        for g, ln in ranges:
            s = starts[bisect.bisect_right(starts, g) - 1]
            if s not in split and docs[s] != ln:
                where.setdefault(s, []).append((r, g, ln))
    for s, pieces in where.items():
        if len(pieces) != 2 or pieces[0][0] == pieces[1][0]:
            continue
        for (ra, ga, la), (rb, gb, lb) in (pieces, pieces[::-1]):
            give = _exact_docs(got[ra], lb, docs, split, exclude=s)
            if give is None:
                continue
            got[ra] = [x for x in got[ra] if x != (ga, la) and x not in give] + [(s, docs[s])]
            got[rb] = [x for x in got[rb] if x != (gb, lb)] + give
            moved = sum(area[g] for g, _ in give)
            load[ra] += area[s] - area_of(ga, la) - moved
            load[rb] += moved - area_of(gb, lb)
            break


def _exact_docs(ranges: list[Range], need: int, docs: dict[int, int], split, exclude: int) -> list[Range] | None:
    """One or two whole documents among ``ranges`` of ``need`` tokens in all (smallest first), or None."""
    whole = sorted((ln, g) for g, ln in ranges if docs.get(g) == ln and g not in split and g != exclude)
    by_len: dict[int, int] = {}
    for ln, g in whole:
        if ln == need:
            return [(g, ln)]
        by_len.setdefault(ln, g)
    for ln, g in whole:
        other = need - ln
        if other <= 0:
            break
        g2 = by_len.get(other)
        if g2 is not None and g2 != g:
            return [(g, ln), (g2, other)]
        if other == ln:  # two documents of the same length
            twins = [x for x in whole if x[0] == ln and x[1] != g]
            if twins:
                return [(g, ln), (twins[0][1], ln)]
    return None


def plan_layout(
    cu: list[int] | tuple[int, ...], world: int, *, causal: bool = False, window: tuple[int, int] | None = None,
    chunk_size: int | None = None, tolerance: float = TOLERANCE,
) -> tuple[ChunkLayout, list[int], int]:  # fmt: skip
    """The dispatcher's layout of a packed sequence over ``world`` ranks (the module docstring's rule).

    Args:
        cu: 0, then the cumulative document lengths, ending at the total (a multiple of ``world``).
        causal, window: the mask inside each document (flash_attn_varlen_func's).
        chunk_size: the piece size of split documents (default `default_chunk_size`).
        tolerance: max / mean area per rank accepted before a whole document is split for balance.

    Returns:
        (layout, mask area per rank, chunk size).

    Raises:
        ValueError / TypeError: a total not divisible by ``world``, a bad ``chunk_size``.
    """
    cu = list(cu)
    total = cu[-1]
    n, cs = _check_sizes(total, world, chunk_size)
    band = doc_band(causal, normalize_window(window))
    docs = {cu[d]: cu[d + 1] - cu[d] for d in range(len(cu) - 1) if cu[d + 1] > cu[d]}  # start -> length
    area = {s: range_area(band, ln, 0, ln) for s, ln in docs.items()}
    starts = sorted(docs)

    def area_of(start: int, length: int) -> int:  # a piece of the document holding `start`
        s = starts[bisect.bisect_right(starts, start) - 1]
        return range_area(band, docs[s], start - s, start - s + length)

    mean = sum(area.values()) / world
    split = {s for s, ln in docs.items() if ln > n}  # longer than a shard: always split
    for _round in range(MAX_ROUNDS + 1):
        items = []
        for s, ln in docs.items():
            if s in split:
                for a in range(0, ln, cs):
                    b = min(a + cs, ln)
                    items.append((-range_area(band, ln, a, b), a - b, s + a))
            else:
                items.append((-area[s], -ln, s))
        items.sort()
        got, load = _deal(items, world, n, area_of)
        _mend_cuts(got, load, docs, area, split, area_of)
        worst = max(range(world), key=lambda r: (load[r], -r))
        if mean == 0 or load[worst] <= (1 + tolerance) * mean:
            break
        # its largest whole document (a range that is a whole document) is split for the next deal
        whole = [(area[s], s) for s, ln in got[worst] if docs.get(s) == ln and ln > 1 and s not in split]
        if not whole:
            break
        split.add(max(whole)[1])
    return _layout(got, total), load, cs


def _layout(got: list[list[Range]], total: int) -> ChunkLayout:
    chunks = []
    for ranges in got:
        runs: list[list[int]] = []  # [local_start, length, global_start]
        pos = 0
        for g, ln in sorted(ranges):
            if runs and runs[-1][2] + runs[-1][1] == g:
                runs[-1][1] += ln
            else:
                runs.append([pos, ln, g])
            pos += ln
        chunks.append(tuple(tuple(r) for r in runs))
    return ChunkLayout(total, tuple(chunks))


def plan_needs(
    cu: list[int] | tuple[int, ...], layout: ChunkLayout, *, causal: bool = False,
    window: tuple[int, int] | None = None,
) -> tuple[tuple[tuple[Range, ...], ...], ...]:  # fmt: skip
    """Which tokens each rank needs from each other rank: ``needs[r][s]`` holds the global ranges
    ``(start, length)`` (ascending, merged) of rank s's tokens holding a key that some query of rank r sees (same
    document, band inside it); ``needs[r][r]`` is empty (`blocks.needed_ranges` of the document mask)."""
    return needed_ranges(Documents(tuple(cu), doc_band(causal, normalize_window(window))), layout.chunks)

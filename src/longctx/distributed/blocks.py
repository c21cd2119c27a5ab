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

The methods do not launch those calls one by one: a `SparseStep` is all of one step's calls as one block-sparse
launch (every local query row against a contiguous range of the current keys, the mask "same document and band"
built once from each token's document and global position, `step_block_mask`), whose partial result is merged
once. `needed_ranges` says which of a rank's tokens each other rank's queries see, `export_rows` their union: the
only K/V a method needs to move.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

import torch

from longctx.dtypes import accumulation_dtype
from longctx.masks import Band, TileKind

__all__ = [
    "Call",
    "Documents",
    "SparseStep",
    "doc_step",
    "RowsStep",
    "seeing_step",
    "take_rows",
    "put_rows",
    "rows_forward",
    "rows_backward",
    "step_block_mask",
    "export_rows",
    "needed_ranges",
    "step_forward",
    "step_backward",
    "rounded_like",
    "rows_index",
    "pack_kv",
    "unpack_kv",
    "STEP_BLOCK",
    "plan_calls",
    "gather_calls",
    "doc_token_areas",
    "merge_into",
    "merge_partial",
    "accumulate",
    "Cover",
]

Chunk = tuple[int, int, int]  # (local_start, length, global_start)

# The block size of the steps' masks: the block-sparse kernels' tile.
STEP_BLOCK = 128


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


@dataclass(frozen=True)
class SparseStep:
    """One step as one block-sparse launch: every local query row (``q_chunks``) against the keys [k0, k1) of the
    current K/V, whose runs are ``k_chunks`` (local starts relative to k0). None of a step is empty."""

    docs: Documents
    q_chunks: tuple[Chunk, ...]
    k0: int
    k1: int
    k_chunks: tuple[Chunk, ...]


@functools.lru_cache(maxsize=4096)
def doc_step(docs: Documents, q_chunks: tuple[Chunk, ...], k_chunks: tuple[Chunk, ...]) -> SparseStep | None:
    """The step of the local queries against keys laid out as ``k_chunks``, restricted to the keys some query sees;
    None when no query sees any key of them (nothing to launch)."""
    calls = _doc_calls(docs, q_chunks, k_chunks)
    if not calls:
        return None
    k0, k1 = min(c.k0 for c in calls), max(c.k1 for c in calls)
    kept = []
    for kl, kn, kg in k_chunks:
        a, b = max(kl, k0), min(kl + kn, k1)
        if b > a:
            kept.append((a - k0, b - a, kg + a - kl))
    return SparseStep(docs, q_chunks, k0, k1, tuple(kept))


def _positions(chunks: tuple[Chunk, ...], device) -> torch.Tensor:
    """Global positions (int64) of the rows laid out as ``chunks``, in local order."""
    return torch.cat([torch.arange(g, g + n, dtype=torch.int64) for _, n, g in chunks]).to(device)


@functools.lru_cache(maxsize=256)
def step_block_mask(step: SparseStep, device: str, block_size: int = STEP_BLOCK):
    """The `BlockMask` (batch 1, heads 1, Sq = local rows, Sk = k1 - k0) of a step: key j is visible to query i
    iff both lie in one document and the band holds between their global positions. Built once per step (every
    layer and both passes reuse it), on ``device``."""
    from longctx.masks.build import _build_analytic
    from longctx.masks.mask_mods import DocBand

    cu = torch.tensor(step.docs.cu, dtype=torch.int64, device=device)
    qp, kp = _positions(step.q_chunks, device), _positions(step.k_chunks, device)
    qd, kd = (torch.searchsorted(cu, p, right=True) - 1 for p in (qp, kp))
    band = step.docs.band
    rule = DocBand(
        q_doc=qd.to(torch.int32), k_doc=kd.to(torch.int32), q_pos=qp.to(torch.int32), k_pos=kp.to(torch.int32),
        lo=band.lo, hi=band.hi,
    )  # fmt: skip
    return _build_analytic(rule, qp.numel(), kp.numel(), block_size, torch.device(device), None, "cp step")


def step_forward(step: SparseStep, q, k, v, *, scale: float, launchers):
    """(out, lse) of one step, one launch: every local query row of ``q`` (B, Hq, S_loc, D) against the keys
    ``k[:, :, step.k0:step.k1]`` (rows that see none of them: output 0, lse -inf)."""
    bm = step_block_mask(step, str(q.device))
    ks = slice(step.k0, step.k1)
    return launchers.sparse_forward(q, k[:, :, ks], v[:, :, ks], scale=scale, block_mask=bm)


def rounded_like(acc: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``acc`` (an accumulator) in ``like``'s dtype and memory layout: a layer whose q is a (B, H, S, D) view of a
    (B, S, H, D) tensor gets its output in that layout too, so its reshape back to (B, S, H D) is a view, not a copy
    kept for the output projection's backward (what the single-GPU kernels' outputs do: `runtime.out_like`)."""
    return torch.empty_like(like).copy_(acc)


def step_backward(step: SparseStep, do, q, k, v, out, lse, *, scale: float, launchers):
    """(dq, dk, dv) of one step, in the launchers' accumulation dtype: dq (B, Hq, S_loc, D) for every local row, dk
    and dv for the keys ``[step.k0, step.k1)`` only."""
    bm = step_block_mask(step, str(q.device))
    ks = slice(step.k0, step.k1)
    return launchers.sparse_backward(do, q, k[:, :, ks], v[:, :, ks], out, lse, scale=scale, block_mask=bm)


@dataclass(frozen=True)
class RowsStep:
    """A step over the local query rows that see its keys, not every local row: the rows of every piece (a run cut
    at document boundaries) of which some row sees a key of the step (the pieces of split documents, for a step over
    other ranks' rows). ``step``: its queries laid out as ``rows`` (local runs ``(start, length)``) taken in order;
    every other row has no part in it (output 0, lse -inf)."""

    step: SparseStep
    rows: tuple[tuple[int, int], ...]


@functools.lru_cache(maxsize=4096)
def seeing_step(docs: Documents, q_chunks: tuple[Chunk, ...], k_chunks: tuple[Chunk, ...]) -> RowsStep | None:
    """The `RowsStep` of the local queries (runs ``q_chunks``) against keys laid out as ``k_chunks``; None when no
    query sees any of them."""
    pieces = sorted({(c.q0, c.q1) for c in _doc_calls(docs, q_chunks, k_chunks)})
    runs: list[list[int]] = []  # [local start, local end, global start]
    for q0, q1 in pieces:
        ls, _, g = next(ch for ch in q_chunks if ch[0] <= q0 < ch[0] + ch[1])
        g0 = g + q0 - ls
        if runs and q0 <= runs[-1][1] and runs[-1][2] - runs[-1][0] == g0 - q0:  # contiguous in both orders
            runs[-1][1] = max(runs[-1][1], q1)
        else:
            runs.append([q0, q1, g0])
    if not runs:
        return None
    compact, off = [], 0
    for q0, q1, g0 in runs:
        compact.append((off, q1 - q0, g0))
        off += q1 - q0
    step = doc_step(docs, tuple(compact), k_chunks)
    return RowsStep(step, tuple((q0, q1 - q0) for q0, q1, _ in runs))


def take_rows(t: torch.Tensor, rows: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """Rows ``rows`` (local runs) of ``t`` along dim 2, in order, contiguous (``t`` itself where one run is all)."""
    if len(rows) == 1:
        return t[:, :, rows[0][0] : rows[0][0] + rows[0][1]].contiguous()
    return t.index_select(2, rows_index(rows, str(t.device)))


def put_rows(t: torch.Tensor, rows: tuple[tuple[int, int], ...], val: torch.Tensor, add: bool = False) -> None:
    """``t[rows] = val`` (``+= val`` with ``add``) along dim 2, in place."""
    if len(rows) == 1:
        part = t[:, :, rows[0][0] : rows[0][0] + rows[0][1]]
        part.add_(val) if add else part.copy_(val)
        return
    idx = rows_index(rows, str(t.device))
    t.index_add_(2, idx, val) if add else t.index_copy_(2, idx, val)


def rows_forward(rs: RowsStep, q, k, v, out: torch.Tensor, lse: torch.Tensor, *, scale: float, launchers):
    """Run ``rs`` (one launch) and merge its partial result into the rows it covers of ``out`` (in place) and
    ``lse`` by their lse, in the accumulation dtype (float32, float64 for float64 inputs); returns the lse (``lse``
    itself, or a copy in the accumulation dtype)."""
    out_b, lse_b = step_forward(rs.step, take_rows(q, rs.rows), k, v, scale=scale, launchers=launchers)
    adt = accumulation_dtype(out.dtype)
    out_m, lse_m = take_rows(out, rs.rows).to(adt), take_rows(lse, rs.rows).to(adt, copy=True)
    merge_into(out_m, lse_m, out_b, lse_b)
    put_rows(out, rs.rows, out_m.to(out.dtype))
    lse = lse.to(adt)
    put_rows(lse, rs.rows, lse_m)
    return lse


def rows_backward(rs: RowsStep, do, q, k, v, out, lse, dq: torch.Tensor, *, scale: float, launchers):
    """The backward of ``rs``: its dQ added into the rows it covers of ``dq`` (in place); returns its (dk, dv) for
    the keys ``[rs.step.k0, rs.step.k1)``, in the launchers' accumulation dtype."""
    dq_b, dk_b, dv_b = step_backward(rs.step, *(take_rows(t, rs.rows) for t in (do, q)), k, v,
                                     *(take_rows(t, rs.rows) for t in (out, lse)), scale=scale,
                                     launchers=launchers)  # fmt: skip
    put_rows(dq, rs.rows, dq_b, add=True)
    return dk_b, dv_b


@functools.lru_cache(maxsize=1024)
def rows_index(rows: tuple[tuple[int, int], ...], device: str) -> torch.Tensor:
    """The local rows ``(start, length)`` as one int64 index on ``device`` (empty for no rows)."""
    parts = [torch.arange(a, a + n) for a, n in rows]
    return (torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)).to(device)


def pack_kv(k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """K and V rows ``idx`` (along S) as one flat message: K's rows, then V's."""
    return torch.cat([k.index_select(2, idx).reshape(-1), v.index_select(2, idx).reshape(-1)])


def unpack_kv(buf: torch.Tensor, like: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, v), each (B, H, n, D) with ``like``'s B, H, D: views of a flat message of ``n`` rows (`pack_kv`'s)."""
    B, H, _, D = like.shape
    m = B * H * n * D
    return buf[:m].view(B, H, n, D), buf[m : 2 * m].view(B, H, n, D)


@functools.lru_cache(maxsize=256)
def needed_ranges(
    docs: Documents, layout_chunks: tuple[tuple[Chunk, ...], ...]
) -> tuple[tuple[tuple[tuple[int, int], ...], ...], ...]:
    """Which tokens each rank needs from each other rank: ``needs[r][s]`` holds the global ranges ``(start, length)``
    (ascending, merged) of rank s's tokens holding a key that some query of rank r sees (same document, band inside
    it); ``needs[r][r]`` is empty.

    A query piece (a run of rank r cut at document boundaries) sees the contiguous keys
    [max(doc start, first + lo), min(doc end, last + hi + 1)) (`gather_calls`): the union of its rows' bands is
    contiguous and every key in it is seen by some row. Only the documents split across ranks are walked: a whole
    document's keys are all on the rank that holds its queries. O((pieces of split documents + runs) log runs).
    """
    total = sum(n for runs in layout_chunks for _, n, _ in runs)
    world = len(layout_chunks)
    owned = sorted((g, n, r) for r, runs in enumerate(layout_chunks) for _, n, g in runs)
    starts = [g for g, _, _ in owned]
    cu = docs.cu
    split = sorted(  # the documents a boundary between two ranks' runs falls inside
        {d for (_, _, r1), (g2, _, r2) in zip(owned, owned[1:]) if r1 != r2
         for d in [bisect.bisect_right(cu, g2) - 1] if cu[d] != g2}
    )  # fmt: skip
    needs = []
    for r in range(world):
        runs = sorted(layout_chunks[r], key=lambda run: run[2])
        run_starts = [g for _, _, g in runs]
        queries = []  # rank r's runs cut to the split documents
        for d in split:
            a, b = cu[d], cu[d + 1]
            i = max(0, bisect.bisect_right(run_starts, a) - 1)
            while i < len(runs) and runs[i][2] < b:
                ls, n, g = runs[i]
                lo, hi = max(a, g), min(b, g + n)
                if hi > lo:
                    queries.append((ls + lo - g, hi - lo, lo))
                i += 1
        spans = sorted((c.k0, c.k1) for c in _gather_calls(docs, tuple(queries), total))
        merged: list[list[int]] = []
        for a, b in spans:
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        row: list[list[list[int]]] = [[] for _ in range(world)]
        for a, b in merged:
            i = max(0, bisect.bisect_right(starts, a) - 1)
            while i < len(owned) and owned[i][0] < b:
                g, n, s = owned[i]
                lo, hi = max(a, g), min(b, g + n)
                if hi > lo and s != r:
                    if row[s] and row[s][-1][0] + row[s][-1][1] == lo:
                        row[s][-1][1] += hi - lo
                    else:
                        row[s].append([lo, hi - lo])
                i += 1
        needs.append(tuple(tuple(tuple(x) for x in rs) for rs in row))
    return tuple(needs)


@functools.lru_cache(maxsize=256)
def export_rows(docs: Documents, layout_chunks: tuple[tuple[Chunk, ...], ...]) -> tuple[tuple[Chunk, ...], ...]:
    """Per rank s, the runs ``(local_start on s, length, global_start)`` of its tokens holding a key that some query
    of another rank sees (the union over r of `needed_ranges` ``[r][s]``), in local order: the only K/V rows of s
    any method needs to send. Empty for every rank when no document crosses ranks."""
    needs = needed_ranges(docs, layout_chunks)
    result = []
    for s, runs in enumerate(layout_chunks):
        by_global = sorted(runs, key=lambda run: run[2])
        starts = [g for _, _, g in by_global]
        pieces = []  # each needed range cut at s's runs, as (local start, length, global start)
        for a, n in (x for row in needs for x in row[s]):
            i = max(0, bisect.bisect_right(starts, a) - 1)
            while i < len(by_global) and by_global[i][2] < a + n:
                ls, rn, g = by_global[i]
                lo, hi = max(a, g), min(a + n, g + rn)
                if hi > lo:
                    pieces.append((ls + lo - g, hi - lo, lo))
                i += 1
        merged: list[list[int]] = []
        for ls, n, g in sorted(pieces):
            # overlapping rows lie in one run; touching ones merge only where they touch globally too
            pl, pn, pg = merged[-1] if merged else (0, -1, 0)
            if merged and (ls < pl + pn or (ls == pl + pn and g == pg + pn)):
                merged[-1][1] = max(pl + pn, ls + n) - pl
            else:
                merged.append([ls, n, g])
        result.append(tuple(tuple(m) for m in merged))
    return tuple(result)


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

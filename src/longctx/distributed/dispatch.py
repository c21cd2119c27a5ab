"""The dispatcher: packed documents sharded over a context-parallel group by the work each rank computes.

Sharding packed documents by tokens balances tokens, not work: under a causal mask the area a query row computes
grows with its position in its document, and one long document next to many short ones leaves some ranks with
several times the work of others. `dispatch_plan` cuts the packed sequence into chunks of ``chunk_size`` tokens,
computes the mask area of each chunk (the number of visible (query, key) pairs of its query rows: same document
and band, `blocks.doc_token_areas`) and deals the chunks to the ranks greedily, largest first, each to the rank
with the least work so far among those with room left (every rank gets the same number of chunks, so the same
number of tokens: the rest of the model is balanced by tokens).

    plan = dispatch_plan(cu_seqlens, causal=True)              # the same on every rank
    x_loc = plan.dispatch(x)                                   # (total, ...) -> this rank's (total / P, ...)
    out_loc = plan.attention(q_loc, k_loc, v_loc, method="ring")   # (total / P, H, D), varlen layout
    out = plan.undispatch(out_loc)                             # back to (total, ...) in order

A rank's tokens are its chunks in global order, merged where adjacent (a `sharding.ChunkLayout`); every method
of `cp_attention` runs on that layout with the `blocks.Documents` mask: the ring skips the (query, key) chunk
pairs that have no visible entry, all-gather attends each local document piece only to the keys its band
reaches in its document, Ulysses attends over the whole packed sequence one document at a time. The plan's own
method, "p2p" (`P2PAttention`), moves only the K/V chunks some local query can see: ``plan.needs`` lists them per
pair of ranks when the plan is built (`plan_needs`), and ``plan.traffic`` counts the bytes per rank against the
ring and all-gather.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from longctx.distributed.attention import (
    METHODS,
    _crc,
    _describe,
    _exchange_rows,
    _local_checks,
    _meta,
    agree_or_raise,
    check_cu_seqlens,
    run_method,
)
from longctx.distributed.blocks import Call, Documents, doc_token_areas, gather_calls, merge_into, plan_calls
from longctx.distributed.comm import GroupInfo, RingComm, cp_group_info, exchange, gather_seq
from longctx.distributed.sharding import ChunkLayout
from longctx.launchers.select import resolve_launchers
from longctx.masks import Band, normalize_window

__all__ = [
    "dispatch_plan",
    "DispatchPlan",
    "PLAN_METHODS",
    "Traffic",
    "plan_layout",
    "plan_needs",
    "default_chunk_size",
    "balance_chunks",
]

# "p2p" exists only here: it needs the chunk plan to know which K/V chunks each rank's queries can see.
PLAN_METHODS = (*METHODS, "p2p")


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def default_chunk_size(tokens_per_rank: int) -> int:
    """The chunk size when none is given: a divisor of the tokens per rank, a multiple of 128 (a kernel tile)
    giving at least 16 chunks per rank where one exists (16 chunks keep the greedy within a few percent of
    the mean on document mixes), else at least 4; else the largest divisor giving at least 8 chunks."""
    divs = _divisors(tokens_per_rank)
    for min_chunks in (16, 4):
        good = [c for c in divs if c % 128 == 0 and tokens_per_rank // c >= min_chunks]
        if good:
            return max(good)
    good = [c for c in divs if tokens_per_rank // c >= 8]
    return max(good) if good else 1


def balance_chunks(areas: list[int], world: int) -> list[list[int]]:
    """Deal ``len(areas)`` chunks (a multiple of ``world``) to ``world`` ranks, the same number each: largest
    area first, each to the least loaded rank with room (ties: the lower rank). Returns chunk ids per rank, sorted."""
    per_rank = len(areas) // world
    assert per_rank * world == len(areas), (len(areas), world)
    load, owned = [0] * world, [[] for _ in range(world)]
    for c in sorted(range(len(areas)), key=lambda i: (-areas[i], i)):
        r = min((r for r in range(world) if len(owned[r]) < per_rank), key=lambda r: (load[r], r))
        owned[r].append(c)
        load[r] += areas[c]
    return [sorted(o) for o in owned]


def _doc_band(causal: bool, window: tuple[int, int]) -> Band:
    """The band inside a document (queries and keys of one document: no offset), as flash_attn_varlen_func."""
    return Band.from_args(1, 1, causal=causal, window=window)


def plan_layout(
    cu: list[int], world: int, *, causal: bool = False, window: tuple[int, int] | None = None,
    chunk_size: int | None = None,
) -> tuple[ChunkLayout, list[int], int]:  # fmt: skip
    """The pure planning of `dispatch_plan` (no processes): (layout, mask area per rank, chunk size).

    Raises:
        ValueError: a total not divisible by ``world``, or a ``chunk_size`` that does not divide total / world.
    """
    total = cu[-1]
    if world < 1 or total == 0 or total % world != 0:
        raise ValueError(
            f"the packed sequence has {total} tokens, which must be a positive multiple of the context-parallel size "
            f"({world}): every rank holds the same number of tokens; pad it (e.g. append a padding document, "
            f"cu_seqlens + [{-(-max(total, 1) // world) * world}])"
        )
    n_loc = total // world
    if chunk_size is None:
        chunk_size = default_chunk_size(n_loc)
    elif isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size must be an int, got {type(chunk_size).__name__} ({chunk_size!r})")
    elif chunk_size < 1 or n_loc % chunk_size != 0:
        raise ValueError(
            f"chunk_size ({chunk_size}) must be a positive divisor of the tokens per rank ({total} / {world} = "
            f"{n_loc}); e.g. {default_chunk_size(n_loc)}, or leave chunk_size=None"
        )
    band = _doc_band(causal, normalize_window(window))
    areas = doc_token_areas(cu, band).reshape(-1, chunk_size).sum(1).tolist()  # per chunk
    owned = balance_chunks(areas, world)
    chunks = []
    for ids in owned:
        runs: list[list[int]] = []  # [local_start, length, global_start]
        for c in ids:
            g = c * chunk_size
            if runs and runs[-1][2] + runs[-1][1] == g:
                runs[-1][1] += chunk_size
            else:
                runs.append([len(runs) and runs[-1][0] + runs[-1][1], chunk_size, g])
        chunks.append(tuple(tuple(r) for r in runs))
    rank_areas = [sum(areas[c] for c in ids) for ids in owned]
    return ChunkLayout(total, tuple(chunks)), rank_areas, chunk_size


def plan_needs(
    cu: list[int] | tuple[int, ...], layout: ChunkLayout, chunk_size: int, *, causal: bool = False,
    window: tuple[int, int] | None = None,
) -> tuple[tuple[tuple[int, ...], ...], ...]:  # fmt: skip
    """Which K/V chunks each rank needs from each other rank: ``needs[r][s]`` holds the ids (ascending; chunk c is
    tokens [c * chunk_size, (c + 1) * chunk_size)) of the chunks rank s owns in which some query of rank r sees at
    least one key (same document, band inside it); ``needs[r][r]`` is empty.

    A query piece (a run of rank r cut at document boundaries) sees the contiguous keys
    [max(doc start, first + lo), min(doc end, last + hi + 1)) (`blocks.gather_calls`): the union of its rows' bands
    is contiguous and every key in it is seen by some row, so a chunk overlapping that range is needed and no other.
    O(pieces + chunks) per rank.
    """
    total, world = layout.total, layout.world
    mask = Documents(tuple(cu), _doc_band(causal, normalize_window(window)))
    owner = [0] * (total // chunk_size)
    for r, runs in enumerate(layout.chunks):
        for _, n, g in runs:
            owner[g // chunk_size : (g + n) // chunk_size] = [r] * (n // chunk_size)
    needs = []
    for r in range(world):
        spans = sorted(
            (c.k0 // chunk_size, (c.k1 - 1) // chunk_size + 1)
            for c in gather_calls(mask, list(layout.chunks[r]), total)
        )
        row: list[list[int]] = [[] for _ in range(world)]
        end = 0  # chunks below `end` are already listed
        for a, b in spans:
            for c in range(max(a, end), b):
                if owner[c] != r:
                    row[owner[c]].append(c)
            end = max(end, b)
        needs.append(tuple(tuple(x) for x in row))
    return tuple(needs)


@dataclass(frozen=True)
class Traffic:
    """Bytes each rank sends and receives in one attention call of a method (per rank, in rank order).

    ``forward_*``: K/V of the forward; ``backward_*``: K/V again (no method saves what it received) and the dK/dV
    partial sums (``grad_itemsize`` each). Collectives count what a bandwidth-optimal algorithm moves per rank
    (all-gather, reduce-scatter: (P - 1) / P of the whole).
    """

    forward_sent: tuple[int, ...]
    forward_received: tuple[int, ...]
    backward_sent: tuple[int, ...]
    backward_received: tuple[int, ...]

    def max_per_rank(self, *, backward: bool = True) -> int:
        """The largest number of bytes a rank sends or receives (forward, plus the backward unless False)."""
        fs, fr = self.forward_sent, self.forward_received
        if backward:
            fs = tuple(a + b for a, b in zip(fs, self.backward_sent))
            fr = tuple(a + b for a, b in zip(fr, self.backward_received))
        return max(max(fs), max(fr))


@functools.lru_cache(maxsize=256)
def _p2p_routes(plan_key: tuple, rank: int) -> _Routes:
    layout, needs, chunk_size, mask = plan_key
    return _Routes.build(layout, needs, chunk_size, mask, rank)


@dataclass(frozen=True)
class _Routes:
    """Rank ``rank``'s part of a p2p plan.

    ``sends``: (peer, runs of local rows [(local_start, length)], tokens) for every peer that needs some of this
    rank's chunks; ``recvs``: (peer, offset in the received buffer, tokens) for every peer this rank needs chunks
    from, in rank order (the received buffer holds them one peer after another, each peer's chunks ascending).
    ``local_calls`` / ``remote_calls``: the launcher calls of the local queries against the local K/V and
    against the received buffer (`blocks.plan_calls`: only the document pieces whose band meets).
    """

    sends: tuple[tuple[int, tuple[tuple[int, int], ...], int], ...]
    recvs: tuple[tuple[int, int, int], ...]
    n_recv: int
    local_calls: tuple[Call, ...]
    remote_calls: tuple[Call, ...]

    @staticmethod
    def build(layout: ChunkLayout, needs, chunk_size: int, mask: Documents, rank: int) -> _Routes:
        local_of = {}  # global chunk id -> its local start on its owner
        for runs in layout.chunks:
            for ls, n, g in runs:
                for i in range(n // chunk_size):
                    local_of[g // chunk_size + i] = ls + i * chunk_size
        sends = []
        for peer in range(layout.world):
            ids = needs[peer][rank]
            if ids:
                runs: list[list[int]] = []
                for c in ids:
                    a = local_of[c]
                    if runs and runs[-1][0] + runs[-1][1] == a:
                        runs[-1][1] += chunk_size
                    else:
                        runs.append([a, chunk_size])
                sends.append((peer, tuple((a, n) for a, n in runs), len(ids) * chunk_size))
        recvs, k_chunks, off = [], [], 0  # k_chunks: runs of the received buffer, (start, length, global start)
        for peer in range(layout.world):
            ids = needs[rank][peer]
            if not ids:
                continue
            recvs.append((peer, off, len(ids) * chunk_size))
            for c in ids:
                g = c * chunk_size
                if k_chunks and k_chunks[-1][0] + k_chunks[-1][1] == off and k_chunks[-1][2] + k_chunks[-1][1] == g:
                    k_chunks[-1][1] += chunk_size
                else:
                    k_chunks.append([off, chunk_size, g])
                off += chunk_size
        q_chunks = list(layout.chunks[rank])
        remote = plan_calls(mask, q_chunks, [tuple(c) for c in k_chunks]) if k_chunks else []
        return _Routes(tuple(sends), tuple(recvs), off, tuple(plan_calls(mask, q_chunks, q_chunks)), tuple(remote))


def _pack(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.reshape(-1) for p in parts])


def _rows(x: torch.Tensor, runs) -> torch.Tensor:
    """The local rows ``runs`` [(start, length)] of a (B, H, S, D) tensor, concatenated along S."""
    return torch.cat([x[:, :, a : a + n] for a, n in runs], dim=2)


def _fetch_kv(k: torch.Tensor, v: torch.Tensor, routes: _Routes, info: GroupInfo, tag: int):
    """Start the K/V exchange of a p2p plan; returns (requests, receive buffers). `_unpack_kv` once waited."""
    sends = [(peer, _pack([_rows(k, runs), _rows(v, runs)])) for peer, runs, _ in routes.sends]
    per_tok = k[:, :, :1].numel() + v[:, :, :1].numel()
    bufs = [(peer, torch.empty(n * per_tok, dtype=k.dtype, device=k.device)) for peer, _, n in routes.recvs]
    return exchange(info, sends, bufs, tag), bufs


def _unpack(bufs, counts: list[int], like: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """Split flat per-peer buffers (each holding, per tensor of ``like``, ``count`` rows along S) into tensors of
    ``like``'s shapes with the rows of every peer concatenated along S, in peer order."""
    outs: list[list[torch.Tensor]] = [[] for _ in like]
    for (_, buf), n in zip(bufs, counts):
        pos = 0
        for i, t in enumerate(like):
            B, H, _, D = t.shape
            outs[i].append(buf[pos : pos + B * H * n * D].view(B, H, n, D))
            pos += B * H * n * D
    return [torch.cat(o, dim=2) for o in outs]


class P2PAttention(torch.autograd.Function):
    """Attention of the local queries against the local K/V and the K/V chunks they can see on other ranks.

    forward: start the batched point-to-point exchange of the planned chunks (`_Routes`), compute the local calls
    while it runs, then the calls against the received chunks; partial results merge by their lse in the
    accumulation dtype (float32, float64 for float64 inputs). backward: the chunks are exchanged again (saving them
    would keep every layer's received K/V alive), dQ stays local, the dK/dV of received chunks go back to their
    owners in the accumulation dtype and are added there.
    """

    @staticmethod
    def forward(ctx, q, k, v, info: GroupInfo, routes: _Routes, scale: float, launchers):
        B, Hq, S_loc, D = q.shape
        adt = torch.float64 if q.dtype == torch.float64 else torch.float32
        k, v = k.contiguous(), v.contiguous()
        reqs, bufs = _fetch_kv(k, v, routes, info, tag=0)
        out_acc = torch.zeros(B, Hq, S_loc, D, device=q.device, dtype=adt)
        lse_acc = torch.full((B, Hq, S_loc), float("-inf"), device=q.device, dtype=adt)
        for c in routes.local_calls:
            o, l = launchers.forward(q[:, :, c.q0 : c.q1], k[:, :, c.k0 : c.k1], v[:, :, c.k0 : c.k1], scale=scale,
                                     band=c.band)  # fmt: skip
            merge_into(out_acc[:, :, c.q0 : c.q1], lse_acc[:, :, c.q0 : c.q1], o, l)
        RingComm.wait(reqs)
        if routes.remote_calls:
            k_r, v_r = _unpack(bufs, [n for _, _, n in routes.recvs], (k, v))  # (B, Hkv, n_recv, D)
            for c in routes.remote_calls:
                o, l = launchers.forward(q[:, :, c.q0 : c.q1], k_r[:, :, c.k0 : c.k1], v_r[:, :, c.k0 : c.k1],
                                         scale=scale, band=c.band)  # fmt: skip
                merge_into(out_acc[:, :, c.q0 : c.q1], lse_acc[:, :, c.q0 : c.q1], o, l)
        del bufs
        out = out_acc.to(q.dtype)
        lse = lse_acc if q.dtype == torch.float64 else lse_acc.float()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.info, ctx.routes, ctx.scale, ctx.launchers = info, routes, scale, launchers
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        info, routes, scale, launchers = ctx.info, ctx.routes, ctx.scale, ctx.launchers
        adt = torch.float64 if q.dtype == torch.float64 else torch.float32
        do = do.contiguous()
        reqs, bufs = _fetch_kv(k, v, routes, info, tag=1)
        dq = torch.zeros(q.shape, device=q.device, dtype=adt)
        dk = torch.zeros(k.shape, device=q.device, dtype=adt)
        dv = torch.zeros(v.shape, device=q.device, dtype=adt)

        def run(calls, kk, vv, dkk, dvv):
            for c in calls:
                qs, ks = slice(c.q0, c.q1), slice(c.k0, c.k1)
                dq_b, dk_b, dv_b = launchers.backward(
                    do[:, :, qs], q[:, :, qs], kk[:, :, ks], vv[:, :, ks], out[:, :, qs], lse[:, :, qs], scale=scale,
                    band=c.band,
                )  # fmt: skip
                dq[:, :, qs] += dq_b
                dkk[:, :, ks] += dk_b
                dvv[:, :, ks] += dv_b

        run(routes.local_calls, k, v, dk, dv)
        RingComm.wait(reqs)
        back, back_bufs = [], []
        if routes.recvs:
            k_r, v_r = _unpack(bufs, [n for _, _, n in routes.recvs], (k, v))
            dk_r = torch.zeros(k_r.shape, device=q.device, dtype=adt)  # (B, Hkv, n_recv, D)
            dv_r = torch.zeros(v_r.shape, device=q.device, dtype=adt)
            run(routes.remote_calls, k_r, v_r, dk_r, dv_r)
            back = [(peer, _pack([dk_r[:, :, o : o + n], dv_r[:, :, o : o + n]])) for peer, o, n in routes.recvs]
        del bufs
        per_tok = k[:, :, :1].numel() + v[:, :, :1].numel()
        back_bufs = [(peer, torch.empty(n * per_tok, dtype=adt, device=q.device)) for peer, _, n in routes.sends]
        RingComm.wait(exchange(info, back, back_bufs, tag=2))
        if routes.sends:
            dk_in, dv_in = _unpack(back_bufs, [n for _, _, n in routes.sends], (dk, dv))
            pos = 0
            for _, runs, _ in routes.sends:
                for a, n in runs:
                    dk[:, :, a : a + n] += dk_in[:, :, pos : pos + n]
                    dv[:, :, a : a + n] += dv_in[:, :, pos : pos + n]
                    pos += n
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


class _Undispatch(torch.autograd.Function):
    """All-gather in global order; the backward keeps this rank's rows of the incoming gradient."""

    @staticmethod
    def forward(ctx, x_local, info: GroupInfo, layout: ChunkLayout):
        ctx.info, ctx.layout = info, layout
        return gather_seq(x_local, 0, info, layout)

    @staticmethod
    def backward(ctx, g):
        return _take(g, ctx.layout.chunks[ctx.info.rank]), None, None


def _take(x: torch.Tensor, runs) -> torch.Tensor:
    return torch.cat([x[g : g + n] for _, n, g in runs], dim=0)


@dataclass(frozen=True)
class DispatchPlan:
    """Which tokens of a packed sequence each rank holds, and attention over them (see `dispatch_plan`).

    Attributes:
        cu_seqlens: the document boundaries (list of ints). causal, window: the mask inside each document.
        chunk_size: tokens per chunk. layout: the `ChunkLayout` (runs per rank, in local order).
        areas: mask area (visible (query, key) pairs of its query rows) per rank.
        needs: ``needs[r][s]``, the ids of rank s's chunks some query of rank r sees (`plan_needs`): what
            method "p2p" moves.
    """

    cu_seqlens: tuple[int, ...]
    causal: bool
    window: tuple[int, int]
    chunk_size: int
    layout: ChunkLayout
    areas: tuple[int, ...]
    needs: tuple[tuple[tuple[int, ...], ...], ...] = field(repr=False)
    info: GroupInfo = field(repr=False)

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def world(self) -> int:
        return self.info.world

    @property
    def total(self) -> int:
        return self.layout.total

    @property
    def local_len(self) -> int:
        return self.layout.local_len

    def balance(self) -> float:
        """max / mean of the per-rank mask area (1.0: perfectly balanced)."""
        mean = sum(self.areas) / len(self.areas)
        return max(self.areas) / mean if mean > 0 else 1.0

    def traffic(
        self, method: str = "p2p", *, kv_heads: int = 1, head_dim: int = 1, itemsize: int = 2, grad_itemsize: int = 4
    ) -> Traffic:
        """Bytes each rank sends and receives in one `attention` call of ``method``, from the plan alone.

        Args:
            method: "p2p" (the planned chunks), "ring" (every rank's K/V passes every other rank; the backward
                sends K/V again and the dK/dV partial sums around a second ring, P hops) or "allgather" (all-gather
                of K/V, again in the backward, and a reduce-scatter of dK/dV).
            kv_heads, head_dim: of K and V (each token moves ``2 * kv_heads * head_dim`` values).
            itemsize: bytes per K/V value (2 for bf16). grad_itemsize: bytes per dK/dV value sent (the
                accumulation dtype: 4 for float32).

        Raises:
            ValueError: another method.
        """
        P, n = self.world, self.local_len
        kv, gr = 2 * kv_heads * head_dim * itemsize, 2 * kv_heads * head_dim * grad_itemsize  # per token
        if method == "ring":
            f, b = ((P - 1) * n * kv,) * P, ((P - 1) * n * kv + (P * n * gr if P > 1 else 0),) * P
            return Traffic(f, f, b, b)
        if method == "allgather":
            f, b = ((P - 1) * n * kv,) * P, ((P - 1) * n * (kv + gr),) * P
            return Traffic(f, f, b, b)
        if method != "p2p":
            raise ValueError(f"traffic is counted for 'p2p', 'ring' and 'allgather', got {method!r}")
        cs = self.chunk_size
        recv = [sum(len(ids) for ids in self.needs[r]) * cs for r in range(P)]  # tokens
        sent = [sum(len(self.needs[r][s]) for r in range(P)) * cs for s in range(P)]
        return Traffic(
            tuple(t * kv for t in sent), tuple(t * kv for t in recv),
            tuple(s * kv + r * gr for s, r in zip(sent, recv)), tuple(r * kv + s * gr for s, r in zip(sent, recv)),
        )  # fmt: skip

    def positions(self, device=None) -> torch.Tensor:
        """Global positions (int64, (total / P,)) of this rank's tokens, in local order."""
        return torch.cat([torch.arange(g, g + n, device=device) for _, n, g in self.layout.chunks[self.rank]])

    def dispatch(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a packed (total, ...) tensor: (total / P, ...). Differentiable (a gather of rows)."""
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[0] != self.total:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"dispatch takes the whole packed sequence along dim 0 ({self.total} tokens, as cu_seqlens[-1]), "
                f"got {got}"
            )
        return _take(x, self.layout.chunks[self.rank])

    def undispatch(self, x_local: torch.Tensor) -> torch.Tensor:
        """Gather every rank's rows back into the packed (total, ...) tensor in order (an all-gather; every rank
        calls it). Differentiable: the gradient of this rank's rows is its rows of the incoming gradient (right
        when every rank computes the same function of the gathered tensor, e.g. a replicated loss)."""
        if not isinstance(x_local, torch.Tensor) or x_local.dim() < 1 or x_local.shape[0] != self.local_len:
            got = tuple(x_local.shape) if isinstance(x_local, torch.Tensor) else type(x_local).__name__
            raise ValueError(f"undispatch takes this rank's {self.local_len} rows along dim 0, got {got}")
        return _Undispatch.apply(x_local, self.info, self.layout)

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        method: str = "ring",
        scale: float | None = None,
        backend: str = "auto",
        ulysses_size: int | None = None,
    ) -> torch.Tensor:
        """This rank's output of `flash_attn_varlen_func` over the whole packed sequence (self-attention).

        Args:
            q: (total / P, Hq, D) this rank's queries (``plan.dispatch(q_packed)``); k, v: (total / P, Hkv, D).
            method: "ring" (K/V around the ring; pairs of chunks with no visible entry are not computed),
                "allgather" (gather K/V; each local document piece attends only the keys it can see),
                "ulysses" (all-to-all to heads, attention over the whole packed sequence per document),
                "ulysses_ring" (all-to-all inside groups of ``ulysses_size`` ranks, ring across them) or "p2p"
                (only the K/V chunks some local query can see, point to point: ``plan.needs``; `traffic`).
            scale: softmax scale (default 1/sqrt(D)). backend: "auto", "tiled" or "triton" (as `cp_attention`).

        Returns:
            (total / P, Hq, D), differentiable in q, k and v.

        Raises:
            ValueError / TypeError on every rank (checked collectively): bad tensors, a local length other than
            the plan's, inputs that differ across ranks, heads the method cannot split, an unknown method.
        """
        q4, k4, v4 = (_to_bhsd(t) for t in (q, k, v))  # (1, H, total / P, D)
        scale = self._check(q4, k4, v4, method=method, scale=scale, backend=backend, ulysses_size=ulysses_size)
        mask = Documents(self.cu_seqlens, _doc_band(self.causal, self.window))
        launchers = resolve_launchers(backend, q4.device, q4.dtype)
        if method == "p2p":
            routes = _p2p_routes((self.layout, self.needs, self.chunk_size, mask), self.rank)
            out = P2PAttention.apply(q4, k4, v4, self.info, routes, scale, launchers)
        else:
            out = run_method(
                q4, k4, v4, info=self.info, method=method, layout=self.layout, mask=mask, scale=scale,
                launchers=launchers, ulysses_size=ulysses_size,
            )  # fmt: skip
        return out[0].permute(1, 0, 2).contiguous()  # (total / P, Hq, D)

    def _check(self, q4, k4, v4, *, method, scale, backend, ulysses_size) -> float:
        """`attention.cp_attention`'s collective check with the plan's methods (p2p is checked as allgather, which
        puts no constraint on heads, and told apart by an extra column). Returns the scale."""
        info, where = self.info, "DispatchPlan.attention"
        known = isinstance(method, str) and method in PLAN_METHODS
        base = "allgather" if method == "p2p" else method
        err: Exception | None = None
        resolved = None
        try:
            if not known:
                raise ValueError(f"method must be one of {PLAN_METHODS}, got {method!r}")
            resolved = _local_checks(
                q4, k4, v4, info=info, method=base, layout=self.layout, causal=self.causal, window=self.window,
                scale=scale, backend=backend, ulysses_size=ulysses_size,
            )  # fmt: skip
        except (TypeError, ValueError) as e:
            err = e
        if info.world == 1:
            if err is not None:
                raise err
            return resolved[0]
        row = _meta(
            q4, k4, v4, method=base if known else None, layout=self.layout, causal=self.causal, window=self.window,
            scale=resolved[0] if resolved else scale, backend=backend, err=int(err is not None),
            ulysses_size=ulysses_size,
        ) + [PLAN_METHODS.index(method) if known else -1]  # fmt: skip

        def describe(rw: list[int]) -> str:
            return _describe(rw[:-1]) + f" (method {PLAN_METHODS[rw[-1]] if rw[-1] >= 0 else '?'})"

        agree_or_raise(
            row, err, info, q4, where=where, same="its share of one packed sequence with the same arguments",
            describe=describe,
        )  # fmt: skip
        return resolved[0]


def _to_bhsd(t):
    """(tokens, H, D) -> (1, H, tokens, D), contiguous; anything else passes through to the checks."""
    if isinstance(t, torch.Tensor) and t.dim() == 3:
        return t.permute(1, 0, 2).unsqueeze(0).contiguous()
    if isinstance(t, torch.Tensor):
        raise ValueError(
            f"DispatchPlan.attention takes the varlen layout (tokens, heads, head_dim), got shape {tuple(t.shape)}"
        )
    raise TypeError(f"DispatchPlan.attention takes tensors, got {type(t).__name__}")


def dispatch_plan(
    cu_seqlens: torch.Tensor | list[int],
    *,
    group=None,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    chunk_size: int | None = None,
) -> DispatchPlan:
    """Shard a packed sequence over a context-parallel group, balancing the mask area each rank computes.

    Every rank of ``group`` calls it with the same arguments (checked collectively).

    Args:
        cu_seqlens: 0, then the cumulative document lengths (int32/int64 tensor or list of ints), ending at the
            number of packed tokens, a multiple of the group size.
        group: the context-parallel process group (default: the world; needs torch.distributed initialised);
            `SINGLE_PROCESS` for this process alone.
        causal, window: the mask inside each document, as in `flash_attn_varlen_func` (window (left, right),
            -1 unbounded).
        chunk_size: tokens per chunk, a divisor of total / P (default: `default_chunk_size`).

    Returns:
        A `DispatchPlan`.

    Raises:
        RuntimeError: torch.distributed not initialised (and ``group`` not `SINGLE_PROCESS`).
        ValueError / TypeError, on every rank: invalid cu_seqlens, a total not divisible by P, a bad chunk_size
        or window, or arguments that differ across ranks.
    """
    info = cp_group_info(group, "dispatch_plan")
    err: Exception | None = None
    result = None
    try:
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
        win = normalize_window(window)
        total = (
            int(cu_seqlens[-1]) if isinstance(cu_seqlens, (list, tuple, torch.Tensor)) and len(cu_seqlens) > 0 else -1
        )
        cu = check_cu_seqlens(cu_seqlens, total)
        layout, areas, cs = plan_layout(cu, info.world, causal=causal, window=win, chunk_size=chunk_size)
        result = (cu, win, layout, areas, cs)
    except (TypeError, ValueError) as e:
        err = e
    if info.world > 1:
        row = [int(err is not None)]
        if result is not None:
            cu, win, _, _, cs = result
            row += [_crc(cu), cu[-1], int(causal), win[0], win[1], cs]
        else:
            row += [-1] * 6
        rows = _exchange_rows(row, info)
        bad = [r for r, rw in enumerate(rows) if rw[0]]
        if bad and err is None:
            raise ValueError(f"dispatch_plan: invalid arguments on rank(s) {bad}; every rank stops here")
        if not bad and any(rw != rows[0] for rw in rows):
            raise ValueError(
                "dispatch_plan: the ranks passed different cu_seqlens, causal, window or chunk_size; every rank must "
                "plan the same packed sequence:\n"
                + "\n".join(
                    f"  rank {r}: cu_seqlens checksum {rw[1]:08x}, {rw[2]} tokens, causal={bool(rw[3])}, "
                    f"window=({rw[4]}, {rw[5]}), chunk_size={rw[6]}"
                    for r, rw in enumerate(rows)
                )
            )
    if err is not None:
        raise type(err)(f"dispatch_plan on rank {info.rank}: {err}") from err
    cu, win, layout, areas, cs = result
    needs = plan_needs(cu, layout, cs, causal=causal, window=win)
    return DispatchPlan(tuple(cu), causal, win, cs, layout, tuple(areas), needs, info)

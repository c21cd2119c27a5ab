"""The dispatcher's "p2p" method: only the K/V rows some local query can see move, in one batched point-to-point
exchange per pass.

`placement.plan_needs` lists, per pair of ranks, the token ranges one needs from the other. Rank r's part of a plan
(`Routes`): what it sends to each peer (its local rows of the ranges the peer needs), what it receives from each
(in peer order, each peer's ranges ascending) and two block-sparse steps, its queries against its own K/V and
against the received rows (`blocks.SparseStep`: one launch each).

forward: start the exchange, compute the local step while it runs, then the remote step; the two partial results
merge by their lse in the accumulation dtype (float32, float64 for float64 inputs). backward: the rows are
exchanged again (saving them would keep every layer's received K/V alive), dQ stays local, the dK/dV of received
rows go back to their owners in the accumulation dtype and are added there.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

import torch

from longctx.distributed.blocks import (
    Documents,
    SparseStep,
    doc_step,
    merge_two,
    pack_kv,
    rows_index,
    step_backward,
    step_forward,
    unpack_kv,
)
from longctx.distributed.comm import GroupInfo, RingComm, exchange
from longctx.distributed.sharding import ChunkLayout

__all__ = ["Routes", "routes", "P2PAttention"]


@dataclass(frozen=True)
class Routes:
    """Rank ``rank``'s part of a p2p plan.

    ``sends``: (peer, local rows [(local_start, length)], tokens) for every peer that needs some of this rank's
    tokens; ``recvs``: (peer, offset in the received buffer, tokens) for every peer this rank needs tokens from, in
    rank order. ``local`` / ``remote``: the steps against the local K/V and against the received buffer (None:
    nothing to compute there).
    """

    rank: int
    sends: tuple[tuple[int, tuple[tuple[int, int], ...], int], ...]
    recvs: tuple[tuple[int, int, int], ...]
    n_recv: int
    local: SparseStep | None
    remote: SparseStep | None


def _local_rows(runs: tuple[tuple[int, int, int], ...], g: int, n: int) -> int:
    """The local start of global tokens [g, g + n) on a rank holding ``runs`` (they lie in one run)."""
    starts = [r[2] for r in runs]
    i = bisect.bisect_right(starts, g) - 1
    ls, ln, rg = runs[i]
    assert rg <= g and g + n <= rg + ln, (g, n, runs[i])
    return ls + g - rg


@functools.lru_cache(maxsize=256)
def routes(layout: ChunkLayout, needs, docs: Documents, rank: int) -> Routes:
    """Rank ``rank``'s `Routes` for a layout, its `placement.plan_needs` and the document mask."""
    own = tuple(sorted(layout.chunks[rank], key=lambda r: r[2]))
    sends = []
    for peer in range(layout.world):
        ranges = needs[peer][rank]
        if ranges:
            rows = tuple((_local_rows(own, g, n), n) for g, n in ranges)
            sends.append((peer, rows, sum(n for _, n in ranges)))
    recvs, k_chunks, off = [], [], 0  # k_chunks: runs of the received buffer, (start, length, global start)
    for peer in range(layout.world):
        ranges = needs[rank][peer]
        if not ranges:
            continue
        recvs.append((peer, off, sum(n for _, n in ranges)))
        for g, n in ranges:
            k_chunks.append((off, n, g))
            off += n
    q_chunks = layout.chunks[rank]
    remote = doc_step(docs, q_chunks, tuple(k_chunks)) if k_chunks else None
    return Routes(rank, tuple(sends), tuple(recvs), off, doc_step(docs, q_chunks, q_chunks), remote)


def _fetch_kv(k: torch.Tensor, v: torch.Tensor, r: Routes, info: GroupInfo, tag: int):
    """Start the K/V exchange; returns (requests, receive buffers): one flat message (K then V) per peer."""
    dev = str(k.device)
    sends = [(peer, pack_kv(k, v, rows_index(rows, dev))) for peer, rows, _ in r.sends]
    per_tok = k[:, :, :1].numel() + v[:, :, :1].numel()
    bufs = [(peer, torch.empty(n * per_tok, dtype=k.dtype, device=k.device)) for peer, _, n in r.recvs]
    return exchange(info, sends, bufs, tag), bufs


def _unpack(bufs, counts: list[int], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the flat per-peer messages, (B, H, sum(counts), D) each, peers one after another along S."""
    kvs = [unpack_kv(buf, like, n) for (_, buf), n in zip(bufs, counts)]
    return torch.cat([k for k, _ in kvs], dim=2), torch.cat([v for _, v in kvs], dim=2)


class P2PAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, info: GroupInfo, r: Routes, scale: float, launchers):
        k, v = k.contiguous(), v.contiguous()
        reqs, bufs = _fetch_kv(k, v, r, info, tag=0)
        out, lse = step_forward(r.local, q, k, v, scale=scale, launchers=launchers)
        RingComm.wait(reqs)
        if r.remote is not None:
            k_r, v_r = _unpack(bufs, [n for _, _, n in r.recvs], k)  # (B, Hkv, n_recv, D)
            partial = step_forward(r.remote, q, k_r, v_r, scale=scale, launchers=launchers)
            out, lse = merge_two(out, lse, *partial)
        del bufs
        lse = lse if q.dtype == torch.float64 else lse.float()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.info, ctx.routes, ctx.scale, ctx.launchers = info, r, scale, launchers
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        info, r, scale, launchers = ctx.info, ctx.routes, ctx.scale, ctx.launchers
        do = do.contiguous()
        reqs, bufs = _fetch_kv(k, v, r, info, tag=1)
        dq, dk_l, dv_l = step_backward(r.local, do, q, k, v, out, lse, scale=scale, launchers=launchers)
        adt = dq.dtype
        dk = torch.zeros(k.shape, device=q.device, dtype=adt)
        dv = torch.zeros(v.shape, device=q.device, dtype=adt)
        dk[:, :, r.local.k0 : r.local.k1] += dk_l
        dv[:, :, r.local.k0 : r.local.k1] += dv_l
        RingComm.wait(reqs)
        back = []
        if r.recvs:
            k_r, v_r = _unpack(bufs, [n for _, _, n in r.recvs], k)
            dk_r = torch.zeros(k_r.shape, device=q.device, dtype=adt)  # (B, Hkv, n_recv, D)
            dv_r = torch.zeros(v_r.shape, device=q.device, dtype=adt)
            if r.remote is not None:
                dq_b, dk_b, dv_b = step_backward(r.remote, do, q, k_r, v_r, out, lse, scale=scale, launchers=launchers)
                dq += dq_b
                dk_r[:, :, r.remote.k0 : r.remote.k1] = dk_b
                dv_r[:, :, r.remote.k0 : r.remote.k1] = dv_b
            for peer, o, n in r.recvs:
                back.append((peer, torch.cat([dk_r[:, :, o : o + n].reshape(-1), dv_r[:, :, o : o + n].reshape(-1)])))
        del bufs
        per_tok = k[:, :, :1].numel() + v[:, :, :1].numel()
        back_bufs = [(peer, torch.empty(n * per_tok, dtype=adt, device=q.device)) for peer, _, n in r.sends]
        RingComm.wait(exchange(info, back, back_bufs, tag=2))
        if r.sends:
            dk_in, dv_in = _unpack(back_bufs, [n for _, _, n in r.sends], k)
            idx = torch.cat([rows_index(rows, str(q.device)) for _, rows, _ in r.sends])
            dk.index_add_(2, idx, dk_in.to(adt))
            dv.index_add_(2, idx, dv_in.to(adt))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None

"""The dispatcher's "p2p" method: only the K/V rows some local query can see move, in one all-to-all with uneven
splits per exchange (a single collective call: far less host time than a batch of point-to-point operations).

`placement.plan_needs` lists, per pair of ranks, the token ranges one needs from the other. Rank r's part of a plan
(`Routes`): the local rows it sends (every peer's rows one after another, in peer order), the tokens it sends to and
receives from each rank, and two block-sparse steps, its queries against its own K/V and against the received rows
(`blocks.SparseStep`: one launch each). A message is token-major: each row's K heads, then its V heads
(``(tokens, B, 2 Hkv, D)``), so every peer's share is one contiguous slice of one buffer.

forward: start the exchange, compute the local step while it runs, then the remote step over the local query rows
that see some received key (``remote_rows``: the pieces of split documents; every other row has its whole result
from the local step); the two partial results of those rows merge by their lse in the accumulation dtype (float32,
float64 for float64 inputs). backward: the rows are exchanged again (saving them would keep every layer's received
K/V alive), dQ stays local, the dK/dV of received rows go back to their owners in the accumulation dtype and are
added there.
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
    merge_into,
    plan_calls,
    rows_index,
    step_backward,
    step_forward,
)
from longctx.distributed.comm import Done, GroupInfo, all_to_all_rows
from longctx.distributed.sharding import ChunkLayout

__all__ = ["Routes", "routes", "P2PAttention"]


@dataclass(frozen=True)
class Routes:
    """Rank ``rank``'s part of a p2p plan.

    ``send_rows``: the local rows ``(start, length)`` sent, every peer's after the previous peer's;
    ``send_counts`` / ``recv_counts``: tokens sent to / received from each rank of the group (0 for itself and
    for ranks it exchanges nothing with), the received rows in peer order, each peer's ranges ascending.
    ``local``: the step of every local query against the local K/V; ``remote``: the step of the local query rows
    ``remote_rows`` (runs ``(local start, length)``, taken in order into one tensor) against the received rows
    (None: nothing to compute there). ``moves``: whether any rank of the group exchanges rows (when none does, as
    when every document is whole on one rank, no rank calls the collective).
    """

    rank: int
    moves: bool
    send_rows: tuple[tuple[int, int], ...]
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    local: SparseStep | None
    remote: SparseStep | None
    remote_rows: tuple[tuple[int, int], ...] = ()

    @property
    def n_send(self) -> int:
        return sum(self.send_counts)

    @property
    def n_recv(self) -> int:
        return sum(self.recv_counts)


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
    send_rows: list[tuple[int, int]] = []
    send_counts, recv_counts = [0] * layout.world, [0] * layout.world
    k_chunks, off = [], 0  # k_chunks: runs of the received rows, (start, length, global start)
    for peer in range(layout.world):
        for g, n in needs[peer][rank]:
            send_rows.append((_local_rows(own, g, n), n))
            send_counts[peer] += n
        for g, n in needs[rank][peer]:
            k_chunks.append((off, n, g))
            recv_counts[peer] += n
            off += n
    q_chunks = layout.chunks[rank]
    remote, remote_rows = None, ()
    if k_chunks:
        compact, remote_rows = _seeing_rows(docs, q_chunks, tuple(k_chunks))
        remote = doc_step(docs, compact, tuple(k_chunks)) if compact else None
    moves = any(ranges for row in needs for ranges in row)
    local = doc_step(docs, q_chunks, q_chunks)
    return Routes(rank, moves, tuple(send_rows), tuple(send_counts), tuple(recv_counts), local, remote, remote_rows)


def _seeing_rows(docs: Documents, q_chunks, k_chunks) -> tuple[tuple, tuple[tuple[int, int], ...]]:
    """The local query rows that see some key of ``k_chunks``: as chunks of the tensor that takes them in local
    order ``(start in it, length, global start)``, and as local runs ``(start, length)``."""
    pieces = sorted({(c.q0, c.q1) for c in plan_calls(docs, list(q_chunks), list(k_chunks))})
    runs: list[list[int]] = []  # [local start, local end, global start]
    for q0, q1 in pieces:
        ls, _, g = next(ch for ch in q_chunks if ch[0] <= q0 < ch[0] + ch[1])
        g0 = g + q0 - ls
        if runs and q0 <= runs[-1][1] and runs[-1][2] - runs[-1][0] == g0 - q0:  # contiguous in both orders
            runs[-1][1] = max(runs[-1][1], q1)
        else:
            runs.append([q0, q1, g0])
    compact, off = [], 0
    for q0, q1, g0 in runs:
        compact.append((off, q1 - q0, g0))
        off += q1 - q0
    return tuple(compact), tuple((q0, q1 - q0) for q0, q1, _ in runs)


def _take(t: torch.Tensor, runs: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """Rows ``runs`` of ``t`` along dim 2, in order, contiguous (``t`` itself where the run is all of it)."""
    if len(runs) == 1:
        return t[:, :, runs[0][0] : runs[0][0] + runs[0][1]].contiguous()
    return t.index_select(2, rows_index(runs, str(t.device)))


def _put(t: torch.Tensor, runs: tuple[tuple[int, int], ...], val: torch.Tensor, add: bool = False) -> None:
    """``t[rows] = val`` (``+= val`` with ``add``) for the rows ``runs`` of ``t`` along dim 2, in place."""
    if len(runs) == 1:
        part = t[:, :, runs[0][0] : runs[0][0] + runs[0][1]]
        part.add_(val) if add else part.copy_(val)
        return
    idx = rows_index(runs, str(t.device))
    t.index_add_(2, idx, val) if add else t.index_copy_(2, idx, val)


def _rows_message(rows: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, v), each (B, Hkv, n, D) contiguous, of a token-major message ``(n, B, 2 Hkv, D)``."""
    h = like.shape[1]
    return tuple(rows[:, :, s].permute(1, 2, 0, 3).contiguous() for s in (slice(0, h), slice(h, 2 * h)))


def _fetch_kv(k: torch.Tensor, v: torch.Tensor, r: Routes, info: GroupInfo):
    """Start the K/V exchange; returns (request, receive buffer (n_recv, B, 2 Hkv, D))."""
    B, H, _, D = k.shape
    kv = torch.cat((k, v), dim=1).permute(2, 0, 1, 3)  # (S_loc, B, 2 Hkv, D), a view of one copy
    send = kv.index_select(0, rows_index(r.send_rows, str(k.device)))
    recv = torch.empty((r.n_recv, B, 2 * H, D), dtype=k.dtype, device=k.device)
    return _exchange(info, r, send, r.send_counts, recv, r.recv_counts), recv


def _exchange(info: GroupInfo, r: Routes, send, send_counts, recv, recv_counts):
    """`all_to_all_rows` where some rank of the plan moves rows; nothing (on every rank) where none does."""
    return all_to_all_rows(info, send, send_counts, recv, recv_counts) if r.moves else Done()


class P2PAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, info: GroupInfo, r: Routes, scale: float, launchers):
        k, v = k.contiguous(), v.contiguous()
        req, recv = _fetch_kv(k, v, r, info)
        out, lse = step_forward(r.local, q, k, v, scale=scale, launchers=launchers)
        req.wait()
        if r.remote is not None:
            k_r, v_r = _rows_message(recv, k)  # (B, Hkv, n_recv, D)
            rows = r.remote_rows
            out_b, lse_b = step_forward(r.remote, _take(q, rows), k_r, v_r, scale=scale, launchers=launchers)
            adt = torch.float64 if out.dtype == torch.float64 else torch.float32
            out_m, lse_m = _take(out, rows).to(adt), _take(lse, rows).to(adt, copy=True)
            merge_into(out_m, lse_m, out_b, lse_b)
            _put(out, rows, out_m.to(out.dtype))
            lse = lse.to(adt)
            _put(lse, rows, lse_m)
        del recv
        lse = lse if q.dtype == torch.float64 else lse.float()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.info, ctx.routes, ctx.scale, ctx.launchers = info, r, scale, launchers
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        info, r, scale, launchers = ctx.info, ctx.routes, ctx.scale, ctx.launchers
        do = do.contiguous()
        req, recv = _fetch_kv(k, v, r, info)
        dq, dk_l, dv_l = step_backward(r.local, do, q, k, v, out, lse, scale=scale, launchers=launchers)
        adt = dq.dtype
        dk = torch.zeros(k.shape, device=q.device, dtype=adt)
        dv = torch.zeros(v.shape, device=q.device, dtype=adt)
        dk[:, :, r.local.k0 : r.local.k1] += dk_l
        dv[:, :, r.local.k0 : r.local.k1] += dv_l
        req.wait()
        H = k.shape[1]
        back = torch.zeros((r.n_recv, k.shape[0], 2 * H, k.shape[3]), device=q.device, dtype=adt)
        if r.remote is not None:
            k_r, v_r = _rows_message(recv, k)
            rows = r.remote_rows
            dq_b, dk_b, dv_b = step_backward(r.remote, *(_take(t, rows) for t in (do, q)), k_r, v_r,
                                             *(_take(t, rows) for t in (out, lse)), scale=scale,
                                             launchers=launchers)  # fmt: skip
            _put(dq, rows, dq_b, add=True)
            back[r.remote.k0 : r.remote.k1, :, :H] = dk_b.permute(2, 0, 1, 3)
            back[r.remote.k0 : r.remote.k1, :, H:] = dv_b.permute(2, 0, 1, 3)
        del recv
        grads = torch.empty((r.n_send, k.shape[0], 2 * H, k.shape[3]), device=q.device, dtype=adt)
        _exchange(info, r, back, r.recv_counts, grads, r.send_counts).wait()
        if r.n_send:
            idx = rows_index(r.send_rows, str(q.device))
            dk.index_add_(2, idx, grads[:, :, :H].permute(1, 2, 0, 3))
            dv.index_add_(2, idx, grads[:, :, H:].permute(1, 2, 0, 3))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None

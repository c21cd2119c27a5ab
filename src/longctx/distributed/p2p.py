"""The dispatcher's "p2p" method: only the K/V rows some local query can see move, in one all-to-all with uneven
splits per exchange (a single collective call: far less host time than a batch of point-to-point operations).

`placement.plan_needs` lists, per pair of ranks, the token ranges one needs from the other. Rank r's part of a plan
(`Routes`): the local rows it sends (every peer's rows one after another, in peer order), the tokens it sends to and
receives from each rank, and two block-sparse steps, its queries against its own K/V and against the received rows
(`blocks.SparseStep`: one launch each). A message is token-major: each row's K heads, then its V heads
(``(tokens, B, 2 Hkv, D)``), so every peer's share is one contiguous slice of one buffer.

forward: start the exchange, compute the local step while it runs, then the remote step over the local query rows
that see some received key (`blocks.RowsStep`: the pieces of split documents; every other row has its whole result
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
    RowsStep,
    SparseStep,
    doc_step,
    rows_backward,
    rows_forward,
    rows_index,
    seeing_step,
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
    that see received keys against the received rows (`blocks.RowsStep`; None: nothing to compute there).
    ``moves``: whether any rank of the group exchanges rows (when none does, as when every document is whole on
    one rank, no rank calls the collective).
    """

    rank: int
    moves: bool
    send_rows: tuple[tuple[int, int], ...]
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    local: SparseStep | None
    remote: RowsStep | None

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
    remote = seeing_step(docs, q_chunks, tuple(k_chunks)) if k_chunks else None
    moves = any(ranges for row in needs for ranges in row)
    local = doc_step(docs, q_chunks, q_chunks)
    return Routes(rank, moves, tuple(send_rows), tuple(send_counts), tuple(recv_counts), local, remote)


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
            lse = rows_forward(r.remote, q, k_r, v_r, out, lse, scale=scale, launchers=launchers)
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
            dk_b, dv_b = rows_backward(r.remote, do, q, k_r, v_r, out, lse, dq, scale=scale, launchers=launchers)
            keys = slice(r.remote.step.k0, r.remote.step.k1)
            back[keys, :, :H] = dk_b.permute(2, 0, 1, 3)
            back[keys, :, H:] = dv_b.permute(2, 0, 1, 3)
        del recv
        grads = torch.empty((r.n_send, k.shape[0], 2 * H, k.shape[3]), device=q.device, dtype=adt)
        _exchange(info, r, back, r.recv_counts, grads, r.send_counts).wait()
        if r.n_send:
            idx = rows_index(r.send_rows, str(q.device))
            dk.index_add_(2, idx, grads[:, :, :H].permute(1, 2, 0, 3))
            dv.index_add_(2, idx, grads[:, :, H:].permute(1, 2, 0, 3))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None

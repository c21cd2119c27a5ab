"""All-gather attention (Llama 3's context parallelism): gather the whole K/V, attend the local queries.

forward: K, V (B, Hkv, S/P, D) of every rank are all-gathered into the full sequence (B, Hkv, S, D) in global
order; each local query chunk at global position ``qs`` attends only the keys its band can reach
(`Band.key_range`) with the global band shifted by ``qs - ks``. With GQA the gathered K/V are Hq/Hkv times
smaller than the queries, which is why this is cheap.

backward: the full K/V are gathered again (not saved: saving them would make the memory of every layer
grow with the whole sequence), each chunk's backward adds into full-length float32 dK/dV, and a
reduce-scatter returns to every rank the sum for the keys it owns.

Packed documents (`blocks.Documents`) take `DocAllGatherAttention`: only the *export rows* of every rank (the tokens
some query of another rank sees, `blocks.export_rows`) are gathered, padded to the largest rank's count, and each
rank computes two launches, its queries against its own K/V and against the other ranks' export rows (one
block-sparse launch each, `blocks.SparseStep`); the backward reduce-scatters the float32 dK/dV of the export rows.
When no rank exports anything (every document whole on one rank) there is no communication at all.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from longctx.distributed.blocks import (
    Call,
    Chunk,
    Documents,
    Mask,
    RowsStep,
    SparseStep,
    doc_step,
    export_rows,
    gather_calls,
    rows_backward,
    rows_forward,
    rows_index,
    seeing_step,
    step_backward,
    step_forward,
)
from longctx.distributed.comm import GroupInfo, gather_flat, gather_seq, reduce_scatter_flat, reduce_scatter_seq
from longctx.distributed.sharding import local_chunks
from longctx.dtypes import accumulation_dtype
from longctx.launchers.select import Launchers

__all__ = ["AllGatherAttention", "DocAllGatherAttention"]


def _calls(band: Mask, seq_total: int, info: GroupInfo, layout) -> list[Call]:
    """One call per local query chunk (per document piece); k0/k1 index the full (gathered) sequence."""
    return gather_calls(band, local_chunks(seq_total, info.rank, info.world, layout), seq_total)


class AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, info: GroupInfo, layout, band: Mask, scale: float, launchers: Launchers):
        B, Hq, S_loc, D = q.shape
        seq_total = S_loc * info.world
        k_full = gather_seq(k, 2, info, layout)  # (B, Hkv, S, D)
        v_full = gather_seq(v, 2, info, layout)
        out = torch.zeros_like(q)
        lse_dt = accumulation_dtype(q.dtype)
        lse = torch.full((B, Hq, S_loc), float("-inf"), device=q.device, dtype=lse_dt)
        for q0, q1, k0, k1, b in ((c.q0, c.q1, c.k0, c.k1, c.band) for c in _calls(band, seq_total, info, layout)):
            o, l = launchers.forward(q[:, :, q0:q1], k_full[:, :, k0:k1], v_full[:, :, k0:k1], scale=scale, band=b)
            out[:, :, q0:q1] = o
            lse[:, :, q0:q1] = l
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.info, ctx.layout, ctx.band, ctx.scale, ctx.launchers = info, layout, band, scale, launchers
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        info, layout, band, scale, launchers = ctx.info, ctx.layout, ctx.band, ctx.scale, ctx.launchers
        S_loc = q.shape[2]
        seq_total = S_loc * info.world
        adt = accumulation_dtype(q.dtype)
        do = do.contiguous()
        k_full = gather_seq(k, 2, info, layout)
        v_full = gather_seq(v, 2, info, layout)
        dq = torch.zeros(q.shape, device=q.device, dtype=adt)
        dk_full = torch.zeros(k_full.shape, device=q.device, dtype=adt)
        dv_full = torch.zeros_like(dk_full)
        for q0, q1, k0, k1, b in ((c.q0, c.q1, c.k0, c.k1, c.band) for c in _calls(band, seq_total, info, layout)):
            dq_b, dk_b, dv_b = launchers.backward(
                do[:, :, q0:q1],
                q[:, :, q0:q1],
                k_full[:, :, k0:k1],
                v_full[:, :, k0:k1],
                out[:, :, q0:q1],
                lse[:, :, q0:q1],
                scale=scale,
                band=b,
            )
            dq[:, :, q0:q1] += dq_b
            dk_full[:, :, k0:k1] += dk_b
            dv_full[:, :, k0:k1] += dv_b
        dk = reduce_scatter_seq(dk_full, 2, info, layout)
        dv = reduce_scatter_seq(dv_full, 2, info, layout)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


@dataclass(frozen=True)
class _GatherPlan:
    """Rank ``rank``'s part of a document all-gather: every rank's export rows (padded to ``most`` in the gather),
    the local step, and the step over the other ranks' export rows in global order (``order``: their places in
    the padded gather, (rank, row) -> rank * most + row)."""

    rank: int
    exports: tuple[tuple[Chunk, ...], ...]
    sizes: tuple[int, ...]
    most: int
    order: tuple[int, ...]
    local: SparseStep | None
    remote: RowsStep | None


@functools.lru_cache(maxsize=256)
def _gather_plan(docs: Documents, chunks: tuple[tuple[Chunk, ...], ...], rank: int) -> _GatherPlan:
    exports = export_rows(docs, chunks)
    sizes = tuple(sum(n for _, n, _ in e) for e in exports)
    most = max(sizes)
    rows = []  # (global position, place in the gather) of the other ranks' export rows
    for s, runs in enumerate(exports):
        if s == rank:
            continue
        i = 0
        for _, n, g in runs:
            rows += [(g + j, s * most + i + j) for j in range(n)]
            i += n
    rows.sort()
    runs: list[list[int]] = []  # the gathered buffer in global order, as (start, length, global_start)
    for pos, (g, _) in enumerate(rows):
        if runs and runs[-1][2] + runs[-1][1] == g:
            runs[-1][1] += 1
        else:
            runs.append([pos, 1, g])
    remote = seeing_step(docs, chunks[rank], tuple(tuple(r) for r in runs)) if runs else None
    local = doc_step(docs, chunks[rank], chunks[rank])
    return _GatherPlan(rank, exports, sizes, most, tuple(p for _, p in rows), local, remote)


@functools.lru_cache(maxsize=256)
def _indices(plan: _GatherPlan, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's export rows, the places of the other ranks' rows in the padded gather), on ``device``."""
    own = rows_index(tuple((ls, n) for ls, n, _ in plan.exports[plan.rank]), device)
    return own, torch.tensor(plan.order, dtype=torch.int64, device=device)


def _gather_remote(k, v, plan: _GatherPlan, info: GroupInfo):
    """The other ranks' export rows of K and V, (B, Hkv, rows, D) each, in global order."""
    own, order = _indices(plan, str(k.device))
    B, H, _, D = k.shape
    send = torch.zeros(2, B, H, plan.most, D, dtype=k.dtype, device=k.device)
    send[0, :, :, : own.numel()] = k.index_select(2, own)
    send[1, :, :, : own.numel()] = v.index_select(2, own)
    got = gather_flat(send, info).view(info.world, 2, B, H, plan.most, D)
    kv = got.permute(1, 2, 3, 0, 4, 5).reshape(2, B, H, info.world * plan.most, D).index_select(3, order)
    return kv[0], kv[1]


class DocAllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, info: GroupInfo, chunks, docs: Documents, scale: float, launchers: Launchers):
        plan = _gather_plan(docs, chunks, info.rank)
        out, lse = step_forward(plan.local, q, k, v, scale=scale, launchers=launchers)
        if plan.most:
            k_r, v_r = _gather_remote(k, v, plan, info)
            if plan.remote is not None:
                lse = rows_forward(plan.remote, q, k_r, v_r, out, lse, scale=scale, launchers=launchers)
        lse = lse if q.dtype == torch.float64 else lse.float()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.info, ctx.plan, ctx.scale, ctx.launchers = info, plan, scale, launchers
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        info, plan, scale, launchers = ctx.info, ctx.plan, ctx.scale, ctx.launchers
        do = do.contiguous()
        dq, dk_b, dv_b = step_backward(plan.local, do, q, k, v, out, lse, scale=scale, launchers=launchers)
        dk = torch.zeros(k.shape, device=q.device, dtype=dq.dtype)
        dv = torch.zeros_like(dk)
        ks = slice(plan.local.k0, plan.local.k1)
        dk[:, :, ks] += dk_b
        dv[:, :, ks] += dv_b
        if plan.most:
            own, order = _indices(plan, str(q.device))
            k_r, v_r = _gather_remote(k, v, plan, info)
            B, H, _, D = k.shape
            back = torch.zeros(2, B, H, info.world * plan.most, D, dtype=dq.dtype, device=q.device)
            if plan.remote is not None:
                dk_r, dv_r = rows_backward(plan.remote, do, q, k_r, v_r, out, lse, dq, scale=scale,
                                           launchers=launchers)  # fmt: skip
                rs = order[plan.remote.step.k0 : plan.remote.step.k1]
                back[0].index_copy_(2, rs, dk_r)
                back[1].index_copy_(2, rs, dv_r)
            back = back.view(2, B, H, info.world, plan.most, D).permute(3, 0, 1, 2, 4, 5).reshape(info.world, -1)
            mine = reduce_scatter_flat(back, info).view(2, B, H, plan.most, D)[:, :, :, : own.numel()]
            dk.index_add_(2, own, mine[0])
            dv.index_add_(2, own, mine[1])
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None

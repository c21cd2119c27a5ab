"""Ring attention over packed documents: one launch per step, and only the K/V rows another rank can see travel.

With packed documents most of a rank's keys are seen by its own queries alone: a document kept whole on one rank
(the dispatcher keeps every document it can whole) needs no other rank's K/V. So the ring moves, for every rank
s, only its *export rows* (`blocks.export_rows`: the tokens holding a key some query of another rank sees), packed
into one message, and each step is one block-sparse launch (`blocks.SparseStep`) with one log-sum-exp merge:

    forward, rank r of P:
        send my export rows to r+1 (one message: K and V)            | while computing
        step 0: my queries against my whole K/V (one launch)          | the local step
        for t = 1 .. P-1: the block of rank src = r - t has arrived:
            forward it to r+1 (unless t = P-1), receive the next       | while computing
            my queries against src's export rows (one launch, one merge)

    backward: the same K/V schedule; dQ stays local; dK/dV of the local step go straight into the local gradients,
    those of src's export rows are added to a float32 partial sum that travels with the block one step behind
    (the dense ring's scheme on fewer rows) and reaches src after P hops.

When no rank exports anything (every document whole on one rank) there is no communication at all: one launch
forward, one backward. Steps whose block no local query sees are neither launched nor merged; the block is still
forwarded. Plans (steps, masks, index tensors) are cached per (documents, layout, rank): every layer and both
passes reuse them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from longctx.distributed.blocks import (
    Chunk,
    Documents,
    SparseStep,
    doc_step,
    export_rows,
    merge_into,
    pack_kv,
    rounded_like,
    rows_index,
    unpack_kv,
)
from longctx.distributed.blocks import step_backward as _step_backward
from longctx.distributed.blocks import step_forward as _step_forward
from longctx.distributed.comm import GroupInfo, RingComm, exchange
from longctx.dtypes import accumulation_dtype
from longctx.launchers.select import Launchers

__all__ = ["DocRingAttention", "ring_plan"]


@dataclass(frozen=True)
class RingPlan:
    """Rank ``rank``'s part of a document ring: ``sizes[s]`` export rows of every rank s, ``local`` the step on
    its own K/V, ``remote[t - 1]`` the step on the export rows of rank ``rank - t`` (None: nothing seen there)."""

    rank: int
    world: int
    exports: tuple[tuple[Chunk, ...], ...]
    sizes: tuple[int, ...]
    local: SparseStep | None
    remote: tuple[SparseStep | None, ...]

    @property
    def active(self) -> bool:
        """Whether any K/V crosses ranks."""
        return any(self.sizes)

    def src(self, t: int) -> int:
        return (self.rank - t) % self.world


@functools.lru_cache(maxsize=256)
def ring_plan(docs: Documents, chunks: tuple[tuple[Chunk, ...], ...], rank: int) -> RingPlan:
    """The plan of rank ``rank`` for the layout ``chunks`` (every rank's runs)."""
    world = len(chunks)
    exports = export_rows(docs, chunks)
    sizes = tuple(sum(n for _, n, _ in e) for e in exports)
    remote = []
    for t in range(1, world):
        src = (rank - t) % world
        runs, off = [], 0
        for _, n, g in exports[src]:
            runs.append((off, n, g))
            off += n
        remote.append(doc_step(docs, chunks[rank], tuple(runs)) if runs else None)
    local = doc_step(docs, chunks[rank], chunks[rank])
    return RingPlan(rank, world, exports, sizes, local, tuple(remote))


def _export_index(plan: RingPlan, device: str) -> torch.Tensor:
    return rows_index(tuple((ls, n) for ls, n, _ in plan.exports[plan.rank]), device)


class _Blocks:
    """The K/V blocks travelling around the ring: two flat receive buffers of the largest block, rotated (a fixed
    set per call: see `ring`'s note on the caching allocator and NCCL streams)."""

    def __init__(self, plan: RingPlan, info: GroupInfo, like: torch.Tensor, dtype: torch.dtype, tag: int) -> None:
        self.plan, self.info, self.like, self.tag = plan, info, like, tag
        per_row = 2 * like.shape[0] * like.shape[1] * like.shape[3]
        self.per_row = per_row
        most = max(plan.sizes)
        self.bufs = [torch.empty(most * per_row, dtype=dtype, device=like.device) for _ in range(2)]
        self.nxt = (info.rank + 1) % info.world
        self.prv = (info.rank - 1) % info.world

    def start(self, send: torch.Tensor | None, t: int) -> tuple[list, torch.Tensor | None]:
        """Send ``send`` forward; receive the block of step ``t`` (rank r - t's export rows) into buffer t % 2."""
        n_in = self.plan.sizes[self.plan.src(t)]
        recv = self.bufs[t % 2][: n_in * self.per_row] if n_in else None
        sends = [(self.nxt, send)] if send is not None and send.numel() else []
        recvs = [(self.prv, recv)] if recv is not None else []
        return exchange(self.info, sends, recvs, self.tag), recv


class DocRingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, info: GroupInfo, chunks, docs: Documents, scale: float, launchers: Launchers):
        B, Hq, S_loc, D = q.shape
        plan = ring_plan(docs, chunks, info.rank)
        adt = accumulation_dtype(q.dtype)
        k, v = k.contiguous(), v.contiguous()
        out_acc = torch.zeros(B, Hq, S_loc, D, device=q.device, dtype=adt)
        lse_acc = torch.full((B, Hq, S_loc), float("-inf"), device=q.device, dtype=adt)
        first = [True]

        def merge(o, l):  # one merge per step, over every local row
            if first[0]:
                out_acc.copy_(o)
                lse_acc.copy_(l)
                first[0] = False
            else:
                merge_into(out_acc, lse_acc, o, l)

        blocks = reqs = held = None
        if plan.active:
            blocks = _Blocks(plan, info, k, k.dtype, tag=0)
            mine = pack_kv(k, v, _export_index(plan, str(q.device))) if plan.sizes[info.rank] else None
            reqs, held = blocks.start(mine, 1)
        if plan.local is not None:
            merge(*_step_forward(plan.local, q, k, v, scale=scale, launchers=launchers))
        if plan.active:
            for t in range(1, plan.world):
                RingComm.wait(reqs)
                cur = held
                if t < plan.world - 1:
                    reqs, held = blocks.start(cur, t + 1)
                step = plan.remote[t - 1]
                if step is not None:
                    k_b, v_b = unpack_kv(cur, k, plan.sizes[plan.src(t)])
                    merge(*_step_forward(step, q, k_b, v_b, scale=scale, launchers=launchers))
        del blocks, held
        out = rounded_like(out_acc, q)
        lse = lse_acc if q.dtype == torch.float64 else lse_acc.float()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.info, ctx.chunks, ctx.docs, ctx.scale, ctx.launchers = info, chunks, docs, scale, launchers
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        info, scale, launchers = ctx.info, ctx.scale, ctx.launchers
        plan = ring_plan(ctx.docs, ctx.chunks, info.rank)
        adt = accumulation_dtype(q.dtype)
        do = do.contiguous()
        dq = torch.zeros(q.shape, device=q.device, dtype=adt)
        dk = torch.zeros(k.shape, device=q.device, dtype=adt)
        dv = torch.zeros(v.shape, device=q.device, dtype=adt)

        def grads(step, kk, vv):
            dq_b, dk_b, dv_b = _step_backward(step, do, q, kk, vv, out, lse, scale=scale, launchers=launchers)
            dq.add_(dq_b)
            return dk_b, dv_b

        if not plan.active:
            if plan.local is not None:
                dk_b, dv_b = grads(plan.local, k, v)
                ks = slice(plan.local.k0, plan.local.k1)
                dk[:, :, ks] += dk_b
                dv[:, :, ks] += dv_b
            return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None
        idx = _export_index(plan, str(q.device))
        blocks = _Blocks(plan, info, k, k.dtype, tag=0)
        sums = _Blocks(plan, info, k, adt, tag=2)  # the travelling float32 partial sums of dK/dV
        reqs, held = blocks.start(pack_kv(k, v, idx) if plan.sizes[info.rank] else None, 1)
        if plan.local is not None:
            dk_b, dv_b = grads(plan.local, k, v)
            ks = slice(plan.local.k0, plan.local.k1)
            dk[:, :, ks] += dk_b
            dv[:, :, ks] += dv_b
        sum_reqs, sum_in = [], None
        for t in range(1, plan.world):
            RingComm.wait(reqs)
            cur = held
            if t < plan.world - 1:
                reqs, held = blocks.start(cur, t + 1)
            n = plan.sizes[plan.src(t)]
            acc = None
            if n:
                acc = torch.zeros(n * blocks.per_row, device=q.device, dtype=adt)
                step = plan.remote[t - 1]
                if step is not None:
                    k_b, v_b = unpack_kv(cur, k, n)
                    dk_b, dv_b = grads(step, k_b, v_b)
                    a_k, a_v = unpack_kv(acc, k, n)
                    a_k[:, :, step.k0 : step.k1] += dk_b
                    a_v[:, :, step.k0 : step.k1] += dv_b
            RingComm.wait(sum_reqs)
            if sum_in is not None:  # the partial sums of this block from the ranks before
                acc += sum_in
            # pass them on (after P - 1 steps the next rank is the block's owner) and receive the next block's
            sum_reqs, sum_in = sums.start(acc, t + 1)
        RingComm.wait(sum_reqs)
        if sum_in is not None:  # our own export rows' sums, back from every other rank
            s_k, s_v = unpack_kv(sum_in, k, plan.sizes[info.rank])
            dk.index_add_(2, idx, s_k)
            dv.index_add_(2, idx, s_v)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None

"""Ring attention: K/V blocks travel around the ring while each rank attends its queries to them.

forward, on rank r of P, with its local q, k, v (in the chunks of the layout):

    step t = 0 .. P-1:   holds K/V of rank src = r - t (mod P)
        start sending the K/V it holds to r+1 and receiving the next from r-1   (overlaps the compute)
        for each launcher call the mask leaves (`blocks.plan_calls`, global band shifted per chunk pair):
            out_b, lse_b = fwd(q[chunk], K[chunk], V[chunk])
            merge (out_b, lse_b) into the float32 accumulators of those queries (`blocks.merge_into`)
        wait for the exchange

backward: the final (out, lse) are what each block's backward uses, so Delta = rowsum(dO * O) and the
recomputed probabilities are the global ones and the per-block gradients simply add up. dQ stays on its rank;
dK/dV of a block are accumulated by every rank that saw it, travelling around a second ring one step behind
the K/V: at step t rank r adds its share for the K/V of rank r - t to the partial sum received from r - 1 and
passes it on, so after P steps the sums arrive back at their owners.

``band`` may be `blocks.Documents` (packed documents) and ``layout`` a `sharding.ChunkLayout` (the dispatcher's):
the planned calls then skip every (query, key) chunk pair without a visible entry, while the K/V still travel
the whole ring.

Memory and passes: the receive buffers are a fixed set per call, rotated (K/V: two pairs; dK/dV: two float32
accumulators and one receive pair), never one new allocation per step: a block handed to NCCL on its own
stream and freed while the host runs ahead cannot be reused by the caching allocator until the GPU catches up,
so per-step buffers inflated the memory reserved with the ring size. Accumulators start empty and the first
partial result of a range is copied in (`blocks.Cover`): no zero fill, no add of zeros, no lse merge on step 0.
"""

from __future__ import annotations

import functools

import torch

from longctx.distributed.blocks import Call, Cover, Mask, accumulate, merge_partial, plan_calls, rounded_like
from longctx.distributed.comm import GroupInfo, RingComm
from longctx.distributed.sharding import local_chunks
from longctx.dtypes import accumulation_dtype
from longctx.launchers.select import Launchers

__all__ = ["RingAttention"]


@functools.lru_cache(maxsize=4096)  # every layer, and the backward, plan the same steps
def _step_calls(band: Mask, seq_total: int, rank: int, src: int, world: int, layout) -> list[Call]:
    return plan_calls(band, local_chunks(seq_total, rank, world, layout), local_chunks(seq_total, src, world, layout))


def _fill_gaps(cover: Cover, *pairs: tuple[torch.Tensor, float]) -> None:
    for a, b in cover.gaps():
        for t, value in pairs:
            t[:, :, a:b].fill_(value)


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, info: GroupInfo, layout, band: Mask, scale: float, launchers: Launchers):
        B, Hq, S_loc, D = q.shape
        P, r = info.world, info.rank
        seq_total = S_loc * P
        adt = accumulation_dtype(q.dtype)
        out_acc = torch.empty(B, Hq, S_loc, D, device=q.device, dtype=adt)
        lse_acc = torch.empty(B, Hq, S_loc, device=q.device, dtype=adt)
        cover = Cover(S_loc)
        comm = RingComm(info) if P > 1 else None
        k_cur, v_cur = k.contiguous(), v.contiguous()
        spare = [None, None]  # the two receive pairs, rotated: step t receives into spare[t % 2]
        for t in range(P):
            src = (r - t) % P
            reqs = None
            if t < P - 1:
                (k_nxt, v_nxt), reqs = comm.start([k_cur, v_cur], tag=0, out=spare[t % 2])
                spare[t % 2] = [k_nxt, v_nxt]
            for c in _step_calls(band, seq_total, r, src, P, layout):
                o_b, l_b = launchers.forward(
                    q[:, :, c.q0 : c.q1], k_cur[:, :, c.k0 : c.k1], v_cur[:, :, c.k0 : c.k1], scale=scale, band=c.band
                )
                merge_partial(out_acc, lse_acc, cover, c.q0, c.q1, o_b, l_b)
                del o_b, l_b
            if reqs is not None:
                RingComm.wait(reqs)
                k_cur, v_cur = k_nxt, v_nxt
        _fill_gaps(cover, (out_acc, 0.0), (lse_acc, float("-inf")))
        del spare, k_cur, v_cur
        out = rounded_like(out_acc, q)
        lse = lse_acc if q.dtype == torch.float64 else lse_acc.float()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.info, ctx.layout, ctx.band, ctx.scale, ctx.launchers = info, layout, band, scale, launchers
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        info, layout, band, scale, launchers = ctx.info, ctx.layout, ctx.band, ctx.scale, ctx.launchers
        B, Hq, S_loc, D = q.shape
        Hkv = k.shape[1]
        P, r = info.world, info.rank
        seq_total = S_loc * P
        adt = accumulation_dtype(q.dtype)
        do = do.contiguous()
        dq_acc = torch.empty(B, Hq, S_loc, D, device=q.device, dtype=adt)
        dq_cover = Cover(S_loc)
        comm = RingComm(info) if P > 1 else None
        k_cur, v_cur = k.contiguous(), v.contiguous()
        spare = [None, None]  # K/V receive pairs, rotated as in the forward
        # dK/dV: step t accumulates into acc[t % 2] while acc[(t - 1) % 2] is still being sent; the partial
        # sums from behind always land in the one pair `recv` (read by the add before the next receive starts).
        acc = [
            [torch.empty(B, Hkv, S_loc, D, device=q.device, dtype=adt) for _ in range(2)]
            for _ in range(2 if P > 1 else 1)
        ]
        recv = None
        dkv_reqs = None
        for t in range(P):
            src = (r - t) % P
            kv_reqs = None
            if t < P - 1:
                (k_nxt, v_nxt), kv_reqs = comm.start([k_cur, v_cur], tag=0, out=spare[t % 2])
                spare[t % 2] = [k_nxt, v_nxt]
            dk_blk, dv_blk = acc[t % len(acc)]
            cover = Cover(S_loc)
            for c in _step_calls(band, seq_total, r, src, P, layout):
                qs = slice(c.q0, c.q1)
                dq_b, dk_b, dv_b = launchers.backward(
                    do[:, :, qs],
                    q[:, :, qs],
                    k_cur[:, :, c.k0 : c.k1],
                    v_cur[:, :, c.k0 : c.k1],
                    out[:, :, qs],
                    lse[:, :, qs],
                    scale=scale,
                    band=c.band,
                )
                accumulate(dq_acc, dq_cover.claim(c.q0, c.q1), c.q0, c.q1, dq_b)
                claim = cover.claim(c.k0, c.k1)
                accumulate(dk_blk, claim, c.k0, c.k1, dk_b)
                accumulate(dv_blk, claim, c.k0, c.k1, dv_b)
                del dq_b, dk_b, dv_b
            _fill_gaps(cover, (dk_blk, 0.0), (dv_blk, 0.0))
            if P > 1:
                if dkv_reqs is not None:  # the partial sums of this K/V block from the ranks before us
                    RingComm.wait(dkv_reqs)
                    dk_blk += recv[0]
                    dv_blk += recv[1]
                recv, dkv_reqs = comm.start([dk_blk, dv_blk], tag=2, out=recv)
            else:
                recv = [dk_blk, dv_blk]
            if kv_reqs is not None:
                RingComm.wait(kv_reqs)
                k_cur, v_cur = k_nxt, v_nxt
        if dkv_reqs is not None:  # after P hops the sums for our own K/V are back
            RingComm.wait(dkv_reqs)
        _fill_gaps(dq_cover, (dq_acc, 0.0))
        dk, dv = recv
        return dq_acc.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None

"""All-gather attention (Llama 3's context parallelism): gather the whole K/V, attend the local queries.

forward: K, V (B, Hkv, S/P, D) of every rank are all-gathered into the full sequence (B, Hkv, S, D) in global
order; each local query chunk at global position ``qs`` attends only the keys its band can reach
(`Band.key_range`) with the global band shifted by ``qs - ks``. With GQA the gathered K/V are Hq/Hkv times
smaller than the queries, which is why this is cheap.

backward: the full K/V are gathered again (not saved: saving them would make the memory of every layer
grow with the whole sequence), each chunk's backward adds into full-length float32 dK/dV, and a
reduce-scatter returns to every rank the sum for the keys it owns.

With packed documents (`blocks.Documents`) each local chunk is cut at document boundaries and every piece attends
only the keys of its document within its band (`blocks.gather_calls`).
"""

from __future__ import annotations

import torch

from longctx.distributed.blocks import Call, Mask, gather_calls
from longctx.distributed.comm import GroupInfo, gather_seq, reduce_scatter_seq
from longctx.distributed.sharding import local_chunks
from longctx.launchers.select import Launchers

__all__ = ["AllGatherAttention"]


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
        lse_dt = torch.float64 if q.dtype == torch.float64 else torch.float32
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
        adt = torch.float64 if q.dtype == torch.float64 else torch.float32
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

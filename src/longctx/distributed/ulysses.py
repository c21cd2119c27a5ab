"""Ulysses (DeepSpeed) attention: all-to-all from sequence-sharded to head-sharded, attention over the whole
sequence for H/P heads, all-to-all back.

    local (B, H, S/P, D) --all-to-all--> (B, H/P, S, D) in global order --attention(global band)--> back

Rank p gets query heads [p Hq/P, (p+1) Hq/P) and kv heads [p Hkv/P, (p+1) Hkv/P), so the GQA mapping
(query head h reads kv head h // (Hq/Hkv)) holds inside each rank. It needs Hq % P == 0 and Hkv % P == 0.
When Hkv < P and P % Hkv == 0 (e.g. MQA), the kv heads are replicated P/Hkv times first (each rank then
receives exactly the kv head its query heads read); the gradients of the copies are summed in float32 before
they are rounded to the input dtype (summing bf16 copies would round twice: up to 2x the single-GPU error).

With packed documents (`blocks.Documents`) the attention over the whole sequence is one block-sparse launch (the
mask of flash_attn_varlen_func, `blocks.SparseStep`). `SeqToHead` / `HeadToSeq` are the two all-to-alls as
autograd functions, for methods that compose them with another (the hybrid Ulysses x ring).
"""

from __future__ import annotations

import torch

from longctx.distributed.blocks import Documents, Mask, SparseStep, doc_step, step_backward, step_forward
from longctx.distributed.comm import GroupInfo, all_to_all
from longctx.distributed.sharding import global_to_rank_major, reorder_to_global
from longctx.launchers.select import Launchers

__all__ = [
    "UlyssesAttention", "SeqToHead", "HeadToSeq", "seq_to_head", "head_to_seq", "seq_to_head_many",
    "head_to_seq_many", "kv_replication",
]  # fmt: skip


def seq_to_head_many(xs: list[torch.Tensor], info: GroupInfo, layout: str) -> list[torch.Tensor]:
    """Each (B, H_i, S/P, D) sequence-sharded -> (B, H_i/P, S, D) head-sharded, sequence in global order: tensors of
    one dtype and sequence shape in one all-to-all and one reorder (not one per tensor)."""
    B, _, S_loc, D = xs[0].shape
    P = info.world
    heads = [x.shape[1] // P for x in xs]
    blocks = [x.reshape(B, P, h, S_loc, D).transpose(0, 1) for x, h in zip(xs, heads)]  # block p goes to rank p
    send = torch.cat(blocks, dim=2) if len(blocks) > 1 else blocks[0]  # (P, B, sum H_i/P, S/P, D)
    recv = all_to_all(send, info)  # block p: rank p's positions of our heads
    whole = reorder_to_global(list(recv.unbind(0)), 2, layout)  # (B, sum H_i/P, S, D)
    return [t.contiguous() for t in whole.split(heads, dim=1)]  # views when B == 1


def head_to_seq_many(ys: list[torch.Tensor], info: GroupInfo, layout: str) -> list[torch.Tensor]:
    """Each (B, H_i/P, S, D) head-sharded in global order -> (B, H_i, S/P, D) sequence-sharded (the inverse), in one
    all-to-all."""
    B, _, S, D = ys[0].shape
    P = info.world
    heads = [y.shape[1] for y in ys]
    whole = torch.cat(ys, dim=1) if len(ys) > 1 else ys[0]
    send = global_to_rank_major(whole, 2, P, layout)  # (P, B, sum H_i/P, S/P, D): block p holds rank p's positions
    recv = all_to_all(send, info)  # block p: our positions of rank p's heads
    return [t.transpose(0, 1).reshape(B, P * h, S // P, D) for t, h in zip(recv.split(heads, dim=2), heads)]


def seq_to_head(x: torch.Tensor, info: GroupInfo, layout: str) -> torch.Tensor:
    """(B, H, S/P, D) sequence-sharded -> (B, H/P, S, D) head-sharded, sequence in global order."""
    return seq_to_head_many([x], info, layout)[0]


def head_to_seq(y: torch.Tensor, info: GroupInfo, layout: str) -> torch.Tensor:
    """(B, H/P, S, D) head-sharded in global order -> (B, H, S/P, D) sequence-sharded (the inverse)."""
    return head_to_seq_many([y], info, layout)[0]


class SeqToHead(torch.autograd.Function):
    """`seq_to_head`, differentiable (its backward is `head_to_seq`)."""

    @staticmethod
    def forward(ctx, x, info: GroupInfo, layout):
        ctx.info, ctx.layout = info, layout
        return seq_to_head(x, info, layout)

    @staticmethod
    def backward(ctx, g):
        return head_to_seq(g.contiguous(), ctx.info, ctx.layout), None, None


class HeadToSeq(torch.autograd.Function):
    """`head_to_seq`, differentiable (its backward is `seq_to_head`)."""

    @staticmethod
    def forward(ctx, y, info: GroupInfo, layout):
        ctx.info, ctx.layout = info, layout
        return head_to_seq(y, info, layout)

    @staticmethod
    def backward(ctx, g):
        return seq_to_head(g.contiguous(), ctx.info, ctx.layout), None, None


def _whole(docs: Documents, S: int) -> SparseStep:
    """The step of the whole packed sequence against itself (global order): flash_attn_varlen_func's mask."""
    whole = ((0, S, 0),)
    step = doc_step(docs, whole, whole)
    assert step is not None  # every token sees itself
    return step


def kv_replication(hq: int, hkv: int, world: int, method: str = "ulysses", what: str = "context-parallel size") -> int:
    """How many times each kv head is repeated for Ulysses (1 when Hkv % P == 0); raises ValueError if impossible."""
    if hq % world != 0:
        raise ValueError(
            f"method={method!r} needs the number of query heads ({hq}) divisible by the {what} ({world}); use "
            f"method='ring' or 'allgather'"
            + (
                ", or a ulysses_size that divides it"
                if method == "ulysses_ring"
                else f", or a group size that divides {hq}"
            )
        )
    if hkv % world == 0:
        return 1
    if world % hkv == 0:
        return world // hkv
    raise ValueError(
        f"method={method!r} needs the number of kv heads ({hkv}) divisible by the {what} ({world}) "
        f"(or dividing it, for kv replication); use method='ring' or 'allgather'"
        + (", or a ulysses_size that divides it" if method == "ulysses_ring" else "")
    )


def splits_heads(hq: int, hkv: int, world: int) -> bool:
    """Whether Ulysses can split these heads over ``world`` ranks (`kv_replication` does not raise)."""
    try:
        kv_replication(hq, hkv, world)
    except ValueError:
        return False
    return True


class UlyssesAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, info: GroupInfo, layout, band: Mask, scale: float, launchers: Launchers, rep: int = 1):
        if rep > 1:  # Hkv < P: every rank must receive the kv head its query heads read
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        q_h, k_h, v_h = seq_to_head_many([q, k, v], info, layout)  # (B, Hq/P, S, D), (B, Hkv/P, S, D) x 2
        if isinstance(band, Documents):  # one launch over the whole packed sequence
            out_h, lse_h = step_forward(_whole(band, q_h.shape[2]), q_h, k_h, v_h, scale=scale, launchers=launchers)
        else:
            out_h, lse_h = launchers.forward(q_h, k_h, v_h, scale=scale, band=band)
        ctx.save_for_backward(q_h, k_h, v_h, out_h, lse_h)
        ctx.info, ctx.layout, ctx.band, ctx.scale, ctx.launchers = info, layout, band, scale, launchers
        ctx.rep = rep
        return head_to_seq(out_h, info, layout)

    @staticmethod
    def backward(ctx, do):
        q_h, k_h, v_h, out_h, lse_h = ctx.saved_tensors
        info, layout = ctx.info, ctx.layout
        do_h = seq_to_head(do, info, layout)
        if isinstance(ctx.band, Documents):
            step = _whole(ctx.band, q_h.shape[2])
            dq_h, dk_h, dv_h = step_backward(step, do_h, q_h, k_h, v_h, out_h, lse_h, scale=ctx.scale,
                                             launchers=ctx.launchers)  # fmt: skip
        else:
            dq_h, dk_h, dv_h = ctx.launchers.backward(do_h, q_h, k_h, v_h, out_h, lse_h, scale=ctx.scale, band=ctx.band)
        rep = ctx.rep
        if rep == 1:
            dq, dk, dv = head_to_seq_many([g.to(q_h.dtype) for g in (dq_h, dk_h, dv_h)], info, layout)
        else:  # the copies' gradients travel in the launchers' float32 and are summed before rounding
            dq = head_to_seq(dq_h.to(q_h.dtype), info, layout)
            dk, dv = head_to_seq_many([dk_h, dv_h], info, layout)  # (B, Hkv rep, S/P, D)
            dk, dv = (g.unflatten(1, (g.shape[1] // rep, rep)).sum(2).to(k_h.dtype) for g in (dk, dv))
        return dq, dk, dv, None, None, None, None, None, None

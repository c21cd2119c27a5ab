"""Block-sparse attention in plain PyTorch: the `tiled` backend's path for ``block_mask=...``.

The FlashAttention algorithm of `longctx.reference.tiled`, walking only the blocks a `BlockMask` keeps:

    forward, per (batch, head, query block):  for kv block in full list + partial list:
        S = Q K^T * scale ; on partial blocks S[~element_mask] = -inf ; online softmax update
    backward, per (batch, head, kv block):    for q block in the *transposed* full + partial lists:
        P = exp(S - lse) ; dV += P^T dO ; dS = P * (dO V^T - Delta) ; dQ += dS K ; dK += dS^T Q

Work is proportional to the number of kept blocks. When the mask broadcasts over heads (Hm == 1) all query
heads of a batch are processed together (GQA through a broadcast view of K/V, never a copy); per-head masks
go head by head. A ``band`` (causal=/window= given together with the block mask) is intersected with it.
``softcap > 0`` caps the scaled scores, ``S -> softcap * tanh(S / softcap)``, before the element mask; the backward
multiplies dS by ``1 - tanh(S / softcap)^2``.
"""

from __future__ import annotations

import torch

from longctx.dtypes import accumulation_dtype
from longctx.masks import Band, BlockMask, TileKind
from longctx.reference.tiled import softcap_scores

__all__ = ["tiled_block_sparse", "block_sparse_forward", "block_sparse_backward"]


def _units(q, k, v, bm: BlockMask):
    """Yield (b, mask_b, mask_h, head slice, q5, k4, v4): q5 (Hkv_u, G_u, Sq, D), k4/v4 (Hkv_u, 1, Sk, D)."""
    B, Hq, Sq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    mb, mh = bm.block_kind.shape[:2]
    for b in range(B):
        bb = b if mb > 1 else 0
        if mh == 1:
            yield (
                b,
                bb,
                0,
                slice(0, Hq),
                q[b].reshape(Hkv, G, Sq, D),
                k[b].unsqueeze(1),
                v[b].unsqueeze(1),
            )
        else:
            for h in range(Hq):
                yield (
                    b,
                    bb,
                    h,
                    slice(h, h + 1),
                    q[b, h].reshape(1, 1, Sq, D),
                    k[b, h // G].reshape(1, 1, -1, D),
                    v[b, h // G].reshape(1, 1, -1, D),
                )


def _element_mask(bm: BlockMask, band: Band, bb, hh, qb, kb, qs, qe, ks, ke, partial, device):
    """Element mask of one block, or None when every entry is visible; "skip" when the band removes it."""
    kind = band.tile_kind(qs, qe, ks, ke)
    if kind is TileKind.EMPTY:
        return "skip"
    mask = bm.tile_mask(bb, hh, qb, kb)[: qe - qs, : ke - ks].to(device) if partial else None
    if kind is TileKind.PARTIAL:
        bmask = band.mask(qs, qe, ks, ke, device=device)
        mask = bmask if mask is None else (mask & bmask)
    return mask


def block_sparse_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    band: Band,
    block_mask: BlockMask,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher contract: q (B, Hq, Sq, D), k/v (B, Hkv, Sk, D) -> out (B, Hq, Sq, D), lse (B, Hq, Sq)."""
    bm = block_mask
    B, Hq, Sq, D = q.shape
    Sk = k.shape[2]
    bs = bm.block_size
    cdt = accumulation_dtype(q.dtype)
    L = bm.cpu_lists()
    out = torch.empty(B, Hq, Sq, D, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, Hq, Sq, device=q.device, dtype=cdt)
    ninf = float("-inf")
    for b, bb, hh, hs, q5, k4, v4 in _units(q, k, v, bm):
        out_u = out[b, hs].view(q5.shape)  # (Hkv_u, G_u, Sq, D)
        lse_u = lse[b, hs].view(q5.shape[:-1])
        for qb in range(bm.num_blocks[0]):
            qs, qe = qb * bs, min(qb * bs + bs, Sq)
            q_t = q5[:, :, qs:qe].to(cdt)
            m = torch.full(q_t.shape[:-1], ninf, device=q.device, dtype=cdt)
            l = torch.zeros_like(m)
            acc = torch.zeros(q_t.shape, device=q.device, dtype=cdt)
            blocks = [(kb, False) for kb in L["full_kv_indices"][bb][hh][qb][: L["full_kv_num_blocks"][bb][hh][qb]]]
            blocks += [(kb, True) for kb in L["kv_indices"][bb][hh][qb][: L["kv_num_blocks"][bb][hh][qb]]]
            for kb, partial in blocks:
                ks, ke = kb * bs, min(kb * bs + bs, Sk)
                mask = _element_mask(bm, band, bb, hh, qb, kb, qs, qe, ks, ke, partial, q.device)
                if isinstance(mask, str):
                    continue
                # -- scores; the element mask only on partial blocks --
                s = torch.matmul(q_t, k4[:, :, ks:ke].to(cdt).transpose(-1, -2)) * scale
                s = softcap_scores(s, softcap)[0]
                if mask is not None:
                    s = s.masked_fill(~mask, ninf)
                # -- online softmax update --
                m_new = torch.maximum(m, s.amax(dim=-1))
                m_safe = torch.where(m_new == ninf, torch.zeros_like(m_new), m_new)
                p = torch.exp(s - m_safe.unsqueeze(-1))
                alpha = torch.exp(m - m_safe)
                l = l * alpha + p.sum(dim=-1)
                acc = acc * alpha.unsqueeze(-1) + torch.matmul(p, v4[:, :, ks:ke].to(cdt))
                m = m_new
            # -- epilogue: rows that saw nothing get output 0 and lse -inf --
            empty = l == 0
            l_safe = torch.where(empty, torch.ones_like(l), l)
            out_u[:, :, qs:qe] = (acc / l_safe.unsqueeze(-1)).to(q.dtype)
            lse_u[:, :, qs:qe] = torch.where(empty, torch.full_like(m, ninf), m + torch.log(l_safe))
    return out, lse


def block_sparse_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float,
    band: Band,
    block_mask: BlockMask,
    dlse: torch.Tensor | None = None,
    softcap: float = 0.0,
    grad_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recomputing backward over the transposed block lists: (dq, dk, dv) in the input dtype (``grad_dtype`` when
    given)."""
    bm = block_mask
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    bs = bm.block_size
    cdt = accumulation_dtype(q.dtype)
    L = bm.cpu_lists()
    # -- preprocessing: Delta = rowsum(dO * O) - dlse --
    delta = (do.to(cdt) * out.to(cdt)).sum(-1)
    if dlse is not None:
        delta = delta - dlse.to(cdt)
    lse_safe = torch.where(lse == float("-inf"), torch.full_like(lse, float("inf")), lse).to(cdt)
    dq = torch.zeros(B, Hq, Sq, D, device=q.device, dtype=cdt)
    dk = torch.zeros(B, Hkv, Sk, D, device=q.device, dtype=cdt)
    dv = torch.zeros_like(dk)
    G = Hq // Hkv
    mh = bm.block_kind.shape[1]
    for b, bb, hh, hs, q5, k4, v4 in _units(q, k, v, bm):
        shp = q5.shape
        do5 = do[b, hs].reshape(shp)
        dq5 = dq[b, hs].view(shp)
        d5 = delta[b, hs].reshape(shp[:-1])
        l5 = lse_safe[b, hs].reshape(shp[:-1])
        kv_h = slice(0, Hkv) if mh == 1 else slice(hh // G, hh // G + 1)
        for kb in range(bm.num_blocks[1]):
            ks, ke = kb * bs, min(kb * bs + bs, Sk)
            k_t = k4[:, :, ks:ke].to(cdt)  # (Hkv_u, 1, bk, D)
            v_t = v4[:, :, ks:ke].to(cdt)
            dk_t = torch.zeros(k_t.shape[0], ke - ks, D, device=q.device, dtype=cdt)
            dv_t = torch.zeros_like(dk_t)
            blocks = [(qb, False) for qb in L["full_q_indices"][bb][hh][kb][: L["full_q_num_blocks"][bb][hh][kb]]]
            blocks += [(qb, True) for qb in L["q_indices"][bb][hh][kb][: L["q_num_blocks"][bb][hh][kb]]]
            for qb, partial in blocks:
                qs, qe = qb * bs, min(qb * bs + bs, Sq)
                mask = _element_mask(bm, band, bb, hh, qb, kb, qs, qe, ks, ke, partial, q.device)
                if isinstance(mask, str):
                    continue
                q_t = q5[:, :, qs:qe].to(cdt)
                do_t = do5[:, :, qs:qe].to(cdt)
                # -- recompute the probabilities --
                s = torch.matmul(q_t, k_t.transpose(-1, -2)) * scale
                s, t = softcap_scores(s, softcap)
                if mask is not None:
                    s = s.masked_fill(~mask, float("-inf"))
                p = torch.exp(s - l5[:, :, qs:qe].unsqueeze(-1))
                # -- gradients; a shared kv head sums over the query heads of its group --
                dv_t += torch.matmul(p.transpose(-1, -2), do_t).sum(1)
                dp = torch.matmul(do_t, v_t.transpose(-1, -2))
                ds = p * (dp - d5[:, :, qs:qe].unsqueeze(-1))
                if t is not None:  # chain rule through the cap
                    ds = ds * (1 - t * t)
                dq5[:, :, qs:qe] += torch.matmul(ds, k_t) * scale
                dk_t += torch.matmul(ds.transpose(-1, -2), q_t).sum(1) * scale
            dk[b, kv_h, ks:ke] += dk_t
            dv[b, kv_h, ks:ke] += dv_t
    return dq.to(grad_dtype or q.dtype), dk.to(grad_dtype or k.dtype), dv.to(grad_dtype or v.dtype)


class TiledBlockSparse(torch.autograd.Function):
    """Saves q, k, v, out, lse (and the mask object); the backward walks the transposed lists."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float, band: Band, bm: BlockMask, softcap: float = 0.0):
        out, lse = block_sparse_forward(q, k, v, scale=scale, band=band, block_mask=bm, softcap=softcap)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.band, ctx.bm, ctx.softcap = scale, band, bm, softcap
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = block_sparse_backward(
            dout, q, k, v, out, lse, scale=ctx.scale, band=ctx.band, block_mask=ctx.bm, dlse=dlse, softcap=ctx.softcap
        )
        return dq, dk, dv, None, None, None, None


def tiled_block_sparse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    band: Band,
    block_mask: BlockMask,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable block-sparse attention in plain PyTorch: ``(out, lse)``; ``softcap > 0`` caps the scores."""
    return TiledBlockSparse.apply(q, k, v, scale, band, block_mask, float(softcap))

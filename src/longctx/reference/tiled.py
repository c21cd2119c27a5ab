"""FlashAttention in plain PyTorch: the tiled online-softmax forward and the recomputing backward.

The same algorithm as the Triton kernels, written with tensor operations so that it runs anywhere (CPU
included) and can be read top to bottom:

forward, for each query tile Q_i and each key/value tile (K_j, V_j) the mask does not remove entirely:

    S    = Q_i K_j^T * scale                (masked per element only on boundary tiles)
    m'   = max(m, rowmax(S))
    P    = exp(S - m')
    l    = l * exp(m - m') + rowsum(P)
    acc  = acc * exp(m - m') + P V_j
    m    = m'
    then O_i = acc / l and lse_i = m + log(l)

backward (only q, k, v, out and lse were saved), with Delta = rowsum(dO * O):

    P  = exp(Q_i K_j^T * scale - lse_i)     (the probabilities, recomputed tile by tile)
    dV_j += P^T dO_i ;  dP = dO_i V_j^T ;  dS = P * (dP - Delta_i)
    dQ_i += dS K_j * scale ;  dK_j += dS^T Q_i * scale

Logit softcapping (Gemma 2, ``softcap > 0``): S is replaced by ``softcap * tanh(S / softcap)`` before the mask;
the backward multiplies dS by the derivative of the cap, ``1 - tanh(S / softcap)^2``, before dQ and dK.

Peak memory is O(S * D) plus one tile of scores: linear in the sequence length. GQA shares a kv head
between the query heads of a group through broadcasting; K/V are never repeated in memory. Arithmetic is in
float32 (float64 for float64 inputs) whatever the input dtype.
"""

from __future__ import annotations

import torch

from longctx.dtypes import accumulation_dtype
from longctx.masks import Band, TileKind

__all__ = ["tiled_forward", "tiled_backward", "TiledAttention", "tiled_attention"]

DEFAULT_BLOCK = 128


def _tiles(n: int, block: int) -> list[tuple[int, int]]:
    return [(s, min(s + block, n)) for s in range(0, n, block)]


def softcap_scores(s: torch.Tensor, softcap: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(softcap * tanh(s / softcap), tanh(s / softcap))`` for softcap > 0; ``(s, None)`` for softcap == 0."""
    if softcap <= 0:
        return s, None
    t = torch.tanh(s / softcap)
    return softcap * t, t


def tiled_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    band: Band = Band(),
    block_q: int = DEFAULT_BLOCK,
    block_k: int = DEFAULT_BLOCK,
    stats: dict | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiled forward following the launcher contract (`longctx.ops`).

    Args:
        q: (B, Hq, Sq, D); k, v: (B, Hkv, Sk, D), Hq % Hkv == 0.
        scale: softmax scale.
        band: mask band (`longctx.masks.Band`); tiles it removes entirely are skipped.
        block_q, block_k: tile sizes.
        stats: if a dict is given, ``stats["tiles"]`` / ``stats["tiles_total"]`` count computed and total tiles.
        softcap: if > 0, scores are capped to ``softcap * tanh(scores / softcap)`` before the mask.

    Returns:
        out (B, Hq, Sq, D) in q.dtype and lse (B, Hq, Sq) in float32 (float64 for float64 inputs).
    """
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    cdt = accumulation_dtype(q.dtype)
    q5 = q.reshape(B, Hkv, G, Sq, D)  # (B, Hkv, G, Sq, D): a view when q is contiguous per head
    k4, v4 = k.unsqueeze(2), v.unsqueeze(2)  # (B, Hkv, 1, Sk, D): broadcast over the group
    out = torch.empty(B, Hkv, G, Sq, D, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, Hkv, G, Sq, device=q.device, dtype=cdt)
    computed = 0
    k_tiles = _tiles(Sk, block_k)
    for qs, qe in _tiles(Sq, block_q):
        q_t = q5[:, :, :, qs:qe].to(cdt)  # (B, Hkv, G, bq, D)
        m = torch.full(q_t.shape[:-1], float("-inf"), device=q.device, dtype=cdt)  # running row max
        l = torch.zeros_like(m)  # running row sum of exp(S - m)
        acc = torch.zeros(q_t.shape, device=q.device, dtype=cdt)
        for ks, ke in k_tiles:
            kind = band.tile_kind(qs, qe, ks, ke)
            if kind is TileKind.EMPTY:
                continue
            computed += 1
            # -- scores --
            s = torch.matmul(q_t, k4[:, :, :, ks:ke].to(cdt).transpose(-1, -2)) * scale  # (B,Hkv,G,bq,bk)
            s = softcap_scores(s, softcap)[0]
            if kind is TileKind.PARTIAL:  # boundary tile: mask per element
                s = s.masked_fill(~band.mask(qs, qe, ks, ke, device=q.device), float("-inf"))
            # -- online softmax update --
            m_new = torch.maximum(m, s.amax(dim=-1))
            m_safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)  # rows with no key yet
            p = torch.exp(s - m_safe.unsqueeze(-1))
            alpha = torch.exp(m - m_safe)  # exp(-inf) = 0 before the first visible key
            l = l * alpha + p.sum(dim=-1)
            acc = acc * alpha.unsqueeze(-1) + torch.matmul(p, v4[:, :, :, ks:ke].to(cdt))
            m = m_new
        # -- epilogue: normalise; a row that saw no key has l == 0: output 0, lse -inf --
        empty = l == 0
        l_safe = torch.where(empty, torch.ones_like(l), l)
        out[:, :, :, qs:qe] = (acc / l_safe.unsqueeze(-1)).to(q.dtype)
        lse[:, :, :, qs:qe] = torch.where(empty, torch.full_like(m, float("-inf")), m + torch.log(l_safe))
    if stats is not None:
        stats["tiles"] = stats.get("tiles", 0) + computed
        stats["tiles_total"] = stats.get("tiles_total", 0) + len(k_tiles) * len(_tiles(Sq, block_q))
    return out.reshape(B, Hq, Sq, D), lse.reshape(B, Hq, Sq)


def tiled_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float,
    band: Band = Band(),
    dlse: torch.Tensor | None = None,
    block_q: int = DEFAULT_BLOCK,
    block_k: int = DEFAULT_BLOCK,
    grad_dtype: torch.dtype | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tiled backward following the launcher contract: recomputes P from q, k and lse.

    Args:
        do: (B, Hq, Sq, D) gradient of the output.
        q, k, v, out, lse: as given to / returned by `tiled_forward` (out and lse may be the merged result of
            several partial attentions, as in ring attention: the gradients are then this block's share).
        dlse: optional (B, Hq, Sq) gradient of lse (d lse / d S = P, so it enters as ``Delta - dlse``).
        grad_dtype: dtype of the returned gradients (default: the input dtype).
        softcap: the forward's softcap (0: none).

    Returns:
        dq (B, Hq, Sq, D), dk, dv (B, Hkv, Sk, D).
    """
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    cdt = accumulation_dtype(q.dtype)
    gdt = grad_dtype or q.dtype
    q5 = q.reshape(B, Hkv, G, Sq, D)
    do5 = do.reshape(B, Hkv, G, Sq, D)
    # -- preprocessing: Delta = rowsum(dO * O) (minus dlse when lse itself has a gradient) --
    delta = (do.to(cdt) * out.to(cdt)).sum(dim=-1)  # (B, Hq, Sq)
    if dlse is not None:
        delta = delta - dlse.to(cdt)
    delta = delta.reshape(B, Hkv, G, Sq)
    # lse = -inf marks rows that see nothing: +inf there makes every recomputed probability exactly 0.
    lse_safe = torch.where(lse == float("-inf"), torch.full_like(lse, float("inf")), lse).to(cdt)
    lse_safe = lse_safe.reshape(B, Hkv, G, Sq)
    dq = torch.zeros(B, Hkv, G, Sq, D, device=q.device, dtype=cdt)
    dk = torch.zeros(B, Hkv, Sk, D, device=q.device, dtype=cdt)
    dv = torch.zeros(B, Hkv, Sk, D, device=q.device, dtype=cdt)
    q_tiles = _tiles(Sq, block_q)
    for ks, ke in _tiles(Sk, block_k):
        k_t = k[:, :, ks:ke].to(cdt).unsqueeze(2)  # (B, Hkv, 1, bk, D)
        v_t = v[:, :, ks:ke].to(cdt).unsqueeze(2)
        dk_t = torch.zeros(B, Hkv, ke - ks, D, device=q.device, dtype=cdt)
        dv_t = torch.zeros_like(dk_t)
        for qs, qe in q_tiles:
            kind = band.tile_kind(qs, qe, ks, ke)
            if kind is TileKind.EMPTY:
                continue
            q_t = q5[:, :, :, qs:qe].to(cdt)  # (B, Hkv, G, bq, D)
            do_t = do5[:, :, :, qs:qe].to(cdt)
            # -- recompute probabilities --
            s = torch.matmul(q_t, k_t.transpose(-1, -2)) * scale  # (B, Hkv, G, bq, bk)
            s, t = softcap_scores(s, softcap)
            if kind is TileKind.PARTIAL:
                s = s.masked_fill(~band.mask(qs, qe, ks, ke, device=q.device), float("-inf"))
            p = torch.exp(s - lse_safe[:, :, :, qs:qe].unsqueeze(-1))
            # -- gradients; dK/dV of a shared kv head sum over the query heads of its group --
            dv_t += torch.matmul(p.transpose(-1, -2), do_t).sum(dim=2)
            dp = torch.matmul(do_t, v_t.transpose(-1, -2))
            ds = p * (dp - delta[:, :, :, qs:qe].unsqueeze(-1))
            if t is not None:  # chain rule through the cap: d(softcap * tanh(x / softcap))/dx = 1 - tanh^2
                ds = ds * (1 - t * t)
            dq[:, :, :, qs:qe] += torch.matmul(ds, k_t) * scale
            dk_t += torch.matmul(ds.transpose(-1, -2), q_t).sum(dim=2) * scale
        dk[:, :, ks:ke] = dk_t
        dv[:, :, ks:ke] = dv_t
    return dq.reshape(B, Hq, Sq, D).to(gdt), dk.to(gdt), dv.to(gdt)


class TiledAttention(torch.autograd.Function):
    """Autograd for the tiled backend: saves only q, k, v, out and lse; the backward recomputes."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float, band: Band, block_q: int, block_k: int, softcap: float = 0.0):
        out, lse = tiled_forward(q, k, v, scale=scale, band=band, block_q=block_q, block_k=block_k, softcap=softcap)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.band, ctx.block_q, ctx.block_k, ctx.softcap = scale, band, block_q, block_k, softcap
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = tiled_backward(
            dout,
            q,
            k,
            v,
            out,
            lse,
            scale=ctx.scale,
            band=ctx.band,
            dlse=dlse,
            block_q=ctx.block_q,
            block_k=ctx.block_k,
            softcap=ctx.softcap,
        )
        return dq, dk, dv, None, None, None, None, None


def tiled_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    band: Band = Band(),
    block_q: int = DEFAULT_BLOCK,
    block_k: int = DEFAULT_BLOCK,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable tiled attention (in q, k, v, and through lse): ``(out, lse)``; ``softcap > 0`` caps the scaled
    scores to ``softcap * tanh(scores / softcap)``."""
    return TiledAttention.apply(q, k, v, scale, band, block_q, block_k, float(softcap))

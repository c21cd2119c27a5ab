"""The dense reference ("math" backend): every score materialised, any dtype including float64.

It is the oracle the tests trust, so it is written to be obviously right rather than fast: GQA by
indexing the kv head of each query head (a broadcast view, no copy of K/V), the mask from `Band`,
softmax through an explicit log-sum-exp so that fully masked rows give output 0 and lse -inf. With
``softcap > 0`` the scaled scores are capped, ``s -> softcap * tanh(s / softcap)`` (Gemma 2), before masking.
"""

from __future__ import annotations

import torch

from longctx.dtypes import accumulation_dtype
from longctx.masks import Band

__all__ = ["naive_attention"]


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    band: Band = Band(),
    mask: torch.Tensor | None = None,
    upcast: torch.dtype | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention returning ``(out, lse)``; differentiable through plain autograd.

    Args:
        q: (B, Hq, Sq, D).
        k, v: (B, Hkv, Sk, D) with Hq a multiple of Hkv; query head h reads kv head h // (Hq // Hkv).
        scale: multiplies q @ k^T.
        band: causal / window band (see `longctx.masks`).
        mask: optional extra boolean mask broadcastable to (B, Hq, Sq, Sk), True = visible.
        upcast: compute in this dtype (float64 for the oracle); default float32, or float64 for
            float64 inputs.
        softcap: if > 0, the scaled scores become ``softcap * tanh(scale * q.k / softcap)`` before the mask
            and the softmax; 0 leaves them as they are.

    Returns:
        out (B, Hq, Sq, D) in q's dtype, or in ``upcast`` when given; lse (B, Hq, Sq) in the compute
        dtype (natural log; -inf where a row sees no key).
    """
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    cdt = upcast or accumulation_dtype(q.dtype)
    group = Hq // Hkv
    # (B, Hkv, group, Sq, D): query heads of one group share a kv head without copying K/V.
    q5 = q.to(cdt).reshape(B, Hkv, group, Sq, D)
    k5 = k.to(cdt).unsqueeze(2)  # (B, Hkv, 1, Sk, D)
    v5 = v.to(cdt).unsqueeze(2)
    s = torch.matmul(q5, k5.transpose(-1, -2)) * scale  # (B, Hkv, group, Sq, Sk)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    keep = band.mask(0, Sq, 0, Sk, device=q.device)
    if mask is not None:
        m = mask.to(torch.bool).expand(B, Hq, Sq, Sk).reshape(B, Hkv, group, Sq, Sk)
        keep = m if keep is None else (m & keep)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1, keepdim=True)  # (B, Hkv, group, Sq, 1)
    # exp(s - lse) with lse = -inf on fully masked rows would be NaN; use a finite stand-in there.
    lse_safe = torch.where(torch.isinf(lse) & (lse < 0), torch.zeros_like(lse), lse)
    p = torch.exp(s - lse_safe)
    out = torch.matmul(p, v5).reshape(B, Hq, Sq, D)
    out_dtype = upcast or q.dtype
    return out.to(out_dtype), lse.reshape(B, Hq, Sq)

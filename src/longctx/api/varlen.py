"""Packed documents: flash-attn's ``flash_attn_varlen_func`` on top of block-sparse attention.

The documents of a batch are concatenated along the token axis (no padding) and described by cumulative
lengths ``cu_seqlens`` (int32, batch + 1 entries, starting at 0). Document d holds queries
``cu_seqlens_q[d]:cu_seqlens_q[d+1]`` and keys ``cu_seqlens_k[d]:cu_seqlens_k[d+1]``; attention never crosses
a document boundary, and causal / window masks apply inside each document, aligned bottom-right as in
flash-attn (the last query of a document sees its last key):

    packed:   | doc 0 (Lq0 x Lk0) |                       per document, local indices i (query), j (key):
              |                   | doc 1 |                 visible iff  -left <= j - (i + Lk - Lq) <= right
              |                           | doc 2 ... |     (causal: right = 0; -1 = unbounded)

Internally it is one block-sparse attention over the packed sequence (batch 1, heads Hq) whose mask is the
analytic `DocBand` rule (per-token document ids and document-local positions): blocks outside every document
are skipped, blocks inside a document's band are computed without a mask, and only blocks on a document or
band boundary apply the element rule. So the work is proportional to the sum over documents of the visible
part of Lq x Lk, never to batch x max_seqlen^2.
"""

from __future__ import annotations

import math
import numbers
import weakref
from collections import OrderedDict

import torch

from longctx.api.core import follow_autocast, unsupported_flash_args
from longctx.dispatch import AttnInputs, get_backend, select_backend
from longctx.masks import Band, BlockMask, DocBand, flash_window
from longctx.masks.build import _build_analytic

__all__ = [
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "varlen_block_mask",
]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_CACHE: OrderedDict = OrderedDict()
_CACHE_SIZE = 16
# cu_seqlens tensors already read and validated: id -> (weakref to the tensor, its version counter, values).
# A model passes the same cu_seqlens to every layer; reading it costs a device-to-host copy (a sync), so it is
# read once per tensor and again only after an in-place change (which bumps the version counter).
_SEEN: OrderedDict = OrderedDict()


def _values(cu: torch.Tensor) -> list[int]:
    key = id(cu)
    hit = _SEEN.get(key)
    if hit is not None and hit[0]() is cu and hit[1] == cu._version:
        _SEEN.move_to_end(key)
        return hit[2]
    vals = cu.tolist()
    _SEEN[key] = (weakref.ref(cu), cu._version, vals)
    while len(_SEEN) > _CACHE_SIZE:
        _SEEN.popitem(last=False)
    return vals


def _check_cu(name: str, cu: object, total: int, max_seqlen: object, device: torch.device) -> list[int]:
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of dtype int32, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32 (as in flash-attn), got {cu.dtype}; use .to(torch.int32)")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be 1-D with batch + 1 >= 2 entries, got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device} but q is on {device}; move it with .to(q.device)")
    vals = _values(cu)  # one host copy per cu_seqlens tensor (and per in-place change), not per call
    if vals[0] != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {vals[0]}")
    for i in range(1, len(vals)):
        if vals[i] < vals[i - 1]:
            raise ValueError(
                f"{name} must be non-decreasing (cumulative document lengths), but {name}[{i}] = {vals[i]} < "
                f"{name}[{i - 1}] = {vals[i - 1]}"
            )
    if vals[-1] != total:
        raise ValueError(
            f"{name}[-1] = {vals[-1]} must equal the number of packed tokens ({total}, the first dimension of "
            f"{'q' if name.endswith('_q') else 'k and v'})"
        )
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, numbers.Integral):
        raise TypeError(f"max_seqlen for {name} must be an int, got {type(max_seqlen).__name__}")
    longest = max(vals[i + 1] - vals[i] for i in range(len(vals) - 1))
    if max_seqlen < longest:
        raise ValueError(
            f"max_seqlen ({max_seqlen}) is smaller than the longest document of {name} ({longest}); "
            "pass the maximum of the document lengths"
        )
    return vals


def _doc_tensors(cu: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token document index and document-local position, int32 (total,)."""
    lengths = torch.tensor([cu[i + 1] - cu[i] for i in range(len(cu) - 1)], dtype=torch.int64)
    doc = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int64), lengths)
    pos = torch.arange(cu[-1], dtype=torch.int64) - torch.tensor(cu[:-1], dtype=torch.int64)[doc]
    return doc.to(device=device, dtype=torch.int32), pos.to(device=device, dtype=torch.int32)


def varlen_block_mask(
    cu_q: list[int],
    cu_k: list[int],
    *,
    causal: bool,
    window: tuple[int, int],
    block_size: int,
    device: torch.device,
) -> BlockMask:
    """The `BlockMask` (batch 1, heads 1) of packed documents; cached on the cu_seqlens values."""
    key = (tuple(cu_q), tuple(cu_k), bool(causal), tuple(window), block_size, str(device))
    hit = _CACHE.get(key)
    if hit is not None:
        _CACHE.move_to_end(key)
        return hit
    q_doc, q_loc = _doc_tensors(cu_q, device)
    k_doc, k_pos = _doc_tensors(cu_k, device)
    # the bottom-right alignment of each document: query position shifted by Lk_d - Lq_d
    shift = torch.tensor(
        [(cu_k[d + 1] - cu_k[d]) - (cu_q[d + 1] - cu_q[d]) for d in range(len(cu_q) - 1)], dtype=torch.int32
    ).to(device)
    q_pos = q_loc + shift[q_doc.long()]
    left, right = window
    lo = -left if left >= 0 else None
    hi = right if right >= 0 else None
    if causal:
        hi = 0
    rule = DocBand(q_doc=q_doc, k_doc=k_doc, q_pos=q_pos, k_pos=k_pos, lo=lo, hi=hi)
    bm = _build_analytic(rule, cu_q[-1], cu_k[-1], block_size, device, None, "varlen")
    _CACHE[key] = bm
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return bm


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
    *,
    backend: str = "auto",
    block_size: int = 128,
):
    """Drop-in for flash-attn's ``flash_attn_varlen_func`` (v2.6+ signature): attention over packed documents.

    Args:
        q: (total_q, Hq, D) queries of all documents, concatenated.
        k, v: (total_k, Hkv, D); Hq a multiple of Hkv (GQA: query head h reads kv head h // (Hq // Hkv)).
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,), on q's device: 0, then cumulative document lengths.
        max_seqlen_q, max_seqlen_k: ints, at least the longest document (as in flash-attn).
        dropout_p: must be 0.0. alibi_slopes, block_table: must be None.
        softcap: logit softcapping (Gemma 2): with softcap > 0 the scaled scores s become
            ``softcap * tanh(s / softcap)`` before the mask and softmax; 0.0 is off.
        softmax_scale: default 1/sqrt(D).
        causal: bottom-right within each document (query i of a document with Lq queries and Lk keys sees
            local keys j <= i + Lk - Lq; with Lq > Lk the first rows see nothing and give 0).
        window_size: (left, right) within each document, -1 unbounded; as in flash-attn, a side of max_seqlen_k or
            more is unbounded and causal makes the right side 0 (`longctx.masks.flash_window`).
        deterministic: accepted (every longctx backward here is deterministic).
        return_attn_probs: also return ``(softmax_lse (Hq, total_q) float32, None)``.
        backend: "auto" (CUDA: "triton_sparse" when it can run, else "tiled"; CPU: "tiled"), "tiled",
            "triton_sparse" or "math" (dense reference, quadratic memory).
        block_size: the block size of the underlying block-sparse mask.

    Inside ``torch.autocast`` on q's device, q, k and v are cast to the autocast dtype first (as `attention`).

    Returns:
        out (total_q, Hq, D), or ``(out, softmax_lse, None)`` with return_attn_probs.

    Raises:
        TypeError/ValueError: bad tensors (mixed dtypes outside autocast), or cu_seqlens that are not int32, not
            on q's device, not starting at 0, decreasing, not ending at the number of tokens, or a max_seqlen below
            the longest document.
        ValueError: dropout_p != 0, a negative softcap, alibi_slopes or block_table given.

    A document with no keys (a repeated entry in cu_seqlens_k) gives output 0, lse -inf and zero gradients for
    its queries, as in flash-attn.
    """
    softcap = unsupported_flash_args("flash_attn_varlen_func", dropout_p, softcap, alibi_slopes, block_table)
    q, k, v, run_ctx = follow_autocast(q, k, v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(
                f"{name} must have 3 dimensions (total_tokens, heads, head_dim) in flash_attn_varlen_func, got "
                f"shape {tuple(t.shape)}"
            )
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; expected float16, bfloat16, float32 or float64")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    Tq, Hq, D = q.shape
    Tk, Hkv = k.shape[0], k.shape[1]
    if k.shape[2] != D:
        raise ValueError(f"head_dim differs: q has {D}, k and v have {k.shape[2]}")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"the number of query heads ({Hq}) must be a positive multiple of the kv heads ({Hkv})")
    cu_q = _check_cu("cu_seqlens_q", cu_seqlens_q, Tq, max_seqlen_q, q.device)
    cu_k = _check_cu("cu_seqlens_k", cu_seqlens_k, Tk, max_seqlen_k, q.device)
    if len(cu_q) != len(cu_k):
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe the same number of documents, got {len(cu_q) - 1} "
            f"and {len(cu_k) - 1}"
        )
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    window = flash_window(tuple(window_size), causal=causal, seqlen_k=max_seqlen_k)
    if softmax_scale is None:
        scale = 1.0 / math.sqrt(D) if D > 0 else 1.0
    else:
        scale = float(softmax_scale)
        if not math.isfinite(scale):
            raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    if Tq == 0 or Tk == 0:
        out = torch.zeros_like(q) + 0 * q.sum() + 0 * k.sum() + 0 * v.sum()
        lse = torch.full((Hq, Tq), float("-inf"), device=q.device, dtype=torch.float32)
        return (out, lse, None) if return_attn_probs else out

    bm = varlen_block_mask(cu_q, cu_k, causal=causal, window=window, block_size=block_size, device=q.device)
    # (total, H, D) -> (1, H, total, D): strided views, no copy
    q4, k4, v4 = (t.permute(1, 0, 2).unsqueeze(0) for t in (q, k, v))
    inp = AttnInputs.from_tensors(
        q4, k4, band=Band(), return_lse=return_attn_probs, block_mask=True, varlen=True, softcap=softcap
    )
    if backend == "auto":
        chosen = None
        if q.device.type == "cuda":
            try:
                cand = select_backend("triton_sparse", inp).backend
                chosen = cand
            except ValueError:
                chosen = None
        if chosen is None:
            chosen = get_backend("tiled")
    else:
        chosen = select_backend(backend, inp).backend
    with run_ctx:
        out4, lse = chosen.run(
            q4,
            k4,
            v4,
            scale=scale,
            band=Band(),
            return_lse=True,
            deterministic=deterministic,
            block_mask=bm,
            softcap=softcap,
        )
    out = out4[0].permute(1, 0, 2)  # (total_q, Hq, D)
    if not out.is_contiguous():
        out = out.contiguous()
    if return_attn_probs:
        return out, lse[0].float() if lse.dtype != torch.float64 else lse[0], None
    return out


def flash_attn_varlen_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    backend: str = "auto",
    block_size: int = 128,
):
    """flash-attn's ``flash_attn_varlen_kvpacked_func``: `flash_attn_varlen_func` with kv (total_k, 2, Hkv, D).

    k and v are views of ``kv[:, 0]`` and ``kv[:, 1]`` (no copies); gradients flow to kv.
    """
    if not isinstance(kv, torch.Tensor) or kv.dim() != 4 or kv.shape[1] != 2:
        raise ValueError(
            f"kv must be a tensor of shape (total_k, 2, heads_k, head_dim), got "
            f"{tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__}"
        )
    k, v = kv.unbind(1)  # (total_k, Hkv, D) views
    return flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
        window_size, softcap, alibi_slopes, deterministic, return_attn_probs, backend=backend, block_size=block_size,
    )  # fmt: skip


def flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    backend: str = "auto",
    block_size: int = 128,
):
    """flash-attn's ``flash_attn_varlen_qkvpacked_func``: `flash_attn_varlen_func` with qkv (total, 3, H, D).

    q, k and v are views of ``qkv[:, i]`` (no copies) sharing ``cu_seqlens``; gradients flow to qkv.
    """
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 4 or qkv.shape[1] != 3:
        raise ValueError(
            f"qkv must be a tensor of shape (total, 3, heads, head_dim), got "
            f"{tuple(qkv.shape) if isinstance(qkv, torch.Tensor) else type(qkv).__name__}"
        )
    q, k, v = qkv.unbind(1)  # (total, H, D) views
    return flash_attn_varlen_func(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale, causal, window_size,
        softcap, alibi_slopes, deterministic, return_attn_probs, backend=backend, block_size=block_size,
    )  # fmt: skip

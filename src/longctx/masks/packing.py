"""Packed documents from their start flags: the positions inside each document and the cu_seqlens of rows packed
end to end (what packed-document training hands to `flash_attn_varlen_func` and to the context-parallel
dispatcher)."""

from __future__ import annotations

import torch

__all__ = ["document_positions", "packed_cu_seqlens"]


def document_positions(doc_starts: torch.Tensor) -> torch.Tensor:
    """(B, S) int64 position of every token inside its document, from doc_starts (B, S) bool."""
    S = doc_starts.shape[-1]
    idx = torch.arange(S, device=doc_starts.device).expand_as(doc_starts)  # (B, S)
    start = torch.where(doc_starts, idx, torch.zeros_like(idx)).cummax(dim=-1).values  # (B, S) its doc's start
    return idx - start


def packed_cu_seqlens(doc_starts: torch.Tensor) -> torch.Tensor:
    """int32 cu_seqlens (0, then cumulative document lengths) of the rows of doc_starts (B, S) packed end to end
    (B * S tokens; every row starts a document, so no document crosses rows)."""
    flat = doc_starts.reshape(-1).clone()
    flat[:: doc_starts.shape[-1]] = True  # each row starts a document whatever the caller marked
    starts = flat.nonzero().flatten()
    end = torch.tensor([flat.numel()], device=flat.device)
    return torch.cat([starts, end]).to(torch.int32)

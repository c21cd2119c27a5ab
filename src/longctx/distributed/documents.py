"""Packed documents under context parallelism for a `longctx.GPT` (what `longctx train --doc-separator` runs at
``--context-parallel P``).

Each step, the rows of the batch are packed end to end into one sequence (every row starts a document, so no
document crosses rows), the dispatcher (`dispatch_plan`) deals its chunks to the ranks of the group by mask area,
and every layer's core attention runs `DispatchPlan.attention` over this rank's tokens:

    cp = setup_document_parallel(model, group=cp_group(mesh), method="ring")   # installs the core attention
    inputs, labels, mask, pos = cp.shard_batch(inputs, labels, loss_mask, doc_starts)   # (1, B S / P) each
    local_sum = model(inputs, position_ids=pos, labels=labels, loss_mask=mask, reduction="sum")
    loss, loss_value = share_of_mean(local_sum, mask.sum())          # as for one sequence per row

Positions are document-local (RoPE restarts in each document), so a rank needs no global offsets. The plan of
the last `shard_batch` stays installed until the next one, so a recomputed forward in the backward sees it too.
"""

from __future__ import annotations

import torch

from longctx.distributed.comm import cp_group_info
from longctx.distributed.dispatch import DispatchPlan, dispatch_plan
from longctx.masks.packing import document_positions, packed_cu_seqlens

__all__ = ["DocumentParallel", "setup_document_parallel"]

_PLAN_METHODS = ("ring", "allgather", "ulysses", "ulysses_ring", "p2p")


class DocumentParallel:
    """Context parallelism over packed documents: the group, the method, and the plan of the current batch.

    Args:
        group: the context-parallel process group (None: the world).
        method: "ring", "allgather", "ulysses", "ulysses_ring" (with ``ulysses_size``) or "p2p"
            (`DispatchPlan.attention`).
        backend: "auto", "tiled" or "triton" (the launchers of `DispatchPlan.attention`).
    """

    unfused = False  # as a core attention: fused (ring over flash launchers)

    def __init__(
        self, group=None, method: str = "ring", backend: str = "auto", ulysses_size: int | None = None
    ) -> None:
        if method not in _PLAN_METHODS:
            raise ValueError(
                f"context-parallel method {method!r} cannot run packed documents; expected one of {_PLAN_METHODS}"
            )
        self.group = group
        self.method = method
        self.cp_backend = backend
        self.ulysses_size = ulysses_size
        info = cp_group_info(group, "DocumentParallel")
        self.rank, self.world = info.rank, info.world
        self.plan: DispatchPlan | None = None

    def shard_batch(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        loss_mask: torch.Tensor | None,
        doc_starts: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Plan the batch's packed documents over the group and return this rank's tokens.

        Every rank of the group passes the same full rows (the data is a function of seed and step).

        Args:
            inputs, labels: (B, S) int64; loss_mask: (B, S) bool or None (every token counts);
            doc_starts: (B, S) bool, True where a document starts.

        Returns:
            ``(inputs, labels, loss_mask, position_ids)``, each (1, B * S / P): this rank's tokens of the rows
            packed end to end, in the plan's order, with their positions inside their documents.

        Raises:
            ValueError (on every rank, from `dispatch_plan`): B * S not a multiple of P, or rows that differ
            across ranks.
        """
        if inputs.shape != doc_starts.shape or labels.shape != inputs.shape:
            raise ValueError(
                f"inputs {tuple(inputs.shape)}, labels {tuple(labels.shape)} and doc_starts "
                f"{tuple(doc_starts.shape)} must all be (batch, seq)"
            )
        cu = packed_cu_seqlens(doc_starts).tolist()
        self.plan = dispatch_plan(cu, group=self.group, causal=True)
        if loss_mask is None:
            loss_mask = torch.ones_like(inputs, dtype=torch.bool)
        pos = document_positions(doc_starts)  # (B, S)
        local = [self.plan.dispatch(t.reshape(-1)).unsqueeze(0) for t in (inputs, labels, loss_mask, pos)]
        return local[0], local[1], local[2], local[3]  # each (1, B S / P)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The core attention: q (1, Hq, L, D), k and v (1, Hkv, L, D) of this rank's L tokens -> (1, Hq, L, D)."""
        if self.plan is None:
            raise ValueError("DocumentParallel has no plan: call shard_batch(...) for the batch before the forward")
        if q.shape[0] != 1:
            raise ValueError(
                f"under context parallelism with documents the model runs one packed row per rank, got batch "
                f"{q.shape[0]}; pass the tensors returned by shard_batch"
            )
        q_LHD, k_LHD, v_LHD = (t[0].transpose(0, 1) for t in (q, k, v))  # (L, H, D)
        out = self.plan.attention(
            q_LHD, k_LHD, v_LHD, method=self.method, backend=self.cp_backend, ulysses_size=self.ulysses_size
        )  # (L, Hq, D)
        return out.transpose(0, 1).unsqueeze(0)  # (1, Hq, L, D)


def setup_document_parallel(
    model, group=None, method: str = "ring", backend: str | None = None, ulysses_size: int | None = None
) -> DocumentParallel:
    """Install a `DocumentParallel` as the core attention of every layer of a `longctx.GPT` and return it.

    ``backend`` defaults to the model's ``attention_backend`` when that is "tiled" or "triton", else "auto".
    Parameters are not broadcast: start every rank from the same seed (``longctx train`` checks it).

    Raises:
        ValueError: a method the dispatcher cannot run, ``attention_dropout > 0``, or heads Ulysses cannot split.
    """
    from longctx.distributed.model import _cp_backend

    cfg = getattr(model, "config", None)
    if backend is None:
        backend = _cp_backend(getattr(cfg, "attention_backend", "auto"))
    cp = DocumentParallel(group=group, method=method, backend=backend, ulysses_size=ulysses_size)
    if cfg is not None:
        if getattr(cfg, "attention_dropout", 0.0) > 0:
            raise ValueError(
                "context parallelism needs attention_dropout == 0: the dropout path is a dense local attention "
                "that cannot see the keys of the other ranks"
            )
        if method in ("ulysses", "ulysses_ring"):
            from longctx.distributed.ulysses import kv_replication

            kv_replication(cfg.num_attention_heads, cfg.kv_heads, cp.world if method == "ulysses" else ulysses_size)
    model.set_core_attention(cp)
    return cp

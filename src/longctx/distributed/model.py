"""Wiring a `longctx.GPT` for context parallelism (what `longctx train --context-parallel N` calls).

Every rank of the context-parallel group holds the whole model and 1/P of every sequence:

    cp = setup_context_parallel(model, method="ring", layout="zigzag")    # core attention -> cp_attention
    inputs, labels, mask, pos = cp.shard_batch(batch.inputs, batch.labels, batch.loss_mask)
    logits = model(inputs, position_ids=pos)                               # (B, S/P, V), global RoPE positions
    loss, loss_value = cp.loss(logits, labels, mask)                       # loss: this rank's share
    loss.backward()
    cp.allreduce_gradients(model)                                          # sum the shares: = single process
    optimizer.step()

The loss of the single-process run is the mean over all counted tokens of the full sequence. Each rank's
``loss`` is (sum over its tokens) / (count over all ranks), so the shares add up to that mean and the sum
over ranks of their parameter gradients is the single-process gradient; the attention backward already
returns exact activation gradients to every rank (dK/dV travel back to their owners). ``loss_value`` is the
all-reduced mean, identical on every rank, for logging.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from longctx.distributed.attention import METHODS, cp_attention
from longctx.distributed.comm import comm_device, cp_group_info, group_info
from longctx.distributed.sharding import LAYOUTS, check_divisible, local_positions, shard, unshard
from longctx.launchers.select import BACKENDS

__all__ = [
    "ContextParallel",
    "init_distributed",
    "setup_context_parallel",
    "shard_batch",
    "cp_cross_entropy",
    "allreduce_gradients",
    "broadcast_parameters",
    "check_agreement",
    "AGREEMENT_TIMEOUT_S",
]


def init_distributed(backend: str | None = None) -> tuple[int, int, torch.device]:
    """Initialise torch.distributed from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK).

    NCCL with one GPU per process (cuda:LOCAL_RANK) when CUDA is available, with gloo beside it for CPU tensors
    (the collectives over host-offloaded parameters and gradients, e.g. their norm), else gloo on the CPU. Returns
    ``(rank, world_size, device)``. Without torchrun's variables: ``(0, 1, cuda or cpu)``, nothing initialised.
    """
    if dist.is_initialized():
        dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        return dist.get_rank(), dist.get_world_size(), dev
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size(), dev


AGREEMENT_TIMEOUT_S = 300.0  # how long a rank waits for the others at start-up before it gives up


def check_agreement(
    settings: dict[str, Any], local_error: str | None = None, group=None, *, timeout: float | None = None
) -> None:
    """Check, before any other collective, that every rank runs the same settings and can start.

    One ``all_gather_object`` of ``(settings, local_error)`` on a gloo group with a timeout: every rank learns the
    others' settings and errors and raises the same verdict, so a mismatch (say ``num_layers`` or ``seed``) is an
    error on every rank instead of a collective that waits forever for a tensor of another shape, and a rank that
    never arrives (it failed before, or runs another command) is an error on the others after ``timeout``.

    Args:
        settings: what must be equal on every rank (the model configuration, the training settings, the seed).
        local_error: why this rank cannot start (e.g. a world size that does not fit, the first rank's run
            folder check), or None.
        group: the process group (default: the world).
        timeout: seconds to wait for the other ranks (default ``AGREEMENT_TIMEOUT_S``).

    Raises:
        ValueError: on every rank, naming the differing settings with their values per rank, or the error of
            the rank that cannot start; on the ranks that arrived, the ranks that did not within ``timeout``.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        if local_error:
            raise ValueError(local_error)
        return
    import datetime

    timeout = AGREEMENT_TIMEOUT_S if timeout is None else float(timeout)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    gathered: list[Any] = [None] * world
    ranks = None if group is None else dist.get_process_group_ranks(group)
    try:
        # a gloo group of its own: its timeout bounds the wait, whatever the world's backend and timeout are
        check_group = dist.new_group(
            ranks=ranks,
            backend="gloo",
            timeout=datetime.timedelta(seconds=timeout),
            use_local_synchronization=ranks is not None,  # a subgroup: only its members take part
        )
        dist.all_gather_object(gathered, (settings, local_error), group=check_group)
        dist.destroy_process_group(check_group)
    except RuntimeError as e:
        raise ValueError(
            f"the start-up check of the {world} ranks did not complete within {timeout:g} s ({str(e)[:200]}): a "
            "rank failed before it (see its error) or was started with another command; start every rank with "
            "the same command line"
        ) from e
    errors = [(r, err) for r, (_, err) in enumerate(gathered) if err]
    if errors:
        r, err = errors[0]
        raise ValueError(err if r == rank else f"rank {r} cannot start: {err}")
    ref = gathered[0][0]
    diffs = []
    for r in range(1, world):
        other = gathered[r][0]
        for key in sorted(set(ref) | set(other), key=str):
            if ref.get(key, "<absent>") != other.get(key, "<absent>"):
                diffs.append(
                    f"{key}: rank 0 has {ref.get(key, '<absent>')!r}, rank {r} has {other.get(key, '<absent>')!r}"
                )
    if diffs:
        raise ValueError(
            f"the {world} ranks were started with different settings ({'; '.join(diffs)}); "
            "every rank must run the same command line, config file and seed"
        )


def _cp_backend(attention_backend: str) -> str:
    # The model's backend names the single-process kernel; CP runs on launchers (tiled or triton).
    return attention_backend if attention_backend in BACKENDS else "auto"


@dataclass
class ContextParallel:
    """The context-parallel settings of a model: the group, the method and the sequence layout."""

    group: object = None
    method: str = "ring"
    layout: str = "zigzag"
    backend: str = "auto"
    ulysses_size: int | None = None  # "ulysses_ring": ranks per all-to-all group

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"context-parallel method must be one of {METHODS}, got {self.method!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"context-parallel layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"context-parallel backend must be one of {BACKENDS}, got {self.backend!r}")
        info = cp_group_info(self.group, "ContextParallel")
        self.rank, self.world = info.rank, info.world

    # -- the core attention each layer calls --
    def core_attention(self):
        """``fn(q, k, v)`` = causal `cp_attention` over this group (for ``GPT.set_core_attention``)."""

        def cp_core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return cp_attention(
                q, k, v, group=self.group, method=self.method, layout=self.layout, causal=True, backend=self.backend,
                ulysses_size=self.ulysses_size,
            )  # fmt: skip

        cp_core_attention.unfused = False  # fused launchers: selective recomputation leaves it alone
        cp_core_attention.context_parallel = self  # type: ignore[attr-defined]
        return cp_core_attention

    # -- data --
    def check_seq_len(self, seq_len: int) -> None:
        check_divisible(seq_len, self.world, self.layout, what="context-parallel sequence length")

    def shard(self, x: torch.Tensor | None, dim: int = 1) -> torch.Tensor | None:
        """This rank's part of a (B, S, ...) tensor along the sequence (None passes through)."""
        return None if x is None else shard(x, dim, self.group, self.layout)

    def position_ids(self, seq_len: int, device=None) -> torch.Tensor:
        """(S/P,) global positions of this rank's tokens: ``model(tokens, position_ids=...)`` for RoPE."""
        return local_positions(seq_len, self.rank, self.world, self.layout, device=device)

    def shard_batch(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        """Shard full (B, S) inputs, labels (inputs shifted by one, made *before* sharding) and loss mask.

        Every rank must pass the same full batch (longctx.training.data batches are a function of (seed, step)).
        Returns ``(inputs, labels, loss_mask, position_ids)`` for this rank, each (B, S/P) except the
        (S/P,) position ids.
        """
        S = inputs.shape[1]
        self.check_seq_len(S)
        return (
            self.shard(inputs),
            self.shard(labels),
            self.shard(loss_mask),
            self.position_ids(S, device=inputs.device),
        )

    def gather(self, x_local: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The full sequence from every rank's part (e.g. predictions for evaluation). Not differentiable."""
        return unshard(x_local, dim, self.group, self.layout)

    # -- loss and gradients --
    def loss(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        loss_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss, loss_value)``: this rank's differentiable share and the global mean (detached).

        logits (B, S/P, V), labels (B, S/P), loss_mask (B, S/P) or None. ``loss`` = sum of this rank's
        token losses / the number of counted tokens over the whole group, so the shares of all ranks add up
        to the single-process mean; call `allreduce_gradients` after backward. A model that computes its loss
        without logits (``GPT(..., labels=, reduction="sum")``) passes its local sum to `share_of_mean`.
        """
        per_token = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
        if loss_mask is not None:
            m = loss_mask.flatten().to(per_token.dtype)
            return self.share_of_mean((per_token * m).sum(), m.sum())
        return self.share_of_mean(per_token.sum(), per_token.numel())

    def share_of_mean(
        self, local_sum: torch.Tensor, local_count: torch.Tensor | float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss, loss_value)`` from this rank's summed token loss and its number of counted tokens: the
        differentiable share ``local_sum / global count`` and the global mean (detached, float32)."""
        count = torch.as_tensor(local_count, dtype=torch.float64, device=local_sum.device).detach()
        stats = torch.stack([local_sum.detach().to(torch.float64), count])
        if self.world > 1:
            info = group_info(self.group)
            stats = stats.to(comm_device(info, local_sum))
            dist.all_reduce(stats, group=self.group)
        total_sum, total_count = stats[0].to(local_sum.device), stats[1].clamp_min(1.0).to(local_sum.device)
        loss = local_sum / total_count.to(local_sum.dtype)
        return loss, (total_sum / total_count).to(torch.float32)

    @torch.no_grad()
    def eval_stats(
        self, logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None = None
    ) -> tuple[float, float, float]:
        """``(loss_sum, token_count, correct)`` over the whole group for evaluation (summed over all ranks).

        logits (B, S/P, V), labels and loss_mask (B, S/P); ``correct`` counts argmax hits on counted tokens.
        """
        per_token = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
        m = torch.ones_like(per_token) if loss_mask is None else loss_mask.flatten().to(per_token.dtype)
        hits = (logits.argmax(-1).flatten() == labels.flatten()).to(per_token.dtype) * m
        stats = torch.stack([(per_token * m).sum(), m.sum(), hits.sum()]).to(torch.float64)
        if self.world > 1:
            stats = stats.to(comm_device(group_info(self.group), logits))
            dist.all_reduce(stats, group=self.group)
        loss_sum, count, correct = stats.tolist()
        return loss_sum, count, correct

    def allreduce_gradients(self, model: torch.nn.Module) -> None:
        """Sum the parameter gradients over the group (each rank holds the gradient of its tokens only)."""
        if self.world == 1:
            return
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if not grads:
            return
        # One flat buffer per dtype: one all-reduce instead of one per parameter.
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for gs in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in gs])
            dist.all_reduce(flat, group=self.group)
            off = 0
            for g in gs:
                n = g.numel()
                g.copy_(flat[off : off + n].view_as(g))
                off += n

    def broadcast_parameters(self, model: torch.nn.Module) -> None:
        """Make every rank start from the parameters of the group's first rank."""
        if self.world == 1:
            return
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        with torch.no_grad():
            for t in list(model.parameters()) + list(model.buffers()):
                dist.broadcast(t.data, src=src, group=self.group)


def setup_context_parallel(
    model,
    group=None,
    method: str = "ring",
    layout: str = "zigzag",
    backend: str | None = None,
    broadcast: bool = True,
    ulysses_size: int | None = None,
) -> ContextParallel:
    """Configure a `longctx.GPT` for context parallelism over ``group`` and return the `ContextParallel`.

    Installs `cp_attention` (causal) as the core attention of every layer, checks that the model can run
    under CP, and (``broadcast=True``) copies rank 0's parameters to the other ranks of the group.
    ``backend`` defaults to the model's ``attention_backend`` when that is "tiled" or "triton", else "auto".

    Raises:
        ValueError: an unknown method/layout/backend, ``attention_dropout > 0`` (its dense path cannot see
            the other ranks' keys), or heads Ulysses cannot split.
        RuntimeError: torch.distributed is not initialised (and ``group`` is not ``SINGLE_PROCESS``).
    """
    cfg = getattr(model, "config", None)
    if backend is None:
        backend = _cp_backend(getattr(cfg, "attention_backend", "auto"))
    cp = ContextParallel(group=group, method=method, layout=layout, backend=backend, ulysses_size=ulysses_size)
    if cfg is not None:
        if getattr(cfg, "attention_dropout", 0.0) > 0:
            raise ValueError(
                "context parallelism needs attention_dropout == 0: the dropout path is a dense local attention "
                "that cannot see the keys of the other ranks"
            )
        if method == "ulysses":
            from longctx.distributed.ulysses import kv_replication

            kv_replication(cfg.num_attention_heads, cfg.kv_heads, cp.world)
    model.set_core_attention(cp.core_attention())
    if broadcast:
        cp.broadcast_parameters(model)
    return cp


def shard_batch(cp: ContextParallel, inputs, labels=None, loss_mask=None):
    """Functional form of `ContextParallel.shard_batch`."""
    return cp.shard_batch(inputs, labels, loss_mask)


def cp_cross_entropy(cp: ContextParallel, logits, labels, loss_mask=None):
    """Functional form of `ContextParallel.loss`."""
    return cp.loss(logits, labels, loss_mask)


def allreduce_gradients(cp: ContextParallel, model) -> None:
    """Functional form of `ContextParallel.allreduce_gradients`."""
    cp.allreduce_gradients(model)


def broadcast_parameters(cp: ContextParallel, model) -> None:
    """Functional form of `ContextParallel.broadcast_parameters`."""
    cp.broadcast_parameters(model)

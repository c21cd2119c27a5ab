"""Sequence layouts for context parallelism: which global positions each rank holds, `shard` and `unshard`.

Two layouts of a sequence of S positions over P ranks:

    contiguous (P = 4):  rank 0 | rank 1 | rank 2 | rank 3          rank r holds chunk r of P
    zigzag     (P = 4):  0 | 1 | 2 | 3 | 3 | 2 | 1 | 0              rank r holds chunks r and 2P-1-r of 2P

Under a causal mask the work of a query chunk grows with its position, so the contiguous layout leaves the
last rank with P times the work of the first; zigzag pairs an early chunk with a late one so that every rank
has the same amount of work (Megatron's "load-balanced" CP, ring-flash-attention's zigzag).

A rank's local tensor is its chunks concatenated in the order above (zigzag: chunk r, then chunk 2P-1-r).
`local_chunks` gives ``(local_start, length, global_start)`` for each of them; every other module works from
that list, so it is the single definition of the layouts.

Beside the two names, a layout may be a `ChunkLayout`: an explicit list of runs per rank (every rank the same
number of tokens). The dispatcher (`longctx.distributed.dispatch`) and the hybrid Ulysses x ring method build
them; every function here that takes a layout accepts one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = [
    "LAYOUTS",
    "SINGLE_PROCESS",
    "ChunkLayout",
    "shard",
    "unshard",
    "local_chunks",
    "chunks_per_rank",
    "check_divisible",
    "local_positions",
    "take_local",
]

LAYOUTS = ("zigzag", "contiguous")

Chunk = tuple[int, int, int]  # (local_start, length, global_start)


@dataclass(frozen=True)
class ChunkLayout:
    """An explicit layout: ``chunks[r]`` lists the runs ``(local_start, length, global_start)`` rank r holds, in
    local order (local starts 0, n0, n0 + n1, ...). Every rank holds ``total / world`` tokens."""

    total: int
    chunks: tuple[tuple[Chunk, ...], ...]

    def __post_init__(self) -> None:
        n = self.total // max(1, self.world)
        for r, runs in enumerate(self.chunks):
            pos = 0
            for ls, ln, _g in runs:
                assert ls == pos and ln > 0, (r, runs)
                pos += ln
            assert pos == n and n * self.world == self.total, (r, pos, n, self.total)

    @property
    def world(self) -> int:
        return len(self.chunks)

    @property
    def local_len(self) -> int:
        return self.total // self.world


def chunks_per_rank(layout: str | ChunkLayout) -> int:
    if isinstance(layout, ChunkLayout):
        return 1
    if layout == "zigzag":
        return 2
    if layout == "contiguous":
        return 1
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def check_divisible(seq_len: int, world: int, layout: str | ChunkLayout, *, what: str = "sequence length") -> None:
    """Raise ValueError unless ``seq_len`` splits into the layout's chunks (2P for zigzag, P for contiguous)."""
    if isinstance(layout, ChunkLayout):
        if seq_len != layout.total or world != layout.world:
            raise ValueError(
                f"{what} {seq_len} over {world} ranks does not match the layout ({layout.total} tokens over "
                f"{layout.world} ranks); build the layout (or dispatch plan) for this sequence and group"
            )
        return
    n = chunks_per_rank(layout) * world
    if seq_len % n != 0:
        fix = "pad the sequence" + (
            " or use layout='contiguous'" if layout == "zigzag" and seq_len % world == 0 else ""
        )
        raise ValueError(
            f"{what} {seq_len} is not divisible by {n} (layout={layout!r} cuts it into "
            f"{chunks_per_rank(layout)} x {world} ranks chunks); {fix}"
        )


def local_chunks(seq_total: int, rank: int, world: int, layout: str | ChunkLayout) -> list[tuple[int, int, int]]:
    """``[(local_start, length, global_start), ...]`` of the chunks rank ``rank`` holds, in local order."""
    check_divisible(seq_total, world, layout)
    if isinstance(layout, ChunkLayout):
        return list(layout.chunks[rank])
    if layout == "contiguous":
        c = seq_total // world
        return [(0, c, rank * c)]
    c = seq_total // (2 * world)
    return [(0, c, rank * c), (c, c, (2 * world - 1 - rank) * c)]


def local_positions(seq_total: int, rank: int, world: int, layout: str | ChunkLayout, device=None) -> torch.Tensor:
    """Global positions (int64, shape (S/P,)) of the tokens rank ``rank`` holds: the position ids for RoPE."""
    parts = [torch.arange(g, g + n, device=device) for _, n, g in local_chunks(seq_total, rank, world, layout)]
    return torch.cat(parts)


class _SingleProcess:
    """The type of `SINGLE_PROCESS`."""

    def __repr__(self) -> str:
        return "longctx.distributed.SINGLE_PROCESS"


SINGLE_PROCESS = _SingleProcess()
"""``group=SINGLE_PROCESS``: a context-parallel group of this process alone (world 1), whether or not
torch.distributed is initialised. Without it, the context-parallel entry points require an initialised
torch.distributed (``group=None`` means the world), so a script that forgot ``init_process_group`` raises instead
of computing the whole sequence on every process."""


def _group_info(group) -> tuple[int, int]:
    if group is SINGLE_PROCESS:
        return 0, 1
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise RuntimeError("torch.distributed is not initialized but a process group was given")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _dim(x: torch.Tensor, dim: int) -> int:
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim {dim} out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


def shard(x: torch.Tensor, dim: int, group=None, layout: str | ChunkLayout = "zigzag") -> torch.Tensor:
    """This rank's part of a full-sequence tensor (a copy; no communication).

    Args:
        x: a tensor holding the whole sequence along ``dim`` (the same on every rank).
        dim: the sequence dimension (e.g. 2 for (B, H, S, D), 1 for (B, S) tokens).
        group: the context-parallel process group (default: the world; without torch.distributed
            initialized, a world of one).
        layout: "zigzag" (rank r gets chunks r and 2P-1-r of 2P) or "contiguous" (chunk r of P).

    Returns:
        (..., S/P, ...) along ``dim``.

    Raises:
        ValueError: an unknown layout, or S not divisible by 2P (zigzag) / P (contiguous).
    """
    rank, world = _group_info(group)
    dim = _dim(x, dim)
    chunks = local_chunks(x.shape[dim], rank, world, layout)
    if _indexed(layout):
        return take_local(x, dim, layout, rank)
    return torch.cat([x.narrow(dim, g, n) for _, n, g in chunks], dim=dim)


# Layouts with more runs per rank than this move rows by index (one gather) instead of one slice per run.
_INDEXED_RUNS = 4


def _indexed(layout) -> bool:
    return isinstance(layout, ChunkLayout) and max(len(runs) for runs in layout.chunks) > _INDEXED_RUNS


@functools.lru_cache(maxsize=256)
def _orders(layout: ChunkLayout, device: str) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """(global positions in rank-major order, its inverse, each rank's global positions), int64 on ``device``."""
    mine = [torch.cat([torch.arange(g, g + n) for _, n, g in runs]) for runs in layout.chunks]
    rank_major = torch.cat(mine)
    inverse = torch.empty_like(rank_major)
    inverse[rank_major] = torch.arange(rank_major.numel())
    return rank_major.to(device), inverse.to(device), tuple(m.to(device) for m in mine)


def take_local(x: torch.Tensor, dim: int, layout: ChunkLayout, rank: int) -> torch.Tensor:
    """Rank ``rank``'s rows of a full-sequence tensor along ``dim``, in local order (a copy)."""
    if _indexed(layout):
        return x.index_select(dim, _orders(layout, str(x.device))[2][rank])
    return torch.cat([x.narrow(dim, g, n) for _, n, g in layout.chunks[rank]], dim=dim)


def reorder_to_global(parts: list[torch.Tensor], dim: int, layout: str | ChunkLayout) -> torch.Tensor:
    """Concatenate per-rank local tensors (index = rank) into the full sequence in global order."""
    if _indexed(layout):
        return torch.cat(parts, dim=dim).index_select(dim, _orders(layout, str(parts[0].device))[1])
    world = len(parts)
    n_local = parts[0].shape[dim]
    seq_total = n_local * world
    pieces: list[tuple[int, torch.Tensor]] = []
    for r, p in enumerate(parts):
        for ls, n, g in local_chunks(seq_total, r, world, layout):
            pieces.append((g, p.narrow(dim, ls, n)))
    pieces.sort(key=lambda t: t[0])
    return torch.cat([p for _, p in pieces], dim=dim)


def global_to_rank_major(x: torch.Tensor, dim: int, world: int, layout: str | ChunkLayout) -> torch.Tensor:
    """The inverse of `reorder_to_global`: (P, ...) stacking of every rank's local part (for reduce-scatter)."""
    seq_total = x.shape[dim]
    if _indexed(layout):
        y = x.index_select(dim, _orders(layout, str(x.device))[0])  # rank-major along dim
        return y.unflatten(dim, (world, seq_total // world)).movedim(dim, 0)
    return torch.stack(
        [
            torch.cat([x.narrow(dim, g, n) for _, n, g in local_chunks(seq_total, r, world, layout)], dim=dim)
            for r in range(world)
        ]
    )


def unshard(x_local: torch.Tensor, dim: int, group=None, layout: str | ChunkLayout = "zigzag") -> torch.Tensor:
    """Gather the local parts of every rank back into the full sequence along ``dim`` (an all-gather).

    Every rank must call it with tensors of the same shape and dtype. Not differentiable.
    """
    rank, world = _group_info(group)
    dim = _dim(x_local, dim)
    chunks_per_rank(layout)
    if world == 1:
        return x_local.clone()
    x_local = x_local.contiguous()
    parts = [torch.empty_like(x_local) for _ in range(world)]
    dist.all_gather(parts, x_local, group=group)
    return reorder_to_global(parts, dim, layout)

"""The dispatcher: packed documents sharded over a context-parallel group by the work each rank computes.

Sharding packed documents by tokens balances tokens, not work: under a causal mask the area a query row computes
grows with its position in its document, and one long document next to many short ones leaves some ranks with
several times the work of others. `dispatch_plan` cuts the packed sequence into chunks of ``chunk_size`` tokens,
computes the mask area of each chunk (the number of visible (query, key) pairs of its query rows: same document
and band, `blocks.doc_token_areas`) and deals the chunks to the ranks greedily, largest first, each to the rank
with the least work so far among those with room left (every rank gets the same number of chunks, so the same
number of tokens: the rest of the model is balanced by tokens).

    plan = dispatch_plan(cu_seqlens, causal=True)              # the same on every rank
    x_loc = plan.dispatch(x)                                   # (total, ...) -> this rank's (total / P, ...)
    out_loc = plan.attention(q_loc, k_loc, v_loc, method="ring")   # (total / P, H, D), varlen layout
    out = plan.undispatch(out_loc)                             # back to (total, ...) in order

A rank's tokens are its chunks in global order, merged where adjacent (a `sharding.ChunkLayout`); every method
of `cp_attention` runs on that layout with the `blocks.Documents` mask: the ring skips the (query, key) chunk
pairs that have no visible entry, all-gather attends each local document piece only to the keys its band
reaches in its document, Ulysses attends over the whole packed sequence one document at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from longctx.distributed.attention import _collective_check, _crc, _exchange_rows, check_cu_seqlens, run_method
from longctx.distributed.blocks import Documents, doc_token_areas
from longctx.distributed.comm import GroupInfo, cp_group_info, gather_seq
from longctx.distributed.sharding import ChunkLayout
from longctx.launchers.select import resolve_launchers
from longctx.masks import Band, normalize_window

__all__ = ["dispatch_plan", "DispatchPlan", "plan_layout", "default_chunk_size", "balance_chunks"]


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def default_chunk_size(tokens_per_rank: int) -> int:
    """The chunk size when none is given: a divisor of the tokens per rank, a multiple of 128 (a kernel tile)
    giving at least 16 chunks per rank where one exists (16 chunks keep the greedy within a few percent of
    the mean on document mixes), else at least 4; else the largest divisor giving at least 8 chunks."""
    divs = _divisors(tokens_per_rank)
    for min_chunks in (16, 4):
        good = [c for c in divs if c % 128 == 0 and tokens_per_rank // c >= min_chunks]
        if good:
            return max(good)
    good = [c for c in divs if tokens_per_rank // c >= 8]
    return max(good) if good else 1


def balance_chunks(areas: list[int], world: int) -> list[list[int]]:
    """Deal ``len(areas)`` chunks (a multiple of ``world``) to ``world`` ranks, the same number each: largest
    area first, each to the least loaded rank with room (ties: the lower rank). Returns chunk ids per rank, sorted."""
    per_rank = len(areas) // world
    assert per_rank * world == len(areas), (len(areas), world)
    load, owned = [0] * world, [[] for _ in range(world)]
    for c in sorted(range(len(areas)), key=lambda i: (-areas[i], i)):
        r = min((r for r in range(world) if len(owned[r]) < per_rank), key=lambda r: (load[r], r))
        owned[r].append(c)
        load[r] += areas[c]
    return [sorted(o) for o in owned]


def _doc_band(causal: bool, window: tuple[int, int]) -> Band:
    """The band inside a document (queries and keys of one document: no offset), as flash_attn_varlen_func."""
    return Band.from_args(1, 1, causal=causal, window=window)


def plan_layout(
    cu: list[int], world: int, *, causal: bool = False, window: tuple[int, int] | None = None,
    chunk_size: int | None = None,
) -> tuple[ChunkLayout, list[int], int]:  # fmt: skip
    """The pure planning of `dispatch_plan` (no processes): (layout, mask area per rank, chunk size).

    Raises:
        ValueError: a total not divisible by ``world``, or a ``chunk_size`` that does not divide total / world.
    """
    total = cu[-1]
    if world < 1 or total == 0 or total % world != 0:
        raise ValueError(
            f"the packed sequence has {total} tokens, which must be a positive multiple of the context-parallel size "
            f"({world}): every rank holds the same number of tokens; pad it (e.g. append a padding document, "
            f"cu_seqlens + [{-(-max(total, 1) // world) * world}])"
        )
    n_loc = total // world
    if chunk_size is None:
        chunk_size = default_chunk_size(n_loc)
    elif isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size must be an int, got {type(chunk_size).__name__} ({chunk_size!r})")
    elif chunk_size < 1 or n_loc % chunk_size != 0:
        raise ValueError(
            f"chunk_size ({chunk_size}) must be a positive divisor of the tokens per rank ({total} / {world} = "
            f"{n_loc}); e.g. {default_chunk_size(n_loc)}, or leave chunk_size=None"
        )
    band = _doc_band(causal, normalize_window(window))
    areas = doc_token_areas(cu, band).reshape(-1, chunk_size).sum(1).tolist()  # per chunk
    owned = balance_chunks(areas, world)
    chunks = []
    for ids in owned:
        runs: list[list[int]] = []  # [local_start, length, global_start]
        for c in ids:
            g = c * chunk_size
            if runs and runs[-1][2] + runs[-1][1] == g:
                runs[-1][1] += chunk_size
            else:
                runs.append([len(runs) and runs[-1][0] + runs[-1][1], chunk_size, g])
        chunks.append(tuple(tuple(r) for r in runs))
    rank_areas = [sum(areas[c] for c in ids) for ids in owned]
    return ChunkLayout(total, tuple(chunks)), rank_areas, chunk_size


class _Undispatch(torch.autograd.Function):
    """All-gather in global order; the backward keeps this rank's rows of the incoming gradient."""

    @staticmethod
    def forward(ctx, x_local, info: GroupInfo, layout: ChunkLayout):
        ctx.info, ctx.layout = info, layout
        return gather_seq(x_local, 0, info, layout)

    @staticmethod
    def backward(ctx, g):
        return _take(g, ctx.layout.chunks[ctx.info.rank]), None, None


def _take(x: torch.Tensor, runs) -> torch.Tensor:
    return torch.cat([x[g : g + n] for _, n, g in runs], dim=0)


@dataclass(frozen=True)
class DispatchPlan:
    """Which tokens of a packed sequence each rank holds, and attention over them (see `dispatch_plan`).

    Attributes:
        cu_seqlens: the document boundaries (list of ints). causal, window: the mask inside each document.
        chunk_size: tokens per chunk. layout: the `ChunkLayout` (runs per rank, in local order).
        areas: mask area (visible (query, key) pairs of its query rows) per rank.
    """

    cu_seqlens: tuple[int, ...]
    causal: bool
    window: tuple[int, int]
    chunk_size: int
    layout: ChunkLayout
    areas: tuple[int, ...]
    info: GroupInfo = field(repr=False)

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def world(self) -> int:
        return self.info.world

    @property
    def total(self) -> int:
        return self.layout.total

    @property
    def local_len(self) -> int:
        return self.layout.local_len

    def balance(self) -> float:
        """max / mean of the per-rank mask area (1.0: perfectly balanced)."""
        mean = sum(self.areas) / len(self.areas)
        return max(self.areas) / mean if mean > 0 else 1.0

    def positions(self, device=None) -> torch.Tensor:
        """Global positions (int64, (total / P,)) of this rank's tokens, in local order."""
        return torch.cat([torch.arange(g, g + n, device=device) for _, n, g in self.layout.chunks[self.rank]])

    def dispatch(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a packed (total, ...) tensor: (total / P, ...). Differentiable (a gather of rows)."""
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[0] != self.total:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"dispatch takes the whole packed sequence along dim 0 ({self.total} tokens, as cu_seqlens[-1]), "
                f"got {got}"
            )
        return _take(x, self.layout.chunks[self.rank])

    def undispatch(self, x_local: torch.Tensor) -> torch.Tensor:
        """Gather every rank's rows back into the packed (total, ...) tensor in order (an all-gather; every rank
        calls it). Differentiable: the gradient of this rank's rows is its rows of the incoming gradient (right
        when every rank computes the same function of the gathered tensor, e.g. a replicated loss)."""
        if not isinstance(x_local, torch.Tensor) or x_local.dim() < 1 or x_local.shape[0] != self.local_len:
            got = tuple(x_local.shape) if isinstance(x_local, torch.Tensor) else type(x_local).__name__
            raise ValueError(f"undispatch takes this rank's {self.local_len} rows along dim 0, got {got}")
        return _Undispatch.apply(x_local, self.info, self.layout)

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        method: str = "ring",
        scale: float | None = None,
        backend: str = "auto",
        ulysses_size: int | None = None,
    ) -> torch.Tensor:
        """This rank's output of `flash_attn_varlen_func` over the whole packed sequence (self-attention).

        Args:
            q: (total / P, Hq, D) this rank's queries (``plan.dispatch(q_packed)``); k, v: (total / P, Hkv, D).
            method: "ring" (K/V around the ring; pairs of chunks with no visible entry are not computed),
                "allgather" (gather K/V; each local document piece attends only the keys it can see),
                "ulysses" (all-to-all to heads, attention over the whole packed sequence per document) or
                "ulysses_ring" (all-to-all inside groups of ``ulysses_size`` ranks, ring across them).
            scale: softmax scale (default 1/sqrt(D)). backend: "auto", "tiled" or "triton" (as `cp_attention`).

        Returns:
            (total / P, Hq, D), differentiable in q, k and v.

        Raises:
            ValueError / TypeError on every rank (checked collectively): bad tensors, a local length other than
            the plan's, inputs that differ across ranks, heads the method cannot split.
        """
        q4, k4, v4 = (_to_bhsd(t) for t in (q, k, v))  # (1, H, total / P, D)
        scale, _, _ = _collective_check(
            q4, k4, v4, info=self.info, method=method, layout=self.layout, causal=self.causal, window=self.window,
            scale=scale, backend=backend, ulysses_size=ulysses_size, where="DispatchPlan.attention",
        )  # fmt: skip
        mask = Documents(self.cu_seqlens, _doc_band(self.causal, self.window))
        launchers = resolve_launchers(backend, q4.device, q4.dtype)
        out = run_method(
            q4, k4, v4, info=self.info, method=method, layout=self.layout, mask=mask, scale=scale,
            launchers=launchers, ulysses_size=ulysses_size,
        )  # fmt: skip
        return out[0].permute(1, 0, 2).contiguous()  # (total / P, Hq, D)


def _to_bhsd(t):
    """(tokens, H, D) -> (1, H, tokens, D), contiguous; anything else passes through to the checks."""
    if isinstance(t, torch.Tensor) and t.dim() == 3:
        return t.permute(1, 0, 2).unsqueeze(0).contiguous()
    if isinstance(t, torch.Tensor):
        raise ValueError(
            f"DispatchPlan.attention takes the varlen layout (tokens, heads, head_dim), got shape {tuple(t.shape)}"
        )
    raise TypeError(f"DispatchPlan.attention takes tensors, got {type(t).__name__}")


def dispatch_plan(
    cu_seqlens: torch.Tensor | list[int],
    *,
    group=None,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    chunk_size: int | None = None,
) -> DispatchPlan:
    """Shard a packed sequence over a context-parallel group, balancing the mask area each rank computes.

    Every rank of ``group`` calls it with the same arguments (checked collectively).

    Args:
        cu_seqlens: 0, then the cumulative document lengths (int32/int64 tensor or list of ints), ending at the
            number of packed tokens, a multiple of the group size.
        group: the context-parallel process group (default: the world; needs torch.distributed initialised);
            `SINGLE_PROCESS` for this process alone.
        causal, window: the mask inside each document, as in `flash_attn_varlen_func` (window (left, right),
            -1 unbounded).
        chunk_size: tokens per chunk, a divisor of total / P (default: `default_chunk_size`).

    Returns:
        A `DispatchPlan`.

    Raises:
        RuntimeError: torch.distributed not initialised (and ``group`` not `SINGLE_PROCESS`).
        ValueError / TypeError, on every rank: invalid cu_seqlens, a total not divisible by P, a bad chunk_size
        or window, or arguments that differ across ranks.
    """
    info = cp_group_info(group, "dispatch_plan")
    err: Exception | None = None
    result = None
    try:
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
        win = normalize_window(window)
        total = (
            int(cu_seqlens[-1]) if isinstance(cu_seqlens, (list, tuple, torch.Tensor)) and len(cu_seqlens) > 0 else -1
        )
        cu = check_cu_seqlens(cu_seqlens, total)
        layout, areas, cs = plan_layout(cu, info.world, causal=causal, window=win, chunk_size=chunk_size)
        result = (cu, win, layout, areas, cs)
    except (TypeError, ValueError) as e:
        err = e
    if info.world > 1:
        row = [int(err is not None)]
        if result is not None:
            cu, win, _, _, cs = result
            row += [_crc(cu), cu[-1], int(causal), win[0], win[1], cs]
        else:
            row += [-1] * 6
        rows = _exchange_rows(row, info)
        bad = [r for r, rw in enumerate(rows) if rw[0]]
        if bad and err is None:
            raise ValueError(f"dispatch_plan: invalid arguments on rank(s) {bad}; every rank stops here")
        if not bad and any(rw != rows[0] for rw in rows):
            raise ValueError(
                "dispatch_plan: the ranks passed different cu_seqlens, causal, window or chunk_size; every rank must "
                "plan the same packed sequence:\n"
                + "\n".join(
                    f"  rank {r}: cu_seqlens checksum {rw[1]:08x}, {rw[2]} tokens, causal={bool(rw[3])}, "
                    f"window=({rw[4]}, {rw[5]}), chunk_size={rw[6]}"
                    for r, rw in enumerate(rows)
                )
            )
    if err is not None:
        raise type(err)(f"dispatch_plan on rank {info.rank}: {err}") from err
    cu, win, layout, areas, cs = result
    return DispatchPlan(tuple(cu), causal, win, cs, layout, tuple(areas), info)

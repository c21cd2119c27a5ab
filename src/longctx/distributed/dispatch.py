"""The dispatcher: packed documents sharded over a context-parallel group, whole where they fit, balanced by work.

Sharding packed documents by tokens balances tokens, not work (under a causal mask the area a query row computes
grows with its position in its document), and cuts documents, which costs communication: a document whose
queries and keys lie on one rank needs no other rank's K/V. `dispatch_plan` keeps every document it can whole on
one rank and balances the mask area per rank, splitting only documents longer than a shard or too large to
balance (`placement`; every rank holds the same number of tokens: the rest of the model is balanced by tokens).

    plan = dispatch_plan(cu_seqlens, causal=True)              # the same on every rank
    x_loc = plan.dispatch(x)                                   # (total, ...) -> this rank's (total / P, ...)
    out_loc = plan.attention(q_loc, k_loc, v_loc, method="p2p")    # (total / P, H, D), varlen layout
    out = plan.undispatch(out_loc)                             # back to (total, ...) in order

A rank's tokens are its runs in global order (a `sharding.ChunkLayout`); every method of `cp_attention` runs on
that layout with the `blocks.Documents` mask, one block-sparse launch per step (`blocks.SparseStep`): the ring and
all-gather move only the tokens another rank can see (`blocks.export_rows`; nothing at all when every document is
whole), Ulysses attends over the whole packed sequence in one launch. The plan's own method, "p2p"
(`p2p.P2PAttention`), moves only the K/V rows some local query can see, point to point: ``plan.needs`` lists them
per pair of ranks (`placement.plan_needs`), and ``plan.traffic`` counts the bytes per rank against the ring and
all-gather.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from longctx.distributed.attention import (
    METHODS,
    _crc,
    _describe,
    _exchange_rows,
    _local_checks,
    _meta,
    agree_or_raise,
    check_cu_seqlens,
    run_method,
)
from longctx.distributed.blocks import Documents, export_rows
from longctx.distributed.comm import GroupInfo, cp_group_info, gather_seq
from longctx.distributed.p2p import P2PAttention, routes
from longctx.distributed.placement import default_chunk_size, doc_band, plan_layout, plan_needs
from longctx.distributed.sharding import ChunkLayout, take_local
from longctx.launchers.select import resolve_launchers
from longctx.masks import normalize_window

__all__ = [
    "dispatch_plan",
    "DispatchPlan",
    "PLAN_METHODS",
    "Traffic",
    "plan_layout",
    "plan_needs",
    "default_chunk_size",
]

# "p2p" exists only here: it needs the plan to know which K/V rows each rank's queries can see.
PLAN_METHODS = (*METHODS, "p2p")


@dataclass(frozen=True)
class Traffic:
    """Bytes each rank sends and receives in one attention call of a method (per rank, in rank order).

    ``forward_*``: K/V of the forward; ``backward_*``: K/V again (no method saves what it received) and the dK/dV
    partial sums (``grad_itemsize`` each). Collectives count what a bandwidth-optimal algorithm moves per rank
    (all-gather, reduce-scatter: (P - 1) / P of the whole).
    """

    forward_sent: tuple[int, ...]
    forward_received: tuple[int, ...]
    backward_sent: tuple[int, ...]
    backward_received: tuple[int, ...]

    def max_per_rank(self, *, backward: bool = True) -> int:
        """The largest number of bytes a rank sends or receives (forward, plus the backward unless False)."""
        fs, fr = self.forward_sent, self.forward_received
        if backward:
            fs = tuple(a + b for a, b in zip(fs, self.backward_sent))
            fr = tuple(a + b for a, b in zip(fr, self.backward_received))
        return max(max(fs), max(fr))


class _Undispatch(torch.autograd.Function):
    """All-gather in global order; the backward keeps this rank's rows of the incoming gradient."""

    @staticmethod
    def forward(ctx, x_local, info: GroupInfo, layout: ChunkLayout):
        ctx.info, ctx.layout = info, layout
        return gather_seq(x_local, 0, info, layout)

    @staticmethod
    def backward(ctx, g):
        return take_local(g, 0, ctx.layout, ctx.info.rank), None, None


@dataclass(frozen=True)
class DispatchPlan:
    """Which tokens of a packed sequence each rank holds, and attention over them (see `dispatch_plan`).

    Attributes:
        cu_seqlens: the document boundaries (list of ints). causal, window: the mask inside each document.
        chunk_size: the piece size of split documents. layout: the `ChunkLayout` (runs per rank, in local order).
        areas: mask area (visible (query, key) pairs of its query rows) per rank.
        needs: ``needs[r][s]``, the global ranges ``(start, length)`` of rank s's tokens some query of rank r sees
            (`placement.plan_needs`): what method "p2p" moves.
    """

    cu_seqlens: tuple[int, ...]
    causal: bool
    window: tuple[int, int]
    chunk_size: int
    layout: ChunkLayout
    areas: tuple[int, ...]
    needs: tuple[tuple[tuple[tuple[int, int], ...], ...], ...] = field(repr=False)
    info: GroupInfo = field(repr=False)
    # the calls' arguments every rank of the group agreed on in a collective check of this plan -> scale (`_check`)
    agreed: dict = field(default_factory=dict, repr=False, compare=False)

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

    def traffic(
        self, method: str = "p2p", *, kv_heads: int = 1, head_dim: int = 1, itemsize: int = 2, grad_itemsize: int = 4
    ) -> Traffic:
        """Bytes each rank sends and receives in one `attention` call of ``method``, from the plan alone.

        Args:
            method: "p2p" (the planned ranges), "ring" (every rank's export rows pass every other rank; the backward
                sends them again and their dK/dV partial sums around a second ring, P hops) or "allgather"
                (all-gather of the export rows padded to the largest count, again in the backward, and a
                reduce-scatter of their dK/dV). Export rows: `blocks.export_rows`, none when no document crosses
                ranks.
            kv_heads, head_dim: of K and V (each token moves ``2 * kv_heads * head_dim`` values).
            itemsize: bytes per K/V value (2 for bf16). grad_itemsize: bytes per dK/dV value sent (the
                accumulation dtype: 4 for float32).

        Raises:
            ValueError: another method.
        """
        P = self.world
        kv, gr = 2 * kv_heads * head_dim * itemsize, 2 * kv_heads * head_dim * grad_itemsize  # per token
        if method in ("ring", "allgather"):
            sizes = [sum(n for _, n, _ in e) for e in export_rows(self.documents, self.layout.chunks)]
            if method == "ring":
                # rank r receives every block but its own and forwards every block but the one it holds last (rank
                # r + 1's); the dK/dV partial sums: sent for every block but its own, received for all but r - 1's
                tot = sum(sizes)
                fs = tuple((tot - sizes[(r + 1) % P]) * kv for r in range(P))
                fr = tuple((tot - sizes[r]) * kv for r in range(P))
                bs = tuple(fs[r] + (tot - sizes[r]) * gr for r in range(P))
                br = tuple(fr[r] + (tot - sizes[(r - 1) % P]) * gr for r in range(P))
                return Traffic(fs, fr, bs, br)
            most = max(sizes)
            f = ((P - 1) * most * kv,) * P
            b = ((P - 1) * most * (kv + gr),) * P
            return Traffic(f, f, b, b)
        if method != "p2p":
            raise ValueError(f"traffic is counted for 'p2p', 'ring' and 'allgather', got {method!r}")
        recv = [sum(n for ranges in self.needs[r] for _, n in ranges) for r in range(P)]  # tokens
        sent = [sum(n for r in range(P) for _, n in self.needs[r][s]) for s in range(P)]
        return Traffic(
            tuple(t * kv for t in sent), tuple(t * kv for t in recv),
            tuple(s * kv + r * gr for s, r in zip(sent, recv)), tuple(r * kv + s * gr for s, r in zip(sent, recv)),
        )  # fmt: skip

    @functools.cached_property
    def documents(self) -> Documents:
        """The plan's mask as `blocks.Documents` (built once: every layer's call looks its steps up by it)."""
        return Documents(self.cu_seqlens, doc_band(self.causal, self.window))

    @functools.cached_property
    def routes(self):
        """This rank's `p2p.Routes` (built once per plan)."""
        return routes(self.layout, self.needs, self.documents, self.rank)

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
        return take_local(x, 0, self.layout, self.rank)

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
            method: "ring" (every rank's export rows around the ring, one launch per step), "allgather" (gather
                the export rows; two launches), "ulysses" (all-to-all to heads, one launch over the whole packed
                sequence), "ulysses_ring" (all-to-all inside groups of ``ulysses_size`` ranks, ring across them) or
                "p2p" (only the K/V rows some local query can see, point to point: ``plan.needs``; `traffic`).
                Export rows: the tokens some query of another rank sees (`blocks.export_rows`); none, and no
                communication, when every document is whole on one rank.
            scale: softmax scale (default 1/sqrt(D)). backend: "auto", "tiled" or "triton" (as `cp_attention`).

        Returns:
            (total / P, Hq, D), differentiable in q, k and v.

        Raises:
            ValueError / TypeError on every rank (checked collectively): bad tensors, a local length other than
            the plan's, inputs that differ across ranks, heads the method cannot split, an unknown method.
        """
        q4, k4, v4 = (_to_bhsd(t) for t in (q, k, v))  # (1, H, total / P, D)
        scale = self._check(q4, k4, v4, method=method, scale=scale, backend=backend, ulysses_size=ulysses_size)
        mask = self.documents
        launchers = resolve_launchers(backend, q4.device, q4.dtype)
        if method == "p2p":
            out = P2PAttention.apply(q4, k4, v4, self.info, self.routes, scale, launchers)
        else:
            out = run_method(
                q4, k4, v4, info=self.info, method=method, layout=self.layout, mask=mask, scale=scale,
                launchers=launchers, ulysses_size=ulysses_size,
            )  # fmt: skip
        return out[0].permute(1, 0, 2).contiguous()  # (total / P, Hq, D)

    def _check(self, q4, k4, v4, *, method, scale, backend, ulysses_size) -> float:
        """`attention.cp_attention`'s collective check with the plan's methods (p2p is checked as allgather, which
        puts no constraint on heads, and told apart by an extra column). Returns the scale.

        The first call of a plan with given arguments is checked collectively (a host all-gather, a barrier of the
        group's ranks); a call that repeats arguments every rank agreed on for this plan (every layer of a model,
        a recomputed forward) passes unchecked: its tensors' shapes, dtypes and devices and the other arguments are
        those of the agreed call. A rank whose arguments change alone after that waits for the others in the check
        and raises on its timeout."""
        key = None
        if all(isinstance(t, torch.Tensor) for t in (q4, k4, v4)):
            key = (method, scale, backend, ulysses_size, *((t.shape, t.dtype, t.device) for t in (q4, k4, v4)))
            try:
                if key in self.agreed:
                    return self.agreed[key]
            except TypeError:  # an unhashable argument: the full checks say what is wrong with it
                key = None
        info, where = self.info, "DispatchPlan.attention"
        known = isinstance(method, str) and method in PLAN_METHODS
        base = "allgather" if method == "p2p" else method
        err: Exception | None = None
        resolved = None
        try:
            if not known:
                raise ValueError(f"method must be one of {PLAN_METHODS}, got {method!r}")
            resolved = _local_checks(
                q4, k4, v4, info=info, method=base, layout=self.layout, causal=self.causal, window=self.window,
                scale=scale, backend=backend, ulysses_size=ulysses_size,
            )  # fmt: skip
        except (TypeError, ValueError) as e:
            err = e
        if info.world == 1:
            if err is not None:
                raise err
            return resolved[0]
        row = _meta(
            q4, k4, v4, method=base if known else None, layout=self.layout, causal=self.causal, window=self.window,
            scale=resolved[0] if resolved else scale, backend=backend, err=int(err is not None),
            ulysses_size=ulysses_size,
        ) + [PLAN_METHODS.index(method) if known else -1]  # fmt: skip

        def describe(rw: list[int]) -> str:
            return _describe(rw[:-1]) + f" (method {PLAN_METHODS[rw[-1]] if rw[-1] >= 0 else '?'})"

        agree_or_raise(
            row, err, info, q4, where=where, same="its share of one packed sequence with the same arguments",
            describe=describe,
        )  # fmt: skip
        if key is not None:
            self.agreed[key] = resolved[0]
        return resolved[0]


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
    """Shard a packed sequence over a context-parallel group: documents whole where they fit, the mask area each rank
    computes balanced (`placement.plan_layout`).

    Every rank of ``group`` calls it with the same arguments (checked collectively).

    Args:
        cu_seqlens: 0, then the cumulative document lengths (int32/int64 tensor or list of ints), ending at the
            number of packed tokens, a multiple of the group size.
        group: the context-parallel process group (default: the world; needs torch.distributed initialised);
            `SINGLE_PROCESS` for this process alone.
        causal, window: the mask inside each document, as in `flash_attn_varlen_func` (window (left, right),
            -1 unbounded).
        chunk_size: the piece size of documents that must be split (default: `default_chunk_size`).

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
    needs = plan_needs(cu, layout, causal=causal, window=win)
    return DispatchPlan(tuple(cu), causal, win, cs, layout, tuple(areas), needs, info)

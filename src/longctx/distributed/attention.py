"""`cp_attention`: context-parallel attention on sequence shards, with collective input checks.

`run_method` is the one place a method name becomes its autograd functions (the dispatcher calls it too);
the hybrid Ulysses x ring is composed there from the Ulysses all-to-alls and the ring.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Sequence

import torch

from longctx.api import validate
from longctx.distributed.allgather import AllGatherAttention, DocAllGatherAttention
from longctx.distributed.blocks import Documents, Mask
from longctx.distributed.comm import GroupInfo, comm_device, cp_group_info, cpu_group, sub_group
from longctx.distributed.doc_ring import DocRingAttention
from longctx.distributed.ring import RingAttention
from longctx.distributed.sharding import LAYOUTS, ChunkLayout, chunks_per_rank, local_chunks
from longctx.distributed.ulysses import HeadToSeq, SeqToHead, UlyssesAttention, kv_replication
from longctx.launchers.select import BACKENDS, Launchers, resolve_launchers
from longctx.masks import Band, normalize_window

__all__ = ["cp_attention", "METHODS", "run_method", "check_cu_seqlens"]

METHODS = ("ring", "allgather", "ulysses", "ulysses_ring")
_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def check_cu_seqlens(cu_seqlens: object, total: int, *, name: str = "cu_seqlens") -> list[int]:
    """The document boundaries as a list of ints, checked against ``total`` packed tokens; ValueError/TypeError
    naming what was received otherwise."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1:
            raise TypeError(
                f"{name} must be a 1-D int32 (or int64) tensor of cumulative document lengths, got dtype "
                f"{cu_seqlens.dtype} and shape {tuple(cu_seqlens.shape)}"
            )
        vals = cu_seqlens.tolist()
    elif isinstance(cu_seqlens, Sequence) and not isinstance(cu_seqlens, (str, bytes)):
        vals = list(cu_seqlens)
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in vals):
            raise TypeError(f"{name} must hold ints (cumulative document lengths), got {cu_seqlens!r}")
    else:
        raise TypeError(f"{name} must be an int32 tensor or a list of ints, got {type(cu_seqlens).__name__}")
    if len(vals) < 2 or vals[0] != 0:
        raise ValueError(
            f"{name} must start at 0 and hold batch + 1 >= 2 entries (flash-attn's cu_seqlens), got {vals[:8]}"
            + ("..." if len(vals) > 8 else "")
        )
    for i in range(1, len(vals)):
        if vals[i] < vals[i - 1]:
            raise ValueError(
                f"{name} must be non-decreasing, but {name}[{i}] = {vals[i]} < {name}[{i - 1}] = {vals[i - 1]}"
            )
    if vals[-1] != total:
        raise ValueError(
            f"{name}[-1] = {vals[-1]} must equal the number of packed tokens of the whole sequence ({total}); pass "
            "the boundaries of the global sequence (the same on every rank), not of a shard"
        )
    return vals


def _check_ulysses_size(method: str, ulysses_size: object, world: int) -> int | None:
    if method != "ulysses_ring":
        if ulysses_size is not None:
            raise ValueError(
                f"ulysses_size is for method='ulysses_ring', got ulysses_size={ulysses_size!r} with method={method!r}"
            )
        return None
    if isinstance(ulysses_size, bool) or not isinstance(ulysses_size, int):
        raise TypeError(
            f"method='ulysses_ring' needs ulysses_size, the number of ranks of each all-to-all group (an int dividing "
            f"the group size {world}), got {ulysses_size!r}"
        )
    if ulysses_size < 1 or world % ulysses_size != 0:
        raise ValueError(
            f"ulysses_size ({ulysses_size}) must be a positive divisor of the context-parallel group size ({world}): "
            f"the group is cut into {world} / ulysses_size all-to-all groups joined by a ring"
        )
    return ulysses_size


def _local_checks(
    q, k, v, *, info, method, layout, causal, window, scale, backend, cu_seqlens=None, ulysses_size=None
) -> tuple[float, Band, list[int] | None]:
    """Everything that can be checked on one rank; raises ValueError/TypeError with the reason."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if not isinstance(layout, ChunkLayout) and layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} for context parallelism, got {backend!r}")
    scale, band_local = validate(q, k, v, causal=causal, window=window, scale=scale)
    S_loc, Sk_loc = q.shape[2], k.shape[2]
    if S_loc != Sk_loc:
        raise ValueError(
            f"context-parallel attention is self-attention over one sharded sequence: q and k must hold the same "
            f"number of local positions, got q {S_loc} and k {Sk_loc}"
        )
    if isinstance(layout, ChunkLayout):
        if S_loc != layout.local_len or info.world != layout.world:
            raise ValueError(
                f"this rank holds {S_loc} tokens but the dispatch plan gives it {layout.local_len} (of "
                f"{layout.total} over {layout.world} ranks; group size {info.world}); pass plan.dispatch(x) of the "
                "packed sequence the plan was made for"
            )
    else:
        n = chunks_per_rank(layout)
        if S_loc == 0 or S_loc % n != 0:
            raise ValueError(
                f"the local sequence length {S_loc} (total {S_loc * info.world} over {info.world} ranks) must be a "
                f"positive multiple of {n} for layout={layout!r}: the total must be divisible by {n * info.world}; "
                "pad the sequence" + (" or use layout='contiguous'" if n == 2 else "")
            )
    cu = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, S_loc * info.world)
    U = _check_ulysses_size(method, ulysses_size, info.world)
    if method == "ulysses":
        kv_replication(q.shape[1], k.shape[1], info.world)
    elif method == "ulysses_ring":
        kv_replication(q.shape[1], k.shape[1], U, method="ulysses_ring", what="ulysses_size")
    resolve_launchers(backend, q.device, q.dtype)  # a pinned backend that cannot run raises here
    return scale, band_local, cu


def _crc(obj) -> int:
    return zlib.crc32(repr(obj).encode())


def _meta(
    q, k, v, *, method, layout, causal, window, scale, backend, err: int, cu=None, ulysses_size=None
) -> list[int]:
    def shape(t):
        if not isinstance(t, torch.Tensor):
            return [-1] * 5
        s = list(t.shape)[:4]
        return [t.dim()] + s + [-1] * (4 - len(s))

    def dtype(t):
        return _DTYPES.index(t.dtype) if isinstance(t, torch.Tensor) and t.dtype in _DTYPES else -1

    try:
        wl, wr = normalize_window(window)
    except (TypeError, ValueError):
        wl, wr = -2, -2
    try:
        scale_bits = int(torch.tensor(float(scale), dtype=torch.float64).view(torch.int64))
    except (TypeError, ValueError):
        scale_bits = -1
    return [
        err,
        *shape(q),
        *shape(k),
        *shape(v),
        dtype(q),
        dtype(k),
        dtype(v),
        METHODS.index(method) if method in METHODS else -1,
        (len(LAYOUTS) if isinstance(layout, ChunkLayout) else LAYOUTS.index(layout)) if _known(layout) else -1,
        int(bool(causal)) if isinstance(causal, bool) else -1,
        wl,
        wr,
        scale_bits,
        BACKENDS.index(backend) if backend in BACKENDS else -1,
        -1 if cu is None else _crc(cu),
        ulysses_size if isinstance(ulysses_size, int) and not isinstance(ulysses_size, bool) else -1,
        _crc(layout.chunks) if isinstance(layout, ChunkLayout) else -1,
    ]


def _known(layout) -> bool:
    return isinstance(layout, ChunkLayout) or (isinstance(layout, str) and layout in LAYOUTS)


def _describe(row: list[int]) -> str:
    def shp(off):
        d = row[off]
        return "not a tensor" if d < 0 else str(tuple(x for x in row[off + 1 : off + 1 + min(d, 4)]))

    dts = ["?" if i < 0 else str(_DTYPES[i]).replace("torch.", "") for i in row[16:19]]
    m = METHODS[row[19]] if row[19] >= 0 else "?"
    lay = "?" if row[20] < 0 else ("dispatch plan" if row[20] == len(LAYOUTS) else LAYOUTS[row[20]])
    scale = torch.tensor(row[24], dtype=torch.int64).view(torch.float64).item() if row[24] != -1 else "?"
    return (
        f"q {shp(1)} k {shp(6)} v {shp(11)} dtypes {'/'.join(dts)} method={m} layout={lay} causal={bool(row[21])} "
        f"window=({row[22]}, {row[23]}) scale={scale}"
        + ("" if row[26] == -1 else f" cu_seqlens checksum {row[26]:08x}")
        + ("" if row[27] == -1 else f" ulysses_size={row[27]}")
        + ("" if row[28] == -1 else f" plan checksum {row[28]:08x}")
    )


def _collective_check(
    q,
    k,
    v,
    *,
    info: GroupInfo,
    method,
    layout,
    causal,
    window,
    scale,
    backend,
    cu_seqlens=None,
    ulysses_size=None,
    where: str = "cp_attention",
):
    """Check the inputs on every rank *together* before any point-to-point op, so that a bad input on one
    rank raises on every rank instead of leaving the others waiting forever. Returns (scale, band, cu list)."""
    err: Exception | None = None
    resolved = None
    try:
        resolved = _local_checks(
            q, k, v, info=info, method=method, layout=layout, causal=causal, window=window, scale=scale,
            backend=backend, cu_seqlens=cu_seqlens, ulysses_size=ulysses_size,
        )  # fmt: skip
    except (TypeError, ValueError) as e:
        err = e
    if info.world == 1:
        if err is not None:
            raise err
        return resolved

    row = _meta(
        q, k, v, method=method, layout=layout, causal=causal, window=window,
        scale=resolved[0] if resolved else scale, backend=backend, err=int(err is not None),
        cu=resolved[2] if resolved else None, ulysses_size=ulysses_size,
    )  # fmt: skip
    agree_or_raise(
        row, err, info, q, where=where,
        same="its shard of one sequence with the same arguments (and the same cu_seqlens)",
    )  # fmt: skip
    return resolved


def agree_or_raise(
    row: list[int], err: Exception | None, info: GroupInfo, hint, *, where: str, same: str, describe=None
) -> None:
    """Exchange every rank's check row (``row[0]`` set where this rank's own checks failed with ``err``) and raise
    on every rank if any rank failed or the rows differ: the failing rank re-raises its error, the others a
    ValueError naming it; differing rows name each rank's arguments (``describe`` of a row, default `_describe`).
    ``same`` says what every rank must pass."""
    describe = describe or _describe
    rows = _exchange_rows(row, info, hint)
    bad = [r for r, rw in enumerate(rows) if rw[0]]
    if bad:
        if err is not None:
            raise type(err)(f"{where} on rank {info.rank}: {err}") from err
        raise ValueError(
            f"{where}: invalid input on rank(s) {bad} of the context-parallel group (see the error raised "
            f"there: {describe(rows[bad[0]])}); every rank stops here"
        )
    if any(rw != rows[0] for rw in rows):
        lines = "\n".join(f"  rank {r}: {describe(rw)}" for r, rw in enumerate(rows))
        raise ValueError(
            f"{where}: the ranks of the context-parallel group passed different shapes, dtypes or arguments; "
            f"every rank must pass {same}:\n{lines}"
        )


def _exchange_rows(row: list[int], info: GroupInfo, hint=None) -> list[list[int]]:
    """All-gather one int64 row per rank. Every call, on every rank (a per-shape cache would skip the exchange
    on the ranks whose shapes it has seen and hang the others). On the CPU through gloo (the group itself, or its
    gloo twin for NCCL), so the check never waits for the GPU; the NCCL group itself only where no gloo twin can
    be made."""
    import torch.distributed as dist

    cg = cpu_group(info)
    if cg is not None:
        mine = torch.tensor(row, dtype=torch.int64)
        rows = torch.empty(info.world, len(row), dtype=torch.int64)
        dist.all_gather(list(rows.unbind(0)), mine, group=cg)
    else:
        dev = comm_device(info, hint)
        mine = torch.tensor(row, dtype=torch.int64, device=dev)
        rows = torch.empty(info.world, len(row), dtype=torch.int64, device=dev)
        if info.is_nccl:
            dist.all_gather_into_tensor(rows, mine, group=info.group)
        else:
            dist.all_gather(list(rows.unbind(0)), mine, group=info.group)
    return rows.cpu().tolist()


@functools.lru_cache(maxsize=64)
def _hybrid_layouts(
    seq_total: int, world: int, ulysses_size: int, layout
) -> tuple[ChunkLayout, tuple[ChunkLayout, ...]]:
    """The layouts of the hybrid: ring rank j is the all-to-all group of ranks [jU, (j+1)U); it holds the union
    of their tokens in global order (``ring``, over P/U ranks); ``subs[j]`` places each member's runs in that
    union (the layout of the all-to-all inside group j)."""
    U = ulysses_size
    ring, subs = [], []
    for j in range(world // U):
        pieces = sorted(
            (g, n, u, ls) for u in range(U) for ls, n, g in local_chunks(seq_total, j * U + u, world, layout)
        )
        runs: list[list[int]] = []  # [local_start, length, global_start] in the union
        where: dict[tuple[int, int], int] = {}  # (member, local_start) -> position in the union
        pos = 0
        for g, n, u, ls in pieces:
            where[(u, ls)] = pos
            if runs and runs[-1][2] + runs[-1][1] == g:
                runs[-1][1] += n
            else:
                runs.append([pos, n, g])
            pos += n
        ring.append(tuple(tuple(r) for r in runs))
        members = tuple(
            tuple((ls, n, where[(u, ls)]) for ls, n, _g in local_chunks(seq_total, j * U + u, world, layout))
            for u in range(U)
        )
        subs.append(ChunkLayout(pos, members))
    return ChunkLayout(seq_total, tuple(ring)), tuple(subs)


@functools.lru_cache(maxsize=256)
def _all_chunks(seq_total: int, world: int, layout) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """Every rank's runs under ``layout`` (a name or a `ChunkLayout`)."""
    if isinstance(layout, ChunkLayout):
        return layout.chunks
    return tuple(tuple(local_chunks(seq_total, r, world, layout)) for r in range(world))


def run_method(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    info: GroupInfo,
    method: str,
    layout,
    mask: Mask,
    scale: float,
    launchers: Launchers,
    ulysses_size: int | None = None,
) -> torch.Tensor:
    """The method's autograd functions on checked (B, H, S/P, D) shards; ``mask``: a global `Band` or `Documents`."""
    docs = isinstance(mask, Documents)
    if method == "ring":
        if docs:
            return DocRingAttention.apply(q, k, v, info, _all_chunks(q.shape[2] * info.world, info.world, layout),
                                          mask, scale, launchers)  # fmt: skip
        return RingAttention.apply(q, k, v, info, layout, mask, scale, launchers)
    if method == "allgather":
        if docs:
            chunks = _all_chunks(q.shape[2] * info.world, info.world, layout)
            return DocAllGatherAttention.apply(q, k, v, info, chunks, mask, scale, launchers)
        return AllGatherAttention.apply(q, k, v, info, layout, mask, scale, launchers)
    if method == "ulysses":
        rep = kv_replication(q.shape[1], k.shape[1], info.world)  # > 1 where Hkv < P: kv heads are repeated
        return UlyssesAttention.apply(q, k, v, info, layout, mask, scale, launchers, rep)
    assert method == "ulysses_ring" and ulysses_size is not None
    U, P = ulysses_size, info.world
    j, u = divmod(info.rank, U)
    ring_layout, subs = _hybrid_layouts(q.shape[2] * P, P, U, layout)
    a2a = sub_group(info, tuple(range(j * U, (j + 1) * U)))  # the all-to-all group (consecutive ranks: a node)
    ring = sub_group(info, tuple(range(u, P, U)))  # the ring across groups: the ranks holding the same heads
    rep = kv_replication(q.shape[1], k.shape[1], U, method="ulysses_ring", what="ulysses_size")
    if rep > 1:  # Hkv < U: every member must receive the kv head its query heads read
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    q_h, k_h, v_h = (SeqToHead.apply(t, a2a, subs[j]) for t in (q, k, v))  # (B, H/U, S*U/P, D)
    if isinstance(mask, Documents):
        out_h = DocRingAttention.apply(q_h, k_h, v_h, ring, ring_layout.chunks, mask, scale, launchers)
    else:
        out_h = RingAttention.apply(q_h, k_h, v_h, ring, ring_layout, mask, scale, launchers)
    return HeadToSeq.apply(out_h, a2a, subs[j])


def cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    method: str = "ring",
    layout: str = "zigzag",
    causal: bool = False,
    window: tuple[int, int] | None = None,
    scale: float | None = None,
    backend: str = "auto",
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    ulysses_size: int | None = None,
) -> torch.Tensor:
    """Context-parallel self-attention over a sequence sharded across the ranks of ``group``.

    Every rank passes its shard (as made by ``shard(x, dim=2, group, layout)``) and gets its shard of the output
    of ``longctx.attention(q_full, k_full, v_full, causal=causal, window=window, scale=scale)`` or, with
    ``cu_seqlens``, of ``flash_attn_varlen_func`` over the packed documents of the sequence.

    Args:
        q: (B, Hq, S/P, D) local queries; k, v: (B, Hkv, S/P, D) local keys and values (Hq % Hkv == 0: GQA).
        group: the context-parallel process group (default: the world, which needs torch.distributed
            initialised); `SINGLE_PROCESS` runs this process alone as a group of one.
        method: "ring" (K/V travel around the ring, overlapped with compute; the backward sends dK/dV back
            around a second ring), "allgather" (gather the whole K/V, reduce-scatter dK/dV; Llama 3),
            "ulysses" (all-to-all to heads: Hq and Hkv divisible by P, or P divisible by Hkv with kv
            replication) or "ulysses_ring" (all-to-all to heads inside groups of ``ulysses_size`` consecutive
            ranks, a ring across the groups: for head counts Ulysses alone cannot split).
        layout: how the sequence was sharded: "zigzag" (rank r holds chunks r and 2P-1-r of 2P; balances causal
            work) or "contiguous" (chunk r of P).
        causal, window, scale: as in `longctx.attention`, over global positions (S x S, so causal is the
            usual lower triangle); with ``cu_seqlens``, inside each document (as `flash_attn_varlen_func`).
        backend: "auto" (Triton launchers on CUDA for fp16/bf16 when available, else tiled), "tiled", "triton".
        cu_seqlens: packed documents along the sequence: 0, then the cumulative document lengths of the *global*
            sequence (int32/int64 tensor or list, ending at S; the same on every rank and for every batch row).
            Attention never crosses a document boundary. For load balanced by work, see `dispatch_plan`.
        ulysses_size: for method="ulysses_ring": the size of each all-to-all group (a divisor of P; Hq divisible
            by it, and Hkv divisible by it or dividing it).

    Returns:
        (B, Hq, S/P, D) local output; differentiable in q, k and v.

    Raises:
        RuntimeError: torch.distributed is not initialised (and ``group`` is not `SINGLE_PROCESS`).
        ValueError / TypeError, on every rank of the group (the inputs are checked collectively before any
        point-to-point communication): invalid tensors, local lengths that do not fit the layout (total not
        divisible by 2P for zigzag, P for contiguous), shapes/dtypes/arguments/cu_seqlens that differ across
        ranks, invalid cu_seqlens, head counts Ulysses cannot split, an unknown method, layout or backend, a
        ulysses_size that does not divide P.
    """
    info = cp_group_info(group, "cp_attention")
    scale, _, cu = _collective_check(
        q, k, v, info=info, method=method, layout=layout, causal=causal, window=window, scale=scale, backend=backend,
        cu_seqlens=cu_seqlens, ulysses_size=ulysses_size,
    )  # fmt: skip
    S_total = q.shape[2] * info.world
    band = Band.from_args(S_total, S_total, causal=causal, window=normalize_window(window))
    mask: Mask = band if cu is None else Documents(tuple(cu), band)
    launchers = resolve_launchers(backend, q.device, q.dtype)
    return run_method(
        q, k, v, info=info, method=method, layout=layout, mask=mask, scale=scale, launchers=launchers,
        ulysses_size=ulysses_size,
    )  # fmt: skip

"""`cp_attention`: context-parallel attention on sequence shards, with collective input checks."""

from __future__ import annotations

import torch

from longctx.api import validate
from longctx.distributed.allgather import AllGatherAttention
from longctx.distributed.comm import GroupInfo, comm_device, cpu_group, group_info
from longctx.distributed.ring import RingAttention
from longctx.distributed.sharding import LAYOUTS, chunks_per_rank
from longctx.distributed.ulysses import UlyssesAttention, kv_replication
from longctx.launchers.select import BACKENDS, resolve_launchers
from longctx.masks import Band, normalize_window

__all__ = ["cp_attention", "METHODS"]

METHODS = ("ring", "allgather", "ulysses")
_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _local_checks(q, k, v, *, info, method, layout, causal, window, scale, backend) -> tuple[float, Band]:
    """Everything that can be checked on one rank; raises ValueError/TypeError with the reason."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if layout not in LAYOUTS:
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
    n = chunks_per_rank(layout)
    if S_loc == 0 or S_loc % n != 0:
        raise ValueError(
            f"the local sequence length {S_loc} (total {S_loc * info.world} over {info.world} ranks) must be a "
            f"positive multiple of {n} for layout={layout!r}: the total must be divisible by {n * info.world}; "
            "pad the sequence" + (" or use layout='contiguous'" if n == 2 else "")
        )
    if method == "ulysses":
        kv_replication(q.shape[1], k.shape[1], info.world)
    resolve_launchers(backend, q.device, q.dtype)  # a pinned backend that cannot run raises here
    return scale, band_local


def _meta(q, k, v, *, method, layout, causal, window, scale, backend, err: int) -> list[int]:
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
        LAYOUTS.index(layout) if layout in LAYOUTS else -1,
        int(bool(causal)) if isinstance(causal, bool) else -1,
        wl,
        wr,
        scale_bits,
        BACKENDS.index(backend) if backend in BACKENDS else -1,
    ]


def _describe(row: list[int]) -> str:
    def shp(off):
        d = row[off]
        return "not a tensor" if d < 0 else str(tuple(x for x in row[off + 1 : off + 1 + min(d, 4)]))

    dts = ["?" if i < 0 else str(_DTYPES[i]).replace("torch.", "") for i in row[16:19]]
    m = METHODS[row[19]] if row[19] >= 0 else "?"
    lay = LAYOUTS[row[20]] if row[20] >= 0 else "?"
    scale = torch.tensor(row[24], dtype=torch.int64).view(torch.float64).item() if row[24] != -1 else "?"
    return (
        f"q {shp(1)} k {shp(6)} v {shp(11)} dtypes {'/'.join(dts)} method={m} layout={lay} causal={bool(row[21])} "
        f"window=({row[22]}, {row[23]}) scale={scale}"
    )


def _collective_check(q, k, v, *, info: GroupInfo, method, layout, causal, window, scale, backend):
    """Check the inputs on every rank *together* before any point-to-point op, so that a bad input on one
    rank raises on every rank instead of leaving the others waiting forever."""
    err: Exception | None = None
    resolved = None
    try:
        resolved = _local_checks(
            q,
            k,
            v,
            info=info,
            method=method,
            layout=layout,
            causal=causal,
            window=window,
            scale=scale,
            backend=backend,
        )
    except (TypeError, ValueError) as e:
        err = e
    if info.world == 1:
        if err is not None:
            raise err
        return resolved
    import torch.distributed as dist

    row = _meta(
        q,
        k,
        v,
        method=method,
        layout=layout,
        causal=causal,
        window=window,
        scale=resolved[0] if resolved else scale,
        backend=backend,
        err=int(err is not None),
    )
    # Every call, on every rank (a per-shape cache would skip the exchange on the ranks whose shapes it has seen
    # and hang the others). On the CPU through gloo (the group itself, or its gloo twin for NCCL), so the check
    # never waits for the GPU; the NCCL group itself only where no gloo twin can be made.
    cg = cpu_group(info)
    if cg is not None:
        mine = torch.tensor(row, dtype=torch.int64)
        rows = torch.empty(info.world, len(row), dtype=torch.int64)
        dist.all_gather(list(rows.unbind(0)), mine, group=cg)
    else:
        dev = comm_device(info, q)
        mine = torch.tensor(row, dtype=torch.int64, device=dev)
        rows = torch.empty(info.world, len(row), dtype=torch.int64, device=dev)
        if info.is_nccl:
            dist.all_gather_into_tensor(rows, mine, group=info.group)
        else:
            dist.all_gather(list(rows.unbind(0)), mine, group=info.group)
    rows_l = rows.cpu().tolist()
    bad = [r for r, rw in enumerate(rows_l) if rw[0]]
    if bad:
        if err is not None:
            raise type(err)(f"cp_attention on rank {info.rank}: {err}") from err
        raise ValueError(
            f"cp_attention: invalid input on rank(s) {bad} of the context-parallel group (see the error raised "
            f"there: {_describe(rows_l[bad[0]])}); every rank stops here"
        )
    if any(rw != rows_l[0] for rw in rows_l):
        lines = "\n".join(f"  rank {r}: {_describe(rw)}" for r, rw in enumerate(rows_l))
        raise ValueError(
            "cp_attention: the ranks of the context-parallel group passed different shapes, dtypes or arguments; "
            f"every rank must pass its shard of one sequence with the same arguments:\n{lines}"
        )
    return resolved


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
) -> torch.Tensor:
    """Context-parallel self-attention over a sequence sharded across the ranks of ``group``.

    Every rank passes its shard (as made by ``shard(x, dim=2, group, layout)``) and gets its shard of the output
    of ``longctx.attention(q_full, k_full, v_full, causal=causal, window=window, scale=scale)``.

    Args:
        q: (B, Hq, S/P, D) local queries; k, v: (B, Hkv, S/P, D) local keys and values (Hq % Hkv == 0: GQA).
        group: the context-parallel process group (default: the world).
        method: "ring" (K/V travel around the ring, overlapped with compute; the backward sends dK/dV back
            around a second ring), "allgather" (gather the whole K/V, reduce-scatter dK/dV; Llama 3) or
            "ulysses" (all-to-all to heads: Hq and Hkv divisible by P, or P divisible by Hkv with kv
            replication).
        layout: how the sequence was sharded: "zigzag" (rank r holds chunks r and 2P-1-r of 2P; balances causal
            work) or "contiguous" (chunk r of P).
        causal, window, scale: as in `longctx.attention`, over global positions (S x S, so causal is the
            usual lower triangle).
        backend: "auto" (Triton launchers on CUDA for fp16/bf16 when available, else tiled), "tiled", "triton".

    Returns:
        (B, Hq, S/P, D) local output; differentiable in q, k and v.

    Raises:
        ValueError / TypeError, on every rank of the group (the inputs are checked collectively before any
        point-to-point communication): invalid tensors, local lengths that do not fit the layout (total not
        divisible by 2P for zigzag, P for contiguous), shapes/dtypes/arguments that differ across ranks, head
        counts Ulysses cannot split, an unknown method, layout or backend.
    """
    info = group_info(group)
    scale, _ = _collective_check(
        q, k, v, info=info, method=method, layout=layout, causal=causal, window=window, scale=scale, backend=backend
    )
    S_total = q.shape[2] * info.world
    band = Band.from_args(S_total, S_total, causal=causal, window=normalize_window(window))
    launchers = resolve_launchers(backend, q.device, q.dtype)
    if method == "ring":
        return RingAttention.apply(q, k, v, info, layout, band, scale, launchers)
    if method == "allgather":
        return AllGatherAttention.apply(q, k, v, info, layout, band, scale, launchers)
    rep = kv_replication(q.shape[1], k.shape[1], info.world)  # > 1 where Hkv < P: kv heads are repeated
    return UlyssesAttention.apply(q, k, v, info, layout, band, scale, launchers, rep)

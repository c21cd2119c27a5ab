"""Communication helpers shared by the context-parallel methods: group facts, ring exchanges, all-gather,
reduce-scatter and all-to-all along the sequence, with gloo (CPU) and NCCL (GPU) code paths."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from longctx.distributed.sharding import SINGLE_PROCESS, global_to_rank_major, reorder_to_global

__all__ = [
    "GroupInfo",
    "group_info",
    "cp_group_info",
    "sub_group",
    "comm_device",
    "cuda_backend",
    "cpu_group",
    "RingComm",
    "exchange",
    "all_to_all_rows",
    "Done",
    "gather_seq",
    "reduce_scatter_seq",
    "gather_flat",
    "reduce_scatter_flat",
    "all_to_all",
]


@dataclass(frozen=True)
class GroupInfo:
    """Rank and size in a context-parallel group. ``members``: a sub-group of ``group`` without a process group of
    its own (the ranks of ``group`` it holds, in order; ``rank`` and ``world`` count within it), used by the
    hybrid Ulysses x ring method; its ring exchanges and all-to-alls run on ``group``."""

    group: object
    rank: int
    world: int
    backend: str
    members: tuple[int, ...] | None = None

    @property
    def is_nccl(self) -> bool:
        return cuda_backend(self.backend) == "nccl"


def group_info(group=None) -> GroupInfo:
    """Rank, size and backend of ``group`` (default: the world). A world of one without torch.distributed."""
    if group is SINGLE_PROCESS:
        return GroupInfo(None, 0, 1, "none")
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise RuntimeError("a process group was given but torch.distributed is not initialized")
        return GroupInfo(None, 0, 1, "none")
    return GroupInfo(group, dist.get_rank(group), dist.get_world_size(group), str(dist.get_backend(group)))


def cp_group_info(group, where: str) -> GroupInfo:
    """`group_info` for a context-parallel entry point: ``group=None`` needs torch.distributed initialised.

    Raises:
        RuntimeError: torch.distributed is not initialised and ``group`` is not `SINGLE_PROCESS` (each process
            would otherwise attend over its shard alone, or over the whole sequence, without a word).
    """
    if group is not SINGLE_PROCESS and (not dist.is_available() or not dist.is_initialized()):
        raise RuntimeError(
            f"{where} needs torch.distributed: call torch.distributed.init_process_group(...) first (torchrun sets "
            "the rendezvous variables), or pass group=longctx.distributed.SINGLE_PROCESS to run this process alone "
            "as a context-parallel group of one"
        )
    return group_info(group)


def sub_group(info: GroupInfo, members: tuple[int, ...]) -> GroupInfo:
    """The sub-group of ``info``'s group made of ``members`` (ranks of the group; this rank among them)."""
    assert info.members is None and info.rank in members, (info, members)
    return GroupInfo(info.group, members.index(info.rank), len(members), info.backend, tuple(members))


def cuda_backend(backend: str) -> str:
    """The backend that carries a group's CUDA tensors: ``backend`` itself, or its ``cuda:`` part where the group
    has one backend per device ("cpu:gloo,cuda:nccl" gives "nccl"; "cpu:gloo" alone gives "")."""
    if ":" not in backend:
        return backend
    parts = dict(part.split(":", 1) for part in backend.split(",") if ":" in part)
    return parts.get("cuda", "")


def comm_device(info: GroupInfo, hint: object = None) -> torch.device:
    """The device a small collective of this group must use: CUDA where NCCL carries the group's CUDA tensors
    (NCCL alone, or with gloo beside it for CPU tensors), CPU for gloo alone."""
    if info.backend == "none" or cuda_backend(info.backend) in ("gloo", ""):
        return torch.device("cpu")
    if isinstance(hint, torch.Tensor) and hint.is_cuda:
        return hint.device
    return torch.device("cuda", torch.cuda.current_device())


# id(group) -> (group, its gloo twin or None). The group is kept alive with its twin, so its id is never reused.
_CPU_GROUPS: dict[int, tuple[object, object]] = {}


def cpu_group(info: GroupInfo, *, reuse_gloo: bool = True):
    """A gloo group over the ranks of ``info.group``, for small host-side collectives (shape checks, flags).

    On NCCL every collective is a GPU operation: reading its result back (``.tolist()``) waits for the GPU
    to finish everything queued before it. A CPU tensor through a gloo group never touches the GPU. The
    group itself when gloo already carries its CPU tensors (gloo alone, or beside NCCL; ``reuse_gloo``);
    otherwise a gloo twin created on first use and cached for the life of the process. Only the members of the
    group take part in creating the twin (``use_local_synchronization``), so disjoint context-parallel groups
    may each create theirs at the same time. None when torch.distributed is not initialised, or the twin cannot be
    made (gloo missing, or a group of the same ranks was already created with local synchronisation and took the
    name): callers then use the group's own device. The outcome is the same on every member, so all take the same
    path.
    """
    if info.backend == "none":
        return None
    group = dist.group.WORLD if info.group is None else info.group
    if reuse_gloo and "gloo" in info.backend:
        return group
    hit = _CPU_GROUPS.get(id(group))
    if hit is not None:
        return hit[1]
    try:
        ranks = dist.get_process_group_ranks(group)
        twin = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
    except (RuntimeError, ValueError):
        twin = None
    _CPU_GROUPS[id(group)] = (group, twin)
    return twin


def _global_rank(info: GroupInfo, r: int) -> int:
    if info.members is not None:
        r = info.members[r]
    if info.group is None or info.group is dist.group.WORLD:
        return r
    return dist.get_global_rank(info.group, r)


class RingComm:
    """Batched point-to-point exchange with the ring neighbours: send to rank+1, receive from rank-1."""

    def __init__(self, info: GroupInfo) -> None:
        self.info = info
        self.next = _global_rank(info, (info.rank + 1) % info.world)
        self.prev = _global_rank(info, (info.rank - 1) % info.world)

    def start(
        self, tensors: list[torch.Tensor], tag: int = 0, out: list[torch.Tensor] | None = None
    ) -> tuple[list[torch.Tensor], list]:
        """Start sending ``tensors`` forward and receiving as many from behind; returns (buffers, requests).

        ``out``: receive buffers to reuse (contiguous, the shapes and dtypes of ``tensors``), e.g. the buffers of
        two steps before: the ring methods rotate a fixed set per call instead of allocating one per step, so
        the caching allocator never holds blocks freed while a transfer on the NCCL stream may still use them.
        Reusing a buffer is safe once the previous transfer into or out of it has been waited for: the NCCL
        stream then follows the compute stream, which has finished with it.
        """
        ops, bufs = [], []
        for i, t in enumerate(tensors):
            t = t.contiguous()
            buf = torch.empty_like(t) if out is None else out[i]
            if buf.shape != t.shape or buf.dtype != t.dtype or not buf.is_contiguous():
                raise ValueError(f"RingComm.start: receive buffer {i} does not match its tensor ({t.shape}, {t.dtype})")
            bufs.append(buf)
            # Distinct tags keep gloo's matching unambiguous; NCCL ignores them and matches in issue order.
            ops.append(dist.P2POp(dist.isend, t, self.next, self.info.group, tag + i))
            ops.append(dist.P2POp(dist.irecv, buf, self.prev, self.info.group, tag + i))
        return bufs, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(reqs: list) -> None:
        for r in reqs:
            r.wait()


# id(group) -> group, for the NCCL groups whose communicator a collective has initialised (kept alive: ids stay unique)
_NCCL_READY: dict[int, object] = {}


def _nccl_ready(info: GroupInfo) -> None:
    """One all-reduce on a group's first `exchange`: NCCL requires every rank to take part in the first
    ``batch_isend_irecv`` of a group, and a rank with nothing to move would otherwise issue nothing."""
    group = dist.group.WORLD if info.group is None else info.group
    if id(group) in _NCCL_READY:
        return
    dist.all_reduce(torch.zeros(1, device=comm_device(info)), group=info.group)
    _NCCL_READY[id(group)] = group


def exchange(
    info: GroupInfo, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]], tag: int = 0
) -> list:
    """Start point-to-point transfers with any ranks of the group in one batch; returns the requests (wait with
    `RingComm.wait`).

    ``sends``: (group rank, contiguous tensor) pairs; ``recvs``: (group rank, contiguous buffer) pairs. Both sides
    must plan the same transfers (one message per pair of ranks and ``tag``). A rank with nothing to send or
    receive issues nothing: the transfers are pairwise, so nobody waits for it. Every rank of the group calls it
    (so that on NCCL the first call can initialise the communicator with every rank: `_nccl_ready`).
    """
    if info.is_nccl:
        _nccl_ready(info)
    ops = []
    for peer, t in sends:
        assert t.is_contiguous() and peer != info.rank, (peer, info.rank)
        ops.append(dist.P2POp(dist.isend, t, _global_rank(info, peer), info.group, tag))
    for peer, buf in recvs:
        assert buf.is_contiguous() and peer != info.rank, (peer, info.rank)
        ops.append(dist.P2POp(dist.irecv, buf, _global_rank(info, peer), info.group, tag))
    return dist.batch_isend_irecv(ops) if ops else []


class Done:
    """The request of an exchange that moves nothing (a group of one, or a plan whose ranks exchange no rows)."""

    def wait(self) -> None:
        pass


def all_to_all_rows(info: GroupInfo, send: torch.Tensor, send_counts, recv: torch.Tensor, recv_counts) -> object:
    """Start one all-to-all with uneven splits along dim 0: rows ``send[sum(send_counts[:p]):][:send_counts[p]]`` go
    to group rank p; ``recv`` receives ``recv_counts[p]`` rows from each p, in rank order. Every rank of the group
    calls it (a collective: one call, where a batch of point-to-point operations costs host time per peer), with
    counts that match the peers' (this rank's ``recv_counts[p]`` is rank p's ``send_counts[rank]``). Returns the
    request (``.wait()`` makes the current stream wait for it)."""
    assert info.members is None, "all_to_all_rows runs on a whole group"
    assert send.is_contiguous() and recv.is_contiguous()
    if info.world == 1:
        return Done()
    row = send[0].numel() if send.shape[0] else recv[0].numel() if recv.shape[0] else 0
    return dist.all_to_all_single(
        recv.view(-1), send.view(-1), [n * row for n in recv_counts], [n * row for n in send_counts],
        group=info.group, async_op=True,
    )  # fmt: skip


def gather_seq(x: torch.Tensor, dim: int, info: GroupInfo, layout) -> torch.Tensor:
    """All-gather the local sequence parts of ``x`` and return the full sequence in global order."""
    assert info.members is None, "gather_seq runs on a whole group"
    if info.world == 1:
        return x
    parts = gather_flat(x, info).view(info.world, *x.shape)
    return reorder_to_global(list(parts.unbind(0)), dim, layout)


def reduce_scatter_seq(x_full: torch.Tensor, dim: int, info: GroupInfo, layout) -> torch.Tensor:
    """Sum a full-sequence tensor over the group and return this rank's local part of the sum."""
    assert info.members is None, "reduce_scatter_seq runs on a whole group"
    if info.world == 1:
        return x_full
    stacked = global_to_rank_major(x_full, dim, info.world, layout).contiguous()  # (P, ..., S/P, ...)
    return reduce_scatter_flat(stacked.view(info.world, -1), info).view(stacked.shape[1:])


def gather_flat(x: torch.Tensor, info: GroupInfo) -> torch.Tensor:
    """All-gather a flat tensor of the same size on every rank: (P, n), row p from rank p."""
    assert info.members is None, "gather_flat runs on a whole group"
    x = x.contiguous().view(-1)
    out = torch.empty((info.world, x.numel()), dtype=x.dtype, device=x.device)
    if info.world == 1:
        out[0].copy_(x)
    elif info.is_nccl:
        dist.all_gather_into_tensor(out, x, group=info.group)
    else:
        dist.all_gather(list(out.unbind(0)), x, group=info.group)
    return out


def reduce_scatter_flat(x: torch.Tensor, info: GroupInfo) -> torch.Tensor:
    """Sum (P, n) over the group; this rank's row of the sum, (n,)."""
    assert info.members is None, "reduce_scatter_flat runs on a whole group"
    x = x.contiguous()
    if info.world == 1:
        return x[0]
    if info.is_nccl:
        out = torch.empty(x.shape[1:], dtype=x.dtype, device=x.device)
        dist.reduce_scatter_tensor(out, x, group=info.group)
        return out
    dist.all_reduce(x, group=info.group)  # gloo has no reduce-scatter
    return x[info.rank].clone()


def all_to_all(x: torch.Tensor, info: GroupInfo) -> torch.Tensor:
    """``all_to_all_single`` on a (P, ...) tensor: block p goes to rank p; block p of the result came from p."""
    if info.world == 1:
        return x
    x = x.contiguous()
    out = torch.empty_like(x)
    if info.members is None:
        dist.all_to_all_single(out, x, group=info.group)
        return out
    # a sub-group: one all-to-all over the whole group, exchanging blocks only between members
    world = dist.get_world_size(info.group)
    splits = [0] * world
    for m in info.members:
        splits[m] = 1
    rows, out_rows = x.reshape(info.world, -1), out.reshape(info.world, -1)  # (members, numel / members)
    dist.all_to_all_single(out_rows, rows, splits, splits, group=info.group)
    return out

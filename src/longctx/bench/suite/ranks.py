"""What the context-parallel parts of the suite (`cp_check`, `cp_longest`) share: the first rank's log, a maximum over
the ranks, device syncs."""

from __future__ import annotations

import torch
import torch.distributed as dist

GIB = 2**30


def log(msg: str) -> None:
    """Print on the first rank only."""
    if dist.get_rank() == 0:
        print(msg, flush=True)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def empty_cache(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def max_over_ranks(x: float, dev: torch.device) -> float:
    """The largest ``x`` of the ranks (an all-reduce on ``dev``)."""
    t = torch.tensor([x], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())

"""What the stages of `longctx bench cp` share: names, argument parsers, device syncs and the rank-0 log."""

from __future__ import annotations

import datetime as _dt

import torch
import torch.distributed as dist

METHODS = ("ring", "allgather", "ulysses")
LAYOUTS = ("zigzag", "contiguous")
GIB = 2**30


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def strs(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def empty_cache(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def max_over_ranks(x: float, dev: torch.device) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def versions(dev: torch.device, world: int, launcher: str) -> dict:
    try:
        import triton

        tv = triton.__version__
    except Exception:  # noqa: BLE001
        tv = None
    cuda = dev.type == "cuda"
    return {
        "gpu": torch.cuda.get_device_properties(0).name if cuda else "cpu",
        "gpus": world,
        "torch": torch.__version__,
        "triton": tv,
        "cuda": torch.version.cuda,
        "nccl": ".".join(str(x) for x in torch.cuda.nccl.version()) if cuda else "-",
        "launcher": launcher,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }

"""Timers and memory: `triton.testing.do_bench` medians on CUDA, ``perf_counter`` medians on the CPU."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench_ms(fn: Callable[[], object], device: str, warmup: int, rep: int) -> float:
    """Median milliseconds of ``fn()``: do_bench (``warmup``/``rep`` in ms) on CUDA; on the CPU one warm-up call
    and then calls until ``rep`` ms have passed (at least 3, at most 50)."""
    if device.startswith("cuda"):
        import triton

        return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    fn()
    ts: list[float] = []
    t_end = time.perf_counter() + rep / 1000.0
    while len(ts) < 3 or (time.perf_counter() < t_end and len(ts) < 50):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1000.0)
    return sorted(ts)[len(ts) // 2]


def wall_ms(fn: Callable[[], object], device: str, n: int = 3) -> float:
    """Median wall time of ``fn()`` after one untimed call (host work included: mask builders)."""
    fn()
    sync(device)
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        sync(device)
        ts.append((time.perf_counter() - t0) * 1000.0)
    return sorted(ts)[len(ts) // 2]


class PeakMemory:
    """Peak bytes allocated on a CUDA device above what was allocated on entry (None on the CPU)."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.mib: float | None = None

    def __enter__(self) -> PeakMemory:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.mib = (torch.cuda.max_memory_allocated() - self.base) / 2**20


def is_oom(exc: BaseException) -> bool:
    oom = getattr(torch, "OutOfMemoryError", None)
    if oom is not None and isinstance(exc, oom):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def free_memory(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()

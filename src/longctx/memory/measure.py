"""Measuring memory: bytes saved for backward and peak live tensor bytes, on any device.

- `saved_bytes(fn)`: the bytes autograd keeps between forward and backward (via saved_tensors_hooks),
  counting each storage once.
- `peak_live_bytes(fn)`: the largest number of bytes held by live tensors while ``fn`` runs, tracked with a
  TorchDispatchMode (allocations made by each op, freed when the last tensor using the storage dies). Works
  on the CPU, where PyTorch keeps no allocator statistics; on CUDA `torch.cuda.max_memory_allocated` agrees
  with it up to kernel workspaces. It also counts shape-only tensors (PyTorch's FakeTensorMode), which is how
  the memory model (`longctx.memory.model`) runs a whole training step at any length without the memory.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["saved_bytes", "peak_live_bytes", "LiveBytesTracker", "expandable_segments"]


def expandable_segments() -> str:
    """Set ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` unless the user set the variable, and return the
    setting in force. Call it before the process's first CUDA call (the allocator reads it once). The plans count
    allocated bytes; with expandable segments what the allocator reserves stays closer to them, and a fragmented
    cache gives memory back before an allocation fails (docs/memory.md)."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    return os.environ["PYTORCH_CUDA_ALLOC_CONF"]


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    # the storage object's own address: unique while it lives, for real and for shape-only (fake) tensors alike
    return (str(t.device), t.untyped_storage()._cdata)


def saved_bytes(fn: Callable[[], object]) -> int:
    """Bytes of the distinct storages autograd saves for backward while running ``fn()``."""
    seen: dict[tuple[str, int], int] = {}

    def pack(t: torch.Tensor):
        if t.numel() > 0:
            seen[_storage_key(t)] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


class LiveBytesTracker(TorchDispatchMode):
    """Tracks bytes of storages created inside the mode that are still referenced by a live tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._refs: dict[tuple[str, int], list] = {}
        self._sizes: dict[tuple[str, int], int] = {}
        self.segments: dict[str, int] = {}  # label -> peak bytes while that label was current (`mark`)
        # the marks in order: [label, bytes live at the mark, peak bytes until the next mark]
        self.timeline: list[list] = []
        # (timeline index at allocation, timeline index at release) -> bytes freed in a later segment than made
        self.released: dict[tuple[int, int], int] = {}
        self._born: dict[tuple[str, int], int] = {}
        self._label: str | None = None

    def mark(self, label: str) -> None:
        """Start a segment of the timeline; `segments` keeps the peak of each (a repeated label continues it),
        `timeline` each mark in order with the bytes live at it and the peak until the next mark."""
        self._label = label
        self.segments[label] = max(self.segments.get(label, 0), self.current)
        self.timeline.append([label, self.current, self.current])

    def _release(self, key, ref) -> None:
        refs = self._refs.get(key)
        if refs is None:
            return
        refs[:] = [r for r in refs if r is not ref and r() is not None]
        if not refs:
            del self._refs[key]
            nbytes = self._sizes.pop(key)
            self.current -= nbytes
            born, now = self._born.pop(key), len(self.timeline) - 1
            if born != now:
                self.released[born, now] = self.released.get((born, now), 0) + nbytes

    def _track(self, t: torch.Tensor, input_keys: set) -> None:
        if t.numel() == 0 or (t.is_meta and not is_fake(t)):
            return
        try:
            key = _storage_key(t)
            nbytes = t.untyped_storage().nbytes()
        except RuntimeError:  # tensors without storage (e.g. some wrappers)
            return
        if key not in self._refs:
            if key in input_keys:  # a view of (or in-place result on) memory allocated outside the tracker
                return
            self._refs[key] = []
            self._sizes[key] = nbytes
            self._born[key] = len(self.timeline) - 1
            self.current += nbytes
            self.peak = max(self.peak, self.current)
            if self._label is not None:
                self.segments[self._label] = max(self.segments[self._label], self.current)
                self.timeline[-1][2] = max(self.timeline[-1][2], self.current)
        self._refs[key].append(weakref.ref(t, lambda r, key=key: self._release(key, r)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        input_keys = set()
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and (is_fake(t) or not t.is_meta):
                with contextlib.suppress(RuntimeError):  # tensors without a storage
                    input_keys.add(_storage_key(t))
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t, input_keys)
        return out


def peak_live_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes of tensors allocated (and still alive) during ``fn()``, inputs excluded."""
    tracker = LiveBytesTracker()
    with tracker:
        fn()
    return tracker.peak

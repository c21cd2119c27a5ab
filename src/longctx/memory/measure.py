"""Measuring memory: bytes saved for backward and peak live tensor bytes, on any device.

- `saved_bytes(fn)`: the bytes autograd keeps between forward and backward (via saved_tensors_hooks),
  counting each storage once.
- `peak_live_bytes(fn)`: the largest number of bytes held by live tensors while ``fn`` runs, tracked with a
  TorchDispatchMode (allocations made by each op, freed when the last tensor using the storage dies). Works
  on the CPU, where PyTorch keeps no allocator statistics; on CUDA `torch.cuda.max_memory_allocated` agrees
  with it up to kernel workspaces.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["saved_bytes", "peak_live_bytes", "LiveBytesTracker"]


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


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

    def _release(self, key, ref) -> None:
        refs = self._refs.get(key)
        if refs is None:
            return
        refs[:] = [r for r in refs if r is not ref and r() is not None]
        if not refs:
            del self._refs[key]
            self.current -= self._sizes.pop(key)

    def _track(self, t: torch.Tensor, input_keys: set) -> None:
        if t.is_meta or t.numel() == 0:
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
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        self._refs[key].append(weakref.ref(t, lambda r, key=key: self._release(key, r)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        input_keys = set()
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta:
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

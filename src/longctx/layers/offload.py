"""Activation offloading: the input a checkpointed chunk of layers keeps for backward, in pinned host memory.

With full recomputation every checkpointed chunk keeps one hidden state (B, S, h) for its backward: at S = 512K
and h = 1024 in bf16 that is 1 GiB per chunk, 24 GiB for 24 layers, the largest item of the peak once the layers'
own activations are recomputed. `OffloadedCheckpoint` runs a chunk like a checkpoint (no activations saved, the
chunk recomputed in the backward) but hands its input to an `ActivationOffloader`, which copies it to pinned host
memory on a side stream while the next chunks compute, and copies it back on the side stream one chunk ahead of
the backward that needs it: while chunk i recomputes and differentiates, chunk i-1's input is on its way.

Gradients are bitwise those of the same recomputation without offloading: the copies are exact and the
recomputation replays the chunk with the RNG state and autocast settings of its forward (dropout draws the same
masks). Like PyTorch's reentrant checkpoint, the recomputed chunk is differentiated inside the backward with
`torch.autograd.backward`, so parameter gradients accumulate into ``.grad``: use ``loss.backward()``, not
``torch.autograd.grad``.

On a CPU device there is no host memory to move to: the offloader keeps the tensor as it is (the same code path,
for tests).

torch's pinned-memory allocator rounds every block up to a power of two (a 3 GiB checkpoint would take 4 GiB of
host memory), so each buffer is a few pinned pieces whose sizes are the powers of two of its byte count
(`pinned_pieces`): the host holds what the checkpoints are, to a MiB.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "ActivationOffloader",
    "OffloadedCheckpoint",
    "offloaded_checkpoint",
    "host_memory_available",
    "host_memory_total",
    "pinned_pieces",
    "is_recording",
    "is_replaying",
    "kept_results",
]

_REPLAY = threading.local()


def is_recording() -> bool:
    """True while `OffloadedCheckpoint` runs a chunk's forward (whose activations are dropped): a layer may keep a
    result here that its recomputation in the backward reads back (`is_replaying`)."""
    return getattr(_REPLAY, "recording", False)


def is_replaying() -> bool:
    """True while `OffloadedCheckpoint` recomputes a chunk in the backward (layers that kept results in their
    forward, such as the attention output, read them back instead of recomputing)."""
    return getattr(_REPLAY, "active", False)


def kept_results() -> dict[Any, list] | None:
    """Where the layers of the chunk that `OffloadedCheckpoint` records or replays keep results (a dict a layer
    keys by itself, the same dict in the forward and in its recomputation); None outside a chunk.

    The dict lives with the chunk's autograd node, not with the layer: a recomputation reads only what its own
    forward kept, and a graph dropped without a backward drops what it kept."""
    return getattr(_REPLAY, "kept", None)


def _meminfo(key: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def host_memory_available() -> int | None:
    """Bytes of host memory available for new allocations (MemAvailable of /proc/meminfo), None if unknown."""
    return _meminfo("MemAvailable")


def host_memory_total() -> int:
    """Bytes of host memory of this machine (MemTotal of /proc/meminfo), 0 if unknown."""
    return _meminfo("MemTotal") or 0


PIECE_BYTES = 1 << 20  # the smallest pinned piece; a buffer is its byte count rounded up to this


def pinned_pieces(nbytes: int) -> list[int]:
    """The sizes of the pinned pieces that hold ``nbytes``: the powers of two of ``nbytes`` rounded up to a MiB,
    largest first (what torch's pinned allocator then takes for them exactly: each is already a power of two)."""
    total = -(-nbytes // PIECE_BYTES) * PIECE_BYTES
    return [1 << b for b in range(total.bit_length() - 1, -1, -1) if total >> b & 1]


class _PinnedBuffer:
    """Pinned host memory for one tensor of ``shape`` and ``dtype``, in `pinned_pieces`."""

    def __init__(self, shape: torch.Size, dtype: torch.dtype) -> None:
        self.shape, self.dtype = shape, dtype
        nbytes = shape.numel() * dtype.itemsize
        self.pieces = [torch.empty(n, dtype=torch.uint8, device="cpu", pin_memory=True) for n in pinned_pieces(nbytes)]
        self.nbytes = nbytes

    @property
    def host_bytes(self) -> int:
        return sum(p.numel() for p in self.pieces)

    def _spans(self):
        start = 0
        for piece in self.pieces:
            n = min(piece.numel(), self.nbytes - start)
            if n <= 0:
                return
            yield piece[:n], start, start + n
            start += n

    def store(self, x: torch.Tensor) -> None:
        """Copy ``x`` (on the device) in, without blocking the host."""
        flat = x.contiguous().view(-1).view(torch.uint8)
        for piece, a, b in self._spans():
            piece.copy_(flat[a:b], non_blocking=True)

    def load(self, device: torch.device) -> torch.Tensor:
        """A new tensor on ``device`` with the contents, copied without blocking the host."""
        t = torch.empty(self.shape, dtype=self.dtype, device=device)
        flat = t.view(-1).view(torch.uint8)
        for piece, a, b in self._spans():
            flat[a:b].copy_(piece, non_blocking=True)
        return t


class ActivationOffloader:
    """Slots of tensors moved to pinned host memory and back, in forward order; one per checkpointed chunk.

    ``offload(x) -> slot`` starts the device-to-host copy on a side stream; ``fetch(slot)`` returns the tensor on
    the device (waiting for its copy back, which `prefetch` started earlier) and starts the copy of ``slot - 1``,
    the chunk whose backward comes next. Pinned buffers are kept from one step to the next (pinning is slow).

    Args:
        reserve_bytes: host memory to leave free; offloading a tensor that would cut into it raises ValueError.
    """

    def __init__(self, reserve_bytes: int = 8 << 30) -> None:
        self.reserve_bytes = reserve_bytes
        self._buffers: list[_PinnedBuffer] = []  # pinned host buffers, by slot, reused across steps
        self._slots: list[dict[str, Any]] = []
        self._stream: torch.cuda.Stream | None = None

    def begin(self) -> None:
        """Start a new forward: slots are numbered from 0 again (the buffers stay)."""
        self._slots = []

    @property
    def host_bytes(self) -> int:
        """Pinned host memory held."""
        return sum(b.host_bytes for b in self._buffers)

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _buffer(self, slot: int, x: torch.Tensor) -> _PinnedBuffer:
        if slot < len(self._buffers):
            buf = self._buffers[slot]
            if buf.shape == x.shape and buf.dtype == x.dtype:
                return buf
        need = sum(pinned_pieces(x.numel() * x.element_size()))
        avail = host_memory_available()
        if avail is not None and avail - need < self.reserve_bytes:
            raise ValueError(
                f"cpu_offloading needs {need / 2**30:.2f} GiB more pinned host memory for layer chunk {slot} "
                f"({self.host_bytes / 2**30:.2f} GiB held), but only {avail / 2**30:.2f} GiB is available and "
                f"{self.reserve_bytes / 2**30:.0f} GiB is kept free: offload fewer layers (cpu_offloading_num_layers), "
                "use a shorter sequence, or a machine with more host memory"
            )
        if slot < len(self._buffers):
            self._buffers[slot] = None  # the old pieces go back to the pinned pool before new ones are taken
        buf = _PinnedBuffer(x.shape, x.dtype)
        if slot < len(self._buffers):
            self._buffers[slot] = buf
        else:
            self._buffers.append(buf)
        return buf

    def offload(self, x: torch.Tensor, to_host: bool = True) -> int:
        """Start moving ``x`` to host memory (``to_host``; else keep it as it is); returns its slot."""
        slot = len(self._slots)
        if to_host and _shape_only(x):  # the memory model's trace: the device copy goes, a same-shaped one returns
            self._slots.append({"like": (x.shape, x.dtype, x.device)})
            return slot
        if x.device.type != "cuda" or not to_host:
            self._slots.append({"tensor": x})
            return slot
        buf = self._buffer(slot, x)
        stream = self._side_stream(x.device)
        stream.wait_stream(torch.cuda.current_stream(x.device))  # x is written
        with torch.cuda.stream(stream):
            buf.store(x)
            done = torch.cuda.Event()
            done.record(stream)
        x.record_stream(stream)  # its memory is not reused before the copy has read it
        self._slots.append({"host": buf, "d2h": done, "device": x.device})
        return slot

    def prefetch(self, slot: int) -> None:
        """Start copying ``slot`` back to the device (a no-op if started, or out of range)."""
        if not 0 <= slot < len(self._slots):
            return
        entry = self._slots[slot]
        if "host" not in entry or "tensor" in entry:
            return
        stream = self._side_stream(entry["device"])
        with torch.cuda.stream(stream):
            stream.wait_event(entry["d2h"])
            t = entry["host"].load(entry["device"])
            ready = torch.cuda.Event()
            ready.record(stream)
        entry["tensor"], entry["h2d"] = t, ready

    def fetch(self, slot: int) -> torch.Tensor:
        """The tensor of ``slot`` on its device, ready for the current stream; prefetches ``slot - 1``."""
        self.prefetch(slot)
        entry = self._slots[slot]
        if "like" in entry:
            shape, dtype, device = entry.pop("like")
            return torch.empty(shape, dtype=dtype, device=device)
        t = entry.pop("tensor")
        if "h2d" in entry:
            current = torch.cuda.current_stream(t.device)
            current.wait_event(entry.pop("h2d"))
            t.record_stream(current)  # allocated on the side stream, used and freed on this one
        self.prefetch(slot - 1)
        return t


def _shape_only(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t) or t.is_meta


def _autocast_state(device_type: str) -> dict[str, Any] | None:
    if not torch.is_autocast_enabled(device_type):
        return None
    return {"dtype": torch.get_autocast_dtype(device_type), "cache_enabled": torch.is_autocast_cache_enabled()}


class OffloadedCheckpoint(torch.autograd.Function):
    """``run_fn(x, *args)`` keeping nothing for backward but ``args`` (small, e.g. RoPE tables) and ``x`` (in the
    offloader's host memory when ``to_host``, else where it is); recomputed and differentiated in the backward,
    inside `is_replaying`, after a forward inside `is_recording` (what layers keep there, `kept_results`, stays
    with this node until its recomputation)."""

    @staticmethod
    def forward(
        ctx,
        run_fn: Callable[..., torch.Tensor],
        offloader: ActivationOffloader,
        to_host: bool,
        anchor: torch.Tensor | None,
        x: torch.Tensor,
        *args,
    ):
        dev = x.device
        ctx.run_fn, ctx.offloader, ctx.device = run_fn, offloader, dev
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(dev) if dev.type == "cuda" else None
        ctx.autocast = _autocast_state(dev.type)
        ctx.x_requires_grad = x.requires_grad
        ctx.kept = {}
        _REPLAY.recording, _REPLAY.kept = True, ctx.kept
        try:
            with torch.no_grad():
                y = run_fn(x, *args)
        finally:
            _REPLAY.recording, _REPLAY.kept = False, None
        ctx.slot = offloader.offload(x, to_host)
        ctx.save_for_backward(*args)
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x = ctx.offloader.fetch(ctx.slot).detach().requires_grad_(ctx.x_requires_grad)
        args = ctx.saved_tensors
        dev = ctx.device
        devices = [dev] if dev.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type=dev.type if devices else "cuda"):
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng, dev)
            autocast = (
                torch.autocast(dev.type, **ctx.autocast) if ctx.autocast is not None else contextlib.nullcontext()
            )
            _REPLAY.active, _REPLAY.kept = True, ctx.kept
            try:
                with torch.enable_grad(), autocast:
                    y = ctx.run_fn(x, *args)
            finally:
                _REPLAY.active, _REPLAY.kept = False, None
                ctx.kept = None  # what was not read back goes with the recomputation
        if y.requires_grad:  # nothing in the chunk trains and x needs no gradient: nothing to do
            torch.autograd.backward(y, grad_y)
        return (None, None, None, None, x.grad if ctx.x_requires_grad else None, *(None for _ in args))


def offloaded_checkpoint(
    run_fn: Callable[..., torch.Tensor], offloader: ActivationOffloader, to_host: bool, x: torch.Tensor, *args
) -> torch.Tensor:
    """``run_fn(x, *args)`` through `OffloadedCheckpoint`. Its output needs a gradient even where ``x`` does not (a
    frozen embedding under LoRA adapters, whose parameters autograd cannot see inside ``run_fn``): an empty anchor
    that requires grad goes in then, so the backward (which recomputes and reaches the adapters) runs."""
    anchor = None
    if torch.is_grad_enabled() and not x.requires_grad:
        anchor = torch.empty(0, device=x.device, requires_grad=True)
    return OffloadedCheckpoint.apply(run_fn, offloader, to_host, anchor, x, *args)

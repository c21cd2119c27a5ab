"""The shared Triton runtime of the launchers: is Triton there, the interpreter (``TRITON_INTERPRET=1``) and its
NumPy shim, every kernel launch (`launch`) and the ahead-of-time compilation it records (`compile_ahead`,
`compile_launches`), the scratch allocator of device-side tensor descriptors, TMA-loadability, host-built descriptors
for the Gluon kernels, and the Hopper capability check."""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from longctx import tuning


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=1)
def _triton_import_error() -> str | None:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as exc:  # ImportError, or a broken installation
        return f"triton is not importable ({type(exc).__name__}: {exc}); install it with `pip install triton`"
    return None


@functools.lru_cache(maxsize=1)
def _patch_interpreter_for_numpy2() -> None:
    """Triton 3.6's interpreter turns a scalar into ``int(ndarray of shape (1,))`` when it is a loop bound,
    which NumPy >= 2.4 rejects ("only 0-dimensional arrays can be converted to Python scalars"). Make its
    ``__index__`` read the single element instead. Only ever applied under TRITON_INTERPRET=1."""
    try:
        from triton.runtime import interpreter
    except Exception:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_longctx_patched", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._longctx_patched = True
    interpreter._patch_lang_tensor = patched


# The launches `compile_ahead` records instead of running them; None outside it. A process-wide list, not a
# context variable: the autograd engine runs backward in threads of its own, whose launches must be recorded too.
_RECORDING: list | None = None
_RECORDING_LOCK = threading.Lock()


def launch(kernel, grid, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``: every launcher runs its kernels through here. Inside `compile_ahead` a
    jit kernel's launch is recorded (to be compiled by `compile_launches`), not run; an autotuned kernel and the
    interpreter's run as usual."""
    if _RECORDING is not None and not _interpret() and hasattr(kernel, "device_caches"):
        _RECORDING.append((kernel, grid, args, kwargs))
        return
    kernel[grid](*args, **kwargs)


@contextlib.contextmanager
def compile_ahead():
    """Within this block, the launchers record their kernels' launches instead of running them (outputs are left
    unwritten: what runs inside is for its launches, not its values). Yields the list of recorded launches, for
    `compile_launches`. Not reentrant, and for a process's own warm-up: attention called meanwhile from another
    thread would be recorded too."""
    global _RECORDING
    with _RECORDING_LOCK:
        if _RECORDING is not None:
            raise RuntimeError("compile_ahead is already active (it is not reentrant)")
        _RECORDING = []
    try:
        yield _RECORDING
    finally:
        _RECORDING = None


def _launch_key(kernel, args: tuple, kwargs: dict, device: int | None):
    """What Triton compiles one binary per: the kernel and the specialisation of its arguments (dtypes, 16-byte
    divisibility, constexprs, options), by Triton's own binder; None where this Triton's internals differ (then
    nothing is deduplicated, only compiled twice)."""
    try:
        binder = kernel.device_caches[device][4]
        _, specialization, options = binder(*args, **kwargs)
        return (id(kernel), repr(specialization), repr(options))
    except Exception:
        return None


def compile_launches(launches: list, device: torch.device, workers: int | None = None) -> list[tuple[str, float, str]]:
    """Compile the distinct kernels of recorded ``launches`` (`compile_ahead`) concurrently, in ``workers`` threads
    (default: one per CPU core, at most 32), into the process's kernel cache and Triton's on-disk cache, and load
    each binary; nothing runs on the GPU. Triton releases the GIL while it lowers and assembles a kernel, so the
    wall time is about that of the slowest kernel rather than the sum. Returns ``(kernel name, seconds, error or
    "")`` per distinct kernel; a kernel that fails to compile is reported, not raised (its launcher meets the error
    again when it runs, and falls back where it has a fallback)."""
    index = None
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
    distinct: dict = {}
    for i, (kernel, grid, args, kwargs) in enumerate(launches):
        key = _launch_key(kernel, args, kwargs, index) or (id(kernel), i)
        distinct.setdefault(key, (kernel, grid, args, kwargs))

    def build(item) -> tuple[str, float, str]:
        kernel, grid, args, kwargs = item
        if index is not None:  # the current device is per thread: Triton compiles for (and caches under) it
            torch.cuda.set_device(index)
        t0 = time.perf_counter()
        try:
            compiled = kernel.warmup(*args, grid=grid, **kwargs)
            # what Triton leaves to the first launch: building the kernel's launcher and loading its binary
            init = getattr(compiled, "_init_handles", None)
            if init is not None:
                init()
            err = ""
        except Exception as exc:  # reported; the real launch raises it (or falls back) where it runs
            err = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return getattr(kernel, "__name__", repr(kernel)), time.perf_counter() - t0, err

    if not distinct:
        return []
    try:  # the hash of Triton's installation that keys its on-disk cache: once, not in every thread at once
        from triton.runtime.cache import triton_key

        triton_key()
    except Exception:
        pass
    n = workers if workers is not None else min(32, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=max(1, min(n, len(distinct))), thread_name_prefix="longctx-compile") as ex:
        return list(ex.map(build, distinct.values()))


def _tma_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    # device-side tensor descriptors need a small global scratch buffer per launch (current CUDA device)
    return torch.empty(size, device="cuda", dtype=torch.int8)


@functools.cache
def _triton_allocator_state():
    """(triton.set_allocator, the ContextVar holding the allocator, the type of "none set"); the last two are
    None on a Triton whose internals differ (then the allocator is set unconditionally)."""
    import triton

    try:
        from triton.runtime._allocation import NullAllocator, _allocator
    except ImportError:
        return triton.set_allocator, None, None
    return triton.set_allocator, _allocator, NullAllocator


def _set_tma_allocator() -> None:
    """Install the scratch allocator of device-side tensor descriptors for the calling thread.

    Triton keeps its allocator in a ContextVar, i.e. per thread: setting it once is not enough, because the
    autograd engine runs backward (and with activation checkpointing, the recomputed forward) in its own
    threads. So this runs before every launch that needs it; it keeps an allocator the caller installed.
    """
    if _interpret():  # the interpreter's descriptors live in host memory
        import triton

        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8))
        return
    set_allocator, current, null_type = _triton_allocator_state()
    if current is not None and not isinstance(current.get(), null_type):
        return
    set_allocator(_tma_scratch)


def out_like(q: torch.Tensor) -> torch.Tensor:
    """An output for q (B, H, S, D): q's memory layout when q is dense; for a non-dense q, (B, S, H, D)-contiguous
    when q's seq stride exceeds its head stride (views of flash-attn's packed qkv), else (B, H, S, D)-contiguous.
    So a (B, S, H, D) caller gets a contiguous (B, S, H, D) output without a copy."""
    if q.is_contiguous() or q.transpose(1, 2).is_contiguous() or q.stride(2) <= q.stride(1):
        return torch.empty_like(q)  # dense inputs keep their layout; others fall back to (B, H, S, D)
    B, H, S, D = q.shape
    return torch.empty((B, S, H, D), device=q.device, dtype=q.dtype).transpose(1, 2)  # (B, H, S, D) view


def _tma_ok(t: torch.Tensor, D: int, bd: int, in_interpreter: bool | None = None) -> bool:
    """Whether rows of t (B, H, S, D) can be loaded through TMA descriptors: unit stride on D, 16-byte aligned
    rows, HEAD_DIM == BLOCK_D; a CUDA tensor, or under the interpreter when ``in_interpreter`` allows it (default:
    the ``tma_in_interpreter`` tuning override, which tests of the TMA variants set; the interpreter runs tensor
    descriptors, not their TMA reduce)."""
    if _interpret():
        if in_interpreter is None:
            in_interpreter = bool(tuning.get("tma_in_interpreter"))
        if not in_interpreter:
            return False
    elif t.device.type != "cuda":
        return False
    if bd != D or t.stride(3) != 1:
        return False
    es = t.element_size()
    return t.data_ptr() % 16 == 0 and all((t.stride(i) * es) % 16 == 0 for i in range(3))


@functools.cache
def _ws_capable(device_index: int) -> bool:
    """Gluon importable and an sm_90 GPU (the kernel uses Hopper's wgmma, TMA and setmaxnreg)."""
    if _interpret() or torch.cuda.get_device_capability(device_index)[0] != 9:
        return False
    try:
        from longctx.kernels.gluon import flash_fwd_ws  # noqa: F401
    except Exception:  # a Triton without Gluon
        return False
    return True


@functools.cache
def gpu_name(device_index: int) -> str:
    """The `tuning.MEASURED_TILES` row serving this GPU (`tuning.tile_row`: its own, else the nearest measured GPU
    of its compute capability); "" under the interpreter or where none serves (each list's first entry)."""
    if _interpret():
        return ""
    return tile_row_line(device_index)[0] or ""


@functools.cache
def tile_row_line(device_index: int) -> tuple[str | None, str]:
    """`tuning.tile_row` of this GPU: (row, the line `longctx info` prints)."""
    p = torch.cuda.get_device_properties(device_index)
    return tuning.tile_row(p.name, torch.cuda.get_device_capability(device_index), p.multi_processor_count,
                           p.total_memory / 2**30)  # fmt: skip


def device_index(t: torch.Tensor) -> int:
    """The CUDA device index of ``t`` (the current device for a tensor without one)."""
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def warn_ws_fallback(which: str, exc: Exception) -> None:
    """The warning of a warp-specialised kernel that does not compile (shared with the block-sparse launchers)."""
    import warnings

    warnings.warn(
        f"longctx: the warp-specialised {which} (Gluon) does not compile with this Triton; using the Triton {which} "
        f"instead ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})",
        RuntimeWarning,
        stacklevel=4,
    )


@functools.cache
def _shared_layout(block: tuple[int, ...], dtype: torch.dtype):
    """The shared-memory layout of a TMA block (cached: building one costs as much host time as the descriptor)."""
    from triton.experimental.gluon import language as gl

    gdt = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block), gdt)


def _gluon_desc(t: torch.Tensor, rows: int):
    """Host-built TMA descriptor of a (B, H, S, D) fp16/bf16 tensor for the Gluon kernels: block (1, 1, rows, D),
    any strides (TMA-loadable ones: `_ws_inputs_ok`); rows past S load as zeros."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    block = [1, 1, rows, t.shape[3]]
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, _shared_layout(tuple(block), t.dtype))


def _gluon_rows_desc(t: torch.Tensor, rows: int):
    """1-D TMA descriptor over a contiguous float32 (B, H, padded S) tensor (the backward's lse2 / Delta, each
    head's rows padded to a multiple of 4 floats: `bwd_preprocess`'s row_stride), read ``rows`` at a time."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    flat = t.view(-1)
    return TensorDescriptor(flat, [flat.numel()], [1], [rows], _shared_layout((rows,), torch.float32))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _dot_precision(dtype: torch.dtype) -> str:
    # fp16/bf16 products are exact in the tensor cores either way; float32 takes tf32 on the GPU (documented).
    return "ieee" if _interpret() else "tf32"

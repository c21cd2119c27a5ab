"""Attention launchers for a device and dtype: ``fwd(q, k, v, scale, band) -> (out, lse)`` and
``bwd(do, q, k, v, out, lse, scale, band) -> (dq, dk, dv)`` (dq, dk, dv in float32, float64 for float64 inputs),
and the same over a `BlockMask`, ``sparse_fwd(q, k, v, scale, block_mask)`` and ``sparse_bwd(do, q, k, v, out, lse,
scale, block_mask)`` (one launch per step of context parallelism over packed documents).

Their callers never go through an autograd.Function of a backend: context parallelism calls them block by block
and merges the partial results with their lse itself (as ring-flash-attention does with flash-attn's launchers);
the recomputation that keeps each layer's attention output (`longctx.layers.attention`) replays the backward alone.

backend "auto": the Triton launchers (`longctx.launchers.flash`) on CUDA for float16/bfloat16 when that module
imports, else the tiled launchers (plain PyTorch, any device and dtype). "tiled" and "triton" pin one.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from longctx import switches
from longctx.dtypes import accumulation_dtype
from longctx.masks import Band

__all__ = ["Launchers", "resolve_launchers", "BACKENDS"]

BACKENDS = ("auto", "tiled", "triton")


@dataclass(frozen=True)
class Launchers:
    name: str
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    sparse_forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    sparse_backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@functools.cache  # built once: cp_attention resolves its launchers on every call
def _tiled() -> Launchers:
    from longctx.reference.tiled import tiled_backward, tiled_forward
    from longctx.reference.tiled_sparse import block_sparse_backward, block_sparse_forward

    def fwd(q, k, v, *, scale: float, band: Band):
        return tiled_forward(q, k, v, scale=scale, band=band)

    def bwd(do, q, k, v, out, lse, *, scale: float, band: Band):
        return tiled_backward(do, q, k, v, out, lse, scale=scale, band=band, grad_dtype=accumulation_dtype(q.dtype))

    def sparse_fwd(q, k, v, *, scale: float, block_mask):
        return block_sparse_forward(q, k, v, scale=scale, band=Band(), block_mask=block_mask)

    def sparse_bwd(do, q, k, v, out, lse, *, scale: float, block_mask):
        # float32 (float64) gradients: the per-block results are summed over the ranks in that precision
        grad = accumulation_dtype(q.dtype)
        return block_sparse_backward(
            do, q, k, v, out, lse, scale=scale, band=Band(), block_mask=block_mask, grad_dtype=grad
        )

    return Launchers("tiled", fwd, bwd, sparse_fwd, sparse_bwd)


@functools.cache
def _triton_module():
    try:
        return importlib.import_module("longctx.launchers.flash"), None
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        return None, f"{type(e).__name__}: {e}"


@functools.cache  # only a successful build is cached; a failed import raises again on the next call
def _triton() -> Launchers:
    mod, err = _triton_module()
    if mod is None:
        raise ValueError(f"backend='triton' was requested but longctx.launchers.flash does not import ({err})")

    def fwd(q, k, v, *, scale: float, band: Band):
        return mod.triton_forward(q, k, v, scale=scale, band=band)

    # float32 gradients when the launcher can write them: a block's dK/dV are partial sums that the ring (or the
    # reduce-scatter) adds up, and rounding each one to bf16 first costs up to ~3x the error of one kernel.
    extra = {"grad_dtype": torch.float32} if "grad_dtype" in inspect.signature(mod.triton_backward).parameters else {}

    def bwd(do, q, k, v, out, lse, *, scale: float, band: Band):
        return mod.triton_backward(
            do, q, k, v, out, lse, scale=scale, band=band, deterministic=switches.deterministic(), **extra
        )

    from longctx.launchers import sparse

    def sparse_fwd(q, k, v, *, scale: float, block_mask):
        return sparse.sparse_forward(q, k, v, scale=scale, block_mask=block_mask)

    def sparse_bwd(do, q, k, v, out, lse, *, scale: float, block_mask):
        return sparse.sparse_backward(
            do, q, k, v, out, lse, scale=scale, block_mask=block_mask, deterministic=switches.deterministic(),
            grad_dtype=torch.float32,
        )  # fmt: skip

    return Launchers("triton", fwd, bwd, sparse_fwd, sparse_bwd)


def resolve_launchers(backend: str, device: torch.device, dtype: torch.dtype) -> Launchers:
    """The launchers for ``backend`` ("auto", "tiled" or "triton") on this device and dtype."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} for context parallelism, got {backend!r}")
    if backend == "tiled":
        return _tiled()
    if backend == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise ValueError(f"backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1), got device {device}")
        return _triton()
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and _triton_module()[0] is not None:
        return _triton()
    return _tiled()

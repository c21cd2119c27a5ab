"""Activation recomputation with Megatron/NeMo semantics, over whole transformer layers.

Activations saved for backward grow with depth, batch and (for unfused attention) the square of the
sequence length. Recomputation trades compute for memory: keep less in forward, recompute it in backward.

``recompute_granularity`` (NeMo: ``activations_checkpoint_granularity``)
    None         keep everything.
    "full"       checkpoint the *input* of transformer layers; recompute the layers in backward. The unit
                 is a whole layer (or a chunk of consecutive layers), never a part of one.
    "selective"  recompute only the core attention, the part whose activations are O(S^2) when attention
                 is unfused (the "math" backend, or attention dropout). A flash backend (tiled, Triton,
                 SDPA's fused kernels) already recomputes the scores in its backward and keeps only
                 q, k, v, out and lse, so selective adds nothing there: no checkpoint is placed.

``recompute_method`` (NeMo: ``activations_checkpoint_method``), with granularity "full" only
    "uniform"    split the layers into chunks of ``recompute_num_layers`` consecutive layers and checkpoint
                 each chunk's input (every layer is recomputed; the last chunk may be shorter).
    "block"      checkpoint each of the first ``recompute_num_layers`` layers and run the rest normally.

``recompute_num_layers`` (NeMo: ``activations_checkpoint_num_layers``): 1 <= n <= num_layers.

Full recomputation of N layers costs exactly one extra forward of those N layers (counted with
FlopCounterMode in tests/test_recompute.py) and keeps about one hidden state (B, S, h) per checkpointed
chunk instead of all of its internal activations (counted with saved_tensors_hooks).

Checkpointing is non-reentrant (``torch.utils.checkpoint(..., use_reentrant=False)``) and preserves the
RNG state, so dropout in a recomputed layer draws the same masks again and gradients are bitwise equal to
those without recomputation. Nothing is recomputed in eval mode or under ``torch.no_grad()``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from longctx.layers.offload import ActivationOffloader, offloaded_checkpoint

__all__ = [
    "GRANULARITIES",
    "METHODS",
    "Chunk",
    "validate_recompute",
    "plan_layers",
    "checkpoint_call",
    "recompute_active",
    "run_in_chunks",
    "run_layers",
]

GRANULARITIES = (None, "full", "selective")
METHODS = (None, "uniform", "block")


@dataclass(frozen=True)
class Chunk:
    """Layers [start, end) run as one unit; ``checkpointed`` means only its input is kept for backward."""

    start: int
    end: int
    checkpointed: bool


def validate_recompute(
    granularity: str | None, method: str | None, num_layers_recomputed: int | None, num_layers: int
) -> None:
    """Raise ValueError for settings Megatron rejects (messages name the field and the valid values)."""
    if granularity not in GRANULARITIES:
        raise ValueError(
            f"recompute_granularity must be one of None, 'full', 'selective', got {granularity!r} "
            "(NeMo: activations_checkpoint_granularity)"
        )
    if method not in METHODS:
        raise ValueError(
            f"recompute_method must be None, 'uniform' or 'block', got {method!r} (NeMo: activations_checkpoint_method)"
        )
    if granularity == "full":
        if method is None:
            raise ValueError(
                "recompute_granularity='full' needs recompute_method='uniform' (chunks of recompute_num_layers "
                "layers, every layer recomputed) or 'block' (only the first recompute_num_layers layers)"
            )
        if num_layers_recomputed is None:
            raise ValueError(
                f"recompute_granularity='full' needs recompute_num_layers, an int in [1, {num_layers}] "
                "(NeMo: activations_checkpoint_num_layers)"
            )
        if (
            isinstance(num_layers_recomputed, bool)
            or not isinstance(num_layers_recomputed, int)
            or not 1 <= num_layers_recomputed <= num_layers
        ):
            raise ValueError(
                f"recompute_num_layers must be an int in [1, num_layers={num_layers}], got {num_layers_recomputed!r}"
            )
    elif granularity == "selective":
        if method is not None or num_layers_recomputed is not None:
            raise ValueError(
                "recompute_granularity='selective' recomputes the core attention of every layer; "
                f"recompute_method ({method!r}) and recompute_num_layers ({num_layers_recomputed!r}) must be None "
                "(as in Megatron); use granularity 'full' to choose layers"
            )
    elif method is not None or num_layers_recomputed is not None:
        raise ValueError(
            f"recompute_method ({method!r}) and recompute_num_layers ({num_layers_recomputed!r}) are only meaningful "
            "with recompute_granularity='full'; set it, or leave them None"
        )


def plan_layers(granularity: str | None, method: str | None, n: int | None, num_layers: int) -> list[Chunk]:
    """How ``num_layers`` layers run: a list of chunks, checkpointed or not (full granularity only).

    >>> plan_layers("full", "uniform", 2, 5)   # chunks [0,2) [2,4) [4,5), all checkpointed
    >>> plan_layers("full", "block", 2, 5)     # [0,1) [1,2) checkpointed, [2,3) [3,4) [4,5) not
    """
    validate_recompute(granularity, method, n, num_layers)
    if granularity != "full":
        return [Chunk(i, i + 1, False) for i in range(num_layers)]
    assert n is not None
    if method == "uniform":
        return [Chunk(s, min(s + n, num_layers), True) for s in range(0, num_layers, n)]
    return [Chunk(i, i + 1, i < n) for i in range(num_layers)]


def recompute_active(module: nn.Module) -> bool:
    """Recompute only when it can matter: training mode with autograd recording."""
    return module.training and torch.is_grad_enabled()


def checkpoint_call(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` keeping only its inputs for backward; recomputed (same RNG state) in backward."""
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True)


def run_in_chunks(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, chunk: int | None,
                  module: nn.Module) -> torch.Tensor:  # fmt: skip
    """``fn(x)`` for a position-wise ``fn`` over chunks of ``chunk`` tokens along dim 1, in training (``module``'s
    mode): with autograd, each chunk checkpointed (its intermediates exist for one chunk at a time, in the forward and
    in its recomputation); without (the first forward of a layer under an offloaded checkpoint), each chunk's result
    written into one output as it comes, nothing kept. Whole in eval mode or when x is one chunk or less."""
    if chunk is None or x.dim() != 3 or x.shape[1] <= chunk or not module.training:
        return fn(x)
    if torch.is_grad_enabled():
        return torch.cat([checkpoint_call(fn, xc) for xc in x.split(chunk, dim=1)], dim=1)
    out, start = None, 0
    for xc in x.split(chunk, dim=1):
        y = fn(xc)
        if out is None:
            out = y.new_empty((y.shape[0], x.shape[1], *y.shape[2:]))
        out[:, start : start + y.shape[1]] = y
        start += y.shape[1]
    return out


def run_layers(
    layers: nn.ModuleList,
    x: torch.Tensor,
    chunks: list[Chunk],
    *args: Any,
    active: bool = True,
    offloader: ActivationOffloader | None = None,
    offload_layers: int = 0,
) -> torch.Tensor:
    """Run ``x = layer(x, *args)`` through every layer, checkpointing the chunks that say so when ``active``.

    With an ``offloader``, checkpointed chunks run through `longctx.layers.offload.OffloadedCheckpoint` (which
    lets layers keep results for their recomputation); those within the first ``offload_layers`` layers keep their
    input in pinned host memory instead of on the device.
    """
    if offloader is not None and active:
        offloader.begin()

    def run_chunk(start: int, end: int) -> Callable[..., torch.Tensor]:
        def fn(h: torch.Tensor, *a: Any) -> torch.Tensor:
            for layer in layers[start:end]:
                h = layer(h, *a)
            return h

        return fn

    for c in chunks:
        if c.checkpointed and active and offloader is not None:
            x = offloaded_checkpoint(run_chunk(c.start, c.end), offloader, c.end <= offload_layers, x, *args)
        elif c.checkpointed and active:
            x = checkpoint_call(run_chunk(c.start, c.end), x, *args)
        else:
            x = run_chunk(c.start, c.end)(x, *args)
    return x

"""The provider interface: ``name``, ``supports(case) -> reason or None``, ``build(case) -> fn(q, k, v) -> out``."""

from __future__ import annotations

from collections.abc import Callable

import torch

from longctx.bench.suite.case import KernelCase


class Provider:
    """One attention implementation under test.

    ``supports`` answers from the case alone (mask kind, shape, device), without building anything; ``build``
    returns the forward as ``fn(q, k, v) -> out`` with q (B, Hq, S, D) and k, v (B, Hkv, S, D); the backward is
    timed through autograd on the saved graph of one forward. ``backend`` names what actually runs (for
    ``longctx_auto``: the backend auto picked) and may raise `Unsupported` once it sees the tensors.
    """

    name = ""
    family = "peer"  # "longctx", "peer" or "reference"

    def supports(self, case: KernelCase) -> str | None:
        return None

    def build(self, case: KernelCase) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        raise NotImplementedError

    def backend(self, case: KernelCase, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
        return self.name

    def no_backward(self, case: KernelCase) -> str | None:
        """Why this provider has no backward for the case (then only the forward is timed), or None."""
        return None


def needs_cuda(case: KernelCase) -> str | None:
    return None if case.device.startswith("cuda") else f"needs a CUDA device, got {case.device}"


def sdpa_band(case: KernelCase) -> tuple[str | None, bool]:
    """(reason SDPA cannot express the mask, is_causal): SDPA takes no mask or top-left causal only."""
    band = case.mask.band
    if band is None or not (band.is_dense or (band.lo is None and band.hi == 0)):
        return f"SDPA expresses only full and causal masks, not {case.mask.name}", False
    return None, band.hi == 0

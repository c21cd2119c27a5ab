"""What every attention backend is: `AttnInputs` (the facts of a call, no tensors) and `Backend` (what it supports,
as reasons, and the call). One file per backend beside this one; `longctx.dispatch` imports them and owns the order."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longctx.masks import Band

__all__ = ["AttnInputs", "Backend"]


@dataclass(frozen=True)
class AttnInputs:
    """What a backend needs to know to say whether it can run a call (no tensors, only facts)."""

    device: torch.device
    dtype: torch.dtype
    batch: int
    hq: int
    hkv: int
    sq: int
    sk: int
    head_dim: int
    band: Band = Band()
    needs_grad: bool = False
    return_lse: bool = False
    deterministic: bool = False
    block_mask: bool = False  # a block-sparse mask (longctx.block_mask) is given
    varlen: bool = False  # packed documents (cu_seqlens)
    capability: tuple[int, int] | None = None  # CUDA compute capability, None off CUDA
    pinned: bool = False  # the backend was asked for by name (argument or LONGCTX_ATTN_BACKEND), not by auto
    softcap: float = 0.0  # logit softcapping (scores -> softcap * tanh(scores / softcap)); 0 = off

    @classmethod
    def from_tensors(
        cls,
        q: torch.Tensor,
        k: torch.Tensor,
        *,
        band: Band,
        return_lse: bool = False,
        deterministic: bool = False,
        block_mask: bool = False,
        varlen: bool = False,
        needs_grad: bool | None = None,
        softcap: float = 0.0,
    ) -> AttnInputs:
        cap = torch.cuda.get_device_capability(q.device) if q.device.type == "cuda" else None
        if needs_grad is None:
            needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
        return cls(
            device=q.device,
            dtype=q.dtype,
            batch=q.shape[0],
            hq=q.shape[1],
            hkv=k.shape[1],
            sq=q.shape[2],
            sk=k.shape[2],
            head_dim=q.shape[3],
            band=band,
            needs_grad=needs_grad,
            return_lse=return_lse,
            deterministic=deterministic,
            block_mask=block_mask,
            varlen=varlen,
            capability=cap,
            softcap=float(softcap),
        )


class Backend:
    """One way of computing attention. Subclasses set the class attributes and implement `run`.

    ``family`` groups backends for the environment switches: ``"flash"`` (longctx's own kernels),
    ``"fused"`` (cuDNN), ``"peer"`` (other PyTorch kernels), ``"reference"`` (never switched off).
    """

    name: str = ""
    family: str = "peer"
    description: str = ""

    def not_supported_reasons(self, inp: AttnInputs) -> list[str]:
        raise NotImplementedError

    def available(self) -> tuple[bool, str]:
        """Whether the backend can run at all in this installation (and why not)."""
        return True, ""

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float,
        band: Band,
        return_lse: bool,
        deterministic: bool = False,
        block_mask=None,
        softcap: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Differentiable attention: ``(out, lse)``; lse may be None when ``return_lse`` is False. ``softcap > 0``
        caps the scaled scores to ``softcap * tanh(scores / softcap)`` before the mask (backends that cannot refuse
        it in `not_supported_reasons`)."""
        raise NotImplementedError

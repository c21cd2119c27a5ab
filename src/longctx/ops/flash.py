"""The dense Triton attention as `torch.library` ops with autograd: ``torch.ops.longctx.triton_attn_fwd`` /
``triton_attn_bwd`` (fake implementations included, so `torch.compile` traces through them) and `triton_attention`.

``softcap`` (0: off) caps the scaled scores to ``softcap * tanh(scores / softcap)`` in the forward and the backward."""

from __future__ import annotations

import torch

from longctx.launchers.flash import _backward_impl, _forward_impl
from longctx.masks import Band
from longctx.ops import LIB, define, eager_twin, through_op

__all__ = ["triton_attention"]

# -- torch.library registration --

_FWD_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, float scale, SymInt? lo, SymInt? hi, bool deterministic=False, "
    "float softcap=0.0) -> (Tensor, Tensor)"
)
_BWD_SCHEMA = (
    "(Tensor do, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, float scale, "
    "SymInt? lo, SymInt? hi, bool deterministic=False, float softcap=0.0) -> (Tensor, Tensor, Tensor)"
)


def _attn_fwd_op(q, k, v, scale, lo, hi, deterministic=False, softcap=0.0):
    return _forward_impl(q, k, v, scale, lo, hi, softcap)


def _attn_fwd_fake(q, k, v, scale, lo, hi, deterministic=False, softcap=0.0):
    B, Hq, Sq, _ = q.shape
    return torch.empty_like(q), q.new_empty((B, Hq, Sq), dtype=torch.float32)


def _attn_bwd_op(do, q, k, v, out, lse, dlse, scale, lo, hi, deterministic=False, softcap=0.0):
    return _backward_impl(do, q, k, v, out, lse, dlse, scale, lo, hi, deterministic, softcap=softcap)


def _attn_bwd_fake(do, q, k, v, out, lse, dlse, scale, lo, hi, deterministic=False, softcap=0.0):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, scale, lo, hi, deterministic, softcap = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.scale, ctx.lo, ctx.hi, ctx.deterministic, ctx.softcap = scale, lo, hi, deterministic, softcap


def _gradients(bwd, ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    return bwd(dout, q, k, v, out, lse, dlse, ctx.scale, ctx.lo, ctx.hi, ctx.deterministic, ctx.softcap)


def _backward(ctx, dout, dlse):
    return (*_gradients(torch.ops.longctx.triton_attn_bwd, ctx, dout, dlse), None, None, None, None, None)


# the op's twin in plain eager calls (`longctx.ops.through_op`)
_Eager = eager_twin(_attn_fwd_op, _setup_context, lambda *a: _gradients(_attn_bwd_op, *a), 8)


define("triton_attn_fwd", _FWD_SCHEMA, _attn_fwd_op, _attn_fwd_fake)
define("triton_attn_bwd", _BWD_SCHEMA, _attn_bwd_op, _attn_bwd_fake)
torch.library.register_autograd("longctx::triton_attn_fwd", _backward, setup_context=_setup_context, lib=LIB)


def triton_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    band: Band,
    deterministic: bool = False,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable ``(out, lse)`` through the registered op (traceable by torch.compile; in plain eager calls its
    twin, `_Eager`).

    ``deterministic`` selects the backward without atomics (see `triton_backward`); ``softcap > 0`` caps the scaled
    scores to ``softcap * tanh(scores / softcap)``.
    """
    fwd = torch.ops.longctx.triton_attn_fwd if through_op(q) else _Eager.apply
    return fwd(q, k, v, float(scale), band.lo, band.hi, bool(deterministic), float(softcap))

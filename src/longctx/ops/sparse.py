"""The block-sparse Triton attention as `torch.library` ops with autograd: ``torch.ops.longctx.triton_sparse_fwd`` /
``triton_sparse_bwd`` and `triton_sparse_attention` (which unpacks a `BlockMask` into the ops' arguments).

``softcap`` (0: off) caps the scaled scores to ``softcap * tanh(scores / softcap)`` in the forward and the backward."""

from __future__ import annotations

import torch

from longctx.launchers.sparse import _backward_impl, _forward_impl
from longctx.masks import BlockMask
from longctx.ops import LIB, define, eager_twin, through_op

__all__ = ["triton_sparse_attention"]

# -- torch.library registration: the mask travels as its tensors and ints (a BlockMask is not an op argument) --

_FWD_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, float scale, Tensor[] mask, int[] meta, bool deterministic, "
    "float softcap) -> (Tensor, Tensor)"
)
_BWD_SCHEMA = (
    "(Tensor do, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, float scale, Tensor[] mask, "
    "int[] meta, bool deterministic, float softcap) -> (Tensor, Tensor, Tensor)"
)


def _sparse_fwd_op(q, k, v, scale, mask, meta, deterministic, softcap=0.0):
    return _forward_impl(q, k, v, scale, tuple(mask), list(meta), softcap)


def _sparse_fwd_fake(q, k, v, scale, mask, meta, deterministic, softcap=0.0):
    B, Hq, Sq, _ = q.shape
    return torch.empty_like(q), q.new_empty((B, Hq, Sq), dtype=torch.float32)


def _sparse_bwd_op(do, q, k, v, out, lse, dlse, scale, mask, meta, deterministic, softcap=0.0):
    return _backward_impl(do, q, k, v, out, lse, dlse, scale, tuple(mask), list(meta), deterministic, softcap)


def _sparse_bwd_fake(do, q, k, v, out, lse, dlse, scale, mask, meta, deterministic, softcap=0.0):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, scale, mask, meta, deterministic, softcap = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, *mask)
    ctx.scale, ctx.meta, ctx.deterministic, ctx.softcap = scale, meta, deterministic, softcap


def _gradients(bwd, ctx, dout, dlse):
    q, k, v, out, lse, *mask = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    return bwd(dout, q, k, v, out, lse, dlse, ctx.scale, mask, ctx.meta, ctx.deterministic, ctx.softcap)


def _backward(ctx, dout, dlse):
    dq, dk, dv = _gradients(torch.ops.longctx.triton_sparse_bwd, ctx, dout, dlse)
    return dq, dk, dv, None, [None] * (len(ctx.saved_tensors) - 5), None, None, None


# the op's twin in plain eager calls (`longctx.ops.through_op`)
_Eager = eager_twin(_sparse_fwd_op, _setup_context, lambda *a: _gradients(_sparse_bwd_op, *a), 8)


define("triton_sparse_fwd", _FWD_SCHEMA, _sparse_fwd_op, _sparse_fwd_fake)
define("triton_sparse_bwd", _BWD_SCHEMA, _sparse_bwd_op, _sparse_bwd_fake)
torch.library.register_autograd("longctx::triton_sparse_fwd", _backward, setup_context=_setup_context, lib=LIB)


def triton_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    block_mask: BlockMask,
    deterministic: bool = False,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable block-sparse attention on the Triton kernels: ``(out, lse)``, through the registered op
    ``torch.ops.longctx.triton_sparse_fwd`` (traceable by torch.compile, no graph break; in plain eager calls its
    twin, `_Eager`); ``softcap > 0`` caps the
    scaled scores to ``softcap * tanh(scores / softcap)``."""
    block_mask.check_compatible(q, k)
    mt, meta = block_mask.kernel_tensors(), block_mask.kernel_meta()
    fwd = torch.ops.longctx.triton_sparse_fwd if through_op(q) else _Eager.apply
    return fwd(q, k, v, float(scale), list(mt), meta, bool(deterministic), float(softcap))

"""RMSNorm, rotary embeddings and SwiGLU as autograd functions: one fused kernel each way on a GPU
(`longctx.launchers.pointwise`), the same math in torch elsewhere (the CPU, float64, or ``LONGCTX_FUSED_POINTWISE=0``).

    rms_norm(x, weight, eps)   x / sqrt(mean(x^2) + eps) * weight, in float32 (float64 for float64 x), x's dtype out
    rotary(x, cos, sin)        x * cos + rotate_half(x) * sin, x (B, H, S, D); cos, sin (S, D) or (B, S, D) float32
    swiglu(gate_up)            silu(gate) * up, gate_up (..., 2F) = [gate, up] (one fused projection's output);
    swiglu(gate, up)           the same over two projections' outputs

What each keeps for its backward is the least it needs: RMSNorm its input (the residual stream, alive anyway) and
one float32 ``rstd`` per row; rotary nothing but the tables; SwiGLU its input. Torch's autograd through the unfused
ops keeps float32 copies of the normalised rows and the gate's activation besides. The memory model traces these
functions through `twins` (outputs allocated as the kernels allocate them, nothing computed).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace

import torch

from longctx import switches
from longctx.dtypes import accumulation_dtype
from longctx.launchers import pointwise as kernels

__all__ = ["rms_norm", "rotary", "swiglu", "twins"]


# -- the same math in torch ----------------------------------------------------------------------------------------


def _norm_fwd(x, weight, eps):
    acc = accumulation_dtype(x.dtype)
    xa = x.to(acc)
    rstd = torch.rsqrt(xa.pow(2).mean(-1, keepdim=True) + eps)
    y = (xa * rstd * weight.to(acc)).to(x.dtype)
    return y, rstd.reshape(-1)


def _norm_bwd(dy, x, weight, rstd, need_dw):
    acc = accumulation_dtype(x.dtype)
    h = x.shape[-1]
    r = rstd.reshape(*x.shape[:-1], 1)
    xhat = x.to(acc) * r
    dya = dy.to(acc)
    g = dya * weight.to(acc)
    dx = ((g - xhat * (g * xhat).mean(-1, keepdim=True)) * r).to(x.dtype)
    dw = (dya * xhat).reshape(-1, h).sum(0).to(weight.dtype) if need_dw else None
    return dx, dw


def _halves(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return t.chunk(2, dim=-1)


def _rope(x, cos, sin, backward=False):
    if cos.dim() == 3:  # (B, S, D) -> (B, 1, S, D): per-sequence positions
        cos, sin = cos[:, None], sin[:, None]
    acc = accumulation_dtype(x.dtype)
    x1, x2 = _halves(x.to(acc))
    c1, c2 = _halves(cos.to(acc))
    s1, s2 = _halves(sin.to(acc))
    if backward:
        y = torch.cat((x1 * c1 + x2 * s2, x2 * c2 - x1 * s1), dim=-1)
    else:
        y = torch.cat((x1 * c1 - x2 * s1, x2 * c2 + x1 * s2), dim=-1)
    return y.to(x.dtype)


def _swiglu_fwd(gate, up):
    acc = accumulation_dtype(gate.dtype)
    return (torch.nn.functional.silu(gate.to(acc)) * up.to(acc)).to(gate.dtype)


def _swiglu_bwd(dout, gate, up, dgate, dup):
    acc = accumulation_dtype(gate.dtype)
    g, u, d = gate.to(acc), up.to(acc), dout.to(acc)
    sig = torch.sigmoid(g)
    dgate.copy_(d * u * sig * (1 + g * (1 - sig)))
    dup.copy_(d * g * sig)


_TORCH = SimpleNamespace(
    rmsnorm_forward=_norm_fwd, rmsnorm_backward=_norm_bwd, rope=_rope, swiglu_forward=_swiglu_fwd,
    swiglu_backward=_swiglu_bwd,
)  # fmt: skip


# -- the memory model's twins: the kernels' allocations, nothing computed -------------------------------------------


def _twin_norm_fwd(x, weight, eps):
    n = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(n, dtype=torch.float32)


_TWIN_PROGRAMS = kernels.PROGRAMS_PER_SM * 132  # the RMSNorm backward's programs on an H100 / H200


def _twin_norm_bwd(dy, x, weight, rstd, need_dw):
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    if not need_dw:
        return dx, None
    n = x.numel() // x.shape[-1] if x.shape[-1] else 0
    partial = x.new_empty((max(1, min(n, _TWIN_PROGRAMS)), x.shape[-1]), dtype=torch.float32)  # summed, then freed
    del partial
    return dx, torch.empty_like(weight)


_TWINS = SimpleNamespace(
    rmsnorm_forward=_twin_norm_fwd,
    rmsnorm_backward=_twin_norm_bwd,
    rope=lambda x, cos, sin, backward=False: kernels.rope_output(x),
    swiglu_forward=lambda g, u: torch.empty_like(g, memory_format=torch.contiguous_format),
    swiglu_backward=lambda dout, g, u, dg, du: None,
)

_twins_on = False


@contextlib.contextmanager
def twins() -> Iterator[None]:
    """Within this block every call allocates its outputs as the kernels do and computes nothing: what the memory
    model traces (on shape-only tensors) and what its tests run for real to compare with."""
    global _twins_on
    before, _twins_on = _twins_on, True
    try:
        yield
    finally:
        _twins_on = before


def _impl(*tensors: torch.Tensor):
    if _twins_on:
        return _TWINS
    if switches.fused_pointwise_disabled() is None and kernels.supports(*tensors):
        return kernels
    return _TORCH


# -- autograd --------------------------------------------------------------------------------------------------------


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = _impl(x, weight).rmsnorm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = _impl(dy, x, weight).rmsnorm_backward(dy, x, weight, rstd, ctx.needs_input_grad[1])
        return dx, dw, None


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _impl(x, cos, sin).rope(x, cos, sin)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _impl(dy, cos, sin).rope(dy, cos, sin, backward=True), None, None


class _SwiGLU(torch.autograd.Function):
    """Over one fused projection's output [gate, up]: its gradient is one tensor, written in halves."""

    @staticmethod
    def forward(ctx, gate_up):
        ctx.save_for_backward(gate_up)
        gate, up = _halves(gate_up)
        return _impl(gate_up).swiglu_forward(gate, up)

    @staticmethod
    def backward(ctx, dout):
        (gate_up,) = ctx.saved_tensors
        dgu = torch.empty_like(gate_up, memory_format=torch.contiguous_format)
        _impl(dout, gate_up).swiglu_backward(dout, *_halves(gate_up), *_halves(dgu))
        return dgu


class _SwiGLUPair(torch.autograd.Function):
    """Over two projections' outputs (transformers' gate_proj and up_proj)."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return _impl(gate, up).swiglu_forward(gate, up)

    @staticmethod
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        dgate = torch.empty_like(gate, memory_format=torch.contiguous_format)
        dup = torch.empty_like(up, memory_format=torch.contiguous_format)
        _impl(dout, gate, up).swiglu_backward(dout, gate, up, dgate, dup)
        return dgate, dup


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2, -1) + eps) * weight`` computed in float32 (float64 for float64 x), returned in x's
    dtype; x (..., h), weight (h,)."""
    if x.shape[-1:] != weight.shape:
        raise ValueError(f"rms_norm: weight must have shape ({x.shape[-1]},) for x of shape {tuple(x.shape)}, "
                         f"got {tuple(weight.shape)}")  # fmt: skip
    return _RMSNorm.apply(x, weight, eps)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, H, S, D) by cos/sin of shape (S, D) or (B, S, D) in the rotate-half form; computed in float32,
    returned in x's dtype."""
    if x.dim() != 4 or x.shape[-1] % 2 or cos.shape != sin.shape or cos.shape[-2:] != (x.shape[2], x.shape[3]):
        raise ValueError(f"rotary: x must be (B, H, S, D) with D even and cos, sin (S, D) or (B, S, D) of its S and "
                         f"D; got x {tuple(x.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")  # fmt: skip
    return _Rotary.apply(x, cos, sin)


def swiglu(gate_up: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up``, computed in float32, returned in gate's dtype: ``swiglu(gate_up)`` for one fused
    projection's output (..., 2F) holding [gate, up], or ``swiglu(gate, up)`` for two of the same shape."""
    if up is None:
        if gate_up.shape[-1] % 2:
            raise ValueError(f"swiglu: the last dimension holds [gate, up] and must be even, got "
                             f"{tuple(gate_up.shape)}")  # fmt: skip
        return _SwiGLU.apply(gate_up)
    if gate_up.shape != up.shape or gate_up.dtype != up.dtype:
        raise ValueError(f"swiglu: gate and up must have one shape and dtype, got {tuple(gate_up.shape)} "
                         f"{gate_up.dtype} and {tuple(up.shape)} {up.dtype}")  # fmt: skip
    return _SwiGLUPair.apply(gate_up, up)

"""Launchers of the position-wise kernels (`longctx.kernels.triton.pointwise`): tensors in, tensors out, no autograd.

    rmsnorm_forward(x, weight, eps) -> (y, rstd)           x (..., h); y like x; rstd (N,) float32, N = x.numel() / h
    rmsnorm_backward(dy, x, weight, rstd, need_dw) -> (dx, dw or None)
    rope(x, cos, sin, backward=False) -> y                 x (B, H, S, D); cos, sin (S, D) or (B, S, D) float32
    swiglu_forward(gate, up) -> out                        gate, up (..., F); out (..., F)
    swiglu_backward(dout, gate, up, dgate, dup)            writes the gradients into dgate, dup

`supports(...)` says whether a tensor can take these kernels (a CUDA tensor, float16 / bfloat16 / float32, unit
stride along the last dimension); `longctx.ops.pointwise` falls back to the same math in torch where it cannot. The
launchers themselves also run CPU tensors under ``TRITON_INTERPRET=1`` (the interpreter tests call them directly).
"""

from __future__ import annotations

import functools

import torch

from longctx.launchers.runtime import _interpret, _patch_interpreter_for_numpy2, launch

__all__ = ["supports", "rmsnorm_forward", "rmsnorm_backward", "rope", "swiglu_forward", "swiglu_backward"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_SWIGLU_BLOCK = 1024
PROGRAMS_PER_SM = 8  # the RMSNorm backward's programs a multiprocessor, each summing its rows' weight gradient


def supports(*tensors: torch.Tensor) -> bool:
    """True when every tensor can go to the kernels: on a CUDA device, float16, bfloat16 or float32, unit stride
    along the last dimension. (The launchers run CPU tensors under the interpreter too, but a model's layers do not
    take that path: one interpreted program a row would be slower than torch by orders of magnitude.)"""
    if not tensors:
        return False
    return all(t.is_cuda and t.dtype in _DTYPES and (t.dim() == 0 or t.stride(-1) == 1) for t in tensors)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as (N, last): a view where the strides allow, else a contiguous copy."""
    return t.reshape(-1, t.shape[-1]) if t.stride(-1) == 1 else t.contiguous().reshape(-1, t.shape[-1])


def _prepare() -> None:
    if _interpret():
        _patch_interpreter_for_numpy2()


def _norm_warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


def rmsnorm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    import triton

    from longctx.kernels.triton.pointwise import rmsnorm_fwd_kernel

    _prepare()
    h = x.shape[-1]
    x2 = _rows(x)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y2 = y.view(-1, h)
    n = x2.shape[0]
    rstd = torch.empty(n, dtype=torch.float32, device=x.device)
    if n:
        block = triton.next_power_of_2(h)
        launch(rmsnorm_fwd_kernel, (n,), x2, weight, y2, rstd, x2.stride(0), y2.stride(0), h, eps, BLOCK=block,
               num_warps=_norm_warps(block))  # fmt: skip
    return y, rstd


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _bwd_programs(n: int, device: torch.device) -> int:
    """Programs of the RMSNorm backward: `PROGRAMS_PER_SM` a multiprocessor, at most n."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return max(1, min(n, PROGRAMS_PER_SM * _sm_count(index)))
    return max(1, min(n, 4))


def rmsnorm_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, need_dw: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    import triton

    from longctx.kernels.triton.pointwise import rmsnorm_bwd_kernel

    _prepare()
    h = x.shape[-1]
    x2, dy2 = _rows(x), _rows(dy)
    n = x2.shape[0]
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dx2 = dx.view(-1, h)
    programs = _bwd_programs(n, x.device)
    per = triton.cdiv(n, programs) if n else 1
    programs = triton.cdiv(n, per) if n else 0
    part = torch.empty((programs, h) if need_dw else (1,), dtype=torch.float32, device=x.device)
    if n:
        block = triton.next_power_of_2(h)
        launch(rmsnorm_bwd_kernel, (programs,), dy2, x2, weight, rstd, dx2, part, dy2.stride(0), x2.stride(0),
               dx2.stride(0), n, h, per, BLOCK=block, NEED_DW=need_dw, num_warps=_norm_warps(block))  # fmt: skip
    if not need_dw:
        return dx, None
    dw = part.sum(0) if n else torch.zeros(h, dtype=torch.float32, device=x.device)
    return dx, dw.to(weight.dtype)


def rope_output(x: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor of x's shape and dtype, laid out as x's elements are: (B, S, H, D) in memory where x
    is the heads-inner view of a fused projection (as elementwise ops in torch would lay it out), else contiguous."""
    B, H, S, D = x.shape
    if x.stride(1) < x.stride(2):
        return torch.empty((B, S, H, D), dtype=x.dtype, device=x.device).transpose(1, 2)
    return torch.empty((B, H, S, D), dtype=x.dtype, device=x.device)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool = False) -> torch.Tensor:
    import triton

    from longctx.kernels.triton.pointwise import rope_kernel

    _prepare()
    B, H, S, D = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    y = rope_output(x)
    scb = cos.stride(0) if cos.dim() == 3 else 0
    scs = cos.stride(-2)
    half = D // 2
    block_h = min(triton.next_power_of_2(H), 16)
    if B * S:
        launch(rope_kernel, (B * S, triton.cdiv(H, block_h)), x, cos, sin, y, S, H, half, x.stride(0), x.stride(1),
               x.stride(2), y.stride(0), y.stride(1), y.stride(2), scb, scs, BLOCK_H=block_h,
               BLOCK_D=triton.next_power_of_2(half), BACKWARD=backward, num_warps=4)  # fmt: skip
    return y


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for gate, up (..., F) (the halves of one fused projection's output may be passed as
    views: rows keep their own strides)."""
    import triton

    from longctx.kernels.triton.pointwise import swiglu_fwd_kernel

    _prepare()
    f = gate.shape[-1]
    g2, u2 = _rows(gate), _rows(up)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    out2 = out.view(-1, f)
    n = g2.shape[0]
    block = min(_SWIGLU_BLOCK, triton.next_power_of_2(f))
    if n:
        launch(swiglu_fwd_kernel, (n, triton.cdiv(f, block)), g2, u2, out2, g2.stride(0), u2.stride(0), out2.stride(0),
               f, BLOCK=block, num_warps=4)  # fmt: skip
    return out


def swiglu_backward(
    dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, dgate: torch.Tensor, dup: torch.Tensor
) -> None:
    """The gradients of gate and up written into ``dgate`` and ``dup`` (gate's shape; views of one tensor allowed)."""
    import triton

    from longctx.kernels.triton.pointwise import swiglu_bwd_kernel

    _prepare()
    f = gate.shape[-1]
    g2, u2, d2 = _rows(gate), _rows(up), _rows(dout)
    dg2, du2 = dgate.view(-1, f), dup.view(-1, f)  # views: the kernel writes into the caller's tensors
    n = g2.shape[0]
    block = min(_SWIGLU_BLOCK, triton.next_power_of_2(f))
    if n:
        launch(swiglu_bwd_kernel, (n, triton.cdiv(f, block)), d2, g2, u2, dg2, du2, d2.stride(0), g2.stride(0),
               u2.stride(0), dg2.stride(0), du2.stride(0), f, BLOCK=block, num_warps=4)  # fmt: skip

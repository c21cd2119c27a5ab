"""The position-wise parts of a transformer layer, each fused into one kernel for its forward and one for its backward:
RMSNorm, rotary embeddings and SwiGLU's gate. Every element is read once and written once, in float32 inside.

- `rmsnorm_fwd_kernel`: one row per program; writes ``y = x * rstd * w`` and the row's ``rstd``.
- `rmsnorm_bwd_kernel`: a run of rows per program; writes ``dx`` and the program's partial sum of ``dw``.
- `rope_kernel`: one (sequence position, block of heads) per program; the rotate-half rotation, or its transpose for
  the backward (``BACKWARD``).
- `swiglu_fwd_kernel` / `swiglu_bwd_kernel`: one (row, block of columns) per program; gate and up (and their
  gradients) are read and written through their own pointers and row strides: two halves of one fused projection's
  output, or two projections' outputs.

Offsets are computed in int64: at long S one tensor can exceed 2**31 elements.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rmsnorm_fwd_kernel(X, W, Y, RSTD, stride_x, stride_y, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


# Row and position counts are not specialised on (their value 1 or divisibility by 16): one binary serves every
# length, so a short stand-in sequence compiles what a long one runs (the trainer's compile-ahead).
@triton.jit(do_not_specialize=["n_rows", "rows_per_program"])
def rmsnorm_bwd_kernel(
    DY, X, W, RSTD, DX, DW_PART, stride_dy, stride_x, stride_dx, n_rows, n_cols, rows_per_program,
    BLOCK: tl.constexpr, NEED_DW: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    start = pid.to(tl.int64) * rows_per_program
    end = tl.minimum(start + rows_per_program, n_rows)
    for row in range(start, end):  # int64 bounds: an int64 row
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        xhat = x * rstd
        g = dy * w
        c = tl.sum(g * xhat, axis=0) / n_cols
        tl.store(DX + row * stride_dx + cols, ((g - xhat * c) * rstd).to(DX.dtype.element_ty), mask=mask)
        if NEED_DW:
            dw += dy * xhat
    if NEED_DW:
        tl.store(DW_PART + pid.to(tl.int64) * n_cols + cols, dw, mask=mask)


@triton.jit(do_not_specialize=["seq_len"])
def rope_kernel(
    X, COS, SIN, Y, seq_len, n_heads, half,
    sxb, sxh, sxs, syb, syh, sys, scb, scs,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BACKWARD: tl.constexpr,
):  # fmt: skip
    pos = tl.program_id(0)  # b * seq_len + s
    b = (pos // seq_len).to(tl.int64)
    s = (pos % seq_len).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    dmask = d < half
    mask = (heads < n_heads)[:, None] & dmask[None, :]
    heads = heads.to(tl.int64)
    x_at = X + b * sxb + s * sxs + heads[:, None] * sxh + d[None, :]
    x1 = tl.load(x_at, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_at + half, mask=mask, other=0.0).to(tl.float32)
    c_at = b * scb + s * scs + d
    c1 = tl.load(COS + c_at, mask=dmask, other=0.0)[None, :]
    c2 = tl.load(COS + c_at + half, mask=dmask, other=0.0)[None, :]
    s1 = tl.load(SIN + c_at, mask=dmask, other=0.0)[None, :]
    s2 = tl.load(SIN + c_at + half, mask=dmask, other=0.0)[None, :]
    if BACKWARD:  # the transpose of the rotation: dx1 = dy1 c1 + dy2 s2, dx2 = dy2 c2 - dy1 s1
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:  # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1)
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    y_at = Y + b * syb + s * sys + heads[:, None] * syh + d[None, :]
    tl.store(y_at, y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(y_at + half, y2.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_fwd_kernel(G, U, OUT, stride_g, stride_u, stride_out, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    tl.store(OUT + row * stride_out + cols, (g * sig * u).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_bwd_kernel(
    DOUT, G, U, DG, DU, stride_dout, stride_g, stride_u, stride_dg, stride_du, n_cols, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dout = tl.load(DOUT + row * stride_dout + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    dg = dout * u * sig * (1.0 + g * (1.0 - sig))
    du = dout * g * sig
    tl.store(DG + row * stride_dg + cols, dg.to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + row * stride_du + cols, du.to(DU.dtype.element_ty), mask=mask)

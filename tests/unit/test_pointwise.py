"""`longctx.ops.pointwise`: RMSNorm, rotary embeddings and SwiGLU as autograd functions. On the CPU they run the torch
math with their own backward; here against autograd through the unfused formulas (float64), what each keeps for its
backward, the twins the memory model traces against the kernels' allocations, the switch, and bad input."""

from __future__ import annotations

import pytest
import torch

from longctx.launchers import pointwise as kernels
from longctx.ops import pointwise as P


def _ref_norm(x, w, eps):
    xa = x.to(torch.float64)
    return (xa * torch.rsqrt(xa.pow(2).mean(-1, keepdim=True) + eps) * w.to(torch.float64)).to(x.dtype)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _ref_rope(x, cos, sin):
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    return x * cos + _rotate_half(x) * sin


def _ref_swiglu(gu):
    g, u = gu.chunk(2, dim=-1)
    return torch.nn.functional.silu(g) * u


def _grads(fn, *inputs):
    inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    out = fn(*inputs)
    dout = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad(out, [t for t in inputs if t.requires_grad], dout)
    return out, grads


def _tables(shape, D):
    pos = torch.randint(0, 5000, shape, generator=torch.Generator().manual_seed(2)).double()
    inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2).double() / D))
    emb = torch.cat([pos[..., None] * inv] * 2, dim=-1)
    return emb.cos(), emb.sin()


def test_rms_norm_and_its_backward_equal_autograd_float64():
    torch.manual_seed(0)
    x = torch.randn(2, 7, 48, dtype=torch.float64, requires_grad=True)
    w = (1 + 0.1 * torch.randn(48, dtype=torch.float64)).requires_grad_()
    out, (dx, dw) = _grads(lambda a, b: P.rms_norm(a, b, 1e-5), x, w)
    ref, (rdx, rdw) = _grads(lambda a, b: _ref_norm(a, b, 1e-5), x, w)
    torch.testing.assert_close(out, ref, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(dx, rdx, rtol=1e-11, atol=1e-12)
    torch.testing.assert_close(dw, rdw, rtol=1e-11, atol=1e-12)


def test_rms_norm_float32_forward_is_the_unfused_formula_bit_for_bit():
    torch.manual_seed(0)
    x, w = torch.randn(5, 64), 1 + 0.1 * torch.randn(64)
    xa = x.float()
    ref = (xa * torch.rsqrt(xa.pow(2).mean(-1, keepdim=True) + 1e-6)) * w
    assert torch.equal(P.rms_norm(x, w, 1e-6), ref)


def test_rms_norm_with_a_frozen_weight_returns_no_weight_gradient():
    x = torch.randn(3, 16, dtype=torch.float64, requires_grad=True)
    w = torch.ones(16, dtype=torch.float64)
    P.rms_norm(x, w, 1e-5).sum().backward()
    assert x.grad is not None and w.grad is None


@pytest.mark.parametrize("per_sequence", [False, True])
def test_rotary_and_its_backward_equal_autograd_float64(per_sequence):
    torch.manual_seed(0)
    B, H, S, D = 2, 3, 5, 8
    x = torch.randn(B, S, H + 2, D, dtype=torch.float64)[:, :, :H].transpose(1, 2).requires_grad_()  # a q view
    cos, sin = _tables((B, S) if per_sequence else (S,), D)
    out, (dx,) = _grads(lambda a: P.rotary(a, cos, sin), x)
    ref, (rdx,) = _grads(lambda a: _ref_rope(a, cos, sin), x)
    torch.testing.assert_close(out, ref, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(dx, rdx, rtol=1e-12, atol=1e-13)


def test_swiglu_and_its_backward_equal_autograd_float64():
    torch.manual_seed(0)
    gu = (3 * torch.randn(2, 5, 2 * 24, dtype=torch.float64)).requires_grad_()
    out, (dgu,) = _grads(P.swiglu, gu)
    ref, (rdgu,) = _grads(_ref_swiglu, gu)
    torch.testing.assert_close(out, ref, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(dgu, rdgu, rtol=1e-12, atol=1e-13)


def test_swiglu_over_two_projections_equals_autograd_float64():
    torch.manual_seed(0)
    g = (3 * torch.randn(2, 5, 24, dtype=torch.float64)).requires_grad_()
    u = torch.randn(2, 5, 24, dtype=torch.float64, requires_grad=True)
    out, (dg, du) = _grads(P.swiglu, g, u)
    ref, (rdg, rdu) = _grads(lambda a, b: torch.nn.functional.silu(a) * b, g, u)
    torch.testing.assert_close(out, ref, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(dg, rdg, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(du, rdu, rtol=1e-12, atol=1e-13)


def _saved_bytes(fn, *inputs):
    """Bytes of the tensors autograd keeps for the backward of ``fn(*inputs)`` that are not its inputs' storage."""
    kept: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        fn(*inputs)
    own = {t.untyped_storage().data_ptr() for t in inputs}
    seen, total = set(), 0
    for t in kept:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in own and ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
    return total


def test_what_each_keeps_for_its_backward():
    """RMSNorm: its input (no copy) and one float32 rstd a row; rotary: the tables only; SwiGLU: its input only."""
    x = torch.randn(4, 32, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(32, requires_grad=True)
    assert _saved_bytes(lambda a, b: P.rms_norm(a, b, 1e-5), x, w) == 4 * 4
    assert _saved_bytes(lambda a, b: _ref_norm(a.float(), b, 1e-5), x, w) > 4 * 32 * 4  # float32 copies
    q = torch.randn(1, 2, 3, 8, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = (t.float() for t in _tables((3,), 8))
    assert _saved_bytes(lambda a, c, s: P.rotary(a, c, s), q, cos, sin) == 0
    gu = torch.randn(4, 64, dtype=torch.bfloat16, requires_grad=True)
    assert _saved_bytes(P.swiglu, gu) == 0
    assert _saved_bytes(_ref_swiglu, gu) == 4 * 32 * 2  # the unfused gate activation


def test_twins_allocate_what_the_kernels_return():
    x = torch.randn(2, 3, 40, dtype=torch.bfloat16)
    w = torch.ones(40)
    q = torch.randn(2, 5, 6, 8, dtype=torch.bfloat16)[:, :, :4].transpose(1, 2)
    cos, sin = (t.float() for t in _tables((5,), 8))
    gu = torch.randn(2, 3, 80, dtype=torch.bfloat16)
    with P.twins():
        y, rstd = P._impl(x).rmsnorm_forward(x, w, 1e-5)
        dx, dw = P._impl(x).rmsnorm_backward(x, x, w, rstd, True)
        r = P._impl(q).rope(q, cos, sin)
        o = P._impl(gu).swiglu_forward(*gu.chunk(2, dim=-1))
    assert (y.shape, y.dtype, rstd.shape, rstd.dtype) == (x.shape, x.dtype, (6,), torch.float32)
    assert (dx.shape, dx.dtype, dw.shape, dw.dtype) == (x.shape, x.dtype, w.shape, w.dtype)
    ref = kernels.rope_output(q)
    assert (r.shape, r.dtype, r.stride()) == (q.shape, q.dtype, ref.stride()) and r.stride(1) < r.stride(2)
    assert (o.shape, o.dtype) == ((2, 3, 40), gu.dtype) and o.is_contiguous()
    assert not P._twins_on


def test_the_kernels_are_taken_where_supported_unless_switched_off(monkeypatch):
    x = torch.randn(3, 8)
    monkeypatch.setattr(kernels, "supports", lambda *t: True)
    monkeypatch.delenv("LONGCTX_FUSED_POINTWISE", raising=False)
    assert P._impl(x) is kernels
    monkeypatch.setenv("LONGCTX_FUSED_POINTWISE", "0")
    assert P._impl(x) is P._TORCH


@pytest.mark.parametrize("interpret", ["0", "1"])
def test_cpu_tensors_take_torch_even_under_the_interpreter(monkeypatch, interpret):
    """A model's layers on the CPU never run the kernels interpreted (one interpreted program a row)."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    assert not kernels.supports(torch.randn(2, 4))
    assert P._impl(torch.randn(2, 4)) is P._TORCH


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: P.rms_norm(torch.randn(2, 8), torch.ones(7), 1e-5), r"weight must have shape \(8,\)"),
        (lambda: P.rotary(torch.randn(1, 2, 3, 7), torch.ones(3, 7), torch.ones(3, 7)), "D even"),
        (lambda: P.rotary(torch.randn(1, 2, 3, 8), torch.ones(4, 8), torch.ones(4, 8)), "cos, sin"),
        (lambda: P.swiglu(torch.randn(2, 7)), "must be even"),
        (lambda: P.swiglu(torch.randn(2, 8), torch.randn(2, 4)), "one shape and dtype"),
    ],
)
def test_bad_shapes_say_what_to_fix(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_kernels_compile_for_sm90(dtype):
    """Each kernel (and each constexpr branch) compiles for sm_90 offline, as the launchers call it: what the
    interpreter cannot show (types, int64 loops, broadcasting) before a GPU runs it."""
    triton = pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as exc:  # another Triton version: the internals this test uses moved
        pytest.skip(f"Triton internals for offline compilation not found: {exc}")
    from longctx.kernels.triton import pointwise as K

    def compile_(fn, pointers: dict, consts: dict, warps: int = 4):
        sig = {n: "constexpr" if n in consts else pointers.get(n, "i32") for n in fn.arg_names}
        sig.update({"eps": "fp32"} if "eps" in sig else {})
        src = ASTSource(fn=fn, signature=sig, constexprs=consts)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})

    t, f32 = f"*{dtype}", "*fp32"
    compile_(K.rmsnorm_fwd_kernel, {"X": t, "W": f32, "Y": t, "RSTD": f32}, {"BLOCK": 4096}, 8)
    for need in (True, False):
        compile_(K.rmsnorm_bwd_kernel, {"DY": t, "X": t, "W": f32, "RSTD": f32, "DX": t, "DW_PART": f32},
                 {"BLOCK": 4096, "NEED_DW": need}, 8)  # fmt: skip
    for backward in (False, True):
        compile_(K.rope_kernel, {"X": t, "COS": f32, "SIN": f32, "Y": t},
                 {"BLOCK_H": 16, "BLOCK_D": 64, "BACKWARD": backward})  # fmt: skip
    compile_(K.swiglu_fwd_kernel, {"G": t, "U": t, "OUT": t}, {"BLOCK": 1024})
    compile_(K.swiglu_bwd_kernel, {"DOUT": t, "G": t, "U": t, "DG": t, "DU": t}, {"BLOCK": 1024})

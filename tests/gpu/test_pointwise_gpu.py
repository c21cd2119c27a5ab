"""The fused RMSNorm, rotary and SwiGLU kernels on a GPU: bf16 and float32 against float64 torch at the widths of the
presets, and a GPT step with them against the same step in torch's unfused ops (``LONGCTX_FUSED_POINTWISE=0``)."""

from __future__ import annotations

import pytest
import torch

from longctx.launchers import pointwise as K
from longctx.models.gpt import GPT, GPTConfig
from longctx.ops import pointwise as P

TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-5}


def _err(a, b):
    return float((a.double() - b.double()).abs().max() / max(1.0, float(b.double().abs().max())))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("h", [1024, 4096, 5120])
def test_rms_norm_kernels(dtype, h):
    torch.manual_seed(0)
    x = torch.randn(3, 1000, h, device="cuda").to(dtype)
    w = 1 + 0.1 * torch.randn(h, device="cuda")
    dy = torch.randn_like(x)
    y, rstd = K.rmsnorm_forward(x, w, 1e-5)
    y_ref, rstd_ref = P._norm_fwd(x.double(), w.double(), 1e-5)
    dx, dw = K.rmsnorm_backward(dy, x, w, rstd, True)
    dx_ref, dw_ref = P._norm_bwd(dy.double(), x.double(), w.double(), rstd_ref, True)
    tol = TOL[dtype]
    assert _err(y, y_ref) < tol and _err(rstd, rstd_ref) < 1e-5 and _err(dx, dx_ref) < tol
    assert _err(dw, dw_ref) < 1e-4  # summed over 3000 rows in float32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("H", "D"), [(32, 128), (8, 64), (4, 256)])
def test_rotary_kernels(dtype, H, D):
    torch.manual_seed(0)
    B, S = 2, 777
    x = torch.randn(B, S, H + 4, D, device="cuda")[:, :, :H].transpose(1, 2).to(dtype)
    pos = torch.randint(0, 500000, (B, S), device="cuda").double()
    inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device="cuda").double() / D))
    emb = torch.cat([pos[..., None] * inv] * 2, dim=-1)
    cos, sin = emb.cos().float(), emb.sin().float()
    y = K.rope(x, cos, sin)
    dx = K.rope(x, cos, sin, backward=True)
    assert y.stride(1) < y.stride(2)  # the heads-inner layout of the projection, as torch's elementwise ops keep it
    assert _err(y, P._rope(x.double(), cos.double(), sin.double())) < TOL[dtype]
    assert _err(dx, P._rope(x.double(), cos.double(), sin.double(), backward=True)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("F", [2816, 14336, 1000])
def test_swiglu_kernels(dtype, F):
    torch.manual_seed(0)
    gu = (3 * torch.randn(2, 300, 2 * F, device="cuda")).to(dtype)
    dout = torch.randn(2, 300, F, device="cuda").to(dtype)
    g, u = gu.chunk(2, dim=-1)
    dgu = torch.empty_like(gu)
    K.swiglu_backward(dout, g, u, *dgu.chunk(2, dim=-1))
    ref = torch.empty(gu.shape, dtype=torch.float64, device="cuda")
    P._swiglu_bwd(dout.double(), g.double(), u.double(), *ref.chunk(2, dim=-1))
    assert _err(K.swiglu_forward(g, u), P._swiglu_fwd(g.double(), u.double())) < TOL[dtype]
    assert _err(dgu, ref) < TOL[dtype]


def _step(monkeypatch, fused: bool):
    monkeypatch.setenv("LONGCTX_FUSED_POINTWISE", "1" if fused else "0")
    cfg = GPTConfig(vocab_size=1024, seq_length=2048, num_layers=2, hidden_size=512, num_attention_heads=8,
                    num_query_groups=2, ffn_hidden_size=1408)  # fmt: skip
    torch.manual_seed(0)
    model = GPT(cfg).cuda()
    x = torch.randint(0, cfg.vocab_size, (2, 2048), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x, labels=x)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_gpt_step_with_the_kernels_equals_the_unfused_step(monkeypatch):
    loss, grads = _step(monkeypatch, True)
    ref_loss, ref_grads = _step(monkeypatch, False)
    assert torch.isfinite(loss) and abs(float(loss) - float(ref_loss)) < 2e-3 * abs(float(ref_loss))
    for name, g in grads.items():
        cos = torch.nn.functional.cosine_similarity(g.flatten().double(), ref_grads[name].flatten().double(), dim=0)
        assert cos > 0.999, f"{name}: gradient direction differs (cosine {float(cos):.5f})"

"""The fused RMSNorm, rotary and SwiGLU kernels (`longctx.launchers.pointwise`) under TRITON_INTERPRET=1, forward and
backward, against the same math in float64 torch: widths that are not powers of two, rows with a stride of their own
(a slice of a wider tensor), the heads-inner (B, S, H, D) layout of a fused projection's q and k, per-sequence rotary
tables, several column blocks. float32 cases must agree to 1e-5 relative to the largest reference value; float16
(stored in half, computed in float32) to 3e-3.
"""

from __future__ import annotations

import textwrap

import pytest

from tests.interpreter.cases import run_cases

pytestmark = pytest.mark.interpreter

triton = pytest.importorskip("triton")

# name: (op, dtype, extra)
CASES = {
    "norm_f32_h40": ("norm", "float32", {"shape": [2, 5, 40]}),
    "norm_f32_strided_rows_no_dw": ("norm", "float32", {"shape": [7, 24], "strided": True, "need_dw": False}),
    "norm_f16_h96": ("norm", "float16", {"shape": [9, 96]}),
    "rope_f32_heads_inner_d12": ("rope", "float32", {"B": 2, "H": 3, "S": 5, "D": 12, "per_seq": False}),
    "rope_f32_per_sequence_d16": ("rope", "float32", {"B": 2, "H": 5, "S": 4, "D": 16, "per_seq": True}),
    "rope_f16_contiguous_d8": ("rope", "float16", {"B": 1, "H": 2, "S": 6, "D": 8, "contiguous": True}),
    "swiglu_f32_f40": ("swiglu", "float32", {"shape": [2, 3], "F": 40}),
    "swiglu_f32_two_blocks": ("swiglu", "float32", {"shape": [3], "F": 1500}),
    "swiglu_f16_f64": ("swiglu", "float16", {"shape": [4], "F": 64}),
    "swiglu_pair_f32_f24": ("swiglu", "float32", {"shape": [2, 5], "F": 24, "pair": True}),
}

_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from longctx.launchers import pointwise as K
    from longctx.ops import pointwise as P

    def err(a, b):
        return float((a.double() - b.double()).abs().max() / max(1.0, float(b.double().abs().max())))

    cases = json.loads(sys.argv[1])
    for name, (op, dtype, extra) in cases.items():
        torch.manual_seed(0)
        dt = getattr(torch, dtype)
        errs = {}
        if op == "norm":
            shape = extra["shape"]
            h = shape[-1]
            if extra.get("strided"):
                x = torch.randn(*shape[:-1], h + 8)[..., :h].to(dt)
            else:
                x = torch.randn(*shape).to(dt)
            w = (1 + 0.1 * torch.randn(h)).float()
            dy = torch.randn(*shape).to(dt)
            need_dw = extra.get("need_dw", True)
            y, rstd = K.rmsnorm_forward(x, w, 1e-5)
            y_ref, rstd_ref = P._norm_fwd(x.double(), w.double(), 1e-5)
            dx, dw = K.rmsnorm_backward(dy, x, w, rstd, need_dw)
            dx_ref, dw_ref = P._norm_bwd(dy.double(), x.double(), w.double(), rstd_ref, need_dw)
            errs = {"y": err(y, y_ref), "rstd": err(rstd, rstd_ref), "dx": err(dx, dx_ref)}
            if need_dw:
                errs["dw"] = err(dw, dw_ref)
            else:
                errs["dw_none"] = 0.0 if dw is None else 1.0
            layout_ok = y.shape == x.shape and y.dtype == x.dtype and dx.shape == x.shape
        elif op == "rope":
            B, H, S, D = extra["B"], extra["H"], extra["S"], extra["D"]
            if extra.get("contiguous"):
                x = torch.randn(B, H, S, D).to(dt)
                dy = torch.randn(B, H, S, D).to(dt)
            else:  # q of a fused projection: (B, S, H + more, D) viewed as (B, H, S, D)
                x = torch.randn(B, S, H + 2, D)[:, :, :H].transpose(1, 2).to(dt)
                dy = torch.randn(B, S, H, D).transpose(1, 2).to(dt)
            pos = torch.randint(0, 1000, (B, S) if extra.get("per_seq") else (S,)).double()
            inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2).double() / D))
            emb = torch.cat([pos[..., None] * inv] * 2, dim=-1)
            cos, sin = emb.cos().float(), emb.sin().float()
            y = K.rope(x, cos, sin)
            dx = K.rope(dy, cos, sin, backward=True)
            errs = {"y": err(y, P._rope(x.double(), cos.double(), sin.double())),
                    "dx": err(dx, P._rope(dy.double(), cos.double(), sin.double(), backward=True))}
            layout_ok = y.shape == x.shape and y.dtype == x.dtype and (
                extra.get("contiguous") or y.stride(1) < y.stride(2))
        else:
            F = extra["F"]
            gu = torch.randn(*extra["shape"], 2 * F).to(dt)
            dout = torch.randn(*extra["shape"], F).to(dt)
            g, u = gu.chunk(2, dim=-1)  # the halves of one fused projection's output: rows of stride 2F
            if extra.get("pair"):  # two projections' outputs
                g, u = g.contiguous(), u.contiguous()
            out = K.swiglu_forward(g, u)
            dgu = torch.empty_like(gu)
            K.swiglu_backward(dout, g, u, *dgu.chunk(2, dim=-1))
            ref = torch.empty(gu.shape, dtype=torch.float64)
            P._swiglu_bwd(dout.double(), g.double(), u.double(), *ref.chunk(2, dim=-1))
            errs = {"out": err(out, P._swiglu_fwd(g.double(), u.double())), "dgu": err(dgu, ref)}
            layout_ok = out.shape == (*gu.shape[:-1], F) and out.is_contiguous()
        print("CASE " + json.dumps({"name": name, "errs": errs, "layout_ok": bool(layout_ok)}), flush=True)
    """
)


@pytest.fixture(scope="module")
def results():
    return run_cases(_SCRIPT, CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_float64(results, name):
    rec = results.get(name)
    assert rec is not None, f"case {name} printed nothing:\n{results['__stderr__']}"
    tol = 1e-5 if CASES[name][1] == "float32" else 3e-3
    assert rec["layout_ok"], rec
    bad = {k: v for k, v in rec["errs"].items() if not v <= tol}
    assert not bad, f"{name}: errors over {tol}: {bad}"

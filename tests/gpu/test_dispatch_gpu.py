"""The dispatcher's kernels and the packed-document path at context-parallel size 1, on CUDA in bf16.

A context-parallel group of one without torch.distributed (`SINGLE_PROCESS`: no process group to share with the
other test modules of a worker) runs `dispatch_plan(...).attention` and `cp_attention(cu_seqlens=...)` with the
Triton launchers, each per-document call a band launch with document offsets; outputs and gradients are compared
with the float64 oracle within 2x (plus a small floor) of the error `flash_attn_varlen_func` reaches in bf16 on the
same inputs.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _cu(total: int) -> list[int]:
    lengths = [1, 127, 0, 1000, 129, 64, 3]
    lengths.append(total - sum(lengths))
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def _errs(outs, ref) -> list[float]:
    return [float((a.double() - r).abs().max()) for a, r in zip(outs, ref)]


@pytest.mark.parametrize("method", ["ring", "allgather", "ulysses", "ulysses_ring"])
@pytest.mark.parametrize("mask", [dict(causal=True), dict(causal=True, window=(255, 0)), dict(causal=False)])
@pytest.mark.parametrize("hd", [64, 128])
def test_dispatch_plan_bf16_matches_varlen(method: str, mask: dict, hd: int) -> None:
    import longctx
    from longctx.distributed import SINGLE_PROCESS, dispatch_plan

    dev = torch.device("cuda")
    total, hq, hkv = 4096, 8, 2
    cu = _cu(total)
    cut = torch.tensor(cu, dtype=torch.int32, device=dev)
    mx = max(b - a for a, b in zip(cu, cu[1:]))
    g = torch.Generator(device=dev).manual_seed(0)
    q, do = (torch.randn(total, hq, hd, generator=g, device=dev, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(total, hkv, hd, generator=g, device=dev, dtype=torch.float64) for _ in range(2))
    window = mask.get("window")
    vkw = dict(causal=mask["causal"], window_size=window or (-1, -1))

    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    o = longctx.flash_attn_varlen_func(*ref, cut, cut, mx, mx, backend="math", **vkw)
    o.backward(do)
    oracle = [o.detach()] + [t.grad for t in ref]

    one = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    o1 = longctx.flash_attn_varlen_func(*one, cut, cut, mx, mx, **vkw)
    o1.backward(do.bfloat16())
    e_one = _errs([o1.detach()] + [t.grad for t in one], oracle)

    plan = dispatch_plan(cut, causal=mask["causal"], window=window, group=SINGLE_PROCESS)
    assert plan.balance() == 1.0
    loc = [plan.dispatch(t.bfloat16()).requires_grad_() for t in (q, k, v)]
    extra = dict(ulysses_size=1) if method == "ulysses_ring" else {}
    out = plan.attention(*loc, method=method, backend="triton", **extra)
    out.backward(plan.dispatch(do.bfloat16()))
    got = [plan.undispatch(out.detach())] + [plan.undispatch(t.grad) for t in loc]
    e_cp = _errs(got, oracle)
    for name, a, b in zip(("out", "dq", "dk", "dv"), e_cp, e_one):
        assert a <= 2 * b + 1e-3, f"{name}: {a:.3e} vs flash_attn_varlen_func's {b:.3e}"


@pytest.mark.parametrize("method", ["ring", "allgather", "ulysses"])
def test_cp_attention_cu_seqlens_bf16(method: str) -> None:
    """cp_attention(cu_seqlens=...) on (1, H, S, D) at CP size 1 against the float64 oracle, next to the varlen
    kernel's own bf16 error."""
    import longctx
    from longctx.distributed import SINGLE_PROCESS, cp_attention

    dev = torch.device("cuda")
    total, hq, hkv, hd = 2048, 4, 4, 128
    cu = _cu(total)
    cut = torch.tensor(cu, dtype=torch.int32, device=dev)
    mx = max(b - a for a, b in zip(cu, cu[1:]))
    g = torch.Generator(device=dev).manual_seed(1)
    q, do = (torch.randn(total, hq, hd, generator=g, device=dev, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(total, hkv, hd, generator=g, device=dev, dtype=torch.float64) for _ in range(2))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    o = longctx.flash_attn_varlen_func(*ref, cut, cut, mx, mx, causal=True, backend="math")
    o.backward(do)
    oracle = [o.detach()] + [t.grad for t in ref]
    one = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    o1 = longctx.flash_attn_varlen_func(*one, cut, cut, mx, mx, causal=True)
    o1.backward(do.bfloat16())
    e_one = _errs([o1.detach()] + [t.grad for t in one], oracle)

    loc = [t.bfloat16().permute(1, 0, 2).unsqueeze(0).contiguous().requires_grad_() for t in (q, k, v)]
    out = cp_attention(
        *loc, method=method, layout="contiguous", causal=True, cu_seqlens=cut, backend="triton", group=SINGLE_PROCESS
    )
    out.backward(do.bfloat16().permute(1, 0, 2).unsqueeze(0))
    got = [t[0].permute(1, 0, 2) for t in [out.detach()] + [t.grad for t in loc]]
    for name, a, b in zip(("out", "dq", "dk", "dv"), _errs(got, oracle), e_one):
        assert a <= 2 * b + 1e-3, f"{name}: {a:.3e} vs flash_attn_varlen_func's {b:.3e}"

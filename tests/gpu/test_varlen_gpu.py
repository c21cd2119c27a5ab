"""Packed documents on the GPU where some documents have no keys (a repeated entry in cu_seqlens_k): their queries
give output 0, lse -inf and zero gradients, on the warp-specialised block-sparse kernels (bf16, D=64/128 on Hopper)
and on the Triton ones (sparse_ws off), and the other documents match the float64 reference."""

from __future__ import annotations

import pytest
import torch

import longctx
from longctx import tuning

pytestmark = pytest.mark.gpu


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def _reference(q, k, v, lq, lk, causal, scale):
    """Each document alone in float64: (out (total_q, H, D), lse (H, total_q)), 0 / -inf for no keys."""
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float64, device=q.device)
    group = q.shape[1] // k.shape[1]
    qs = ks = 0
    for a, b in zip(lq, lk):
        if a and b:
            qd = q[qs : qs + a].double().transpose(0, 1)
            kd = k[ks : ks + b].double().repeat_interleave(group, 1).transpose(0, 1)
            vd = v[ks : ks + b].double().repeat_interleave(group, 1).transpose(0, 1)
            s = qd @ kd.transpose(1, 2) * scale
            if causal:
                i = torch.arange(a, device=q.device)[:, None]
                j = torch.arange(b, device=q.device)[None, :]
                s = s.masked_fill(j > i + b - a, float("-inf"))
            lse_d = torch.logsumexp(s, -1)
            p = torch.nan_to_num(torch.exp(s - lse_d[..., None]))
            out[qs : qs + a] = (p @ vd).transpose(0, 1)
            lse[:, qs : qs + a] = lse_d
        qs, ks = qs + a, ks + b
    return out, lse


@pytest.mark.parametrize("ws", [True, False], ids=["warp_specialised", "triton"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_zero_length_documents(ws, D, causal):
    lq, lk = [300, 700, 256, 500], [0, 900, 0, 0]
    g = torch.Generator(device="cuda").manual_seed(D)
    q = torch.randn(sum(lq), 8, D, device="cuda", generator=g).bfloat16().requires_grad_()
    k = torch.randn(sum(lk), 2, D, device="cuda", generator=g).bfloat16().requires_grad_()
    v = torch.randn(sum(lk), 2, D, device="cuda", generator=g).bfloat16().requires_grad_()
    with tuning.override(sparse_ws=None if ws else False, sparse_ws_bwd=None if ws else False):
        out, lse, _ = longctx.flash_attn_varlen_func(
            q, k, v, _cu(lq), _cu(lk), max(lq), max(lk), causal=causal, return_attn_probs=True
        )
        do = torch.randn(out.shape, device="cuda", generator=g).bfloat16()
        out.backward(do)
    empty = torch.cat([torch.arange(0, 300), torch.arange(1000, 1756)]).cuda()
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    assert bool((lse[:, empty] == float("-inf")).all())
    assert torch.equal(q.grad[empty], torch.zeros_like(q.grad[empty]))
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    ref, ref_lse = _reference(q.detach(), k.detach(), v.detach(), lq, lk, causal, D**-0.5)
    torch.testing.assert_close(out[300:1000].double(), ref[300:1000], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse[:, 300:1000].double(), ref_lse[:, 300:1000], atol=2e-2, rtol=2e-2)


def test_document_attention_hands_every_layer_one_boundaries_tensor(monkeypatch):
    """Boundaries set on the CPU reach flash_attn_varlen_func as one CUDA tensor per batch, so their values are
    read (a device-to-host sync) once per batch, not once per layer; a new batch gets a new tensor."""
    import longctx.api.varlen as varlen
    from longctx.layers.attention import DocumentAttention

    seen = []
    real = varlen._values
    monkeypatch.setattr(varlen, "_values", lambda cu: seen.append(cu) or real(cu))
    fn = DocumentAttention("auto")
    fn.set_documents(torch.tensor([0, 100, 320, 640]))
    q = torch.randn(2, 4, 320, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 2, 320, 64, device="cuda", dtype=torch.bfloat16)
    first = fn(q, k, k)
    torch.testing.assert_close(fn(q, k, k), first)
    assert len(seen) == 4 and all(t is seen[0] for t in seen) and seen[0].is_cuda  # q and k, two layers
    fn.set_documents(torch.tensor([0, 640]))
    fn(q, k, k)
    assert seen[-1] is not seen[0]


def test_document_attention_layers_after_the_first_do_not_synchronise():
    """Boundaries already on the GPU (as the trainer sets them): after a batch's first layer, which builds the mask,
    the other layers' calls make no host synchronisation (a sync per layer stalls the launch queue 24 times a step)."""
    from longctx.layers.attention import DocumentAttention

    fn = DocumentAttention("auto")
    fn.set_documents(torch.tensor([0, 100, 320, 640], device="cuda"))
    q = torch.randn(2, 4, 320, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 2, 320, 64, device="cuda", dtype=torch.bfloat16)
    first = fn(q, k, k)
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = fn(q, k, k)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.testing.assert_close(again, first)

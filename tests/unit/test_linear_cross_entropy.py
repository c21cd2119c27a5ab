"""`longctx.linear_cross_entropy`: F.cross_entropy(F.linear(...)) in value and gradients, without the logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import longctx
from longctx.layers.loss import default_chunk_size
from longctx.memory import peak_live_bytes


def _inputs(N=37, h=24, V=53, dtype=torch.float64, bias=False, seed=0, lead=None):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*(lead or (N,)), h, generator=g, dtype=dtype).requires_grad_()
    weight = (torch.randn(V, h, generator=g, dtype=dtype) / h**0.5).requires_grad_()
    b = (torch.randn(V, generator=g, dtype=dtype) * 0.1).requires_grad_() if bias else None
    labels = torch.randint(0, V, lead or (N,), generator=g)
    return hidden, weight, b, labels


def _reference(hidden, weight, bias, labels, ignore_index=-100, reduction="mean", loss_mask=None):
    logits = F.linear(hidden, weight, bias)
    y = labels
    if loss_mask is not None:
        y = torch.where(loss_mask.bool(), labels, torch.full_like(labels, ignore_index))
    return F.cross_entropy(logits.flatten(0, -2).float() if logits.dtype != torch.float64 else logits.flatten(0, -2),
                           y.flatten(), ignore_index=ignore_index, reduction=reduction).reshape(
        y.shape if reduction == "none" else ())  # fmt: skip


def _grads(loss, tensors, grad_out=None):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None], grad_out)


@pytest.mark.parametrize("chunk", [1, 5, 16, 37, None])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64_reference(chunk, reduction, bias):
    hidden, weight, b, labels = _inputs(bias=bias, seed=chunk or 0)
    labels[3] = labels[10] = -100  # ignored tokens
    ours = longctx.linear_cross_entropy(hidden, weight, labels, bias=b, reduction=reduction, chunk_size=chunk)
    ref = _reference(hidden, weight, b, labels, reduction=reduction)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    grad_out = torch.randn_like(ref) if reduction == "none" else None
    g_ours = _grads(ours, (hidden, weight, b), grad_out)
    g_ref = _grads(ref, (hidden, weight, b), grad_out)
    for a, r in zip(g_ours, g_ref):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12)
    assert float(g_ours[0][3].abs().sum()) == 0.0  # an ignored token gets no gradient


def test_leading_dims_loss_mask_and_ignore_index():
    hidden, weight, _, labels = _inputs(lead=(3, 11), seed=4)
    mask = torch.rand(3, 11, generator=torch.Generator().manual_seed(1)) > 0.4
    labels[0, 0] = -1  # ignore_index
    labels[1, 1], mask[1, 1] = 7_000, False  # out of range, but masked out: never read
    ours = longctx.linear_cross_entropy(hidden, weight, labels, loss_mask=mask, ignore_index=-1, chunk_size=4)
    ref = _reference(hidden, weight, None, labels, ignore_index=-1, loss_mask=mask)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    for a, r in zip(_grads(ours, (hidden, weight)), _grads(ref, (hidden, weight))):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12)


def test_all_ignored_mean_is_nan_like_cross_entropy():
    hidden, weight, _, labels = _inputs(N=5)
    labels[:] = -100
    ours = longctx.linear_cross_entropy(hidden, weight, labels)
    assert torch.isnan(ours) and torch.isnan(_reference(hidden, weight, None, labels))
    assert longctx.linear_cross_entropy(hidden, weight, labels, reduction="sum").item() == 0.0


def test_float32_within_what_pytorch_reaches():
    h64, w64, _, labels = _inputs(N=300, h=64, V=1000, seed=2)
    oracle = _reference(h64, w64, None, labels)
    h32, w32 = (t.detach().float().requires_grad_() for t in (h64, w64))
    ours = longctx.linear_cross_entropy(h32, w32, labels, chunk_size=64)
    plain = _reference(h32, w32, None, labels)
    assert abs(ours.item() - oracle.item()) <= 2 * abs(plain.item() - oracle.item()) + 1e-6
    g_or = _grads(oracle, (h64, w64))
    for a, p, o in zip(_grads(ours, (h32, w32)), _grads(plain, (h32, w32)), g_or):
        assert (a.double() - o).abs().max() <= 2 * (p.double() - o).abs().max() + 1e-7


def test_bf16_autocast_on_cpu_like_linear_then_cross_entropy():
    """Under autocast the matmuls run in bf16 and the softmax in float32, as F.linear + F.cross_entropy do.

    Against the float64 oracle, loss and gradients are within twice the error of F.linear + F.cross_entropy under
    the same autocast, plus a floor of 1% of the largest gradient entry (the FlashAttention rule).
    """
    h64, w64, _, labels = _inputs(N=200, h=64, V=500, seed=3)
    oracle = _reference(h64, w64, None, labels)
    h, w = (t.detach().float().requires_grad_() for t in (h64, w64))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = longctx.linear_cross_entropy(h, w, labels, chunk_size=32)
        plain = F.cross_entropy(F.linear(h, w), labels)
    assert ours.dtype == torch.float32
    assert abs(ours.item() - oracle.item()) <= 2 * abs(plain.item() - oracle.item()) + 1e-4
    g_ours, g_plain, g_or = _grads(ours, (h, w)), _grads(plain, (h, w)), _grads(oracle, (h64, w64))
    for name, a, p, o in zip(("hidden", "weight"), g_ours, g_plain, g_or):
        assert a.dtype == p.dtype == torch.float32
        err, err_plain = (a.double() - o).abs().max(), (p.double() - o).abs().max()
        floor = 1e-2 * o.abs().max()
        assert err <= 2 * err_plain + floor, f"{name}: error {err:.3e}, PyTorch's {err_plain:.3e}, floor {floor:.1e}"


def test_never_holds_the_logits():
    """The peak of live bytes stays far below one (tokens, vocab) float32 logits tensor."""
    N, h, V = 2048, 32, 4096
    hidden, weight, _, labels = _inputs(N=N, h=h, V=V, dtype=torch.float32, seed=5)
    logits_bytes = N * V * 4

    def fused():
        longctx.linear_cross_entropy(hidden, weight, labels, chunk_size=128).backward()

    def plain():
        F.cross_entropy(F.linear(hidden, weight), labels).backward()

    assert peak_live_bytes(plain) >= logits_bytes
    assert peak_live_bytes(fused) < logits_bytes / 4


def test_default_chunk_size():
    assert default_chunk_size(65536, 1024, 32000) == 4096  # logits chunk about the size of the hidden states
    assert default_chunk_size(100, 1024, 32000) == 100  # never more than every token
    assert default_chunk_size(10**6, 8, 32000) == 256  # at least 256 tokens


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(reduction="avg"), "reduction"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(loss_mask=torch.ones(3)), "loss_mask"),
        (dict(bias=torch.zeros(2)), "bias"),
    ],
)
def test_bad_arguments(kwargs, match):
    hidden, weight, _, labels = _inputs(N=6)
    with pytest.raises(ValueError, match=match):
        longctx.linear_cross_entropy(hidden, weight, labels, **kwargs)


def test_bad_tensors():
    hidden, weight, _, labels = _inputs(N=6, V=10)
    with pytest.raises(TypeError, match="labels"):
        longctx.linear_cross_entropy(hidden, weight, labels.float())
    with pytest.raises(ValueError, match="leading shape"):
        longctx.linear_cross_entropy(hidden, weight, labels[:4])
    with pytest.raises(ValueError, match="same h"):
        longctx.linear_cross_entropy(hidden, weight[:, :5], labels)
    labels[2] = 10
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        longctx.linear_cross_entropy(hidden, weight, labels)

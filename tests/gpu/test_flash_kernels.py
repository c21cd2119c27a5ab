"""GPU tests of the `triton` backend against the float64 oracle (skipped without CUDA).

The FlashAttention rule: for out, lse, dq, dk and dv, ``err(ours) <= 2 * err(plain PyTorch in the same
dtype) + floor``, errors being max-abs differences from the float64 oracle (`naive_attention` upcast to
float64); "plain PyTorch in the same dtype" is the same dense reference computed in bf16/fp16.

Run on the device machine: ``PYTHONPATH=src python -m pytest -q tests/gpu/test_flash_kernels.py``.
Autotuning is switched off here (the ``autotune`` tuning override) so the matrix does not time every config.
"""

from __future__ import annotations

import math

import pytest
import torch

from longctx import tuning


@pytest.fixture(autouse=True)
def _untuned():
    """The first tile of each list: autotuning would time every config of the matrix."""
    with tuning.override(autotune=False):
        yield


DTYPES = [torch.bfloat16, torch.float16]


def _inputs(B, Hq, Hkv, Sq, Sk, D, dtype, *, layout="bhsd", seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def mk(H, S):
        if layout == "bshd":  # flash_attn_func's layout, viewed as (B, H, S, D) without a copy
            return torch.randn(B, S, H, D, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
        return torch.randn(B, H, S, D, device="cuda", dtype=dtype, generator=g)

    q, k, v = mk(Hq, Sq), mk(Hkv, Sk), mk(Hkv, Sk)
    do = torch.randn(B, Hq, Sq, D, device="cuda", dtype=dtype, generator=g)
    return q, k, v, do


def _out_and_grads(fn, q, k, v, do):
    """fn(q, k, v) on fresh leaf copies of q, k, v: its output and the gradients of (out * do).sum()."""
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(qg, kg, vg)
    return out, torch.autograd.grad(out, (qg, kg, vg), do)


def _grads(out, inputs, do):
    return torch.autograd.grad(out, inputs, do)


def _reference(q, k, v, do, band, scale, upcast):
    from longctx.reference.naive import naive_attention

    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = naive_attention(qr, kr, vr, scale=scale, band=band, upcast=upcast)
    dq, dk, dv = _grads(out, (qr, kr, vr), do.to(out.dtype))
    return out, lse, dq, dk, dv


def _err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(a), fin), "non-finite entries differ from the oracle"
    return float((a[fin] - ref[fin]).abs().max()) if fin.any() else 0.0


def check_against_oracle(q, k, v, do, band, scale=None, *, run=None):
    """Compare the triton backend with the float64 oracle under the 2x-of-PyTorch rule."""
    from longctx.ops.flash import triton_attention

    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    if run is None:
        out, lse = triton_attention(qg, kg, vg, scale=scale, band=band)
    else:
        out, lse = run(qg, kg, vg)
    ours = (out, lse, *_grads(out, (qg, kg, vg), do))
    oracle = _reference(q, k, v, do, band, scale, torch.float64)
    plain = _reference(q, k, v, do, band, scale, q.dtype)
    for name, o, r, p in zip(("out", "lse", "dq", "dk", "dv"), ours, oracle, plain):
        assert o.shape == r.shape, name
        e_ours, e_plain = _err(o, r), _err(p.float(), r)
        # small floor: relative to the largest oracle value, plus an absolute 1e-5 for gradients that are
        # exactly 0 in the oracle (one key per row: dS = 0) where ours carries O's rounding (~1e-6)
        floor = 1e-3 * float(r[torch.isfinite(r)].abs().max()) if torch.isfinite(r).any() else 0.0
        assert e_ours <= 2 * e_plain + floor + 1e-5, f"{name}: ours {e_ours:.3e} vs plain PyTorch {e_plain:.3e}"
    return ours


LENGTHS = [(1, 1), (17, 17), (1023, 1023), (1025, 1025), (113, 1025), (1025, 113)]


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("D", [32, 64, 96, 128, 192, 256])
@pytest.mark.parametrize("sq,sk", LENGTHS, ids=[f"{a}x{b}" for a, b in LENGTHS])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_matrix(dtype, D, sq, sk, causal):
    from longctx.masks import Band

    q, k, v, do = _inputs(2, 4, 2, sq, sk, D, dtype, seed=sq * 7 + D)
    check_against_oracle(q, k, v, do, Band.from_args(sq, sk, causal=causal))


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_long_8193(dtype, D, causal):
    from longctx.masks import Band

    q, k, v, do = _inputs(1, 2, 1, 8193, 8193, D, dtype, seed=D)
    check_against_oracle(q, k, v, do, Band.from_args(8193, 8193, causal=causal))


BANDS = {
    "window_causal": dict(causal=True, window=(64, 0)),
    "window_both": dict(causal=False, window=(32, 16)),
    "window_left_only": dict(causal=False, window=(100, -1)),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("mask", list(BANDS))
@pytest.mark.parametrize("sq,sk", [(300, 300), (200, 517)], ids=["300", "200x517"])
def test_windows_gqa(dtype, D, hq, hkv, mask, sq, sk):
    import longctx

    q, k, v, do = _inputs(2, hq, hkv, sq, sk, D, dtype, seed=hq * 3 + hkv)
    band = longctx.Band.from_args(sq, sk, **BANDS[mask])

    def run(qg, kg, vg):
        return longctx.attention(qg, kg, vg, backend="triton", return_lse=True, **BANDS[mask])

    check_against_oracle(q, k, v, do, band, run=run)


@pytest.mark.parametrize("lo,hi", [(-100, -3), (5, 300), (-40, 40), (-5000, -4000), (None, -70), (30, None)])
def test_shifted_bands(lo, hi):
    """Arbitrary integer bands (context parallelism passes band.shifted(delta))."""
    from longctx.masks import Band

    q, k, v, do = _inputs(1, 4, 2, 257, 381, 64, torch.bfloat16, seed=3)
    check_against_oracle(q, k, v, do, Band(lo, hi))


def test_fully_masked_rows():
    import longctx

    q, k, v, do = _inputs(1, 2, 1, 200, 70, 64, torch.float16)
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = longctx.attention(qg, kg, vg, causal=True, backend="triton", return_lse=True)
    # bottom-right causal with Sq > Sk: rows 0..129 see no key
    assert torch.all(out[:, :, :130] == 0) and torch.all(lse[:, :, :130] == float("-inf"))
    assert torch.isfinite(out).all() and torch.isfinite(lse[:, :, 130:]).all()
    dq, dk, dv = torch.autograd.grad(out, (qg, kg, vg), do)
    assert torch.all(dq[:, :, :130] == 0) and torch.isfinite(dq).all()
    check_against_oracle(q, k, v, do, longctx.Band.from_args(200, 70, causal=True))


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_bshd_layout_no_copy(dtype):
    """flash_attn_func's (B, S, H, D) layout goes through as strided views."""
    import longctx

    q, k, v, do = _inputs(2, 8, 2, 333, 333, 128, dtype, layout="bshd")
    assert not q.is_contiguous()
    check_against_oracle(q, k, v, do, longctx.Band.from_args(333, 333, causal=True))
    out = longctx.flash_attn_func(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, backend="triton"
    )
    assert out.shape == (2, 333, 8, 128)


def test_lse_gradient():
    """Gradients through the returned lse (ring attention merges partial results with it)."""
    from longctx.masks import Band
    from longctx.ops.flash import triton_attention
    from longctx.reference.naive import naive_attention

    q, k, v, _ = _inputs(1, 2, 1, 150, 190, 64, torch.float16)
    band = Band.from_args(150, 190, causal=True)
    w = torch.randn(1, 2, 150, device="cuda")

    def loss(o, l):
        return (o.float() ** 2).sum() + (l.float() * w).sum()

    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    g_ours = torch.autograd.grad(loss(*triton_attention(qg, kg, vg, scale=0.125, band=band)), (qg, kg, vg))
    q6, k6, v6 = (t.detach().double().requires_grad_() for t in (q, k, v))
    g_ref = torch.autograd.grad(loss(*naive_attention(q6, k6, v6, scale=0.125, band=band)), (q6, k6, v6))
    for a, b in zip(g_ours, g_ref):
        assert float((a.double() - b).abs().max()) <= 2e-2 * float(b.abs().max())


def test_deterministic_backward_bitwise():
    import longctx

    q, k, v, do = _inputs(2, 8, 2, 1500, 1500, 128, torch.bfloat16)
    grads = []
    for _ in range(3):
        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = longctx.attention(qg, kg, vg, causal=True, backend="triton", deterministic=True)
        grads.append(torch.autograd.grad(out, (qg, kg, vg), do))
    for g in grads[1:]:
        for a, b in zip(grads[0], g):
            assert torch.equal(a, b)


def test_forward_recomputed_in_the_backward_thread():
    """Activation checkpointing reruns the forward inside the autograd engine's thread, where Triton's
    per-thread scratch allocator (for the TMA descriptors) is not set unless the launcher installs it per
    thread."""
    from torch.utils.checkpoint import checkpoint

    import longctx

    q, k, v, do = _inputs(1, 4, 4, 512, 512, 128, torch.bfloat16)

    def f(q, k, v):
        return longctx.attention(q, k, v, causal=True, backend="triton")

    out, grads = _out_and_grads(lambda *a: checkpoint(f, *a, use_reentrant=False), q, k, v, do)
    ref, ref_grads = _out_and_grads(f, q, k, v, do)
    torch.testing.assert_close(out, ref)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


def test_autotune_cache_is_per_kernel_variant():
    """2K and 4K causal share a length bucket, but 2K runs pointer loads and 4K TMA with the pipelined QK^T
    (and a different backward): a config tuned at 2K must not be reused at 4K (it runs out of shared memory
    there unless the variants are part of the autotune key)."""
    import longctx

    for S in (2048, 4096):
        q, k, v, do = _inputs(1, 2, 2, S, S, 128, torch.bfloat16)
        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = longctx.attention(qg, kg, vg, causal=True, backend="triton")
        torch.autograd.grad(out, (qg, kg, vg), do)
        torch.cuda.synchronize()


def test_torch_compile_fullgraph():
    from longctx.masks import Band
    from longctx.ops.flash import triton_attention

    q, k, v, do = _inputs(1, 4, 2, 256, 256, 64, torch.bfloat16)
    band = Band.from_args(256, 256, causal=True)

    def f(q, k, v):
        out, lse = triton_attention(q, k, v, scale=0.125, band=band)
        return out * 2.0

    torch._dynamo.reset()
    out, grads = _out_and_grads(torch.compile(f, fullgraph=True), q, k, v, do)
    ref, ref_grads = _out_and_grads(f, q, k, v, do)
    torch.testing.assert_close(out, ref)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)


def test_public_api_fullgraph():
    """A model calling longctx.attention compiles without a graph break (dispatch's dataclasses must stay
    traceable)."""
    import longctx

    q, k, v, _ = _inputs(1, 4, 2, 256, 256, 64, torch.bfloat16)

    def g(q, k, v):
        return longctx.attention(q, k, v, causal=True, backend="triton") + 1.0

    torch._dynamo.reset()
    out2 = torch.compile(g, fullgraph=True)(q, k, v)
    torch.testing.assert_close(out2, g(q, k, v))


@pytest.mark.parametrize("D", [64, 128])
def test_atomic_and_deterministic_paths_agree(D):
    from longctx.launchers import flash as tf
    from longctx.masks import Band

    # forced onto the atomic-dQ path (scalar atomics at D=64, the TMA reduce at D=128), ragged lengths
    q, k, v, do = _inputs(2, 8, 2, 1100, 1300, D, torch.bfloat16)
    band = Band()
    out, lse = tf.triton_forward(q, k, v, scale=0.09, band=band)
    with tuning.override(atomic_dq=True):
        fast = tf.triton_backward(do, q, k, v, out, lse, scale=0.09, band=band)
    det = tf.triton_backward(do, q, k, v, out, lse, scale=0.09, band=band, deterministic=True)
    for a, b in zip(fast, det):
        assert float((a.float() - b.float()).abs().max()) <= 2e-2 * float(b.float().abs().max())


@pytest.mark.parametrize("D", [64, 128])
def test_first_autotuned_call_is_correct(D):
    """With autotuning on, the first call of a new key times every config by running it. The atomic-dQ kernel
    adds into its accumulator on every run, so unless the autotuner zeroes it before each run and before the
    real one, the first backward of each key returns dQ several times too large."""
    from longctx.launchers import flash as tf
    from longctx.masks import Band

    tf._kernel.cache_clear()  # fresh autotuners: nothing tuned yet
    try:
        with tuning.override(autotune=True, band_sparse=False):
            # causal, MHA, Sq > 2K: the default backward takes the atomic-dQ path at D=64 and D=128
            q, k, v, do = _inputs(1, 2, 2, 3000, 3000, D, torch.bfloat16)
            band = Band.from_args(3000, 3000, causal=True)
            out, lse = tf.triton_forward(q, k, v, scale=0.1, band=band)
            first = tf.triton_backward(do, q, k, v, out, lse, scale=0.1, band=band)
            det = tf.triton_backward(do, q, k, v, out, lse, scale=0.1, band=band, deterministic=True)
            for a, b in zip(first, det):
                assert float((a.float() - b.float()).abs().max()) <= 2e-2 * float(b.float().abs().max())
    finally:
        tf._kernel.cache_clear()  # the other tests run untuned kernels again


def test_auto_picks_triton_where_cudnn_cannot():
    """cuDNN comes first in the auto order where it can compute the request; everything it cannot
    (bottom-right causal with Sq != Sk, windows, lse, deterministic backward) goes to the Triton kernels."""
    import longctx

    q, k, v, _ = _inputs(1, 4, 2, 64, 96, 128, torch.bfloat16)
    assert longctx.explain(q, k, v, causal=True).backend.name == "triton"
    assert longctx.explain(q, k, v, window=(16, 16)).backend.name == "triton"
    assert longctx.explain(q, k, v, return_lse=True).backend.name == "triton"
    q32 = q.float()
    assert longctx.explain(q32, k.float(), v.float()).backend.name != "triton"

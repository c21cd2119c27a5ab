"""GPU tests of the warp-specialised backward (`kernels.flash_bwd_ws`, and `kernels.flash_bwd_ws_d256` for dK / dV
at D=256; Gluon, Hopper only, skipped elsewhere).

test_flash_kernels.py runs the whole matrix through `triton_attention`, whose backward takes these kernels for the
inputs they support (fp16/bf16, D in {64, 128, 256}, not deterministic) on an sm_90 GPU. Here: that it is really the
kernel taken there, and that every config agrees with the float64 oracle (the 2x-of-PyTorch rule of
test_flash_kernels.py) on shapes that stress it: query tiles per ring slot and per dS^T exchange slot, masked and
unmasked runs of length 0 and 1, ragged Sq and Sk, GQA / MQA group loops, windows and shifted bands, the
flash_attn_func layout, rows that see nothing.
"""

from __future__ import annotations

import math

import pytest
import torch

from longctx import tuning

pytestmark = pytest.mark.hopper


@pytest.fixture(autouse=True)
def _untuned():
    """The first tile of each list (autotuning would time every config of the matrix), and bands kept on the dense
    kernels these tests are about (`tuning.band_via_sparse` hands some to the block-sparse ones)."""
    with tuning.override(autotune=False, band_sparse=False):
        yield


BANDS = {"full": (None, None), "causal": (None, 0), "window": (-300, 0), "two_sided": (-77, 130), "none": (5000, None)}
CONFIGS = {"64x2": (64, 2, False), "64x2e": (64, 2, True), "64x3": (64, 3, False)}


def _grads(tf, q, k, v, do, band, scale):
    out, lse = tf.triton_forward(q, k, v, scale=scale, band=band)
    return tf.triton_backward(do, q, k, v, out, lse, scale=scale, band=band)


def _check(tf, q, k, v, do, band, scale):
    from longctx.reference.naive import naive_attention

    grads = _grads(tf, q, k, v, do, band, scale)

    def ref(upcast):
        qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out, _ = naive_attention(qr, kr, vr, scale=scale, band=band, upcast=upcast)
        return torch.autograd.grad(out, (qr, kr, vr), do.to(out.dtype))

    oracle, plain = ref(torch.float64), ref(q.dtype)  # plain PyTorch computing in bf16 / fp16
    for name, g, r, p in zip(("dq", "dk", "dv"), grads, oracle, plain):
        assert g.shape == r.shape and g.dtype == q.dtype, name
        assert torch.isfinite(g).all(), name
        e, e_plain = float((g.double() - r).abs().max()), float((p.double() - r).abs().max())
        floor = 1e-3 * float(r.abs().max()) + 1e-5
        assert e <= 2 * e_plain + floor, f"{name}: ours {e:.3e} vs plain PyTorch {e_plain:.3e}"
    return grads


@pytest.mark.parametrize("D", [128, 256])
def test_ws_bwd_is_taken(ws_switches, count_calls, D):
    tf = ws_switches
    calls = count_calls(tf, "_backward_ws" if D == 128 else "_backward_ws_d256")
    q = torch.randn(1, 2, 256, D, device="cuda", dtype=torch.bfloat16)
    _grads(tf, q, q, q, q, tf.Band(None, None), 0.1)
    assert calls, f"the warp-specialised backward was not used for bf16 D={D} on Hopper"
    calls.clear()
    out, lse = tf.triton_forward(q, q, q, scale=0.1, band=tf.Band(None, None))
    tf.triton_backward(q, q, q, q, out, lse, scale=0.1, band=tf.Band(None, None), deterministic=True)
    assert not calls, "deterministic=True must keep the atomics-free Triton backward"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("band", list(BANDS))
@pytest.mark.parametrize("sq,sk", [(1000, 1000), (129, 2049), (2048, 300), (17, 40)], ids=str)
def test_ws_bwd_matches_oracle(ws_switches, dtype, D, cfg, band, sq, sk):
    tf = ws_switches
    lo, hi = BANDS[band]
    g = torch.Generator(device="cuda").manual_seed(sq * 7 + sk + D)
    q = torch.randn(2, 4, sq, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(2, 2, sk, D, device="cuda", dtype=dtype, generator=g)  # GQA 4/2
    v = torch.randn(2, 2, sk, D, device="cuda", dtype=dtype, generator=g)
    do = torch.randn(2, 4, sq, D, device="cuda", dtype=dtype, generator=g)
    with tuning.override(ws_bwd=True, ws_bwd_config=CONFIGS[cfg]):
        dq, dk, dv = _check(tf, q, k, v, do, tf.Band(lo, hi), 1.0 / math.sqrt(D))
    if band == "none":  # no row sees a key: every gradient is 0
        assert not dq.any() and not dk.any() and not dv.any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("band", list(BANDS))
@pytest.mark.parametrize("sq,sk", [(1000, 1000), (129, 2049), (2048, 300), (17, 40)], ids=str)
def test_ws_bwd_d256_matches_oracle(ws_switches, count_calls, dtype, band, sq, sk):
    """D=256: dK / dV by `flash_bwd_ws_d256` (its one config), dQ by the Triton dQ kernel."""
    tf = ws_switches
    calls = count_calls(tf, "_backward_ws_d256")
    lo, hi = BANDS[band]
    g = torch.Generator(device="cuda").manual_seed(sq * 7 + sk)
    q = torch.randn(2, 4, sq, 256, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(2, 2, sk, 256, device="cuda", dtype=dtype, generator=g) * 2  # GQA 4/2, scores that grow
    v = torch.randn(2, 2, sk, 256, device="cuda", dtype=dtype, generator=g)
    do = torch.randn(2, 4, sq, 256, device="cuda", dtype=dtype, generator=g)
    dq, dk, dv = _check(tf, q, k, v, do, tf.Band(lo, hi), 1.0 / 16)
    assert calls
    if band == "none":
        assert not dq.any() and not dk.any() and not dv.any()


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("hkv", [1, 8])
def test_ws_bwd_mqa_and_long(ws_switches, D, hkv):
    """MQA (one kv head, 8 query heads in the group loop) and MHA at 4100 (many query tiles, ragged tail)."""
    tf = ws_switches
    g = torch.Generator(device="cuda").manual_seed(D + hkv)
    q = torch.randn(1, 8, 4100, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, hkv, 4100, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, hkv, 4100, D, device="cuda", dtype=torch.bfloat16, generator=g)
    do = torch.randn(1, 8, 4100, D, device="cuda", dtype=torch.bfloat16, generator=g)
    with tuning.override(ws_bwd=True):
        _check(tf, q, k, v, do, tf.Band(None, 0), 1.0 / math.sqrt(D))


@pytest.mark.parametrize("D", [128, 256])
def test_ws_bwd_bshd_layout(ws_switches, D):
    """flash_attn_func's (B, S, H, D) layout: strided views in, gradients in the same layout out."""
    tf = ws_switches
    B, S, H = 2, 777, 4
    q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(4))
    with tuning.override(ws_bwd=True):
        dq, dk, dv = _check(tf, q, k, v, do, tf.Band(None, 0), 0.088)
    assert dq.stride() == q.stride() and dk.stride() == k.stride()


@pytest.mark.parametrize("D", [128, 256])
def test_ws_bwd_matches_deterministic_path(ws_switches, D):
    tf = ws_switches
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v, do = (torch.randn(2, 4, 1500, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    band = tf.Band(-600, 0)
    out, lse = tf.triton_forward(q, k, v, scale=0.1, band=band)
    with tuning.override(ws_bwd=True):
        fast = tf.triton_backward(do, q, k, v, out, lse, scale=0.1, band=band)
    det = tf.triton_backward(do, q, k, v, out, lse, scale=0.1, band=band, deterministic=True)
    for a, b in zip(fast, det):
        assert float((a.float() - b.float()).abs().max()) < 2e-2 * float(b.float().abs().max())

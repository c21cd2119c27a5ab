"""GPU tests of the warp-specialised forward (`kernels.flash_fwd_ws`, Gluon; Hopper only, skipped elsewhere).

test_flash_kernels.py runs the whole matrix through `triton_attention`, which takes this kernel for the inputs it
supports (fp16/bf16, D in {64, 128, 256}) on an sm_90 GPU. Here: that it is really the kernel taken there, and
that it agrees with the Triton forward and with the float64 oracle on the shapes that stress its pipeline
(many key tiles per ring slot, runs of length 0 and 1, ragged tails, GQA, the flash_attn_func layout).
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


BANDS = {"full": (None, None), "causal": (None, 0), "window": (-300, 0), "two_sided": (-77, 130)}


@pytest.mark.parametrize("D,band", [(128, "full"), (256, "full"), (256, "causal")])
def test_ws_is_taken(ws_switches, count_calls, D, band):
    tf = ws_switches
    calls = count_calls(tf, "_forward_ws")
    q = torch.randn(1, 2, 256, D, device="cuda", dtype=torch.bfloat16)
    tf.triton_forward(q, q, q, scale=0.1, band=tf.Band(*BANDS[band]))
    assert calls, f"the warp-specialised forward was not used for bf16 D={D} {band} on Hopper"


# configs per head dim: at D=256 the key tile is 64 rows (128-row tiles do not fit shared memory)
CFGS = {
    64: [(128, 2, True), (128, 2, False), (64, 3, True)],
    128: [(128, 2, True), (128, 2, False), (64, 3, True)],
    256: [(64, 2, True), (64, 2, False), (32, 3, True)],
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("D,cfg", [(d, c) for d, cs in CFGS.items() for c in cs], ids=str)
@pytest.mark.parametrize("band", list(BANDS))
@pytest.mark.parametrize("sq,sk", [(1000, 1000), (129, 2049), (2048, 300), (17, 40)], ids=str)
def test_ws_matches_oracle(ws_switches, dtype, D, cfg, band, sq, sk):
    from longctx.reference.naive import naive_attention

    tf = ws_switches
    lo, hi = BANDS[band]
    g = torch.Generator(device="cuda").manual_seed(sq * 7 + sk)
    q = torch.randn(2, 4, sq, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(2, 2, sk, D, device="cuda", dtype=dtype, generator=g) * 2  # GQA 4/2, scores that grow
    v = torch.randn(2, 2, sk, D, device="cuda", dtype=dtype, generator=g)
    scale = 1.0 / math.sqrt(D)
    with tuning.override(ws=True, ws_config=cfg):
        out, lse = tf.triton_forward(q, k, v, scale=scale, band=tf.Band(lo, hi))
    with tuning.override(ws=False):
        out_t, lse_t = tf.triton_forward(q, k, v, scale=scale, band=tf.Band(lo, hi))
    ref, ref_lse = naive_attention(q, k, v, scale=scale, band=tf.Band(lo, hi), upcast=torch.float64)
    low, _ = naive_attention(q, k, v, scale=scale, band=tf.Band(lo, hi), upcast=None)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    floor = 1e-3 * float(ref.abs().max()) + 1e-5
    err = float((out.double() - ref).abs().max())
    err_pt = float((low.double() - ref).abs().max())
    err_t = float((out_t.double() - ref).abs().max())
    assert err <= 2 * err_pt + floor, (err, err_pt, err_t)
    if fin.any():
        assert float((lse[fin].double() - ref_lse[fin]).abs().max()) < 1e-3
    assert torch.all(out[~fin] == 0)  # rows that see no key give 0


@pytest.mark.parametrize("D", [128, 256])
def test_ws_bshd_layout(ws_switches, D):
    tf = ws_switches
    B, S, H = 2, 777, 4
    x = [torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    q, k, v = (t.transpose(1, 2) for t in x)  # (B, H, S, D) views of the flash_attn_func layout
    with tuning.override(ws=True):
        out, lse = tf.triton_forward(q, k, v, scale=0.088, band=tf.Band(None, 0))
    assert out.stride() == q.stride()
    with tuning.override(ws=False):
        out_t, lse_t = tf.triton_forward(q, k, v, scale=0.088, band=tf.Band(None, 0))
    assert float((out.float() - out_t.float()).abs().max()) < 2e-2
    assert float((lse - lse_t).abs().max()) < 1e-3

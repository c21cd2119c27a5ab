"""Logit softcapping on the GPU (skipped without CUDA): the dense and block-sparse kernels with SOFTCAP, forward and
backward, against the float64 oracle; and softcap=0.0 bitwise equal to the call without softcap. The tests marked
``hopper`` (skipped elsewhere) force the warp-specialised Gluon kernels (`kernels.gluon`: dense forward and backward,
block-sparse forward and backward, whose tanh is the hardware's approximation) and fail unless they ran; the others
take whatever kernels the launchers choose for the GPU.

The FlashAttention rule, as in test_flash_kernels.py: for out, lse, dq, dk, dv,
``err(ours) <= 2 * err(plain PyTorch in the same dtype) + floor``, errors being max-abs differences from the float64
oracle (`naive_attention` with the cap, upcast to float64; the CPU lane checks it against the cap applied to explicit
scores); "plain PyTorch" is the same reference computed in bf16. Inputs are scaled so that the scores spread over
several units and the caps used (5 to 30) bend them.

Run on the device machine: ``PYTHONPATH=src python -m pytest -q tests/gpu/test_softcap_gpu.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

import longctx
from longctx import tuning
from longctx.launchers import sparse as ts
from longctx.masks import Band, and_masks, causal_mask, document_mask, local_global_mask, sliding_window_mask
from longctx.reference.naive import naive_attention

pytestmark = pytest.mark.gpu


def _inputs(B, Hq, Hkv, Sq, Sk, D, *, spread=3.0, seed=0, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = (torch.randn(B, Hq, Sq, D, device="cuda", generator=g) * spread).to(dtype)
    k = (torch.randn(B, Hkv, Sk, D, device="cuda", generator=g) * spread).to(dtype)
    v = torch.randn(B, Hkv, Sk, D, device="cuda", generator=g).to(dtype)
    do = torch.randn(B, Hq, Sq, D, device="cuda", generator=g).to(dtype)
    return q, k, v, do


def _run(fn, q, k, v, do):
    """(out, lse, dq, dk, dv) of fn(q, k, v) -> (out, lse) on fresh leaves, gradients of (out * do).sum()."""
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = fn(qg, kg, vg)
    return (out, lse, *torch.autograd.grad(out, (qg, kg, vg), do.to(out.dtype)))


def _err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(a), fin), "non-finite entries differ from the oracle"
    return float((a[fin] - ref[fin]).abs().max()) if fin.any() else 0.0


def _check(ours, q, k, v, do, *, scale, softcap, band=Band(), mask=None):
    def ref(upcast):
        return lambda a, b, c: naive_attention(
            a, b, c, scale=scale, band=band, mask=mask, upcast=upcast, softcap=softcap
        )

    oracle = _run(ref(torch.float64), q, k, v, do)
    plain = _run(ref(q.dtype), q, k, v, do)
    for name, o, r, p in zip(("out", "lse", "dq", "dk", "dv"), ours, oracle, plain):
        assert o.shape == r.shape, name
        e_ours, e_plain = _err(o, r), _err(p.float(), r)
        floor = 1e-3 * float(r[torch.isfinite(r)].abs().max()) if torch.isfinite(r).any() else 0.0
        assert e_ours <= 2 * e_plain + floor + 1e-5, f"{name}: ours {e_ours:.3e} vs plain PyTorch {e_plain:.3e}"


SHAPES = {"gqa_1024": (1, 4, 2, 1024, 1024), "mqa_257x700": (2, 4, 1, 257, 700)}


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_dense_bf16(D, causal, shape):
    B, Hq, Hkv, Sq, Sk = SHAPES[shape]
    q, k, v, do = _inputs(B, Hq, Hkv, Sq, Sk, D, seed=D + Sq)
    cap = 5.0

    def fn(a, b, c):
        return longctx.attention(a, b, c, causal=causal, softcap=cap, backend="triton", return_lse=True)

    ours = _run(fn, q, k, v, do)
    _check(ours, q, k, v, do, scale=1 / math.sqrt(D), softcap=cap, band=Band.from_args(Sq, Sk, causal=causal))


@pytest.mark.parametrize("path", ["atomic_dq", "separate_dq", "deterministic"])
@pytest.mark.parametrize("D", [64, 128])
def test_dense_backward_paths(path, D):
    """Each backward variant: the dK/dV kernel adding dQ by atomics, the separate dQ kernel, the deterministic one."""
    q, k, v, do = _inputs(1, 8, 2, 2304, 2304, D, seed=D)
    cap = 10.0

    def fn(a, b, c):
        return longctx.attention(
            a, b, c, causal=True, window=(700, 0), softcap=cap, backend="triton", return_lse=True,
            deterministic=path == "deterministic",
        )  # fmt: skip

    with tuning.override(atomic_dq=path == "atomic_dq", band_sparse=False):  # the dense kernels' variants
        ours = _run(fn, q, k, v, do)
    band = Band.from_args(2304, 2304, causal=True, window=(700, 0))
    _check(ours, q, k, v, do, scale=1 / math.sqrt(D), softcap=cap, band=band)


def test_flash_attn_func_bshd_softcap():
    B, S, H, D = 2, 777, 4, 128
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = ((torch.randn(B, S, H, D, device="cuda", generator=g) * 3).to(torch.bfloat16) for _ in range(3))
    do = torch.randn(B, S, H, D, device="cuda", generator=g).to(torch.bfloat16)

    def fn(a, b, c):
        out, lse, _ = longctx.flash_attn_func(
            a.transpose(1, 2), b.transpose(1, 2), c.transpose(1, 2), 0.0, None, True, (-1, -1), 30.0,
            return_attn_probs=True,
        )  # fmt: skip
        return out.transpose(1, 2), lse

    qh, kh, vh, doh = (t.transpose(1, 2) for t in (q, k, v, do))  # (B, H, S, D) views
    ours = _run(fn, qh, kh, vh, doh)
    _check(ours, qh, kh, vh, doh, scale=1 / math.sqrt(D), softcap=30.0, band=Band.from_args(S, S, causal=True))


MASKS = {
    "documents": lambda S: and_masks(causal_mask, document_mask(torch.arange(S, device="cuda") * 5 // S)),
    "sliding": lambda S: and_masks(causal_mask, sliding_window_mask(300)),
}


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("mask", list(MASKS))
def test_block_sparse_bf16(D, mask):
    S = 1500
    q, k, v, do = _inputs(1, 4, 2, S, S, D, seed=D)
    bm = longctx.block_mask(MASKS[mask](S), None, None, S, S, block_size=128, device="cuda")
    cap = 5.0

    def fn(a, b, c):
        return longctx.attention(a, b, c, block_mask=bm, softcap=cap, backend="triton_sparse", return_lse=True)

    ours = _run(fn, q, k, v, do)
    _check(ours, q, k, v, do, scale=1 / math.sqrt(D), softcap=cap, mask=bm.dense_mask(torch.device("cuda")))


@pytest.mark.parametrize("D", [64, 128])
def test_varlen_bf16(D):
    cu = [0, 300, 301, 1100, 1600]  # a length-1 document
    T, Hq, Hkv = cu[-1], 4, 2
    q, k, v, do = _inputs(1, Hq, Hkv, T, T, D, seed=D)
    cut = torch.tensor(cu, dtype=torch.int32, device="cuda")
    cap = 5.0

    def fn(a, b, c):  # (1, H, T, D) views in and out
        out, lse, _ = longctx.flash_attn_varlen_func(
            a[0].transpose(0, 1), b[0].transpose(0, 1), c[0].transpose(0, 1), cut, cut, 800, 800,
            causal=True, softcap=cap, return_attn_probs=True,
        )  # fmt: skip
        return out.transpose(0, 1)[None], lse[None]

    keep = torch.zeros(T, T, dtype=torch.bool, device="cuda")
    for a, b in zip(cu[:-1], cu[1:]):
        keep[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool, device="cuda").tril()
    ours = _run(fn, q, k, v, do)
    _check(ours, q, k, v, do, scale=1 / math.sqrt(D), softcap=cap, mask=keep)


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("kind", ["dense", "block_sparse"])
def test_zero_softcap_is_bitwise_the_call_without_softcap(D, kind):
    """softcap=0.0 takes the kernels compiled without SOFTCAP (the warp-specialised ones where they apply)."""
    S = 2048
    q, k, v, do = _inputs(1, 4, 2, S, S, D, spread=1.0, seed=D)
    kw = (
        dict(causal=True)
        if kind == "dense"
        else dict(block_mask=longctx.block_mask(MASKS["documents"](S), None, None, S, S, device="cuda"))
    )
    plain = _run(lambda a, b, c: longctx.attention(a, b, c, return_lse=True, deterministic=True, **kw), q, k, v, do)
    zero = _run(
        lambda a, b, c: longctx.attention(a, b, c, return_lse=True, deterministic=True, softcap=0.0, **kw), q, k, v, do
    )
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), plain, zero):
        assert torch.equal(a, b), name
    out0 = longctx.attention(q, k, v, **kw)
    assert torch.equal(out0, longctx.attention(q, k, v, softcap=0.0, **kw))  # the forward as auto chooses it


# -- the warp-specialised (Gluon) kernels, Hopper only -----------------------------------------------------------


@pytest.fixture
def ws_runs(monkeypatch):
    """``ws_runs(module)`` (`launchers.flash` or `launchers.sparse`): {"fwd": n, "bwd": m}, the launches of the
    module's warp-specialised kernels in the test that returned. A Gluon kernel that does not compile makes the
    launcher fall back to the Triton kernels with a warning; such a launch is not counted (and a failure noted by an
    earlier test is forgotten first)."""

    def wrap(module) -> dict:
        runs = {"fwd": 0, "bwd": 0}
        monkeypatch.setattr(module, "_WS_BROKEN", set())
        # (the D=256 backward's dK / dV kernel has a launcher of its own)
        for kind, name in (("fwd", "_forward_ws"), ("bwd", "_backward_ws"), ("bwd", "_backward_ws_d256")):

            def counted(*args, _real=getattr(module, name), _kind=kind, **kwargs):
                result = _real(*args, **kwargs)
                runs[_kind] += 1
                return result

            monkeypatch.setattr(module, name, counted)
        return runs

    return wrap


def _dense_ws(ws_switches, ws_runs, B, Hq, Hkv, Sq, Sk, D, *, causal, cap, window=None, dtype=torch.bfloat16, **over):
    """The dense attention with softcap ``cap`` under the tuning overrides ``over`` (bands kept on the dense kernels,
    which `tuning.band_via_sparse` would hand to the block-sparse ones), against the oracle; returns the launches of
    the warp-specialised kernels."""
    runs = ws_runs(ws_switches)
    deterministic = over.pop("deterministic", False)
    q, k, v, do = _inputs(B, Hq, Hkv, Sq, Sk, D, seed=D + Sq + int(cap), dtype=dtype)

    def fn(a, b, c):
        return longctx.attention(
            a, b, c, causal=causal, window=window, softcap=cap, backend="triton", return_lse=True,
            deterministic=deterministic,
        )  # fmt: skip

    with tuning.override(autotune=False, band_sparse=False, **over):
        ours = _run(fn, q, k, v, do)
    band = Band.from_args(Sq, Sk, causal=causal, window=window)
    _check(ours, q, k, v, do, scale=1 / math.sqrt(D), softcap=cap, band=band)
    return runs


WS_SHAPES = {30.0: (1, 4, 2, 1024, 1024), 5.0: (2, 4, 1, 777, 1000)}  # GQA, block-aligned; MQA, ragged, Sq != Sk


@pytest.mark.hopper
@pytest.mark.parametrize("cap", list(WS_SHAPES))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_ws_dense_softcap(D, causal, cap, ws_switches, ws_runs):
    """The warp-specialised forward and backward with SOFTCAP, forced on, at their default configs."""
    runs = _dense_ws(ws_switches, ws_runs, *WS_SHAPES[cap], D, causal=causal, cap=cap, ws=True, ws_bwd=True)
    assert runs == {"fwd": 1, "bwd": 1}, runs


@pytest.mark.hopper
@pytest.mark.parametrize(
    "D,fwd_cfg,bwd_cfg",
    [(128, (128, 2, False), (64, 2, True)), (64, (64, 3, True), (64, 3, False))],
    ids=["unpipelined_fwd-early_dv_bwd", "64x3p_fwd-64x3_bwd"],
)
def test_ws_dense_softcap_configs(D, fwd_cfg, bwd_cfg, ws_switches, ws_runs):
    """Other configs: the forward's unmasked run without the pipelined loop, the backward's early dV product (dS^T
    from the bf16 P), deeper rings."""
    over = dict(ws=True, ws_bwd=True, ws_config=fwd_cfg, ws_bwd_config=bwd_cfg)
    runs = _dense_ws(ws_switches, ws_runs, 1, 4, 2, 1000, 1000, D, causal=True, cap=5.0, **over)
    assert runs == {"fwd": 1, "bwd": 1}, runs


@pytest.mark.hopper
def test_ws_dense_softcap_window_fp16(ws_switches, ws_runs):
    """A sliding window (masked runs on both sides of the unmasked one) in float16."""
    runs = _dense_ws(ws_switches, ws_runs, 1, 4, 2, 1500, 1500, 128, causal=True, cap=10.0, window=(300, 0),
                     dtype=torch.float16, ws=True, ws_bwd=True)  # fmt: skip
    assert runs == {"fwd": 1, "bwd": 1}, runs


@pytest.mark.hopper
@pytest.mark.parametrize("pair", ["ws_fwd-triton_bwd", "triton_fwd-ws_bwd"])
def test_ws_and_triton_kernels_mixed_softcap(pair, ws_switches, ws_runs):
    """A forward and a backward of different kernel families: the Gluon kernels' tanh (the hardware's
    approximation) and the Triton kernels' (exp2 and a division) differ in the last bits, so the probabilities the
    backward recomputes differ slightly from the forward's; the gradients must still meet the rule."""
    if pair == "ws_fwd-triton_bwd":
        over, want = dict(ws=True, deterministic=True), {"fwd": 1, "bwd": 0}
    else:
        over, want = dict(ws=False, ws_bwd=True), {"fwd": 0, "bwd": 1}
    runs = _dense_ws(ws_switches, ws_runs, 1, 4, 2, 1024, 1024, 128, causal=True, cap=30.0, **over)
    assert runs == want, runs


def _layout_mask(S: int, H: int):
    """A random per-head layout (MASK_KIND 0) with a query block that sees nothing and a kv block nobody sees."""
    nb = -(-S // 128)
    layout = torch.rand(H, nb, nb, generator=torch.Generator().manual_seed(7)) < 0.4
    layout[1, 2] = False
    layout[2, :, 3] = False
    return longctx.BlockMask.from_layout(layout.cuda(), 128, S, S)


WS_MASKS = {  # name -> (block mask of S, H), the kinds of partial blocks the kernels read
    "documents": lambda S, H: longctx.block_mask(MASKS["documents"](S), None, None, S, S, device="cuda"),
    "local_global": lambda S, H: longctx.block_mask(local_global_mask(100, 17), None, None, S, S, device="cuda"),
    "general": lambda S, H: longctx.block_mask(
        lambda b, h, q, kv: ((q * 31 + kv * 17) % 7 != 0) & (kv <= q + 50), None, None, S, S, device="cuda"
    ),
    "layout": _layout_mask,
}


@pytest.mark.hopper
@pytest.mark.parametrize(
    "D,mask,S,cap",
    [
        (64, "documents", 1024, 30.0),
        (128, "documents", 1024, 30.0),
        (64, "local_global", 1500, 5.0),
        (128, "local_global", 1500, 5.0),
        (64, "general", 1000, 5.0),
        (128, "layout", 1100, 5.0),
        (256, "documents", 1024, 30.0),
        (256, "general", 1000, 5.0),
        (256, "layout", 1100, 5.0),
    ],
    ids=str,
)
def test_ws_block_sparse_softcap(D, mask, S, cap, ws_runs):
    """The warp-specialised block-sparse forward and backward with SOFTCAP (the launchers' default on Hopper for
    128-token mask blocks): block-aligned S (full blocks through the pipelined loop without a mask) and ragged S,
    every kind of partial block."""
    runs = ws_runs(ts)
    q, k, v, do = _inputs(1, 4, 2, S, S, D, seed=D + S)
    bm = WS_MASKS[mask](S, 4)

    def fn(a, b, c):
        return longctx.attention(a, b, c, block_mask=bm, softcap=cap, backend="triton_sparse", return_lse=True)

    with tuning.override(autotune=False):
        ours = _run(fn, q, k, v, do)
    _check(ours, q, k, v, do, scale=1 / math.sqrt(D), softcap=cap, mask=bm.dense_mask(torch.device("cuda")))
    assert runs == {"fwd": 1, "bwd": 1}, runs

"""The triton_sparse kernels under TRITON_INTERPRET=1 (tiny fp32/fp16 shapes), in a subprocess so that the
interpreter flag is set before triton is imported."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

pytestmark = pytest.mark.interpreter

COMMON = textwrap.dedent(
    r"""
    import os
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import torch
    import longctx
    import longctx.masks as bsm
    from longctx.reference.naive import naive_attention

    def check(q, k, v, bm, name):
        scale = q.shape[-1] ** -0.5
        mask = bm.dense_mask()
        g = torch.Generator().manual_seed(5)
        go = torch.randn(q.shape, generator=g).to(q.dtype)
        res = []
        for fn, dt in (
            (lambda a, b, c: longctx.attention(a, b, c, block_mask=bm, backend="triton_sparse", return_lse=True), None),
            (lambda a, b, c: naive_attention(a, b, c, scale=scale, mask=mask, upcast=torch.float64), torch.float64),
            (lambda a, b, c: naive_attention(a, b, c, scale=scale, mask=mask), None),
        ):
            a, b, c = (t.detach().to(dt or t.dtype).requires_grad_() for t in (q, k, v))
            out, lse = fn(a, b, c)
            grads = torch.autograd.grad((out.double() * go.double()).sum(), (a, b, c))
            fin = torch.isfinite(lse)
            res.append((out.double(), torch.where(fin, lse.double(), 0.0), fin, *[x.double() for x in grads]))
        ours, ref, low = res
        assert torch.equal(ours[2], ref[2]), name + ": -inf rows differ"
        for i, nm in ((0, "out"), (1, "lse"), (3, "dq"), (4, "dk"), (5, "dv")):
            assert torch.isfinite(ours[i]).all(), name + " " + nm
            err = (ours[i] - ref[i]).abs().max().item()
            base = (low[i] - ref[i]).abs().max().item()
            floor = 1e-5 if q.dtype == torch.float32 else 2e-3
            assert err <= 2 * base + floor, f"{name} {nm}: {err:.3g} vs {base:.3g}"
        print("ok", name, flush=True)

    def inputs(B, Hq, Hkv, Sq, Sk, D, dtype, seed):
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(B, Hq, Sq, D, generator=g).to(dtype), torch.randn(B, Hkv, Sk, D, generator=g).to(dtype),
                torch.randn(B, Hkv, Sk, D, generator=g).to(dtype))

    """
)

SCRIPT = COMMON + textwrap.dedent(
    r"""
    # ready-made analytic masks (docs with a length-1 document, globals), ragged S, GQA
    S = 75
    docs = torch.tensor([0] * 1 + [1] * 40 + [2] * 34)
    for i, mm in enumerate([bsm.causal_mask, bsm.document_mask(docs) & bsm.causal_mask, bsm.local_global_mask(9, 5)]):
        q, k, v = inputs(1, 4, 2, S, S, 16, torch.float32, i)
        check(q, k, v, longctx.block_mask(mm, None, None, S, S, block_size=32, device="cpu"), repr(mm))
    # general mask_mod, per-head and per-batch, Sq != Sk, rows with nothing visible, fp16, MQA
    mm = lambda b, h, q, kv: ((q + kv + h + b) % 3 == 0) & (q % 7 != 2)
    q, k, v = inputs(2, 2, 1, 40, 70, 16, torch.float16, 7)
    check(q, k, v, longctx.block_mask(mm, 2, 2, 40, 70, block_size=16, device="cpu"), "general per-head fp16")
    # random layout (full blocks only), head dim 24 (padded)
    lay = torch.rand(2, 3, 4, generator=torch.Generator().manual_seed(1)) < 0.5
    q, k, v = inputs(1, 2, 2, 48, 64, 24, torch.float32, 3)
    check(q, k, v, longctx.BlockMask.from_layout(lay, 16, 48, 64), "layout")
    # a head dim past 128 (D=200, padded to 256); GQA, ragged
    docs = torch.tensor([0] * 7 + [1] * 23)
    bm = longctx.block_mask(bsm.document_mask(docs) & bsm.causal_mask, None, None, 30, 30, block_size=16, device="cpu")
    q, k, v = inputs(1, 2, 1, 30, 30, 200, torch.float32, 12)
    check(q, k, v, bm, "d200")
    # packed documents through flash_attn_varlen_func (Sq != Sk per document, length-1 documents, causal)
    lq, lk = [1, 30, 5, 20], [3, 18, 5, 1]
    cu = lambda L: torch.tensor([0] + torch.tensor(L).cumsum(0).tolist(), dtype=torch.int32)
    g = torch.Generator().manual_seed(9)
    q = torch.randn(sum(lq), 2, 16, generator=g)
    k = torch.randn(sum(lk), 1, 16, generator=g)
    v = torch.randn(sum(lk), 1, 16, generator=g)
    f = longctx.flash_attn_varlen_func
    a = f(q, k, v, cu(lq), cu(lk), 30, 18, causal=True, backend="triton_sparse", block_size=16)
    b = f(q, k, v, cu(lq), cu(lk), 30, 18, causal=True, backend="tiled", block_size=16)
    assert (a - b).abs().max().item() < 1e-5
    print("ok varlen", flush=True)
    # torch.compile(fullgraph=True) traces longctx.attention(block_mask=...) through the registered ops
    docs = torch.tensor([0] * 10 + [1] * 38)
    bm = longctx.block_mask(bsm.document_mask(docs) & bsm.causal_mask, None, None, 48, 48, block_size=16, device="cpu")
    q, k, v = (t.requires_grad_() for t in inputs(1, 4, 2, 48, 48, 16, torch.float32, 11))

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(q, k, v, bm):
        return longctx.attention(q, k, v, block_mask=bm, backend="triton_sparse")

    res = []
    for fn in (f, lambda *a: longctx.attention(*a[:3], block_mask=a[3], backend="tiled")):
        out = fn(q, k, v, bm)
        res.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v))))
    for a, b in zip(*res):
        assert (a - b).abs().max().item() < 1e-5
    print("ok compile", flush=True)
    """
)


# The forward's tensor-descriptor loads (tuning key sparse_tma_in_interpreter: they run in the interpreter too).
# Block 32 with the interpreter's 16x16 tiles: two sub-tiles per mask block.
TMA_SCRIPT = COMMON + textwrap.dedent(
    r"""
    S = 75
    docs = torch.tensor([0] * 1 + [1] * 40 + [2] * 34)
    q, k, v = inputs(1, 4, 2, S, S, 16, torch.float32, 0)
    mm = bsm.document_mask(docs) & bsm.causal_mask
    check(q, k, v, longctx.block_mask(mm, None, None, S, S, block_size=32, device="cpu"), "docs ragged GQA")
    mm = lambda b, h, q, kv: ((q + kv + h + b) % 3 == 0) & (q % 7 != 2)
    q, k, v = inputs(2, 2, 1, 40, 70, 16, torch.float16, 7)
    check(q, k, v, longctx.block_mask(mm, 2, 2, 40, 70, block_size=32, device="cpu"), "general per-head fp16")
    lay = torch.rand(2, 3, 4, generator=torch.Generator().manual_seed(1)) < 0.6
    q, k, v = inputs(1, 2, 2, 96, 128, 16, torch.float32, 3)
    check(q, k, v, longctx.BlockMask.from_layout(lay, 32, 96, 128), "layout")
    """
)


def _run(script: str, extra_env: dict | None = None) -> str:
    extra = dict(extra_env or {})
    tuning = ",".join(filter(None, ["autotune=0", extra.pop("LONGCTX_TUNING", "")]))
    env = dict(os.environ, TRITON_INTERPRET="1", LONGCTX_TUNING=tuning, **extra)
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    env["PYTHONPATH"] = os.path.abspath(src) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


def test_sparse_kernels_in_interpreter():
    assert _run(SCRIPT).count("ok") == 8


def test_sparse_kernels_with_descriptor_loads_in_interpreter():
    assert _run(TMA_SCRIPT, {"LONGCTX_TUNING": "sparse_tma_in_interpreter=1"}).count("ok") == 3


# Dense bands handed to the block-sparse kernels (`tuning.band_via_sparse`; forced here, as the rule takes them on
# Hopper only): the same outputs, lse (-inf on rows that see nothing), gradients (with dlse, float32 gradients, GQA,
# softcap) as the dense kernels, for causal, bottom-right causal, windows, two-sided windows and context parallelism's
# shifted bands.
BAND_SCRIPT = textwrap.dedent(
    r"""
    import torch
    from longctx import tuning
    from longctx.launchers import flash, sparse
    from longctx.masks import Band

    g = torch.Generator().manual_seed(3)
    cases = [
        (150, 150, Band(None, 0), 0.0), (40, 150, Band.from_args(40, 150, causal=True), 0.0),
        (150, 150, Band(-20, 0), 0.0), (130, 150, Band(-30, 25), 5.0), (150, 150, Band(None, -130), 0.0),
        (100, 150, Band(-500, 500), 0.0), (150, 100, Band(70, None), 0.0),
    ]
    for sq, sk, band, cap in cases:
        q = torch.randn(1, 4, sq, 16, generator=g)
        k, v = (torch.randn(1, 2, sk, 16, generator=g) for _ in range(2))
        do, dlse = torch.randn(1, 4, sq, 16, generator=g), torch.randn(1, 4, sq, generator=g)
        res = []
        for forced in (False, True):
            with tuning.override(band_sparse=forced):
                n = len(sparse._BAND_MASKS)
                out, lse = flash.triton_forward(q, k, v, scale=0.25, band=band, softcap=cap)
                fin = torch.isfinite(lse)
                grads = flash.triton_backward(do, q, k, v, out, lse, scale=0.25, band=band, softcap=cap,
                                              dlse=torch.where(fin, dlse, 0.0), grad_dtype=torch.float32)
                assert (len(sparse._BAND_MASKS) > n) == forced  # every case's band is a new mask
            res.append((out, torch.where(fin, lse, 0.0), fin, *grads))
        dense, routed = res
        assert torch.equal(dense[2], routed[2]), (band, "rows that see nothing differ")
        assert routed[3].dtype == torch.float32
        for a, b, nm in zip(dense, routed, ("out", "lse", "fin", "dq", "dk", "dv")):
            if nm != "fin":
                err = (a - b).abs().max().item()
                assert err < 2e-5, (band, nm, err)
        print("ok", band, flush=True)
    """
)


def test_dense_bands_through_the_block_sparse_kernels_in_interpreter():
    assert _run(BAND_SCRIPT).count("ok") == 7


VARLEN_SCRIPT = textwrap.dedent(
    r"""
    import torch
    import longctx

    # documents 0 and 2 have no keys (repeated entries in cu_seqlens_k): output 0, lse -inf, zero gradients
    for dt in (torch.float32, torch.float16):
        for causal in (False, True):
            g = torch.Generator().manual_seed(1)
            cq = torch.tensor([0, 5, 41, 44, 80], dtype=torch.int32)
            ck = torch.tensor([0, 0, 33, 33, 70], dtype=torch.int32)
            q = torch.randn(80, 2, 16, generator=g).to(dt).requires_grad_()
            k, v = (torch.randn(70, 1, 16, generator=g).to(dt).requires_grad_() for _ in range(2))
            out, lse, _ = longctx.flash_attn_varlen_func(
                q, k, v, cq, ck, 37, 37, causal=causal, return_attn_probs=True, backend="triton_sparse", block_size=16
            )
            (out.float() * torch.randn(out.shape, generator=g)).sum().backward()
            empty = torch.cat([torch.arange(0, 5), torch.arange(41, 44)])
            assert (out[empty] == 0).all() and (lse[:, empty] == float("-inf")).all(), (dt, causal)
            assert (q.grad[empty] == 0).all() and all(torch.isfinite(t.grad).all() for t in (q, k, v)), (dt, causal)
            print("ok zero-length", dt, causal, flush=True)
    # views of a packed qkv: the launcher writes a contiguous (B, S, H, D) output
    qkv = torch.randn(1, 24, 3, 2, 16)
    out = longctx.flash_attn_varlen_qkvpacked_func(qkv[0], torch.tensor([0, 24], dtype=torch.int32), 24,
                                                    causal=True, backend="triton_sparse", block_size=16)
    ref = longctx.flash_attn_varlen_qkvpacked_func(qkv[0].double(), torch.tensor([0, 24], dtype=torch.int32), 24,
                                                    causal=True, backend="math")
    assert out.is_contiguous() and (out.double() - ref).abs().max() < 1e-5
    print("ok packed", flush=True)
    """
)


def test_varlen_zero_length_documents_and_packed_views_in_interpreter():
    assert _run(VARLEN_SCRIPT).count("ok") == 5


EAGER_SCRIPT = textwrap.dedent(
    r"""
    import contextlib
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    import longctx
    from longctx.masks import Band
    from longctx.ops.flash import triton_attention
    from longctx.ops.sparse import triton_sparse_attention

    class Seen(TorchDispatchMode):  # what a selective-recompute policy or a FLOP counter would see
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 40, 16, generator=g)
    k, v = (torch.randn(1, 2, 40, 16, generator=g) for _ in range(2))
    w_out, w_lse = torch.randn(1, 4, 40, 16, generator=g), torch.randn(1, 4, 40, generator=g)
    bm = longctx.block_mask(longctx.masks.causal_mask, None, None, 40, 40, block_size=16, device="cpu")
    calls = {
        "dense": (lambda q, k, v: triton_attention(q, k, v, scale=0.25, band=Band(None, 0)), "triton_attn"),
        "sparse": (lambda q, k, v: triton_sparse_attention(q, k, v, scale=0.25, block_mask=bm), "triton_sparse"),
    }
    for name, (fn, op) in calls.items():
        for loss in ("out and lse", "lse only"):
            runs = []
            for mode in (None, Seen()):
                qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
                with mode if mode is not None else contextlib.nullcontext():
                    out, lse = fn(qg, kg, vg)
                    total = (lse * w_lse).sum() + (0 if loss == "lse only" else (out * w_out).sum())
                    total.backward()
                runs.append((out, lse, qg.grad, kg.grad, vg.grad))
                assert (type(out.grad_fn).__name__ == "_EagerBackward") == (mode is None), type(out.grad_fn)
                if mode is not None:  # the op, forward and backward, where a dispatch mode looks
                    assert {f"longctx.{op}_fwd", f"longctx.{op}_bwd"} <= mode.ops, (name, mode.ops)
            for a, b in zip(*runs):  # the eager twin and the op: the same launchers, bitwise
                assert torch.equal(a, b), (name, loss)
            print("ok", name, loss, flush=True)
    """
)


def test_eager_twin_equals_the_registered_op_in_interpreter():
    """Plain eager calls run the ops' `torch.autograd.Function` twin (less host time); under a dispatch mode the
    registered ops run and are seen. Both give bitwise the same outputs and gradients, with a loss on lse alone
    too (the output's gradient then None in both)."""
    assert _run(EAGER_SCRIPT, {"LONGCTX_TUNING": "tiles=fwd:16x16x4x1x0"}).count("ok") == 4


COMPILE_SCRIPT = textwrap.dedent(
    r"""
    import torch
    import longctx
    from longctx.masks import causal_mask

    seen = []

    def backend(gm, example_inputs):  # records the graph's calls, runs it as traced
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 40, 16, generator=g)
    k, v = (torch.randn(1, 2, 40, 16, generator=g) for _ in range(2))
    bm = longctx.block_mask(causal_mask, None, None, 40, 40, block_size=16, device="cpu")
    calls = {
        "triton_attn_fwd": lambda q, k, v: longctx.attention(q, k, v, causal=True, backend="triton"),
        "triton_sparse_fwd": lambda q, k, v: longctx.attention(q, k, v, block_mask=bm, backend="triton_sparse"),
    }
    for op, fn in calls.items():
        torch._dynamo.reset()
        seen.clear()
        runs = []
        for f in (torch.compile(fn, fullgraph=True, backend=backend), fn):
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
            out = f(qg, kg, vg)
            out.square().sum().backward()
            runs.append((out, qg.grad, kg.grad, vg.grad))
        assert f"longctx.{op}" in seen, seen  # the graph holds the op, not its eager twin
        for a, b in zip(*runs):
            assert torch.equal(a, b), op
        print("ok", op, flush=True)
    """
)


def test_torch_compile_traces_the_registered_ops_in_interpreter():
    """Under torch.compile (fullgraph) the graph holds the registered ops, not the eager twin, and the compiled
    call's output and gradients are bitwise the eager call's."""
    assert _run(COMPILE_SCRIPT, {"LONGCTX_TUNING": "tiles=fwd:16x16x4x1x0"}).count("ok") == 2

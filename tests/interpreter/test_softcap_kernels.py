"""Logit softcapping in the Triton kernels under TRITON_INTERPRET=1: dense (`flash_fwd`, `flash_bwd`: the atomic-dQ
dK/dV kernel, the separate dK/dV + dQ kernels, the deterministic path, the hand-pipelined forward) and block-sparse
(`flash_sparse`: analytic document masks, stored tiles, packed documents), forward and backward.

As in test_flash_kernels.py the cases run in one subprocess started with TRITON_INTERPRET=1 and print one JSON line
each. Each compares out, lse, dq, dk, dv with the float64 oracle (the cap applied to explicit scores): max-abs error
under ``tol * max(1, max|ref|)``, tol 1e-5 for float32 and 3e-3 for float16 (the interpreter rounds the products to
float16). Scores spread over several units so that the caps used (2 to 5) bend them.
"""

from __future__ import annotations

import textwrap

import pytest

from tests.interpreter.cases import run_cases

pytestmark = pytest.mark.interpreter

triton = pytest.importorskip("triton")

# name: (kind, B, Hq, Hkv, Sq, Sk, D, dtype, softcap, extra)
CASES = {
    "dense_causal_gqa_atomic_f32": ("dense", 1, 4, 2, 37, 45, 16, "float32", 3.0, {"causal": True, "atomic": True}),
    "dense_window_separate_dq_f16": ("dense", 2, 2, 1, 33, 33, 32, "float16", 4.0, {"window": (7, 3)}),
    "dense_deterministic_mqa_lse_grad_f32": (
        "dense",
        1,
        4,
        1,
        29,
        21,
        16,
        "float32",
        2.0,
        {"causal": True, "deterministic": True, "lse_grad": True},
    ),
    "dense_tma_pipelined_f32": ("dense", 1, 2, 2, 40, 70, 16, "float32", 5.0, {"tma": True, "pipe": True}),
    "sparse_documents_causal_gqa_f32": ("sparse", 1, 4, 2, 48, 48, 16, "float32", 3.0, {"mask": "docs"}),
    "sparse_stored_tiles_f16": ("sparse", 1, 2, 2, 40, 56, 16, "float16", 4.0, {"mask": "tiles"}),
    # a head dim past 128 (D=200, padded to 256)
    "sparse_documents_d200_f32": ("sparse", 1, 2, 1, 37, 37, 200, "float32", 3.0, {"mask": "docs"}),
    "varlen_causal_gqa_f32": ("varlen", 1, 4, 2, 0, 0, 16, "float32", 2.5, {}),
}

_SCRIPT = textwrap.dedent(
    """
    import json, math, sys, zlib
    import torch
    import longctx
    import longctx.masks as lm
    from longctx import tuning
    from longctx.masks import Band

    def oracle(q, k, v, scale, cap, keep):
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        s = cap * torch.tanh((q @ k.transpose(-1, -2)) * scale / cap)
        if keep is not None:
            s = s.masked_fill(~keep, float("-inf"))
        lse = torch.logsumexp(s, -1)
        return torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None]) @ v, lse

    def compare(fn, q, k, v, scale, cap, keep, lse_grad):
        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out, lse = fn(qg, kg, vg)
        g = torch.Generator().manual_seed(1)
        do = torch.randn(out.shape, generator=g, dtype=torch.float64)
        w = torch.randn(lse.shape, generator=g, dtype=torch.float64)

        def loss(o, l):
            val = (o.double() * do).sum()
            return val + (torch.where(torch.isfinite(l), l, 0).double() * w).sum() if lse_grad else val

        grads = torch.autograd.grad(loss(out, lse), (qg, kg, vg))
        q6, k6, v6 = (t.detach().double().requires_grad_() for t in (q, k, v))
        ro, rl = oracle(q6, k6, v6, scale, cap, keep)
        rgrads = torch.autograd.grad(loss(ro, rl), (q6, k6, v6))
        errs, finite_ok = {}, True
        for key, a, b in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), (ro, rl, *rgrads)):
            a, b = a.detach().double(), b.detach().double()
            fin = torch.isfinite(b)
            finite_ok &= bool(torch.equal(torch.isfinite(a), fin))
            diff = (a[fin] - b[fin]).abs().max().item() if fin.any() else 0.0
            errs[key] = diff / max(1.0, b[fin].abs().max().item() if fin.any() else 1.0)
        return {"errs": errs, "finite_ok": finite_ok}

    cases = json.loads(sys.argv[1])
    for name, (kind, B, Hq, Hkv, Sq, Sk, D, dt, cap, extra) in cases.items():
        try:
            torch.manual_seed(zlib.crc32(name.encode()) % 1000)
            dtype = getattr(torch, dt)
            scale = 1.0 / math.sqrt(D)
            lse_grad = extra.get("lse_grad", False)
            if kind == "varlen":
                cu = [0, 7, 20, 21, 40]  # a length-1 document
                T = cu[-1]
                q = (torch.randn(1, Hq, T, D) * 2).to(dtype)
                k = (torch.randn(1, Hkv, T, D) * 2).to(dtype)
                v = torch.randn(1, Hkv, T, D).to(dtype)
                keep = torch.zeros(T, T, dtype=torch.bool)
                for a, b in zip(cu[:-1], cu[1:]):
                    keep[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
                cut = torch.tensor(cu, dtype=torch.int32)

                def fn(a, b, c):
                    out, lse, _ = longctx.flash_attn_varlen_func(
                        a[0].transpose(0, 1), b[0].transpose(0, 1), c[0].transpose(0, 1), cut, cut, 19, 19,
                        causal=True, softcap=cap, return_attn_probs=True, backend="triton_sparse", block_size=16)
                    return out.transpose(0, 1)[None], lse[None]

                res = compare(fn, q, k, v, scale, cap, keep, lse_grad)
            elif kind == "sparse":
                q = (torch.randn(B, Hq, Sq, D) * 2).to(dtype)
                k = (torch.randn(B, Hkv, Sk, D) * 2).to(dtype)
                v = torch.randn(B, Hkv, Sk, D).to(dtype)
                if extra["mask"] == "docs":
                    docs = torch.tensor([0] * 13 + [1] * 20 + [2] * (Sq - 33))
                    mm = lm.document_mask(docs) & lm.causal_mask
                else:  # an arbitrary mask_mod: stored element tiles (MASK_KIND 2)
                    def mm(b, h, qi, kj):
                        return ((qi * 7 + kj * 3) % 5 != 0) & (kj <= qi + 9)
                bm = longctx.block_mask(mm, None, None, Sq, Sk, block_size=16, device="cpu")
                keep = bm.dense_mask()

                def fn(a, b, c):
                    return longctx.attention(a, b, c, block_mask=bm, softcap=cap, backend="triton_sparse",
                                             return_lse=True)

                res = compare(fn, q, k, v, scale, cap, keep, lse_grad)
            else:
                q = (torch.randn(B, Hq, Sq, D) * 2).to(dtype)
                k = (torch.randn(B, Hkv, Sk, D) * 2).to(dtype)
                v = torch.randn(B, Hkv, Sk, D).to(dtype)
                causal, window = extra.get("causal", False), extra.get("window")
                band = Band.from_args(Sq, Sk, causal=causal, window=window)
                keep = band.mask(0, Sq, 0, Sk, device=torch.device("cpu"))
                det = extra.get("deterministic", False)

                def fn(a, b, c):
                    return longctx.attention(a, b, c, causal=causal, window=window, softcap=cap, backend="triton",
                                             return_lse=True, deterministic=det)

                with tuning.override(atomic_dq=extra.get("atomic", False), tma_in_interpreter=extra.get("tma", False),
                                     tiles={"fwd": (16, 16, 4, 1, extra.get("pipe", False))}):
                    res = compare(fn, q, k, v, scale, cap, keep, lse_grad)
                    # softcap = 0 is the kernel without SOFTCAP: bitwise the call without softcap
                    a = longctx.attention(q, k, v, causal=causal, window=window, backend="triton", return_lse=True)
                    b = longctx.attention(q, k, v, causal=causal, window=window, backend="triton", return_lse=True,
                                          softcap=0.0)
                    res["zero_is_off"] = all(bool(torch.equal(x, y)) for x, y in zip(a, b))
        except Exception as exc:  # reported per case
            res = {"error": f"{type(exc).__name__}: {exc}"}
        print("CASE " + json.dumps({"name": name, **res}), flush=True)
    """
)


@pytest.fixture(scope="module")
def results() -> dict:
    return run_cases(_SCRIPT, CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_softcap_case(results, name):
    rec = results.get(name)
    assert rec is not None, f"case {name} did not run:\n{results['__stderr__']}"
    assert "error" not in rec, rec.get("error")
    tol = 3e-3 if CASES[name][7] == "float16" else 1e-5
    assert rec["finite_ok"], f"-inf/NaN pattern differs from the oracle: {rec}"
    for key, err in rec["errs"].items():
        assert err <= tol, f"{key}: relative max error {err:.2e} > {tol:.0e}"
    if "zero_is_off" in rec:
        assert rec["zero_is_off"], "softcap=0.0 must give bitwise the result without softcap"

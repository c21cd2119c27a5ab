"""The `triton` backend's kernels under the Triton interpreter (TRITON_INTERPRET=1, CPU, float16/float32).

The interpreter must be switched on before triton compiles anything in the process, and another test module
in the same xdist worker may already have imported triton; so the cases run in one subprocess started with
TRITON_INTERPRET=1, which prints one JSON line per case, and each pytest case below checks its line.

Each case compares out, lse, dq, dk, dv with the float64 oracle (`naive_attention`); max-abs errors must stay
under ``tol * max(1, max|ref|)`` with tol 2e-3 for float16 (the interpreter rounds products to float16) and
1e-5 for float32 (exact arithmetic in numpy).
"""

from __future__ import annotations

import textwrap

import pytest

from tests.interpreter.cases import run_cases

pytestmark = pytest.mark.interpreter

triton = pytest.importorskip("triton")

# name: (B, Hq, Hkv, Sq, Sk, D, dtype, band kwargs, extra)
CASES = {
    "mha_dense_d16_f16": (1, 2, 2, 33, 33, 16, "float16", {"causal": False}, {}),
    "gqa_causal_sq<sk_d32_f16": (1, 4, 2, 37, 53, 32, "float16", {"causal": True}, {}),
    "mqa_causal_sq>sk_masked_rows_d64_f32": (1, 4, 1, 53, 37, 64, "float32", {"causal": True}, {}),
    "window_both_d40_f16": (2, 2, 1, 45, 45, 40, "float16", {"window": (7, 3)}, {}),
    "window_causal_d64_f32": (1, 2, 2, 20, 50, 64, "float32", {"causal": True, "window": (10, 0)}, {}),
    # flash-attn's window semantics: causal takes the right side as 0; a side of Sk or more is unbounded
    "window_causal_two_sided_d16_f32": (1, 4, 2, 40, 40, 16, "float32", {"causal": True, "window": (6, 6)}, {}),
    "window_right_wide_sq>sk_d16_f32": (1, 2, 1, 30, 12, 16, "float32", {"window": (3, 12)}, {}),
    "shifted_band_d16_f16": (1, 4, 2, 40, 20, 16, "float16", {"band": (-23, -15)}, {}),
    "band_lo_only_d32_f32": (1, 2, 1, 30, 41, 32, "float32", {"band": (5, None)}, {}),
    "band_far_away_d16_f32": (1, 2, 1, 19, 23, 16, "float32", {"band": (-500, -400)}, {}),
    "ragged_sq1_d48_f16": (2, 2, 2, 1, 17, 48, "float16", {"causal": True}, {}),
    "ragged_sk1_d16_f32": (1, 2, 1, 17, 1, 16, "float32", {"causal": False}, {}),
    "bshd_strided_gqa_d32_f16": (2, 4, 2, 29, 29, 32, "float16", {"causal": True}, {"layout": "bshd"}),
    "deterministic_gqa_d16_f32": (1, 4, 2, 35, 35, 16, "float32", {"causal": True}, {"deterministic": True}),
    "lse_grad_d16_f32": (1, 2, 1, 21, 26, 16, "float32", {"causal": True}, {"lse_grad": True}),
    # the launcher takes the atomic-dQ backward only from Sq > 2048 (measured), far beyond interpreter
    # shapes: every case above forces it; these run the separate dK/dV + dQ kernels instead
    "separate_gqa_causal_d32_f16": (1, 4, 2, 37, 53, 32, "float16", {"causal": True}, {"atomic": False}),
    "separate_window_d40_f32": (2, 2, 1, 45, 45, 40, "float32", {"window": (7, 3)}, {"atomic": False}),
    # head dims past 128: dV and dK in two launches of the dK/dV kernel (`tuning.split_dkdv`), then dQ
    "split_dkdv_gqa_causal_d256_f32": (1, 4, 2, 21, 29, 256, "float32", {"causal": True}, {"atomic": False}),
    "split_dkdv_window_d200_f16": (1, 2, 1, 30, 30, 200, "float16", {"window": (5, 2)}, {"atomic": False}),
    # forcing the atomic dQ does not apply where dK/dV split: dQ still comes from the dQ kernel
    "split_dkdv_atomic_forced_gqa_causal_d256_f32": (1, 4, 2, 29, 21, 256, "float32", {"causal": True}, {}),
    # the forward's tensor-descriptor variants (K/V through TMA descriptors built on the host, or in the kernel for
    # broadcast views; the hand-pipelined QK^T); keys scaled up along the sequence (the running max keeps growing)
    "tma_causal_gqa_d16_f32": (1, 4, 2, 50, 50, 16, "float32", {"causal": True}, {"tma": True}),
    "tma_host_window_d32_f16": (2, 2, 1, 45, 61, 32, "float16", {"window": (9, 4)}, {"tma": True, "tma_host": True}),
    "tma_host_bshd_causal_d16_f32": (
        2,
        4,
        2,
        37,
        37,
        16,
        "float32",
        {"causal": True},
        {"tma": True, "tma_host": True, "layout": "bshd"},
    ),
    "tma_pipe_full_d16_f32": (
        2,
        2,
        1,
        40,
        77,
        16,
        "float32",
        {"causal": False},
        {"tma": True, "pipe": True, "broadcast_kv": True},
    ),
    # K/V broadcast over batch (stride 0): the host descriptor is not used for such views, the result is the same
    "tma_host_broadcast_kv_d16_f32": (
        2,
        2,
        1,
        33,
        40,
        16,
        "float32",
        {"causal": True},
        {"tma": True, "tma_host": True, "broadcast_kv": True},
    ),
    "tma_host_pipe_growing_scores_causal_d32_f32": (
        1,
        2,
        2,
        70,
        70,
        32,
        "float32",
        {"causal": True},
        {"tma": True, "tma_host": True, "pipe": True, "grow": 60.0},
    ),
}

_SCRIPT = textwrap.dedent(
    """
    import json, math, sys, zlib
    import torch
    import longctx
    from longctx.masks import Band, flash_window
    from longctx import tuning
    from longctx.ops.flash import triton_attention
    from longctx.reference.naive import naive_attention

    cases = json.loads(sys.argv[1])
    for name, (B, Hq, Hkv, Sq, Sk, D, dt, bk, extra) in cases.items():
        try:
            # the interpreter's tile, with the hand-pipelined QK^T where the case asks for it
            with tuning.override(atomic_dq=extra.get("atomic", True), tma_in_interpreter=extra.get("tma", False),
                                 tiles={"fwd": (16, 16, 4, 1, extra.get("pipe", False))}):
                torch.manual_seed(zlib.crc32(name.encode()) % 1000)
                dtype = getattr(torch, dt)

                def mk(H, S):
                    if extra.get("layout") == "bshd":
                        return torch.randn(B, S, H, D, dtype=dtype).transpose(1, 2)
                    return torch.randn(B, H, S, D, dtype=dtype)

                q, k, v = mk(Hq, Sq), mk(Hkv, Sk), mk(Hkv, Sk)
                if extra.get("broadcast_kv"):
                    k, v = k[:1].expand_as(k), v[:1].expand_as(v)
                if "grow" in extra:  # key j scaled by 1 + grow * j / Sk: the row max keeps growing along the keys
                    growth = 1 + extra["grow"] * torch.arange(Sk, dtype=torch.float64) / Sk
                    k = (k.double() * growth[:, None]).to(dtype)
                scale = 1.0 / math.sqrt(D)
                if "band" in bk:
                    band = Band(*bk["band"])
                else:
                    causal = bk.get("causal", False)
                    band = Band.from_args(Sq, Sk, causal, flash_window(bk.get("window"), causal=causal, seqlen_k=Sk))
                qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
                if "band" in bk:
                    out, lse = triton_attention(qg, kg, vg, scale=scale, band=band,
                                                deterministic=extra.get("deterministic", False))
                else:
                    # the public entry point, pinned to the backend
                    out, lse = longctx.attention(qg, kg, vg, causal=bk.get("causal", False), window=bk.get("window"),
                                                 backend="triton", return_lse=True,
                                                 deterministic=extra.get("deterministic", False))
                do = torch.randn_like(out)
                w = torch.randn(B, Hq, Sq, dtype=torch.float64)

                def loss(o, l):
                    val = (o.double() * do.double()).sum()
                    if extra.get("lse_grad"):
                        val = val + (torch.where(torch.isfinite(l), l, 0).double() * w).sum()
                    return val

                grads = torch.autograd.grad(loss(out, lse), (qg, kg, vg))
                q6, k6, v6 = (t.detach().double().requires_grad_() for t in (q, k, v))
                ro, rl = naive_attention(q6, k6, v6, scale=scale, band=band)
                rgrads = torch.autograd.grad(loss(ro, rl), (q6, k6, v6))
                errs, finite_ok = {}, True
                for key, a, b in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), (ro, rl, *rgrads)):
                    a, b = a.detach().double(), b.detach().double()
                    fin = torch.isfinite(b)
                    finite_ok &= bool(torch.equal(torch.isfinite(a), fin))
                    diff = (a[fin] - b[fin]).abs().max().item() if fin.any() else 0.0
                    mag = max(1.0, b[fin].abs().max().item() if fin.any() else 1.0)
                    errs[key] = diff / mag
                masked_rows = bool((rl == float("-inf")).any())
                zero_rows = bool((out.detach()[rl == float("-inf")] == 0).all()) if masked_rows else True
                res = {"errs": errs, "finite_ok": finite_ok, "zero_rows": zero_rows, "masked_rows": masked_rows}
        except Exception as exc:  # reported per case
            res = {"error": f"{type(exc).__name__}: {exc}"}
        print("CASE " + json.dumps({"name": name, **res}), flush=True)

    # auto must never pick the interpreter on CPU tensors
    q = torch.randn(1, 2, 8, 16)
    print("AUTO " + json.dumps({"choice": longctx.explain(q, q, q).backend.name}), flush=True)
    """
)


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    return run_cases(_SCRIPT, CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_case(interpreter_results, name):
    rec = interpreter_results.get(name)
    assert rec is not None, f"case {name} did not run:\n{interpreter_results['__stderr__']}"
    assert "error" not in rec, rec.get("error")
    tol = 2e-3 if CASES[name][6] == "float16" else 1e-5
    assert rec["finite_ok"], f"-inf/NaN pattern differs from the oracle: {rec}"
    assert rec["zero_rows"], "rows that see no key must give output 0"
    for key, err in rec["errs"].items():
        assert err <= tol, f"{key}: relative max error {err:.2e} > {tol:.0e}"


def test_fully_masked_rows_case_has_masked_rows(interpreter_results):
    assert interpreter_results["mqa_causal_sq>sk_masked_rows_d64_f32"]["masked_rows"]


def test_auto_never_picks_triton_on_cpu(interpreter_results):
    assert interpreter_results["__auto__"]["choice"] != "triton"


def test_tma_allocator_is_installed_in_every_thread():
    """Triton keeps its scratch allocator per thread (a ContextVar). The autograd engine runs backward, and
    the recomputed forward of activation checkpointing, in its own threads: the launcher must install the
    allocator there too, not once per process (a recomputed forward fails without it)."""
    import threading

    from triton.runtime import _allocation

    from longctx.launchers import runtime

    runtime._set_tma_allocator()
    seen = {}

    def worker():
        runtime._set_tma_allocator()
        seen["after"] = _allocation._allocator.get()

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["after"] is runtime._tma_scratch or not isinstance(seen["after"], _allocation.NullAllocator)

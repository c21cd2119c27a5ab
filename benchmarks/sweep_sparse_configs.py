"""Variant sweep of the triton_sparse kernels against FlexAttention, sized for one GPU call (developer tool).

    PYTHONPATH=src python benchmarks/sweep_sparse_configs.py [--out DIR] [--budget-s 280] [--no-flex]
    PYTHONPATH=src python benchmarks/sweep_sparse_configs.py --tiles     # the older per-kernel tile sweep

Cases (B=1, H=16, D=128, bf16, S=16K, block 128): sliding window 4096, packed documents 512..8192 (causal
inside each), random block layouts at 10% and 50% density, and dense causal (ours only: the 10% layout should
run >= 5x faster than it). For each case: FlexAttention once (compiled flex_attention, its own
create_block_mask), then every forward variant (`FWD_VARIANTS`) and every backward variant (`BWD_VARIANTS`),
each checked against the "base" variant's output and gradients. TFLOP/s count only the kept score entries
(backward 2.5x the forward FLOPs); `triton.testing.do_bench` medians; backward timed alone (autograd.grad on
a saved graph), as `longctx.bench.masks` does.

A variant is a setting of `longctx.ops.triton_sparse.VARIANT` (flags described in
`longctx.kernels.triton.flash_sparse`) plus forced tiles (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel; "base"
is the current default. To fit one call, the Triton kernels of every (case, variant) are compiled first, in
parallel worker processes that need no GPU (Triton's cache on disk is shared with the main process), while
the main process compiles and times FlexAttention. Rows go to DIR/sweep_sparse.jsonl as they are measured;
the summary table to DIR/sweep_sparse.md. Work left when ``--budget-s`` runs out is skipped (and listed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ["LONGCTX_TRITON_AUTOTUNE"] = "0"

import torch  # noqa: E402

# name -> (VARIANT flags, forward tile). "base": every variant off (the kernels as of 2026-11-20); the defaults since
# 2026-11-21 are grid+idx+tma (forward) and grid+idx with dK/dV 64x128x3 (backward).
FWD_VARIANTS: dict[str, tuple[dict, tuple[int, int, int, int]]] = {
    "base": ({}, (128, 128, 8, 2)),
    "grid": ({"grid_swap": True}, (128, 128, 8, 2)),
    "grid+idx/128x64x3": ({"grid_swap": True, "prefetch_idx": True}, (128, 64, 8, 3)),
    "grid+idx+tma/128x64x3": ({"grid_swap": True, "prefetch_idx": True, "tma": True}, (128, 64, 8, 3)),
    "grid+idx+tma+pipe/128x64x3": (
        {"grid_swap": True, "prefetch_idx": True, "tma": True, "pipe_qk": True},
        (128, 64, 8, 3),
    ),
    "grid+tma+pipe/128x128x2": ({"grid_swap": True, "tma": True, "pipe_qk": True}, (128, 128, 8, 2)),
    "grid+idx+tma+pipe+rev/128x64x3": (
        {"grid_swap": True, "prefetch_idx": True, "tma": True, "pipe_qk": True, "reverse_m": True},
        (128, 64, 8, 3),
    ),
    # the warp-specialised Gluon kernel (`kernels.flash_sparse_ws`); "ws_config": its (BLOCK_N, STAGES, PIPE)
    "ws": ({"ws": True}, (128, 64, 8, 3)),
    "ws/2st": ({"ws": True, "ws_config": (128, 2, True)}, (128, 64, 8, 3)),
    "ws+sched": ({"ws": True, "ws_sched": True}, (128, 64, 8, 3)),
}
# name -> (VARIANT flags, {"dkdv": tile, "dq": tile}); atomic variants launch no dQ kernel.
_B0 = {"dkdv": (64, 128, 8, 2), "dq": (128, 64, 8, 3)}
_B3 = {"dkdv": (64, 128, 8, 3), "dq": (128, 64, 8, 3)}
_B32 = {"dkdv": (32, 128, 8, 3), "dq": (128, 64, 8, 3)}
_GI = {"grid_swap": True, "prefetch_idx": True}
BWD_VARIANTS: dict[str, tuple[dict, dict]] = {
    "base": ({}, _B0),
    "grid": ({"grid_swap": True}, _B0),
    "grid+idx/dkdv64x128x3": (_GI, _B3),
    "grid+idx/dkdv32x128x3": (_GI, _B32),
    "grid+idx+tmadq/dkdv32x128x3": ({**_GI, "tma_dq": True}, _B32),
    "grid+idx+atomic-tma/dkdv32x128x3": ({**_GI, "atomic_dq": "tma"}, _B32),
    "grid+idx+atomic-ptr/dkdv32x128x3": ({**_GI, "atomic_dq": "ptr"}, _B32),
    "grid+idx+rev/dkdv32x128x3": ({**_GI, "reverse_m": True}, _B32),
    # the warp-specialised Gluon kernel; "ws_config": its (BLOCK_M, STAGES, EARLY_DV)
    "ws": ({"ws_bwd": True}, _B3),
    "ws/3st": ({"ws_bwd": True, "ws_config": (64, 3, False)}, _B3),
    "ws/early": ({"ws_bwd": True, "ws_config": (64, 2, True)}, _B3),
    "ws+sched": ({"ws_bwd": True, "ws_sched": True}, _B3),
    "ws/3st+sched": ({"ws_bwd": True, "ws_sched": True, "ws_config": (64, 3, False)}, _B3),
}
_OFF = {
    "grid_swap": False,
    "prefetch_idx": False,
    "tma": False,
    "tma_dq": False,
    "pipe_qk": False,
    "reverse_m": False,
    "atomic_dq": "0",
    "ws": False,
    "ws_bwd": False,
    "ws_sched": False,
}
S_DEFAULT, H, D = 16384, 16, 128
# --dry-run (CPU, TRITON_INTERPRET=1, tiny shapes) checks this script's logic without a GPU
DEV, DTYPE = "cuda", torch.bfloat16


def _set_variant(ts, flags: dict, tiles: dict) -> None:
    flags = dict(flags)
    ws_config = flags.pop("ws_config", None)
    ts.VARIANT.update(_OFF)
    ts.VARIANT.update(flags)
    ts.FORCE_CONFIG.clear()
    ts.FORCE_CONFIG.update(tiles)
    ts.WS_FORCE_CONFIG.clear()
    if ws_config is not None:
        ts.WS_FORCE_CONFIG["fwd" if flags.get("ws") else "bwd"] = ws_config


def _mask(name: str, S: int, device: str):
    """(our BlockMask, what Flex needs to build its own: a mask_mod or a layout)."""
    import longctx
    import longctx.masks as bsm
    from longctx.bench.masks import _doc_ids, _random_layout

    if name == "sliding":
        mm = bsm.sliding_window_mask(4096)
    elif name == "docs":
        mm = bsm.document_mask(_doc_ids(S).to(device)) & bsm.causal_mask
    elif name == "causal":
        mm = bsm.causal_mask
    else:  # "layout0.1", "layout0.5": per-head random block layouts
        dens = float(name[len("layout") :])
        lay = _random_layout(H, S, dens, device)
        return longctx.BlockMask.from_layout(lay, 128, S, S), lay
    return longctx.block_mask(mm, None, None, S, S, device=device), mm


# FlexAttention at S=16K on the H100 (benchmarks/results/masks_2026-11-20_H100-80GB-HBM3.md): (fwd ms, bwd ms).
# Used for "x Flex" when Flex is not measured in the same call (--no-flex, or no budget left for it).
FLEX_REF_MS = {"sliding": (1.23, 3.12), "docs": (1.07, 2.62), "layout0.1": (0.58, 1.49), "layout0.5": (2.58, 6.50)}

CASES = {
    "sliding": "sliding window 4096",
    "docs": "documents 512..8192 causal",
    "layout0.1": "random layout 10%",
    "layout0.5": "random layout 50%",
    "causal": "causal (ours only, for the 5x check)",
}


# ---------------------------------------------------------------------------------------------------------------
# Precompilation in worker processes (no GPU): Triton's `warmup` under a stand-in driver that reports the GPU's
# target, with the same arguments the launchers pass, fills the on-disk cache the main process then reads.
# ---------------------------------------------------------------------------------------------------------------


def _compile_job(job: tuple) -> dict:
    """Compile the kernels of one (case, "fwd" | "bwd", variant) for ``arch`` without a GPU: kernel kind ->
    compiled kernel. Triton's on-disk cache keeps them."""
    case, kind, vname, S, arch = job
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class _Driver:  # what JITFunction.run asks of the active driver before it compiles
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

    driver.set_active(_Driver())
    from longctx.launchers import flash as tf
    from longctx.launchers import sparse as ts

    compiled = {}

    def warm(kind_, bd, mask_bs, grid_fn, args, kwargs):
        bm, bn, w, s = ts.FORCE_CONFIG[kind_]
        fn = ts._kernel_fn(kind_)
        compiled[kind_] = fn.warmup(*args, **kwargs, BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s, grid=(1,))

    def tma_ok(t, D_, bd):  # tf._tma_ok without the device check
        es = t.element_size()
        return bd == D_ and t.stride(3) == 1 and all((t.stride(i) * es) % 16 == 0 for i in range(3))

    ts._launch, ts._tma_ok, tf._set_tma_allocator = warm, tma_ok, lambda: None
    tf.bwd_preprocess = lambda out, do, lse, dlse, bd: (torch.empty_like(lse), torch.empty_like(lse))
    bm, _ = _mask(case, S, "cpu")
    q, k, v, do = (torch.empty(1, H, S, D, dtype=torch.bfloat16) for _ in range(4))
    if kind == "fwd":
        flags, tile = FWD_VARIANTS[vname]
        _set_variant(ts, flags, {"fwd": tile})
        ts.sparse_forward(q, k, v, scale=D**-0.5, block_mask=bm)
    else:
        flags, tiles = BWD_VARIANTS[vname]
        _set_variant(ts, flags, tiles)
        lse = torch.empty(1, H, S, dtype=torch.float32)
        ts.sparse_backward(do, q, k, v, torch.empty_like(q), lse, scale=D**-0.5, block_mask=bm)
    return compiled


def _precompile(job: tuple) -> str:
    t0 = time.perf_counter()
    try:
        _compile_job(job)
        return f"ok {' '.join(map(str, job[:3]))} {time.perf_counter() - t0:.1f}s"
    except Exception as exc:  # the main process compiles it then
        return f"failed {' '.join(map(str, job[:3]))}: {type(exc).__name__}: {exc}"[:300]


def main_aot(args) -> int:
    """--aot: compile every (case, variant) for sm_<arch> on this machine (no GPU) and report shared memory,
    registers and spill bytes (ptxas -v on the PTX): variants that would not fit or would spill show here."""
    import re
    import subprocess
    import tempfile

    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    cases = [c for c in args.cases.split(",") if c and c != "layout0.5"]
    fwd_vs = [v for v in (args.fwd_variants.split(",") if args.fwd_variants else FWD_VARIANTS) if v]
    bwd_vs = [v for v in (args.bwd_variants.split(",") if args.bwd_variants else BWD_VARIANTS) if v]
    jobs = [(c, "fwd", v) for c in cases for v in fwd_vs] + [(c, "bwd", v) for c in cases for v in bwd_vs]
    print("| case | pass | variant | kernel | smem KiB | regs | spill bytes |\n|---|---|---|---|---|---|---|")
    for c, p, v in jobs:
        try:
            kernels = _compile_job((c, p, v, args.s, args.arch))
        except Exception as exc:
            print(f"| {c} | {p} | {v} | error: {type(exc).__name__}: {str(exc)[:150]} ||||")
            continue
        for kind, kern in kernels.items():
            with tempfile.TemporaryDirectory() as tmp:
                src = os.path.join(tmp, "k.ptx")
                with open(src, "w") as fh:
                    fh.write(kern.asm["ptx"])
                arch = f"sm_{args.arch}a" if args.arch >= 90 else f"sm_{args.arch}"
                cmd = [ptxas, f"-arch={arch}", "-v", src, "-o", os.path.join(tmp, "k.cubin")]
                err = subprocess.run(cmd, capture_output=True, text=True).stderr
            regs = re.findall(r"Used (\d+) registers", err)
            spill = re.findall(r"(\d+) bytes spill stores", err)
            print(
                f"| {c} | {p} | {v} | {kind} | {kern.metadata.shared / 1024:.0f} | {regs[-1] if regs else '?'} | "
                f"{spill[-1] if spill else '?'} |",
                flush=True,
            )
    return 0


def _start_precompile(cases: list[str], S: int, workers: int):
    import multiprocessing as mp

    major, minor = torch.cuda.get_device_capability()
    # the two layouts compile the same kernels (same specialisation): one of them is enough
    cases = [c for c in cases if not (c == "layout0.5" and "layout0.1" in cases)]
    # (the Gluon kernels compile in the main process: the stand-in driver cannot launch them)
    jobs = [(c, "fwd", v, S, major * 10 + minor) for c in cases for v in FWD_VARIANTS if not v.startswith("ws")]
    jobs += [(c, "bwd", v, S, major * 10 + minor) for c in cases for v in BWD_VARIANTS if not v.startswith("ws")]
    pool = mp.get_context("spawn").Pool(workers)
    return pool, pool.map_async(_precompile, jobs, chunksize=1)


# ---------------------------------------------------------------------------------------------------------------
# The sweep
# ---------------------------------------------------------------------------------------------------------------


def _sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def _bench(fn, args) -> float:
    if DEV != "cuda":
        t0 = time.perf_counter()
        fn()
        return 1000 * (time.perf_counter() - t0)
    import triton

    return float(triton.testing.do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median"))


def _rel_err(a: list, b: list) -> float:
    return max(
        float((x.float() - y.float()).abs().max()) / max(float(y.float().abs().max()), 1e-6) for x, y in zip(a, b)
    )


def main_variants(args) -> int:
    from longctx.bench import masks as mb
    from longctx.launchers import sparse as ts

    t_start = time.perf_counter()
    left = lambda: args.budget_s - (time.perf_counter() - t_start)  # noqa: E731
    S = args.s
    cases = [c for c in args.cases.split(",") if c]
    fwd_vs = [v for v in (args.fwd_variants.split(",") if args.fwd_variants else FWD_VARIANTS) if v]
    bwd_vs = [v for v in (args.bwd_variants.split(",") if args.bwd_variants else BWD_VARIANTS) if v]
    os.makedirs(args.out, exist_ok=True)
    jsonl_path = os.path.join(args.out, "sweep_sparse.jsonl")
    open(jsonl_path, "w").close()

    def emit(row: dict) -> None:
        row["t"] = round(time.perf_counter() - t_start, 1)
        with open(jsonl_path, "a") as fh:
            fh.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)

    meta = mb._versions() if DEV == "cuda" else {"gpu": "dry run (CPU, Triton interpreter)"}
    emit({"meta": meta, "S": S, "H": H, "D": D, "cases": cases, "fwd": fwd_vs, "bwd": bwd_vs})
    pool = result = None
    if args.workers > 0:
        pool, result = _start_precompile(cases, S, args.workers)
    create_block_mask, flex = (None, None) if args.no_flex else mb._flex_setup()
    g = torch.Generator(device=DEV).manual_seed(0)
    q, k, v = (torch.randn(1, H, S, D, device=DEV, generator=g).to(DTYPE) for _ in range(3))
    scale = D**-0.5
    masks = {c: _mask(c, S, DEV) for c in cases}
    kept = {c: masks[c][0].kept_fraction() for c in cases}

    # -- FlexAttention first (its compile overlaps the workers' Triton compiles) --
    flex_ms: dict[str, tuple[float, float]] = {}
    for c in cases:
        if flex is None or c == "causal" or left() < 60:
            continue
        bm, spec = masks[c]
        try:
            if c.startswith("layout"):
                fbm = mb._flex_layout_mask(spec, S)
            else:
                fbm = create_block_mask(spec, None, None, S, S, device="cuda", BLOCK_SIZE=128)
            tf_, tb_, _ = mb._fwd_bwd_times(
                lambda a, b, c_, fbm=fbm: flex(a, b, c_, block_mask=fbm, scale=scale), q, k, v, args.warmup, args.rep
            )
            flex_ms[c] = (tf_, tb_)
            emit({"case": c, "impl": "flex", "fwd_ms": tf_, "bwd_ms": tb_, "kept": kept[c]})
        except Exception as exc:
            emit({"case": c, "impl": "flex", "error": f"{type(exc).__name__}: {exc}"[:300]})
    flex_src = {c: "measured" for c in flex_ms}
    if S == S_DEFAULT and H == 16 and D == 128:
        for c in cases:
            if c not in flex_ms and c in FLEX_REF_MS:
                flex_ms[c], flex_src[c] = FLEX_REF_MS[c], "ref 2026-11-20"
    emit({"flex_times": {c: {"fwd_ms": f, "bwd_ms": b, "source": flex_src[c]} for c, (f, b) in flex_ms.items()}})
    if result is not None:
        t0 = time.perf_counter()
        try:
            msgs = result.get(timeout=max(1.0, left() - 90))
        except Exception as exc:
            msgs = [f"precompile wait: {type(exc).__name__}: {exc}"]
        pool.terminate()
        n_ok = sum(m.startswith("ok") for m in msgs)
        emit({"precompile": f"{n_ok}/{len(msgs)} ok", "waited_s": round(time.perf_counter() - t0, 1)})
        for m in msgs:
            if not m.startswith("ok"):
                print(m, flush=True)

    # -- ours: every forward variant, then every backward variant, per case --
    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    do = torch.randn(q.shape, device=DEV, generator=g).to(DTYPE)
    skipped = []
    for c in cases:
        bm = masks[c][0]
        flops = 4 * H * S * S * D * kept[c]
        ref = None
        for vname in fwd_vs:
            if left() < 10:
                skipped.append(f"{c} fwd {vname}")
                continue
            flags, tile = FWD_VARIANTS[vname]
            _set_variant(ts, flags, {"fwd": tile})
            row = {"case": c, "impl": "ours", "pass": "fwd", "variant": vname}
            try:
                t0 = time.perf_counter()
                with torch.no_grad():
                    out = ts.sparse_forward(q, k, v, scale=scale, block_mask=bm)[0]
                _sync()
                row["first_call_s"] = round(time.perf_counter() - t0, 2)
                ref = [out] if ref is None else ref
                row["rel_err_vs_base"] = _rel_err([out], ref)
                ms = _bench(lambda bm=bm: ts.sparse_forward(q, k, v, scale=scale, block_mask=bm), args)
                row.update(ms=ms, tflops=flops / ms / 1e9)
                if c in flex_ms:
                    row["vs_flex"] = flex_ms[c][0] / ms
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            emit(row)
        # the graph the backward variants run on (forward in the base variant)
        _set_variant(ts, FWD_VARIANTS["base"][0], {"fwd": FWD_VARIANTS["base"][1]})
        y = ts.triton_sparse_attention(qq, kk, vv, scale=scale, block_mask=bm)[0]
        ref = None
        for vname in bwd_vs:
            if left() < 10:
                skipped.append(f"{c} bwd {vname}")
                continue
            flags, tiles = BWD_VARIANTS[vname]
            _set_variant(ts, flags, tiles)
            row = {"case": c, "impl": "ours", "pass": "bwd", "variant": vname}
            try:
                t0 = time.perf_counter()
                grads = torch.autograd.grad(y, (qq, kk, vv), do, retain_graph=True)
                _sync()
                row["first_call_s"] = round(time.perf_counter() - t0, 2)
                ref = list(grads) if ref is None else ref
                row["rel_err_vs_base"] = _rel_err(list(grads), ref)
                ms = _bench(lambda y=y: torch.autograd.grad(y, (qq, kk, vv), do, retain_graph=True), args)
                row.update(ms=ms, tflops=2.5 * flops / ms / 1e9)
                if c in flex_ms:
                    row["vs_flex"] = flex_ms[c][1] / ms
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            emit(row)
        del y
    md = _summary(jsonl_path, skipped)
    with open(os.path.join(args.out, "sweep_sparse.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


def _summary(path: str, skipped: list[str]) -> str:
    with open(path) as fh:
        rows = [json.loads(x) for x in fh]
    meta = rows[0]
    flex = next((r["flex_times"] for r in rows if "flex_times" in r), {})
    ours = [r for r in rows if r.get("impl") == "ours"]
    out = [
        f"# triton_sparse variant sweep ({meta['meta']['gpu']}, S={meta['S']}, H={meta['H']}, D={meta['D']}, bf16)",
        "",
        "TFLOP/s over kept entries; x Flex = Flex time / ours (>= 1.2 is the target); err = max relative "
        "difference to the base variant (out or grads). Flex times: "
        + (", ".join(f"{c} {v['source']}" for c, v in flex.items()) or "none"),
        "",
        "| case | pass | variant | ms | TFLOP/s | x Flex | err | first call s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in ours:
        if "error" in r:
            out.append(f"| {r['case']} | {r['pass']} | {r['variant']} | error: {r['error'][:120]} |||||")
            continue
        vf = f"{r['vs_flex']:.2f}" if "vs_flex" in r else "-"
        out.append(
            f"| {r['case']} | {r['pass']} | {r['variant']} | {r['ms']:.3f} | {r['tflops']:.0f} | {vf} | "
            f"{r['rel_err_vs_base']:.1e} | {r['first_call_s']} |"
        )
    out += ["", "Best per case (x Flex; layout 10% vs dense causal: target >= 5x):", ""]
    best = {}
    for r in ours:
        if "ms" in r:
            key = (r["case"], r["pass"])
            if key not in best or r["ms"] < best[key]["ms"]:
                best[key] = r
    for (case, p), r in sorted(best.items()):
        f = flex.get(case)
        fms = f"{f['fwd_ms' if p == 'fwd' else 'bwd_ms']:.3f}" if f else "-"
        out.append(f"- {case} {p}: {r['variant']} {r['ms']:.3f} ms (Flex {fms}; x Flex {r.get('vs_flex', 0):.2f})")
    for p in ("fwd", "bwd"):
        a, b = best.get(("layout0.1", p)), best.get(("causal", p))
        if a and b:
            out.append(f"- layout 10% vs causal, {p}: {b['ms'] / a['ms']:.2f}x")
    if skipped:
        out += ["", f"Skipped (budget): {', '.join(skipped)}"]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------------------------
# The older tile sweep: one kernel kind at a time, the others at their defaults (documents mask).
# ---------------------------------------------------------------------------------------------------------------

CANDIDATES = {
    "fwd": [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3)],
    "dkdv": [(64, 128, 8, 2), (32, 128, 8, 3), (64, 128, 8, 3), (32, 128, 4, 3), (64, 64, 4, 3), (32, 64, 4, 4)],
    "dq": [(128, 64, 8, 2), (128, 32, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3), (64, 32, 4, 4)],
}
DEFAULT = {"fwd": (128, 128, 8, 2), "dkdv": (64, 128, 8, 2), "dq": (128, 64, 8, 3)}


def main_tiles(args) -> int:
    import triton

    from longctx.launchers import sparse as ts

    S = args.s
    bm = _mask("docs", S, "cuda")[0]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    flops = 4 * H * S * S * D * bm.kept_fraction()
    out, lse = ts.sparse_forward(q, k, v, scale=D**-0.5, block_mask=bm)
    res = []
    for kind, cands in CANDIDATES.items():
        for cfg in cands:
            ts.FORCE_CONFIG.clear()
            ts.FORCE_CONFIG.update(DEFAULT)
            ts.FORCE_CONFIG[kind] = cfg
            try:
                if kind == "fwd":
                    fn = lambda: ts.sparse_forward(q, k, v, scale=D**-0.5, block_mask=bm)  # noqa: E731
                else:
                    fn = lambda: ts.sparse_backward(do, q, k, v, out, lse, scale=D**-0.5, block_mask=bm)  # noqa: E731
                ms = triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")
                f = flops * (1.0 if kind == "fwd" else 2.5)
                row = {"mask": "docs", "kind": kind, "cfg": cfg, "ms": ms, "tflops": f / ms / 1e9}
            except Exception as exc:
                row = {"mask": "docs", "kind": kind, "cfg": cfg, "error": f"{type(exc).__name__}: {exc}"[:200]}
            res.append(row)
            print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sweep_tiles.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="output folder (default $OUT or .)")
    ap.add_argument("--s", type=int, default=S_DEFAULT)
    ap.add_argument("--cases", default=",".join(CASES), help=f"subset of {','.join(CASES)}")
    ap.add_argument("--fwd-variants", default="", help="subset of FWD_VARIANTS (comma-separated; default all)")
    ap.add_argument("--bwd-variants", default="", help="subset of BWD_VARIANTS (comma-separated; default all)")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    ap.add_argument("--budget-s", type=float, default=250.0, help="skip what is left after this many seconds")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rep", type=int, default=30)
    ap.add_argument("--tiles", action="store_true", help="the older tile sweep (documents mask) instead")
    ap.add_argument("--dry-run", action="store_true", help="CPU, TRITON_INTERPRET=1, S=256, H=2, float32, no Flex")
    ap.add_argument("--aot", action="store_true", help="no GPU: compile for --arch, report smem/registers/spills")
    ap.add_argument("--arch", type=int, default=90, help="compute capability for --aot (90: H100)")
    args = ap.parse_args(argv)
    if args.aot:
        return main_aot(args)
    if args.dry_run:
        global DEV, DTYPE, H
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("--dry-run needs TRITON_INTERPRET=1", file=sys.stderr)
            return 1
        from longctx.launchers import sparse as ts

        ts.TMA_IN_INTERPRETER = True
        DEV, DTYPE, H = "cpu", torch.float32, 2
        args.s, args.no_flex, args.workers = 256, True, 0
        return main_variants(args)
    if not torch.cuda.is_available():
        print("sweep_sparse_configs: needs a CUDA GPU", file=sys.stderr)
        return 1
    return main_tiles(args) if args.tiles else main_variants(args)


if __name__ == "__main__":
    raise SystemExit(main())

"""Mask benchmarks: block-sparse attention and packed documents, ours (triton_sparse) vs FlexAttention.

Cases (B=1, H=16, D=128, bf16 by default): causal sliding window 4096 at S = 16K and 64K; packed documents
with random lengths 512..8192 (causal inside each) at 16K and 64K; random block layouts (block 128) at 10%
and 50% density and dense causal for scale, at 16K (``--layout-s 16384,65536`` adds 64K). FLOPs count only
the score entries the mask keeps: forward ``4 * B * H * S^2 * D * kept_fraction``, backward 2.5x that;
`triton.testing.do_bench` medians, backward timed alone (``autograd.grad`` of a saved graph). FlexAttention
runs compiled (``torch.compile``, dynamo's recompile limits raised) with its own ``create_block_mask`` of the
same mask_mod.
Also: the time to build each mask at 64K, ours vs ``create_block_mask``.

Writes ``<out-dir>/masks_<gpu>[<tag>].json`` and ``.md``, overwriting the previous run on that GPU.

    python -m longctx.bench.masks [--out-dir benchmarks/results] [--s 16384,65536] [--layout-s 16384] [--quick]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
import time

import torch

from longctx.bench import result_stem

__all__ = ["main"]


def _versions() -> dict:
    import triton

    return {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cudnn": str(torch.backends.cudnn.version()),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def _doc_ids(S: int, seed: int = 0, lo: int = 512, hi: int = 8192) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < S:
        lengths.append(int(torch.randint(lo, hi + 1, (1,), generator=g)))
    lengths[-1] -= sum(lengths) - S
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


def _random_layout(H: int, S: int, density: float, device="cpu") -> torch.Tensor:
    """The mask table's random block layout: (H, n, n) bool with n = ceil(S / 128), each block kept with
    probability ``density`` (CPU generator, seed 1, so every script that times it times the same blocks)."""
    n = -(-S // 128)
    return (torch.rand(H, n, n, generator=torch.Generator().manual_seed(1)) < density).to(device)


def _flex_setup():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    dyn = torch._dynamo.config
    dyn.cache_size_limit = max(dyn.cache_size_limit, 1024)
    if hasattr(dyn, "recompile_limit"):
        dyn.recompile_limit = max(dyn.recompile_limit, 1024)
    if hasattr(dyn, "accumulated_recompile_limit"):
        dyn.accumulated_recompile_limit = max(dyn.accumulated_recompile_limit, 4096)
    return create_block_mask, torch.compile(flex_attention, dynamic=False)


def _cases(seqs: list[int], layout_seqs: list[int], which: set[str]):
    import longctx.masks as bsm

    cases = []
    if "sliding" in which:
        for S in seqs:
            cases.append((f"sliding window 4096, S={S}", S, "sliding", bsm.sliding_window_mask(4096)))
    if "docs" in which:
        for S in seqs:
            ids = _doc_ids(S).cuda()
            mm = bsm.document_mask(ids) & bsm.causal_mask
            cases.append((f"documents 512..8192 causal, S={S}", S, "docs", mm))
    for S in layout_seqs:
        if "layout" in which:
            for dens in (0.1, 0.5):
                cases.append((f"random layout {int(dens * 100)}%, S={S}", S, f"layout{dens}", dens))
        if "causal" in which:
            cases.append((f"causal (for scale), S={S}", S, "causal", bsm.causal_mask))
    return cases


def _flex_layout_mask(lay: torch.Tensor, S: int):
    """FlexAttention's BlockMask of a block layout (H, n, n): every kept block full, built from kv blocks."""
    from torch.nn.attention.flex_attention import BlockMask as FlexBlockMask

    lay = lay[None]  # (1, H, n, n)
    num = lay.sum(-1, dtype=torch.int32)
    idx = torch.sort((~lay).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
    return FlexBlockMask.from_kv_blocks(torch.zeros_like(num), idx, num, idx, BLOCK_SIZE=128, seq_lengths=(S, S))


def _bench(fn, warmup: int, rep: int) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def _fwd_bwd_times(fwd, q, k, v, warmup, rep) -> tuple[float, float, float]:
    """(fwd ms, bwd ms, peak extra MiB of one fwd+bwd)."""
    with torch.no_grad():
        t_f = _bench(lambda: fwd(q, k, v), warmup, rep)
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fwd(qq, kk, vv)
    do = torch.randn_like(out)
    torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    t_b = _bench(lambda: torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True), warmup, rep)
    return t_f, t_b, peak


def _build_time(fn, n: int = 3) -> float:
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return 1000 * sorted(ts)[len(ts) // 2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m longctx.bench.masks", description=__doc__.splitlines()[0])
    ap.add_argument("--s", default="16384,65536", help="sequence lengths of the window/document cases")
    ap.add_argument("--layout-s", default="16384", help="sequence lengths of the layout/causal cases")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=25)
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--quick", action="store_true", help="S=16K only, short timing")
    ap.add_argument("--cases", default="sliding,docs,layout,causal", help="subset of sliding,docs,layout,causal")
    ap.add_argument("--no-build", action="store_true", help="skip the mask build timings")
    ap.add_argument("--build-s", type=int, default=65536, help="sequence length of the mask build timings")
    ap.add_argument("--out-dir", default=os.path.join("benchmarks", "results"))
    ap.add_argument("--tag", default="", help="suffix naming what the run covers (e.g. _64k), not when")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("longctx.bench.masks: needs a CUDA GPU", file=sys.stderr)
        return 1
    import longctx
    import longctx.masks as bsm
    from longctx.launchers.sparse import sparse_forward
    from longctx.ops.sparse import triton_sparse_attention

    seqs = [int(x) for x in args.s.split(",") if x]
    if args.quick:
        seqs, args.warmup, args.rep = [16384], 10, 30
    meta = _versions()
    print(f"{meta['gpu']}  torch {meta['torch']}  triton {meta['triton']}", flush=True)
    H, D, dtype = args.heads, args.d, torch.bfloat16
    scale = D**-0.5
    create_block_mask, flex = (None, None) if args.no_flex else _flex_setup()
    rows = []
    layout_seqs = [int(x) for x in args.layout_s.split(",") if x]
    for label, S, kind, spec in _cases(seqs, layout_seqs, set(args.cases.split(","))):
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(1, H, S, D, device="cuda", dtype=dtype, generator=g) for _ in range(3))
        if kind.startswith("layout"):
            lay = _random_layout(H, S, spec, "cuda")
            bm = longctx.BlockMask.from_layout(lay, 128, S, S)
            H_mask = H
        else:
            mm = spec
            bm = longctx.block_mask(mm, None, None, S, S, device="cuda")
            H_mask = None
        kept = bm.kept_fraction()
        flops = 4 * H * S * S * D * kept
        row = {"case": label, "S": S, "kept_fraction": kept, "block_density": bm.block_density()}

        def ours(a, b, c, bm=bm):
            if not a.requires_grad:
                return sparse_forward(a, b, c, scale=scale, block_mask=bm)[0]
            return triton_sparse_attention(a, b, c, scale=scale, block_mask=bm)[0]

        try:
            tf, tb, mem = _fwd_bwd_times(ours, q, k, v, args.warmup, args.rep)
            row.update(
                ours_fwd_ms=tf, ours_bwd_ms=tb, ours_fwd_tflops=flops / tf / 1e9, ours_bwd_tflops=2.5 * flops / tb / 1e9
            )
            row["ours_peak_mib"] = mem
        except Exception as exc:  # report and go on
            row["ours_error"] = f"{type(exc).__name__}: {exc}"[:300]
        if flex is not None:
            try:
                if H_mask is None:
                    fbm = create_block_mask(mm, None, None, S, S, device="cuda", BLOCK_SIZE=128)
                else:
                    fbm = _flex_layout_mask(lay, S)

                def fl(a, b, c, fbm=fbm):
                    return flex(a, b, c, block_mask=fbm, scale=scale)

                tf, tb, mem = _fwd_bwd_times(fl, q, k, v, args.warmup, args.rep)
                row.update(flex_fwd_ms=tf, flex_bwd_ms=tb, flex_fwd_tflops=flops / tf / 1e9)
                row.update(flex_bwd_tflops=2.5 * flops / tb / 1e9, flex_peak_mib=mem)
            except Exception as exc:
                row["flex_error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
        print(json.dumps(row), flush=True)
        del q, k, v, bm
        torch.cuda.empty_cache()

    # -- mask build time --
    S = args.build_s
    ids = _doc_ids(S).cuda()
    builds = {
        "sliding window 4096": bsm.sliding_window_mask(4096),
        "documents & causal": bsm.document_mask(ids) & bsm.causal_mask,
    }
    build_rows = []
    for name, mm in builds.items() if not args.no_build else []:
        r = {"mask": name, "S": S}
        r["ours_ms"] = _build_time(lambda mm=mm: longctx.block_mask(mm, None, None, S, S, device="cuda"))
        r["ours_general_path_ms"] = _build_time(
            lambda mm=mm: longctx.block_mask(mm.fn, None, None, S, S, device="cuda"), n=1
        )
        if create_block_mask is not None:
            try:
                r["flex_ms"] = _build_time(lambda mm=mm: create_block_mask(mm, None, None, S, S, device="cuda"), n=1)
            except Exception as exc:
                r["flex_error"] = f"{type(exc).__name__}: {exc}"[:300]
            try:
                cbm = torch.compile(create_block_mask)
                fn = lambda mm=mm, cbm=cbm: cbm(mm, None, None, S, S, device="cuda")  # noqa: E731
                r["flex_compiled_ms"] = _build_time(fn, n=3)
            except Exception as exc:
                r["flex_compiled_error"] = f"{type(exc).__name__}: {exc}"[:300]
        build_rows.append(r)
        print(json.dumps(r), flush=True)

    os.makedirs(args.out_dir, exist_ok=True)
    stem = result_stem(args.out_dir, "masks", meta["gpu"], args.tag)
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "cases": rows, "mask_build": build_rows}, f, indent=1)
    md = _markdown(rows, build_rows, meta, H, D)
    with open(stem + ".md", "w") as f:
        f.write(md)
    print(md)
    return 0


def _f(x, nd=0) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _markdown(rows, build_rows, meta, H, D) -> str:
    out = [
        f"# Mask benchmarks: triton_sparse vs FlexAttention ({meta['gpu']})",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}, cuDNN {meta['cudnn']}, {meta['date']}. "
        f"B=1, H={H}, D={D}, bf16; TFLOP/s over the kept score entries (backward = 2.5x forward FLOPs, timed "
        "alone); `triton.testing.do_bench` medians. Flex: compiled flex_attention with its own create_block_mask.",
        "",
        "| case | kept | ours fwd / bwd TFLOP/s | Flex fwd / bwd TFLOP/s | ours fwd / bwd ms | Flex fwd / bwd ms "
        "| speed-up fwd / bwd | peak MiB ours / Flex |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        sf = sb = None
        if r.get("flex_fwd_ms") and r.get("ours_fwd_ms"):
            sf, sb = r["flex_fwd_ms"] / r["ours_fwd_ms"], r["flex_bwd_ms"] / r["ours_bwd_ms"]
        out.append(
            f"| {r['case']} | {r['kept_fraction']:.3f} | {_f(r.get('ours_fwd_tflops'))} / "
            f"{_f(r.get('ours_bwd_tflops'))} | {_f(r.get('flex_fwd_tflops'))} / {_f(r.get('flex_bwd_tflops'))} | "
            f"{_f(r.get('ours_fwd_ms'), 2)} / {_f(r.get('ours_bwd_ms'), 2)} | {_f(r.get('flex_fwd_ms'), 2)} / "
            f"{_f(r.get('flex_bwd_ms'), 2)} | {_f(sf, 2)}x / {_f(sb, 2)}x | {_f(r.get('ours_peak_mib'))} / "
            f"{_f(r.get('flex_peak_mib'))} |"
        )
        for key in ("ours_error", "flex_error"):
            if key in r:
                out.append(f"|  {key}: {r[key]} |||||||")
    out += [
        "",
        "Mask build time (ms, median, after a warm-up call):",
        "",
        "| mask | S | ours (analytic) | ours (general mask_mod path) | Flex create_block_mask "
        "| torch.compile(create_block_mask) |",
        "|---|---|---|---|---|---|",
    ]
    for r in build_rows:
        out.append(
            f"| {r['mask']} | {r['S']} | {_f(r.get('ours_ms'), 1)} | {_f(r.get('ours_general_path_ms'), 1)} | "
            f"{_f(r.get('flex_ms'), 1)} | {_f(r.get('flex_compiled_ms'), 1)} |"
        )
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())

"""Where the 10% block layout loses against causal (issue 4's 5x ratio; benchmarks/NOTES.md, session 10).

Two questions, timed in one process (S=16K, H=16, D=128, bf16, as `longctx.bench.masks`):

1. Call vs kernel. For the 10% layout and causal, forward and backward: the call's time as the mask table takes
   it (`triton.testing.do_bench`), each CUDA kernel's time per call (`torch.profiler`), and the host's time to
   issue one call. The difference between the call and its main kernel is work that does not shrink with the
   mask (the backward's Delta pass, the zeroed float32 dQ and its conversion, the schedule, the launch).
2. Per work item. Layouts with exactly ``k`` kept blocks in every query row and every key column (circulant:
   block (r, (r + o_j) mod n) for k offsets o_j), scattered (random offsets) or contiguous (offsets 0..k-1);
   the main kernels' time per kept block against 1/k gives the fixed cost of a work item (in block-times) and
   the steady cost of a block; scattered vs contiguous prices the K/V locality.

    python benchmarks/diag_items.py [--json out.json] [--ks 4,8,13,26,64] [--skip-items]
    python benchmarks/diag_items.py --summary out.json   # call / kernel / other GPU / host us per mask
    python benchmarks/diag_items.py --ratio 5 [--json r.json]   # causal / 10% layout, interleaved rounds
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch


def _profile(fn, n: int) -> dict[str, float]:
    """Microseconds per call of each CUDA kernel ``fn`` launches (``n`` calls under the profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = e.cuda_time_total
        if t > 0 and e.count >= n:  # the calls' kernels (a profiler's own event has no device time)
            out[e.key[:80]] = out.get(e.key[:80], 0.0) + t / n
    return out


def _host_us(fn, n: int) -> float:
    """Microseconds the host takes to issue one call (GPU queue not full: ``n`` small)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return 1e6 * (t1 - t0) / n


def _circulant(n: int, k: int, scattered: bool, seed: int) -> torch.Tensor:
    """(n, n) bool: k kept blocks in every row and column, at offsets 0..k-1 or k random distinct offsets."""
    g = torch.Generator().manual_seed(seed)
    offs = torch.randperm(n, generator=g)[:k] if scattered else torch.arange(k)
    r = torch.arange(n)[:, None]
    lay = torch.zeros(n, n, dtype=torch.bool)
    lay[r.expand(n, k), (r + offs[None, :]) % n] = True
    return lay


def _table_masks(S: int, H: int) -> dict:
    """The mask table's 10% random layout and causal at ``S`` (`longctx.bench.masks`), on the GPU."""
    import longctx
    import longctx.masks as bsm
    from longctx.bench.masks import _random_layout

    return {
        "layout 10%": longctx.BlockMask.from_layout(_random_layout(H, S, 0.1, "cuda"), 128, S, S),
        "causal": longctx.block_mask(bsm.causal_mask, None, None, S, S, device="cuda"),
    }


def _kept_blocks(bm, H: int) -> int:
    """Kept (non-empty) 128 x 128 blocks over all ``H`` heads of a B=1 mask (heads broadcast or per head)."""
    return int((bm.block_kind > 0).sum()) * (H if bm.block_kind.shape[1] == 1 else 1)


def trace(fwd, n_sm: int) -> dict:
    """One forward with `triton_sparse.WS_TRACE`: medians over the work items after each CTA's first (SM clock
    cycles) of Q wait (item start -> Q ready), tiles (Q ready -> last tile done), epilogue (-> output written)
    and gap (output written -> next item's start), per warpgroup pair."""
    from longctx.kernels.gluon import flash_sparse_ws as sws
    from longctx.launchers import sparse as ts

    buf = torch.zeros((n_sm, 2, int(sws.TRACE_ITEMS), 4), dtype=torch.int64, device="cuda")
    ts.WS_TRACE = buf
    try:
        fwd()
        torch.cuda.synchronize()
    finally:
        ts.WS_TRACE = None
    t = buf.cpu().double()
    seen = t[..., 0] != 0  # (cta, wg, item)
    segs = {"q_wait": t[..., 1] - t[..., 0], "tiles": t[..., 2] - t[..., 1], "epilogue": t[..., 3] - t[..., 2]}
    gap = torch.zeros_like(t[..., 0])
    gap[..., 1:] = t[..., 1:, 0] - t[..., :-1, 3]
    segs["gap"] = gap
    later = seen.clone()
    later[..., 0] = False
    out = {name: float(v[later].median()) for name, v in segs.items()}
    out["first_q_wait"] = float(segs["q_wait"][..., 0][seen[..., 0]].median())
    out["items_per_cta"] = float(seen[:, 0].sum(-1).double().mean())
    per_cta = t[:, :, :, 3].amax((1, 2)) - torch.where(seen, t[..., 0], float("inf")).amin((1, 2))
    out["cta_span_median"] = float(per_cta.median())
    out["cta_span_max"] = float(per_cta.max())  # (each SM's own clock: spans compare, start times do not)
    out["tiles_share"] = float(segs["tiles"][seen].sum() / per_cta.sum() / 2)  # of the warpgroups' time
    return out


def _ratio(causal, layout, q, k, v, qq, kk, vv, scale, args) -> int:
    """Causal's time over the 10% layout's, forward and backward, call (`do_bench`) and main kernel (profiler), in
    ``args.ratio`` interleaved rounds (the two cases alternate, so drift between them cancels); the medians."""
    import statistics

    from longctx.bench.masks import _bench
    from longctx.launchers import sparse as ts

    def sides(bm):
        out = ts.triton_sparse_attention(qq, kk, vv, scale=scale, block_mask=bm)[0]
        do = torch.randn_like(out)
        fwd = lambda: ts.sparse_forward(q, k, v, scale=scale, block_mask=bm)  # noqa: E731
        bwd = lambda: torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True)  # noqa: E731
        return {"fwd": fwd, "bwd": bwd}

    fns = {"causal": sides(causal), "layout": sides(layout)}
    for _ in range(300):
        fns["layout"]["fwd"]()
    rounds = []
    for r in range(args.ratio):
        row = {"round": r}
        for name, f in fns.items():
            for side, fn in f.items():
                with torch.no_grad() if side == "fwd" else torch.enable_grad():
                    row[f"{name}_{side}_call_ms"] = _bench(fn, 10, 50)
                    kern = _profile(fn, 10)
                row[f"{name}_{side}_kernel_us"] = max(kern.values())
        for side in ("fwd", "bwd"):
            row[f"{side}_call_ratio"] = row[f"causal_{side}_call_ms"] / row[f"layout_{side}_call_ms"]
            row[f"{side}_kernel_ratio"] = row[f"causal_{side}_kernel_us"] / row[f"layout_{side}_kernel_us"]
        rounds.append(row)
        print(json.dumps(row), flush=True)
    med = {key: statistics.median(r[key] for r in rounds) for key in rounds[0] if key != "round"}
    print("medians: " + json.dumps({key: round(val, 4) for key, val in med.items()}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": rounds, "medians": med}, f, indent=1)
    return 0


def summary(path: str) -> None:
    """One line per mask of a ``--json`` file: call / main kernel / other kernels / host time (us), fwd and bwd."""
    with open(path) as f:
        rows = json.load(f)
    for r in rows:
        if "error" in r:
            print(f"{r['mask']:24s} {r['error']}")
            continue
        cols = []
        for side in ("fwd", "bwd"):
            x = r[side]
            other = sum(x["other_kernels_us"].values())
            cols.append(
                f"{side} {1000 * x['call_ms']:6.0f} / {x['main_us']:6.0f} / {other:4.0f} / {x['host_us']:5.0f} "
                f"({x['us_per_block']:.2f} us/blk)"
            )
        print(f"{r['mask']:24s} {r.get('tag', ''):8s} " + " | ".join(cols))
        if "trace" in r:
            tr = r["trace"]
            print("    trace (cycles, medians): " + ", ".join(f"{k} {v:.0f}" for k, v in tr.items()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--summary", default=None, help="print the summary of a --json file and exit")
    ap.add_argument("--s", type=int, default=16384)
    ap.add_argument("--ks", default="4,8,13,26,64")
    ap.add_argument("--n-prof", type=int, default=20)
    ap.add_argument("--skip-items", action="store_true")
    ap.add_argument("--scattered-only", action="store_true")
    ap.add_argument("--trace", action="store_true", help="also the forward's per-item clock trace")
    ap.add_argument("--ratio", type=int, default=0, help="R rounds of causal vs the 10%% layout, interleaved")
    ap.add_argument("--tag", default=os.environ.get("DIAG_TAG", ""))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.summary:
        summary(args.summary)
        return 0
    import longctx
    from longctx.bench.masks import _bench
    from longctx.launchers import sparse as ts

    S, H, D = args.s, 16, 128
    n = S // 128
    scale = D**-0.5
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    masks = _table_masks(S, H)
    if not args.skip_items:
        for kb in (int(x) for x in args.ks.split(",") if x):
            for scat in (True,) if args.scattered_only else (True, False):
                lay = _circulant(n, kb, scat, seed=kb)
                name = f"k={kb} {'scattered' if scat else 'contiguous'}"
                masks[name] = longctx.BlockMask.from_layout(lay.cuda(), 128, S, S)
    if args.ratio:
        return _ratio(masks["causal"], masks["layout 10%"], q, k, v, qq, kk, vv, scale, args)
    first = next(iter(masks.values()))
    for _ in range(300):  # clocks up before the first timing
        ts.sparse_forward(q, k, v, scale=scale, block_mask=first)
    torch.cuda.synchronize()
    rows = []
    for name, bm in masks.items():
        kept = bm.kept_fraction()
        flops = 4 * H * S * S * D * kept
        tiles = _kept_blocks(bm, H)

        def fwd(bm=bm):
            return ts.sparse_forward(q, k, v, scale=scale, block_mask=bm)[0]

        out = ts.triton_sparse_attention(qq, kk, vv, scale=scale, block_mask=bm)[0]
        do = torch.randn_like(out)

        def bwd(out=out, do=do):
            return torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True)

        row = {"mask": name, "tag": args.tag, "kept": kept, "blocks": tiles}
        try:
            for side, fn, mult in (("fwd", fwd, 1.0), ("bwd", bwd, 2.5)):
                with torch.no_grad() if side == "fwd" else torch.enable_grad():
                    call_ms = _bench(fn, 25, 100)
                    kern = _profile(fn, args.n_prof)
                    host = _host_us(fn, 10)
                main = max(kern, key=kern.get)
                row[side] = {
                    "call_ms": call_ms,
                    "tflops": mult * flops / call_ms / 1e9,
                    "main_kernel": main,
                    "main_us": kern[main],
                    "main_tflops": mult * flops / kern[main] / 1e6,
                    "us_per_block": kern[main] * 132 / tiles,  # one SM's time per kept block (128 x 128)
                    "other_kernels_us": {kname: round(t, 1) for kname, t in kern.items() if kname != main},
                    "host_us": host,
                }
            if args.trace:
                row["trace"] = trace(fwd, torch.cuda.get_device_properties(0).multi_processor_count)
        except Exception as exc:  # report and go on
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

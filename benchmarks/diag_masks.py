"""Where the block-sparse kernels lose time on the mask table's short-list cases (benchmarks/NOTES.md, session 8).

S=16K, H=16, D=128, bf16, as `longctx.bench.masks`. For the packed documents and causal masks, beside each mask:
the same kept blocks as a layout (every block full: the same tiles, no element mask), which prices the partial
blocks; the backward with the work-ordered CTA schedule (``VARIANT["ws_sched"]``), which prices the tail. For the
10% random layout: a layout with the same number of blocks per query row, kept contiguous (the diagonal band),
which separates short lists from scattered ones. TFLOP/s over each mask's own kept entries (the as-full layouts
keep more entries; their column uses the original mask's count, so the columns compare times).

    python benchmarks/diag_masks.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def _as_full(bm, longctx):
    """The kept (full or partial) blocks of ``bm`` as a layout BlockMask: the same tiles, none masked."""
    return longctx.BlockMask.from_layout(bm.block_kind > 0, bm.block_size, bm.seq_len_q, bm.seq_len_kv)


def _band_like(lay):
    """A layout with each query row's count of kept blocks, kept contiguous: blocks [r - n + 1, r] clipped to the
    row's start (then extended to the right)."""
    H, n, _ = lay.shape
    cnt = lay.sum(-1)  # (H, n)
    cols = torch.arange(n)
    rows = torch.arange(n)[None, :]
    start = (rows - cnt + 1).clamp(min=0)
    return (cols >= start[..., None]) & (cols < (start + cnt)[..., None])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--s", type=int, default=16384)
    ap.add_argument("--warmup", type=int, default=25)
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import longctx
    import longctx.masks as bsm
    from longctx.bench.masks import _doc_ids, _fwd_bwd_times, _random_layout
    from longctx.launchers import sparse as ts

    S, H, D = args.s, 16, 128
    scale = D**-0.5
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    ids = _doc_ids(S).cuda()
    lay10 = _random_layout(H, S, 0.1)
    docs = longctx.block_mask(bsm.document_mask(ids) & bsm.causal_mask, None, None, S, S, device="cuda")
    causal = longctx.block_mask(bsm.causal_mask, None, None, S, S, device="cuda")
    masks = {
        "docs": docs,
        "docs as full blocks": _as_full(docs, longctx),
        "causal": causal,
        "causal as full blocks": _as_full(causal, longctx),
        "layout 10%": longctx.BlockMask.from_layout(lay10.cuda(), 128, S, S),
        "layout 10% as bands": longctx.BlockMask.from_layout(_band_like(lay10).cuda(), 128, S, S),
    }
    flops_of = {"docs": docs.kept_fraction(), "causal": causal.kept_fraction()}
    rows = []
    for name, bm in masks.items():
        kept = flops_of.get(name.split(" as ")[0], bm.kept_fraction())
        flops = 4 * H * S * S * D * kept

        def ours(a, b, c, bm=bm):
            if not a.requires_grad:
                return ts.sparse_forward(a, b, c, scale=scale, block_mask=bm)[0]
            return ts.triton_sparse_attention(a, b, c, scale=scale, block_mask=bm)[0]

        default = ts.VARIANT["ws_sched"]
        for sched in (False, True):
            ts.VARIANT["ws_sched"] = sched
            try:
                tf, tb, _ = _fwd_bwd_times(ours, q, k, v, args.warmup, args.rep)
                row = {"mask": name, "sched": sched, "kept": bm.kept_fraction(), "fwd_ms": tf, "bwd_ms": tb,
                       "fwd_tflops": flops / tf / 1e9, "bwd_tflops": 2.5 * flops / tb / 1e9}  # fmt: skip
            except Exception as exc:  # report and go on
                row = {"mask": name, "sched": sched, "error": f"{type(exc).__name__}: {exc}"[:300]}
            finally:
                ts.VARIANT["ws_sched"] = default
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How long one rank takes to plan a packed batch for context parallelism, on this CPU: the dispatcher's layout
(`placement.plan_layout`), the p2p needs (`placement.plan_needs`) and each method's step tables for rank 0 (the ring's
`ring_plan`, the all-gather's `_gather_plan`, p2p's `routes`), for long-tailed document mixes (log-normal lengths).
The collective check of `dispatch_plan` (one small gloo all-gather) is not in it. The first call of each shape warms
Python's caches; the figures are the median of the repeats after it.

    python dev/plan_build_time.py                      # 1M tokens, 10K documents, 4 and 8 ranks
    python dev/plan_build_time.py --tokens 131072 --docs 500
"""

from __future__ import annotations

import argparse
import random
import statistics
import time


def mix(total: int, n: int, seed: int) -> list[int]:
    rnd = random.Random(seed)
    w = [rnd.lognormvariate(0, 1.2) for _ in range(n)]
    s = sum(w)
    lens = [max(1, int(total * x / s)) for x in w]
    lens[-1] += total - sum(lens)
    cu = [0]
    for n_ in lens:
        cu.append(cu[-1] + n_)
    return cu


def main() -> None:
    from longctx.distributed.allgather import _gather_plan
    from longctx.distributed.blocks import Documents
    from longctx.distributed.doc_ring import ring_plan
    from longctx.distributed.p2p import routes
    from longctx.distributed.placement import doc_band, plan_layout, plan_needs
    from longctx.masks import normalize_window

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1 << 20)
    ap.add_argument("--docs", type=int, default=10000)
    ap.add_argument("--ranks", default="4,8")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    win = normalize_window(None)
    for world in (int(x) for x in args.ranks.split(",")):
        parts: dict[str, list[float]] = {}
        for rep in range(args.repeats + 1):
            cu = mix(args.tokens, args.docs, seed=rep)
            docs = Documents(tuple(cu), doc_band(True, win))
            t = [time.perf_counter()]
            layout, _, _ = plan_layout(cu, world, causal=True, window=win)
            t.append(time.perf_counter())
            needs = plan_needs(cu, layout, causal=True, window=win)
            t.append(time.perf_counter())
            ring_plan(docs, layout.chunks, 0)
            t.append(time.perf_counter())
            _gather_plan(docs, layout.chunks, 0)
            t.append(time.perf_counter())
            routes(layout, needs, docs, 0)
            t.append(time.perf_counter())
            if rep == 0:
                continue  # warm-up
            for name, a, b in zip(("layout", "needs", "ring", "allgather", "p2p"), t, t[1:]):
                parts.setdefault(name, []).append(1e3 * (b - a))
        med = {k: statistics.median(v) for k, v in parts.items()}
        print(
            f"{args.tokens:,} tokens, {args.docs:,} documents, {world} ranks: layout {med['layout']:.1f} ms, needs "
            f"{med['needs']:.1f}, step tables ring {med['ring']:.1f} / allgather {med['allgather']:.1f} / p2p "
            f"{med['p2p']:.1f}; a rank of one method at most "
            f"{med['layout'] + med['needs'] + max(med['ring'], med['allgather'], med['p2p']):.1f} ms"
        )


if __name__ == "__main__":
    main()

"""Host (CPU) time of one block-sparse forward and backward call, by function (cProfile; 10% layout, S=16K, H=16,
D=128, bf16, as `longctx.bench.masks`). Session 10 found the short-list calls host-bound (benchmarks/NOTES.md).

    python benchmarks/host_profile.py [--n 200] [--out prefix]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import longctx
    from longctx.bench.masks import _random_layout
    from longctx.launchers import sparse as ts

    S, H, D = 16384, 16, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    bm = longctx.BlockMask.from_layout(_random_layout(H, S, 0.1, "cuda"), 128, S, S)
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    out = ts.triton_sparse_attention(qq, kk, vv, scale=D**-0.5, block_mask=bm)[0]
    do = torch.randn_like(out)
    calls = {
        "fwd": lambda: ts.sparse_forward(q, k, v, scale=D**-0.5, block_mask=bm),
        "bwd": lambda: torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True),
    }
    for name, fn in calls.items():
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.n):
            fn()
            torch.cuda.synchronize()
        prof.disable()
        st = pstats.Stats(prof)
        print(f"== {name}: {args.n} calls (each followed by a synchronize) ==")
        st.sort_stats("tottime").print_stats(30)
        st.sort_stats("cumulative").print_stats(40)
        if args.out:
            st.dump_stats(f"{args.out}_{name}.pstats")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Tile-config sweep of the triton_sparse kernels (developer tool): one kernel kind at a time, the others fixed.

    PYTHONPATH=src python benchmarks/sweep_sparse_configs.py [--out sweep.json]

Times the forward, dK/dV and dQ kernels on the documents mask (lengths 512..8192, causal) at S=16K (B=1, H=16,
D=128, bf16) for each (BLOCK_M, BLOCK_N, num_warps, num_stages) candidate, to choose the default tables.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ["LONGCTX_TRITON_AUTOTUNE"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402

import longctx  # noqa: E402
from longctx import block_sparse as bsm  # noqa: E402
from longctx.bench.masks import _doc_ids  # noqa: E402
from longctx.ops import triton_sparse as ts  # noqa: E402

CANDIDATES = {
    "fwd": [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3)],
    "dkdv": [(64, 128, 8, 2), (32, 128, 8, 3), (64, 128, 8, 3), (32, 128, 4, 3), (64, 64, 4, 3), (32, 64, 4, 4)],
    "dq": [(128, 64, 8, 2), (128, 32, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3), (64, 32, 4, 4)],
}
DEFAULT = {"fwd": (128, 64, 8, 3), "dkdv": (64, 128, 8, 2), "dq": (128, 64, 8, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="sweep.json")
    ap.add_argument("--s", type=int, default=16384)
    args = ap.parse_args()
    S, H, D = args.s, 16, 128
    choice = dict(DEFAULT)
    ts._tile_choices = lambda kind, bd, mask_bs: [choice[kind]]
    masks = {"docs": bsm.document_mask(_doc_ids(S).cuda()) & bsm.causal_mask}
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    res = []
    for mname, mm in masks.items():
        bm = longctx.block_mask(mm, None, None, S, S, device="cuda")
        flops = 4 * H * S * S * D * bm.kept_fraction()
        out, lse = ts.sparse_forward(q, k, v, scale=D**-0.5, block_mask=bm)
        for kind, cands in CANDIDATES.items():
            for cfg in cands:
                choice.update(DEFAULT)
                choice[kind] = cfg
                try:
                    if kind == "fwd":
                        fn = lambda bm=bm: ts.sparse_forward(q, k, v, scale=D**-0.5, block_mask=bm)  # noqa: E731
                    else:
                        fn = lambda bm=bm, o=out, l=lse: ts.sparse_backward(  # noqa: E731
                            do, q, k, v, o, l, scale=D**-0.5, block_mask=bm
                        )
                    ms = triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")
                    f = flops * (1.0 if kind == "fwd" else 2.5)
                    row = {"mask": mname, "kind": kind, "cfg": cfg, "ms": ms, "tflops": f / ms / 1e9}
                except Exception as exc:
                    row = {"mask": mname, "kind": kind, "cfg": cfg, "error": f"{type(exc).__name__}: {exc}"[:200]}
                res.append(row)
                print(json.dumps(row), flush=True)
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()

"""Dense bands through the dense kernels or through the block-sparse ones: for causal masks at 1K-16K and causal
windows on 16K tokens, the launchers' kernel time (and wall time) of `launchers.flash.triton_forward` /
`triton_backward` against `launchers.sparse.sparse_forward` / `sparse_backward` on the band as a `BlockMask` (the
persistent warp-specialised kernels). Decides which lengths and windows the dense launchers hand to the block-sparse
kernels. Outputs and gradients of the two are compared (max abs difference, bf16). Batch x S = 16K tokens.

    PYTHONPATH=src python dev/band_routes.py --out routes.json
"""

from __future__ import annotations

import argparse
import json

import torch


def _calls(name: str, q, k, v, do, scale: float, band, bm):
    """(forward, backward of (out, lse)) through the dense kernels (the launchers with the band kept on them) or the
    block-sparse ones."""
    from longctx import tuning
    from longctx.launchers import flash, sparse

    def dense_fwd():
        with tuning.override(band_sparse=False):
            return flash.triton_forward(q, k, v, scale=scale, band=band)

    def dense_bwd(out, lse):
        def run():
            with tuning.override(band_sparse=False):
                return flash.triton_backward(do, q, k, v, out, lse, scale=scale, band=band)

        return run

    if name == "dense":
        return dense_fwd, dense_bwd
    return (
        lambda: sparse.sparse_forward(q, k, v, scale=scale, block_mask=bm),
        lambda out, lse: lambda: sparse.sparse_backward(do, q, k, v, out, lse, scale=scale, block_mask=bm),
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default="64x16x4,64x32x32,128x16x16", help="DxHqxHkv,...")
    ap.add_argument("--s", default="1024,2048,4096,8192,16384", help="causal lengths")
    ap.add_argument("--windows", default="128,512,1024,2048,4096", help="causal windows on 16K tokens")
    args = ap.parse_args(argv)
    import triton

    from longctx.masks import Band
    from longctx.masks.build import band_block_mask
    from short_attention import _kernel_ms  # the profiler's kernel time, as there (dev/ is the script's directory)

    shapes = [tuple(int(x) for x in sh.split("x")) for sh in args.shapes.split(",")]
    cases = [(int(S), None) for S in args.s.split(",") if S]
    cases += [(16384, int(w)) for w in args.windows.split(",") if w]
    rows = []
    torch.manual_seed(0)
    for D, hq, hkv in shapes:
        for S, w in cases:
            B = max(1, args.tokens // S)
            band = Band(None, 0) if w is None else Band(-(w - 1), 0)
            q = torch.randn(B, hq, S, D, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(B, hkv, S, D, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(B, hkv, S, D, device="cuda", dtype=torch.bfloat16)
            do = torch.randn_like(q)
            bm = band_block_mask(band, S, S, 128, q.device)
            scale = D**-0.5
            area = band.kept_fraction(S, S) * S * S
            flops = 4.0 * B * hq * area * D
            row = {"D": D, "Hq": hq, "Hkv": hkv, "S": S, "B": B, "window": w}
            res = {}
            for name in ("dense", "sparse"):
                fwd, bwd_of = _calls(name, q, k, v, do, scale, band, bm)
                out, lse = fwd()
                bwd = bwd_of(out, lse)
                grads = bwd()
                res[name] = (out, *grads)
                f_ms = triton.testing.do_bench(fwd, warmup=25, rep=100, return_mode="median")
                b_ms = triton.testing.do_bench(bwd, warmup=25, rep=100, return_mode="median")
                fk, bk = _kernel_ms(fwd), _kernel_ms(bwd)
                row[name] = {
                    "fwd_ms": round(f_ms, 4), "bwd_ms": round(b_ms, 4), "fwd_kernel_ms": round(fk, 4),
                    "bwd_kernel_ms": round(bk, 4), "fwd_kernel_tflops": round(flops / fk * 1e-9, 1),
                    "bwd_kernel_tflops": round(2.5 * flops / bk * 1e-9, 1),
                }  # fmt: skip
            row["max_diff"] = [
                float(f"{(a.float() - b.float()).abs().max().item():.3g}") for a, b in zip(res["dense"], res["sparse"])
            ]
            row["sparse_over_dense_kernel"] = [
                round(row["dense"]["fwd_kernel_ms"] / row["sparse"]["fwd_kernel_ms"], 3),
                round(row["dense"]["bwd_kernel_ms"] / row["sparse"]["bwd_kernel_ms"], 3),
            ]
            print(json.dumps(row), flush=True)
            rows.append(row)
            if args.out:
                with open(args.out, "w") as f:
                    meta = {
                        "gpu": torch.cuda.get_device_name(),
                        "torch": torch.__version__,
                        "triton": triton.__version__,
                    }
                    json.dump({**meta, "rows": rows}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

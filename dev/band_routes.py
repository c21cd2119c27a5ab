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


def _split_gqa(q, k, v, do, scale: float, bm, ref: tuple, flops: float) -> dict:
    """The block-sparse backward of a grouped call run as if every query head had its own kv head: K/V repeated
    to Hq heads, dK / dV summed back per group. Kernel time of the backward alone and of the repeat + sum around it;
    the gradients against the grouped backward's (``ref``: out, dq, dk, dv)."""
    from longctx.launchers import sparse
    from short_attention import _kernel_ms

    g = q.shape[1] // k.shape[1]
    kr, vr = (t.repeat_interleave(g, dim=1) for t in (k, v))
    out, lse = sparse.sparse_forward(q, kr, vr, scale=scale, block_mask=bm)
    bwd = lambda: sparse.sparse_backward(do, q, kr, vr, out, lse, scale=scale, block_mask=bm)  # noqa: E731
    dq, dk, dv = bwd()
    B, H, S, D = dk.shape

    def around():
        a, b = (t.repeat_interleave(g, dim=1) for t in (k, v))
        return a, b, dk.view(B, H // g, g, S, D).sum(2), dv.view(B, H // g, g, S, D).sum(2)

    sums = around()[2:]
    bk, ak = _kernel_ms(bwd), _kernel_ms(around)
    diff = [float(f"{(a.float() - b.float()).abs().max().item():.3g}") for a, b in zip((dq, *sums), ref[1:])]
    return {"bwd_kernel_ms": round(bk, 4), "bwd_kernel_tflops": round(2.5 * flops / bk * 1e-9, 1),
            "repeat_and_sum_ms": round(ak, 4), "max_diff_vs_grouped": diff}  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default="64x16x4,64x32x32,128x16x16", help="DxHqxHkv,...")
    ap.add_argument("--s", default="1024,2048,4096,8192,16384", help="causal lengths")
    ap.add_argument("--windows", default="128,512,1024,2048,4096", help="causal windows on 16K tokens")
    ap.add_argument(
        "--split-gqa", action="store_true",
        help="grouped shapes also: the block-sparse backward with K/V repeated to every query head (one kv head "
        "per query head, as the kernel would run with items split per query head), its kernel time apart from the "
        "repeat and the per-group sum of dK / dV",
    )  # fmt: skip
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
            if args.split_gqa and hq != hkv:
                row["sparse_split"] = _split_gqa(q, k, v, do, scale, bm, res["sparse"], flops)
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

"""Tile/variant sweep of the triton backend's kernels on one GPU (a tuning aid; results go to NOTES.md).

Times the forward and backward of ``longctx.launchers.flash`` at forced tile configs and kernel variants
(pointer loads vs TMA descriptors, warp specialisation, atomic vs separate dQ) so one device call compares
many versions. Each variant is compiled and timed in isolation; a variant that fails to compile is reported
and skipped.

    PYTHONPATH=src python benchmarks/sweep_triton.py --d 128 --s 8192 --what fwd,bwd
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", default="64,128,256")
    ap.add_argument("--s", default="8192")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--what", default="fwd,bwd")
    ap.add_argument("--fwd-configs", default="", help="semicolon list of bm,bn,w,s (default: a small grid)")
    ap.add_argument("--bwd-configs", default="", help="semicolon list of bm,bn,w,s for the dK/dV kernel")
    ap.add_argument(
        "--variants",
        default="ptr,tma,tma_pipe",
        help="forward variants (ptr, tma, tma_ws, tma_pipe; a +host suffix: host-built descriptors, TMA_HOST)",
    )
    ap.add_argument(
        "--bwd-variants",
        default="ptr,dqtma",
        help="atomic-dQ dK/dV variants: ptr (pointer loads, scalar atomics), tma (TMA q/dO loads), "
        "dqtma (dQ added by TMA reduce), tma+dqtma",
    )
    ap.add_argument("--gqa", action="store_true", help="Hq=32, Hkv=8 (D=128 only) instead of heads x D = 2048")
    ap.add_argument("--layout", default="bhsd", choices=("bhsd", "bshd"), help="bshd: flash_attn_func's layout")
    ap.add_argument(
        "--sep-configs",
        default="",
        help="separate-dQ path at forced tiles: semicolon list of dkdv/dq pairs, e.g. 64,128,8,2/128,64,8,2",
    )
    ap.add_argument("--no-autotuned", action="store_true", help="skip the autotuned separate path")
    ap.add_argument("--rep", type=int, default=40)
    args = ap.parse_args(argv)

    import triton

    from longctx.launchers import flash as tf

    tf._set_tma_allocator()
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)

    def cfgs(text, default):
        if not text:
            return default
        return [tuple(int(x) for x in c.split(",")) for c in text.split(";") if c]

    for D, S, causal in itertools.product(
        [int(x) for x in args.d.split(",")],
        [int(x) for x in args.s.split(",")],
        [bool(int(c)) for c in args.causal.split(",")],
    ):
        _sweep_case(args, cfgs, D, S, causal)
        torch.cuda.empty_cache()
    return 0


def _sweep_case(args, cfgs, D: int, S: int, causal: bool) -> None:
    import triton

    from longctx.bench.attention import Case, _inputs
    from longctx.launchers import flash as tf
    from longctx.masks import Band

    B, H = max(1, 16384 // S), 2048 // D
    Hkv = H
    if args.gqa:
        H, Hkv = 32, 8
    # the benchmark's inputs (bshd: (B, S, H, D) memory viewed as (B, H, S, D)); dO in q's layout
    q, k, v = _inputs(Case(D, S, causal, H, Hkv, B), args.layout, torch.bfloat16)
    do = torch.randn_like(q)
    band = Band.from_args(S, S, causal=causal)
    flops = 4.0 * B * H * S * S * D * (0.5 if causal else 1.0)
    tag = f"D={D} S={S} {'causal' if causal else 'full'}{' GQA 32/8' if args.gqa else ''} {args.layout}"
    if "fwd" in args.what:
        default = {
            64: [(128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 4, 4), (64, 64, 4, 3)],
            128: [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2)],
            256: [(128, 64, 8, 2), (64, 64, 4, 2), (128, 32, 8, 2)],
        }[D]
        for cfg in cfgs(args.fwd_configs, default):
            for var in args.variants.split(","):
                tf.FORCE_CONFIG.clear()
                tf.EXTRA_KWARGS.clear()
                tf.FORCE_CONFIG["fwd"] = cfg
                base, _, extra = var.partition("+")  # e.g. "tma_pipe+host"
                tf.EXTRA_KWARGS["fwd"] = {
                    "USE_TMA": base.startswith("tma"),
                    "WARP_SPEC": base.endswith("ws"),
                    "PIPE_QK": base.endswith("pipe"),
                    "TMA_HOST": "host" in extra.split("+"),
                }
                t0 = time.time()
                try:
                    out, lse = tf._forward_impl(q, k, v, 1 / math.sqrt(D), band.lo, band.hi)
                    torch.cuda.synchronize()
                    ms = triton.testing.do_bench(
                        lambda: tf._forward_impl(q, k, v, 1 / math.sqrt(D), band.lo, band.hi),
                        warmup=5,
                        rep=args.rep,
                        return_mode="median",
                    )
                    print(
                        f"fwd {tag} {cfg} {var:7s} {flops / ms * 1e-9:6.0f} TFLOP/s ({time.time() - t0:.0f}s)",
                        flush=True,
                    )
                except Exception as exc:  # a variant that does not compile on this GPU/triton
                    print(f"fwd {tag} {cfg} {var:7s} FAILED {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        tf.FORCE_CONFIG.clear()
        tf.EXTRA_KWARGS.clear()
    if "bwd" in args.what:
        out, lse = tf._forward_impl(q, k, v, 1 / math.sqrt(D), band.lo, band.hi)
        default = {
            64: [(64, 128, 8, 3), (32, 128, 4, 3), (64, 64, 4, 3), (64, 128, 8, 2)],
            128: [(64, 128, 8, 2), (32, 128, 8, 3), (64, 64, 4, 3), (64, 128, 8, 3), (32, 128, 4, 2)],
            256: [(64, 64, 8, 2), (32, 64, 4, 2), (32, 128, 8, 2)],
        }[D]
        variants = [
            (False, cfg, bv) for cfg in cfgs(args.bwd_configs, default) for bv in args.bwd_variants.split(",") if bv
        ]
        if not args.no_autotuned:
            variants.append((True, None, "tma"))
        for pair in [p for p in args.sep_configs.split(";") if p]:
            a, b = pair.split("/")
            variants.append((True, (tuple(int(x) for x in a.split(",")), tuple(int(x) for x in b.split(","))), ""))
        for det, cfg, bv in variants:
            tf.FORCE_CONFIG.clear()
            tf.EXTRA_KWARGS.clear()
            # atomic variants run the atomic-dQ kernel for every band (the launcher's rule would send causal
            # bands at D=128 to the separate path); "separate" is the deterministic path, autotuned unless
            # --sep-configs forces the dK/dV and dQ tiles
            tf.FORCE_ATOMIC = None if det else True
            if cfg is not None and det:
                tf.FORCE_CONFIG["dkdv"], tf.FORCE_CONFIG["dq"] = cfg
            elif cfg is not None:
                tf.FORCE_CONFIG["dkdv_atomic"] = cfg
            if not det:
                tf.EXTRA_KWARGS["dkdv_atomic"] = {
                    "USE_TMA": "tma" in bv.split("+"),
                    "DQ_TMA": "dqtma" in bv.split("+"),
                }
            t0 = time.time()

            def run(det=det):
                return tf._backward_impl(do, q, k, v, out, lse, None, 1 / math.sqrt(D), band.lo, band.hi, det)

            try:
                run()
                torch.cuda.synchronize()
                ms = triton.testing.do_bench(run, warmup=5, rep=args.rep, return_mode="median")
                if det:
                    name = f"separate {cfg[0]}/{cfg[1]}" if cfg else "separate(autotuned)"
                else:
                    name = f"atomic {cfg} {bv}"
                print(
                    f"bwd {tag} {name:30s} {2.5 * flops / ms * 1e-9:6.0f} TFLOP/s ({time.time() - t0:.0f}s)",
                    flush=True,
                )
            except Exception as exc:
                print(f"bwd {tag} {cfg} {bv} det={det} FAILED {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        tf.EXTRA_KWARGS.clear()
        tf.FORCE_CONFIG.clear()
        tf.FORCE_ATOMIC = None


if __name__ == "__main__":
    sys.exit(main())

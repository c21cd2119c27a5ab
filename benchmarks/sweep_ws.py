"""Sweep of the warp-specialised forward (`kernels.flash_fwd_ws`) beside the Triton forward and cuDNN, on the GPU.

Each case: bf16, batch x S = 16K tokens, heads x D = 2048 (the attention table's shapes). Every variant is first
checked against the Triton forward (max |diff| of out and lse), then timed with `triton.testing.do_bench`
(--warmup / --rep ms, the benchmark's protocol by default). Forward TFLOP/s = 4 B H S^2 D (halved for causal).

    python benchmarks/sweep_ws.py --d 128 --s 4096,16384 --causal 0,1 --ws "128,2,1;128,2,0;64,3,1"
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys

import torch


def _cases(args):
    for d in [int(x) for x in args.d.split(",")]:
        for s in [int(x) for x in args.s.split(",")]:
            for c in [int(x) for x in args.causal.split(",")]:
                yield d, s, bool(c)


def case_inputs(args, d: int, s: int, causal: bool):
    """One case's inputs, shared with sweep_ws_bwd.py: (peers, warp-specialised configs, q, k, v, scale, band,
    forward FLOPs, the generator that drew q / k / v). bf16, B x S = 16K tokens, heads x D = 2048 (or GQA 32 / 8)."""
    from longctx.masks import Band

    peers = [p for p in args.peers.split(",") if p]
    ws_cfgs = [tuple(int(x) for x in c.split(",")) for c in args.ws.split(";") if c]
    hq = 32 if args.gqa else 2048 // d
    hkv = 8 if args.gqa else hq
    b = max(1, 16384 // s)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=g) for h in (hq, hkv, hkv))
    band = Band(None, 0) if causal else Band(None, None)
    flops = 4 * b * hq * s * s * d / (2 if causal else 1)
    return peers, ws_cfgs, q, k, v, 1.0 / math.sqrt(d), band, flops, g


def _case(args, d: int, s: int, causal: bool) -> dict:
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from longctx.launchers import flash as tf

    peers, ws_cfgs, q, k, v, scale, band, flops, _ = case_inputs(args, d, s, causal)

    def run(ws, cfg=None):
        tf.FORCE_WS = ws
        if cfg is not None:
            tf.WS_CONFIG[d] = (cfg[0], cfg[1], bool(cfg[2]))
        return tf.triton_forward(q, k, v, scale=scale, band=band)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)

    ref_out, ref_lse = run(False)
    variants = {}
    if "triton" in peers:
        variants["triton"] = lambda: run(False)
    for cfg in ws_cfgs:
        variants["ws{},{},{}".format(*cfg)] = functools.partial(run, True, cfg)
    if "cudnn" in peers and not args.gqa:
        variants["cudnn"] = cudnn
    line = {"d": d, "s": s, "causal": causal, "gqa": args.gqa}
    for name, fn in variants.items():
        try:
            res = fn()
            if name.startswith("ws"):
                out, lse = res
                line[name + "_err"] = [float((out.float() - ref_out.float()).abs().max()),
                                       float((lse - ref_lse).abs().max())]  # fmt: skip
            ms = triton.testing.do_bench(fn, warmup=args.warmup, rep=args.rep)
            line[name] = round(flops / ms / 1e9, 1)
        except Exception as exc:  # report and go on with the other variants
            line[name] = f"ERROR {type(exc).__name__}: {str(exc)[:300]}"
    tf.FORCE_WS = None
    return line


def sweep_args(description: str, ws: str, ws_help: str, peers: str, peers_help: str) -> argparse.ArgumentParser:
    """The arguments every warp-specialised sweep takes (this one and sweep_ws_bwd.py)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--d", default="128")
    ap.add_argument("--s", default="4096,8192,16384")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--gqa", action="store_true", help="Hq=32, Hkv=8 at D=128 instead of Hkv = Hq")
    ap.add_argument("--ws", default=ws, help=ws_help)
    ap.add_argument("--peers", default=peers, help=peers_help)
    ap.add_argument("--warmup", type=int, default=25)
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--json", default=None)
    return ap


def run_sweep(args, case) -> int:
    """``case(args, d, s, causal)`` for every (D, S, causal) asked for; one JSON line each, all in --json."""
    rows = []
    for d, s, causal in _cases(args):
        rows.append(case(args, d, s, causal))
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def main(argv=None) -> int:
    ap = sweep_args(__doc__.splitlines()[0], "128,2,1;128,2,0", "warp-specialised configs BLOCK_N,STAGES,PIPE;...",
                    "triton,cudnn", "also time: triton (the Triton forward), cudnn")  # fmt: skip
    return run_sweep(ap.parse_args(argv), _case)


if __name__ == "__main__":
    sys.exit(main())

"""Sweep of the warp-specialised backward (`kernels.flash_bwd_ws`) beside the Triton backward, cuDNN and FA2.

Each case: bf16, batch x S = 16K tokens, heads x D = 2048 (the attention table's shapes; --gqa: Hq=32, Hkv=8).
Every variant is first checked against the float64 oracle on the same inputs (max |error| of dq, dk, dv, next
to the Triton backward's), then timed with `triton.testing.do_bench` (the backward alone: `triton_backward` on
fixed inputs; peers: `autograd.grad` with retain_graph, as in `longctx bench attention`). Backward TFLOP/s =
2.5 x 4 B H S^2 D (halved for causal).

    python benchmarks/sweep_ws_bwd.py --d 128 --s 4096,16384 --causal 0,1 --ws "64,2,0;64,2,1"
"""

from __future__ import annotations

import functools
import sys

import torch

from sweep_ws import case_inputs, run_sweep, sweep_args  # benchmarks/ is the script's directory


def _oracle(q, k, v, do, scale, causal, heads=4):
    """float64 dq, dk, dv of the first batch element's first ``heads`` query heads (GQA by repeat)."""
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    qs = q[:1, :heads].double().requires_grad_()
    kv_heads = slice(0, max(1, heads // group))
    ks = k[:1, kv_heads].double().requires_grad_()
    vs = v[:1, kv_heads].double().requires_grad_()
    kr = ks.repeat_interleave(group, 1)[:, :heads]
    vr = vs.repeat_interleave(group, 1)[:, :heads]
    s = (qs @ kr.transpose(-1, -2)) * scale
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    out = torch.softmax(s, -1) @ vr
    return torch.autograd.grad(out, (qs, ks, vs), do[:1, :heads].double())


def _case(args, d: int, s: int, causal: bool) -> dict:
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from longctx.launchers import flash as tf

    peers, ws_cfgs, q, k, v, scale, band, fwd_flops, g = case_inputs(args, d, s, causal)
    do = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    hq, hkv = q.shape[1], k.shape[1]
    flops = 2.5 * fwd_flops
    out, lse = tf.triton_forward(q, k, v, scale=scale, band=band)
    group = hq // hkv
    heads = min(hq, 4 if group == 1 else group)
    ref = _oracle(q, k, v, do, scale, causal, heads) if s <= args.oracle_max_s else None

    def run(ws, cfg=None):
        tf.FORCE_WS_BWD = ws
        if cfg is not None:
            tf.WS_BWD_CONFIG[d] = (cfg[0], cfg[1], bool(cfg[2]))
            tf.WS_BWD_DQ_TMA = bool(cfg[3]) if len(cfg) > 3 else True
        return tf.triton_backward(do, q, k, v, out, lse, scale=scale, band=band)

    def peer(backend):
        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
        with sdpa_kernel(backend):
            o = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=causal, scale=scale,
                                                                 enable_gqa=hkv != hq)  # fmt: skip
        return lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True)

    variants = {}
    if "triton" in peers:
        variants["triton"] = functools.partial(run, False)
    for cfg in ws_cfgs:
        variants["ws" + ",".join(map(str, cfg))] = functools.partial(run, True, cfg)
    if "cudnn" in peers and not args.gqa:
        variants["cudnn"] = peer(SDPBackend.CUDNN_ATTENTION)
    if "fa2" in peers and not args.gqa:
        variants["fa2"] = peer(SDPBackend.FLASH_ATTENTION)
    line = {"d": d, "s": s, "causal": causal, "gqa": args.gqa}
    for name, fn in variants.items():
        try:
            res = fn()
            if ref is not None and (name == "triton" or name.startswith("ws")):
                kvh = ref[1].shape[1]
                got = (res[0][:1, :heads], res[1][:1, :kvh], res[2][:1, :kvh])
                line[name + "_err"] = [float((a.double() - r).abs().max()) for a, r in zip(got, ref)]
            ms = triton.testing.do_bench(fn, warmup=args.warmup, rep=args.rep)
            line[name] = round(flops / ms / 1e9, 1)
        except Exception as exc:  # report and go on with the other variants
            line[name] = f"ERROR {type(exc).__name__}: {str(exc)[:400]}"
        finally:
            tf.FORCE_WS_BWD = None
            tf.WS_BWD_DQ_TMA = True
    return line


def main(argv=None) -> int:
    ap = sweep_args(__doc__.splitlines()[0], "64,2,0;64,2,1", "warp-specialised configs BLOCK_M,STAGES,EARLY_DV[,DQ]"
                    " (DQ: 1 bulk-reduce dQ, 0 atomics);...",
                    "triton,cudnn,fa2", "also time: triton, cudnn, fa2")  # fmt: skip
    ap.add_argument("--oracle-max-s", type=int, default=4096, help="float64 oracle only up to this length")
    return run_sweep(ap.parse_args(argv), _case)


if __name__ == "__main__":
    sys.exit(main())

"""What the Triton autotuner measured for each config, beside a forced-config timing of the same call.

For each case the forward (and with --bwd the backward) runs once with autotuning on, then the autotuner's own
timings of every config (``configs_timings``, ms: median, 20th and 80th percentile) and its choice are
printed. Answers "does the autotuner pick the tile the sweeps say is fastest?".

    python benchmarks/autotune_probe.py --cases "128,4096,0;128,16384,1" [--bwd]
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="128,4096,0;128,8192,0;128,16384,0;128,4096,1;128,8192,1;128,16384,1")
    ap.add_argument("--bwd", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("LONGCTX_TRITON_AUTOTUNE", "1")
    from longctx import tuning as configs
    from longctx.bench.attention import Case, _inputs
    from longctx.launchers import flash as tf
    from longctx.masks import Band

    print(torch.cuda.get_device_name(), flush=True)
    for spec in args.cases.split(";"):
        D, S, causal = (int(x) for x in spec.split(","))
        B, H = max(1, 16384 // S), 2048 // D
        q, k, v = _inputs(Case(D, S, bool(causal), H, H, B), "bhsd", torch.bfloat16)
        band = Band.from_args(S, S, causal=bool(causal))
        out, lse = tf._forward_impl(q, k, v, 1 / math.sqrt(D), band.lo, band.hi)
        kinds = ["fwd"]
        if args.bwd:
            tf._backward_impl(torch.randn_like(q), q, k, v, out, lse, None, 1 / math.sqrt(D), band.lo, band.hi, False)
            kinds += ["dkdv_atomic", "dkdv", "dq"]
        torch.cuda.synchronize()
        for kind in kinds:
            at = tf._kernel(kind, configs.block_d(D))
            timings = getattr(at, "configs_timings", None)
            if not timings:
                continue
            flops = 4.0 * B * H * S * S * D * (0.5 if causal else 1.0) * (1.0 if kind == "fwd" else 2.5)
            print(f"D={D} S={S} {'causal' if causal else 'full'} {kind}: best {at.best_config}", flush=True)
            for cfg, t in sorted(timings.items(), key=lambda kv: kv[1][0]):
                note = f" ({flops / t[0] * 1e-9:.0f} TFLOP/s)" if kind == "fwd" else ""
                print(f"    {cfg}: {[round(x, 4) for x in t]}{note}", flush=True)
            at.configs_timings = None
    return 0


if __name__ == "__main__":
    sys.exit(main())

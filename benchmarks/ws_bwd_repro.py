"""Run the warp-specialised backward once on given shapes, against the deterministic Triton backward (GPU).

A repro for session 6's crash hunt (scripts/sweep_s6.sh, PART=b3 / b4): each case runs in its own process, since
an illegal instruction leaves the CUDA context unusable. Arguments: D Sq Sk Hq Hkv lo hi ("n" for no bound).

    CUDA_LAUNCH_BLOCKING=1 python benchmarks/ws_bwd_repro.py 64 129 2049 4 2 n n
"""

import sys

import torch

from longctx.launchers import flash as tf


def main() -> None:
    D, sq, sk, hq, hkv, lo, hi = (int(x) if x != "n" else None for x in sys.argv[1:8])
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(2, hq, sq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(2, hkv, sk, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(2, hkv, sk, D, device="cuda", dtype=torch.bfloat16, generator=g)
    do = torch.randn(2, hq, sq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    band = tf.Band(lo, hi)
    out, lse = tf.triton_forward(q, k, v, scale=0.1, band=band)
    det = tf.triton_backward(do, q, k, v, out, lse, scale=0.1, band=band, deterministic=True)
    tf.FORCE_WS_BWD = True
    try:
        ws = tf.triton_backward(do, q, k, v, out, lse, scale=0.1, band=band)
        torch.cuda.synchronize()
        print(sys.argv[1:8], "OK", [f"{(a.float() - b.float()).abs().max():.2e}" for a, b in zip(ws, det)])
    except Exception as e:  # noqa: BLE001 (a repro reports whatever happened)
        print(sys.argv[1:8], "CRASH", type(e).__name__, str(e)[:80])


if __name__ == "__main__":
    main()

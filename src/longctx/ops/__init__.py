"""Launchers, autograd Functions, torch.library registrations and peer adapters.

The launcher contract every attention implementation in longctx follows (the seam that context
parallelism and the model build on):

    forward(q, k, v, *, scale, band) -> (out, lse)
        q (B, Hq, Sq, D); k, v (B, Hkv, Sk, D); Hq % Hkv == 0, query head h reads kv head h // (Hq // Hkv)
        out (B, Hq, Sq, D) in q.dtype; lse (B, Hq, Sq) float32 (float64 for float64 inputs), natural log,
        -inf on rows that see no key (whose output is 0)
    backward(do, q, k, v, out, lse, *, scale, band) -> (dq, dk, dv)
        gradients in the input dtype; Delta = rowsum(dO * O) is computed inside

`band` is a `longctx.masks.Band` (lo <= j - i <= hi).
"""

"""Launchers of the kernels: shapes and strides in, ``(out, lse)`` / ``(dq, dk, dv)`` out, no autograd.

The contract every attention implementation in longctx follows (the seam context parallelism builds on):

    forward(q, k, v, *, scale, band) -> (out, lse)
        q (B, Hq, Sq, D); k, v (B, Hkv, Sk, D); Hq % Hkv == 0, query head h reads kv head h // (Hq // Hkv)
        out (B, Hq, Sq, D) in q.dtype; lse (B, Hq, Sq) float32 (float64 for float64 inputs), natural log,
        -inf on rows that see no key (whose output is 0)
    backward(do, q, k, v, out, lse, *, scale, band) -> (dq, dk, dv)
        gradients in the input dtype; Delta = rowsum(dO * O) is computed inside

- `flash`: the dense kernels (Triton, and the Gluon kernels on Hopper); `sparse`: block-sparse masks.
"""

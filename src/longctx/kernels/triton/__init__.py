"""Triton kernels (``@triton.jit`` only): they run on any CUDA GPU with Triton and under ``TRITON_INTERPRET=1``.

- `flash_fwd`: the FlashAttention-2 forward (online softmax kept on chip), returning out and lse.
- `flash_bwd`: the backward as three kernels: Delta = rowsum(dO * O) (plus lse in base 2), dK/dV (one program per
  kv tile, looping over the query heads of its GQA group) and dQ (one program per query tile, or atomics in dK/dV).
- `flash_sparse`: the same for block-sparse masks, walking a `BlockMask`'s block lists.
"""

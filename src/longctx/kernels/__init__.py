"""Triton kernels of the `triton` backend: only ``@triton.jit`` code and tile configs live here.

- `flash_fwd`: the FlashAttention-2 forward (online softmax kept on chip), returning out and lse.
- `flash_bwd`: the backward as three kernels: Delta = rowsum(dO * O) (plus lse in base 2), dK/dV (one
  program per kv tile, looping over the query heads of its GQA group, no atomics) and dQ (one program
  per query tile). Without atomics the backward is deterministic by construction.
- `flash_fwd_ws`, `flash_bwd_ws`: the forward and the backward (dK, dV and atomic dQ) for Hopper, warp-specialised
  (a producer warp and two consumer warpgroups synchronised by mbarriers), in Gluon, Triton's lower-level
  dialect; they run only on sm_90 GPUs, not in the interpreter.
- `flash_sparse`, `flash_sparse_ws`: block-sparse masks (the lists of a `BlockMask`): the Triton kernels (any GPU,
  the interpreter, the deterministic backward) and the warp-specialised ones for Hopper built from the two above.
- `configs`: the tile configs per head dim and causal-ness, and the default used without autotuning.

The launchers, the autograd Function and the torch.library registration are in `longctx.ops.triton_flash`.
Keeping this package free of torch-side logic lets every Triton kernel run under ``TRITON_INTERPRET=1`` on the CPU.
"""

"""Warp-specialised kernels for Hopper (sm_90) in Gluon, Triton's lower-level dialect: a producer warp feeds two
consumer warpgroups through TMA and mbarriers (FlashAttention-3's design). They do not run in the interpreter.

- `flash_fwd_ws`: the dense forward. `flash_bwd_ws`: the dense backward (dK, dV; dQ by the copy engine's bulk
  reduction). `flash_sparse_ws`: both for block-sparse masks, persistent (one CTA per SM taking work items).
"""

"""Attention in plain PyTorch, for every device and float64: `naive` (the dense oracle), `tiled` (the FlashAttention
algorithm, memory linear in S) and `tiled_sparse` (the same walking a `BlockMask`'s kept blocks)."""

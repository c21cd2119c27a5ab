"""Context parallelism: split one long sequence across GPUs (or CPU processes) of a process group.

    from longctx.distributed import shard, unshard, cp_attention
    q_loc, k_loc, v_loc = (shard(t, dim=2, layout="zigzag") for t in (q, k, v))   # (B, H, S/P, D)
    out_loc = cp_attention(q_loc, k_loc, v_loc, causal=True, method="ring")       # this rank's output
    out = unshard(out_loc, dim=2)                                                  # (B, H, S, D)

Methods: "ring" (K/V around a ring, overlapped with compute), "allgather" (Llama 3) and "ulysses" (all-to-all to
heads). Layouts: "zigzag" (balanced causal work) and "contiguous". Works with gloo on CPU (tiled launchers)
and NCCL on GPU (Triton launchers). Model wiring for `longctx train --context-parallel N`: `longctx.distributed.model`.
"""

from __future__ import annotations

from longctx.distributed.attention import METHODS, cp_attention
from longctx.distributed.model import (
    ContextParallel,
    allreduce_gradients,
    broadcast_parameters,
    cp_cross_entropy,
    init_distributed,
    setup_context_parallel,
    shard_batch,
)
from longctx.distributed.sharding import LAYOUTS, local_positions, shard, unshard

__all__ = [
    "shard",
    "unshard",
    "cp_attention",
    "local_positions",
    "METHODS",
    "LAYOUTS",
    "ContextParallel",
    "setup_context_parallel",
    "shard_batch",
    "cp_cross_entropy",
    "allreduce_gradients",
    "broadcast_parameters",
    "init_distributed",
]

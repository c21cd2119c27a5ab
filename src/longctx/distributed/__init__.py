"""Context parallelism: split one long sequence across GPUs (or CPU processes) of a process group.

    from longctx.distributed import shard, unshard, cp_attention
    q_loc, k_loc, v_loc = (shard(t, dim=2, layout="zigzag") for t in (q, k, v))   # (B, H, S/P, D)
    out_loc = cp_attention(q_loc, k_loc, v_loc, causal=True, method="ring")       # this rank's output
    out = unshard(out_loc, dim=2)                                                  # (B, H, S, D)

Methods: "ring" (K/V around a ring, overlapped with compute), "allgather" (Llama 3), "ulysses" (all-to-all to
heads) and "ulysses_ring" (all-to-all inside groups of ``ulysses_size`` ranks, a ring across them: USP, Transformer
Engine's a2a+p2p). Layouts: "zigzag" (balanced causal work) and "contiguous". ``cu_seqlens=`` makes the sequence
packed documents (causal / window inside each). Works with gloo on CPU (tiled launchers) and NCCL on GPU (Triton
launchers). torch.distributed must be initialised; ``group=SINGLE_PROCESS`` runs one process as a group of one.

Packed documents balanced by work (the dispatcher):

    plan = dispatch_plan(cu_seqlens, causal=True)                   # same on every rank; plan.balance() ~ 1
    q_loc, k_loc, v_loc = (plan.dispatch(t) for t in (q, k, v))     # (total, H, D) -> (total / P, H, D)
    out = plan.undispatch(plan.attention(q_loc, k_loc, v_loc, method="ring"))   # (total, H, D)

Data parallelism x context parallelism (a ("dp", "cp") DeviceMesh, FSDP2 over "dp"), for a loop of one's own:

    mesh = init_mesh(data_parallel=4, context_parallel=2)           # under torchrun; checks agreement on every rank
    apply_fsdp(model, mesh)                                          # fully_shard the decoder layers and embeddings
    rows = batch_rows(batch, mesh)                                   # this dp rank's rows of the global batch

Model wiring for `longctx train --data-parallel N --context-parallel P`: `longctx.distributed.model` and
`longctx.distributed.mesh`. Details: docs/context-parallel.md and docs/training.md.
"""

from __future__ import annotations

from longctx.distributed.attention import METHODS, cp_attention
from longctx.distributed.dispatch import DispatchPlan, dispatch_plan
from longctx.distributed.mesh import (
    MESH_DIMS,
    ParallelDims,
    apply_fsdp,
    batch_rows,
    cp_group,
    dp_group,
    dp_rank,
    fsdp_available,
    init_mesh,
    reduce_gradients,
)
from longctx.distributed.model import (
    AGREEMENT_TIMEOUT_S,
    ContextParallel,
    allreduce_gradients,
    broadcast_parameters,
    check_agreement,
    cp_cross_entropy,
    init_distributed,
    setup_context_parallel,
    shard_batch,
)
from longctx.distributed.sharding import LAYOUTS, SINGLE_PROCESS, ChunkLayout, local_positions, shard, unshard

__all__ = [
    "shard",
    "unshard",
    "cp_attention",
    "dispatch_plan",
    "DispatchPlan",
    "SINGLE_PROCESS",
    "ChunkLayout",
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
    "check_agreement",
    "AGREEMENT_TIMEOUT_S",
    "ParallelDims",
    "MESH_DIMS",
    "init_mesh",
    "apply_fsdp",
    "fsdp_available",
    "batch_rows",
    "dp_rank",
    "dp_group",
    "cp_group",
    "reduce_gradients",
]

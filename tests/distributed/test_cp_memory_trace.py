"""The memory model under context parallelism against a real gloo step: the planner traces rank 0 of a
context-parallel step on shape-only tensors, running the method's own code (its accumulators, its receive buffers)
with transfers that move nothing; here the same step runs for real over gloo, the method's transfers moving real
tensors (the attention kernels' twin in both), and rank 0's peak of live bytes must equal the prediction."""

from __future__ import annotations

from functools import cache

import pytest
import torch

from tests.distributed.spawn import assert_ranks_ok, case_params, run_case_world

pytestmark = pytest.mark.distributed

WORLDS = (2, 4)
WORLD_TIMEOUT_S = 180

BASE = dict(
    vocab_size=512, seq_length=128, num_layers=3, hidden_size=64, num_attention_heads=4, num_query_groups=2,
    ffn_hidden_size=128, attention_backend="tiled",
)  # fmt: skip
FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def case_names(world: int) -> list[str]:
    return [f"{m}-{r}" for m in ("ring", "allgather", "ulysses") for r in ("none", "full")]


def _run_case(name: str, rank: int, world: int) -> None:
    from longctx.distributed.attention import run_method
    from longctx.distributed.comm import group_info
    from longctx.masks import Band
    from longctx.memory import model as memory_model
    from longctx.models.gpt import GPT, GPTConfig
    from tests.memory_steps import real_step_peak

    method, recompute = name.split("-")
    cfg = GPTConfig(**BASE, **(FULL if recompute == "full" else {}))
    S = 128  # this rank's tokens
    est = memory_model.step_memory(cfg, seq_length=S, exact=True, context_parallel=world, cp_method=method)
    torch.manual_seed(0)
    model = GPT(cfg)
    info = group_info(None)

    def core(q, k, v):
        return run_method(q, k, v, info=info, method=method, layout="zigzag", mask=Band(None, 0),
                          scale=q.shape[-1] ** -0.5, launchers=memory_model._CPTwinLaunchers)  # fmt: skip

    model.set_core_attention(core)
    real = real_step_peak(model, torch.zeros(1, S, dtype=torch.long))
    if rank == 0:  # the trace is rank 0's (the zigzag ranks' pieces of work differ a little in size)
        assert est.traced == real, (est.traced, real)
    if method != "ulysses":  # the ring's and all-gather's buffers come on top of one process's attention (Ulysses
        # keeps head-split copies instead of the layer's own layout: it may hold less)
        plain = memory_model.step_memory(cfg, seq_length=S, exact=True)
        assert est.traced >= plain.traced, (est.traced, plain.traced)


@cache
def run_world(world: int) -> dict[str, list[str]]:
    return run_case_world(__name__, world, WORLD_TIMEOUT_S)


@pytest.mark.parametrize("world,name", case_params(WORLDS, case_names, "cp_memory_trace"))
def test_cp_memory_trace_gloo(world: int, name: str) -> None:
    assert_ranks_ok(run_world(world)[name])

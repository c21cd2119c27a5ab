"""The memory model under context parallelism against a real gloo step: the planner traces rank 0 of a
context-parallel step on shape-only tensors, running the method's own code (its accumulators, its receive buffers)
with transfers that move nothing; here the same step runs for real over gloo, the method's transfers moving real
tensors (the attention kernels' twin in both), and rank 0's peak of live bytes must equal the prediction.

The real transfers run on copies the live-bytes tracker does not see (`_transfers_outside_the_tracker`): gloo's
worker thread can drop its reference to a transfer's buffer a moment after the call returns, so a buffer of the
step's own could outlive its last use by a thread switch and move the measured peak by its size, at random.
"""

from __future__ import annotations

import contextlib
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


class _Done:
    """The work of a transfer that already completed (the wrappers below wait before they return)."""

    def wait(self, *args, **kwargs) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


@contextlib.contextmanager
def _transfers_outside_the_tracker():
    """torch.distributed's transfers of the context-parallel methods, each on untracked copies of its tensors (made
    and sent with the dispatch modes off), the results copied into the step's own tensors in place."""
    from unittest import mock

    import torch.distributed as dist
    from torch.utils._python_dispatch import _disable_current_modes

    real = {name: getattr(dist, name) for name in (
        "all_to_all_single", "all_gather", "all_gather_into_tensor", "all_reduce", "reduce_scatter_tensor",
        "batch_isend_irecv",
    )}  # fmt: skip

    def all_gather(outs, inp, group=None, async_op=False):
        with _disable_current_modes():
            os_, i = [torch.empty_like(o) for o in outs], inp.clone()
            real["all_gather"](os_, i, group=group)
        for o, r in zip(outs, os_):
            o.copy_(r)
        return _Done() if async_op else None

    def one_to_one(name):
        def transfer(out, inp, *args, group=None, async_op=False, **kwargs):
            with _disable_current_modes():
                o, i = torch.empty_like(out), inp.clone()
                real[name](o, i, *args, group=group, **kwargs)
            out.copy_(o)
            return _Done() if async_op else None

        return transfer

    def all_reduce(t, *args, group=None, async_op=False, **kwargs):
        with _disable_current_modes():
            c = t.clone()
            real["all_reduce"](c, *args, group=group, **kwargs)
        t.copy_(c)
        return _Done() if async_op else None

    def batch_isend_irecv(ops):
        pairs = []
        with _disable_current_modes():
            copies = []
            for op in ops:
                buf = op.tensor.clone() if op.op is dist.isend else torch.empty_like(op.tensor)
                copies.append(dist.P2POp(op.op, buf, op.peer, op.group, op.tag))
                if op.op is not dist.isend:
                    pairs.append((op.tensor, buf))
            for work in real["batch_isend_irecv"](copies):
                work.wait()
        for mine, buf in pairs:
            mine.copy_(buf)
        return [_Done() for _ in ops]

    with contextlib.ExitStack() as stack:
        for name, fn in (("all_to_all_single", one_to_one("all_to_all_single")), ("all_gather", all_gather),
                         ("all_gather_into_tensor", one_to_one("all_gather_into_tensor")), ("all_reduce", all_reduce),
                         ("reduce_scatter_tensor", one_to_one("reduce_scatter_tensor")),
                         ("batch_isend_irecv", batch_isend_irecv)):  # fmt: skip
            stack.enter_context(mock.patch.object(dist, name, fn))
        yield


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
    with _transfers_outside_the_tracker():
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

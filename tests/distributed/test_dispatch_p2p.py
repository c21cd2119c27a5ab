"""The dispatcher's "p2p" method on gloo processes: only the K/V chunks some local query can see move.

Each world size is spawned once and runs every case inside it (as test_dispatch_plan.py, whose inputs and oracle
it shares). Every rank draws the same packed inputs, computes the float64 oracle (`flash_attn_varlen_func`, math
backend) on the whole sequence and compares its rows of the output and of dq, dk, dv; the bytes actually handed
to the point-to-point exchange are counted and compared with `DispatchPlan.traffic`. Bad methods raise on every
rank, and the group still works for the next case.
"""

from __future__ import annotations

from functools import cache

import pytest
import torch

from tests.distributed.spawn import assert_ranks_ok, case_params, run_case_world
from tests.distributed.test_dispatch_plan import MASKS, _check, _docs, _expect_error, _packed, _rel_err, _varlen_oracle

pytestmark = pytest.mark.distributed

WORLDS = (2, 4)
WORLD_TIMEOUT_S = 120


def case_names(world: int) -> list[str]:
    names = [f"p2p-{mask}-{cs}" for mask in MASKS for cs in (4,)]
    names += ["p2p-causal-1", "p2p-causal-24", "p2p-win2-2", "p2p-isolated", "p2p-bytes", "p2p-bf16"]
    names += ["bad-method", "bad-method-one-rank", "bad-method-differs", "p2p-after-errors"]
    return names


def _isolated_docs(world: int) -> list[int]:
    """One document of two chunks of 4, then documents of exactly one chunk: the greedy gives the two long chunks
    to ranks 0 and 1 (largest area first), so under a causal mask one of them needs the other's chunk and the
    ranks holding only one-chunk documents need nothing."""
    lengths = [8] + [4] * (24 * world // 4 - 2)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def _run_p2p(name: str, cu: list[int], kw: dict, chunk_size: int):
    from longctx.distributed import dispatch_plan

    q, k, v, do = _packed(name, cu[-1])
    out_ref, grads_ref = _varlen_oracle(q, k, v, do, cu, **kw)
    plan = dispatch_plan(torch.tensor(cu, dtype=torch.int32), chunk_size=chunk_size, **kw)
    loc = [plan.dispatch(t).requires_grad_() for t in (q, k, v)]
    out = plan.attention(*loc, method="p2p", backend="tiled")
    assert out.shape == (plan.local_len, 4, 8), out.shape
    out.backward(plan.dispatch(do))
    errs = {"out": _rel_err(out, plan.dispatch(out_ref))}
    for nm, t, gr in zip("qkv", loc, grads_ref):
        errs["d" + nm] = _rel_err(t.grad, plan.dispatch(gr))
    _check(errs, 1e-10)
    return plan


def _run_case(name: str, rank: int, world: int) -> None:
    import torch.distributed as dist

    from longctx.distributed import dispatch_plan

    cu = _docs(world)
    if name.startswith("p2p-") and name.split("-")[1] in MASKS:
        _, mask, cs = name.split("-")
        _run_p2p(name, cu, MASKS[mask], int(cs))
    elif name == "p2p-isolated":
        plan = _run_p2p(name, _isolated_docs(world), MASKS["causal"], 4)
        received = [sum(len(ids) for ids in plan.needs[r]) for r in range(world)]
        assert 0 in received and max(received) > 0, received
        if world == 4:  # ranks holding only one-chunk documents take no part in any transfer
            quiet = [r for r in range(world) if received[r] == 0 and not any(plan.needs[x][r] for x in range(world))]
            assert len(quiet) >= 2, (quiet, plan.needs)
    elif name == "p2p-bytes":
        import longctx.distributed.dispatch as dispatch_mod

        counted = {"sent": 0, "received": 0}
        real = dispatch_mod.exchange

        def counting(info, sends, recvs, tag=0):
            counted["sent"] += sum(t.numel() * t.element_size() for _, t in sends)
            counted["received"] += sum(t.numel() * t.element_size() for _, t in recvs)
            return real(info, sends, recvs, tag)

        dispatch_mod.exchange = counting
        try:
            plan = _run_p2p(name, cu, MASKS["causal"], 4)
        finally:
            dispatch_mod.exchange = real
        tr = plan.traffic("p2p", kv_heads=2, head_dim=8, itemsize=8, grad_itemsize=8)
        assert counted["sent"] == tr.forward_sent[rank] + tr.backward_sent[rank], (counted, tr)
        assert counted["received"] == tr.forward_received[rank] + tr.backward_received[rank], (counted, tr)
        assert tr.max_per_rank() <= plan.traffic("ring", kv_heads=2, head_dim=8, itemsize=8).max_per_rank()
    elif name == "p2p-bf16":
        import longctx

        q, k, v, do = _packed(name, cu[-1])
        out_ref, grads_ref = _varlen_oracle(q, k, v, do, cu, causal=True, window=None)
        cut = torch.tensor(cu, dtype=torch.int32)
        one = [t.bfloat16().requires_grad_() for t in (q, k, v)]
        o1 = longctx.flash_attn_varlen_func(*one, cut, cut, cu[-1], cu[-1], causal=True, backend="tiled")
        o1.backward(do.bfloat16())
        plan = dispatch_plan(cu, causal=True, chunk_size=4)
        loc = [plan.dispatch(t.bfloat16()).requires_grad_() for t in (q, k, v)]
        out = plan.attention(*loc, method="p2p", backend="tiled")
        out.backward(plan.dispatch(do.bfloat16()))
        pairs = [(out, o1.detach(), out_ref)] + [(t.grad, s.grad, r) for t, s, r in zip(loc, one, grads_ref)]
        for nm, (a, s, r) in zip(("out", "dq", "dk", "dv"), pairs):
            e_cp = float((a.double() - plan.dispatch(r)).abs().max())
            e_1 = float((plan.dispatch(s).double() - plan.dispatch(r)).abs().max())
            assert e_cp <= 2 * e_1 + 1e-2, f"{nm}: {e_cp:.3e} vs single process {e_1:.3e}"
    elif name.startswith("bad-method"):
        plan = dispatch_plan(cu, causal=True, chunk_size=4)
        q = torch.randn(plan.local_len, 2, 8)
        if name == "bad-method":
            _expect_error(lambda: plan.attention(q, q, q, method="p2q"), ValueError, "method must be one of")
        elif name == "bad-method-one-rank":
            mine = "p2q" if rank == world - 1 else "p2p"
            exp = "method must be one of" if rank == world - 1 else f"invalid input on rank(s) [{world - 1}]"
            _expect_error(lambda: plan.attention(q, q, q, method=mine), ValueError, exp)
        else:
            mine = "p2p" if rank == 0 else "allgather"
            _expect_error(lambda: plan.attention(q, q, q, method=mine), ValueError, "different shapes")
    elif name == "p2p-after-errors":
        _run_p2p(name, cu, MASKS["causal_win"], 4)
        dist.barrier()
    else:
        raise KeyError(name)


@cache
def run_world(world: int) -> dict[str, list[str]]:
    return run_case_world(__name__, world, WORLD_TIMEOUT_S)


@pytest.mark.parametrize("world,name", case_params(WORLDS, case_names, "dispatch_p2p"))
def test_dispatch_p2p_gloo(world: int, name: str) -> None:
    results = run_world(world)[name]
    assert_ranks_ok(results)

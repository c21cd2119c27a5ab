"""The dispatcher's "p2p" method on gloo processes: only the K/V rows some local query can see move; and what every
method moves and launches per step over packed documents.

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
    names += [f"whole-{m}" for m in ("ring", "allgather", "p2p")]  # documents that fit: no communication
    names += [f"launches-{m}" for m in ("ring", "allgather", "ulysses", "p2p")]
    names += ["bad-method", "bad-method-one-rank", "bad-method-differs", "p2p-after-errors", "check-once"]
    return names


def _isolated_docs(world: int) -> list[int]:
    """A document longer than a shard (it must be split: some ranks need its other pieces), then documents of four
    tokens (each whole on one rank)."""
    lengths = [24 + 8] + [4] * (24 * world // 4 - 8)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def _fitting_docs(world: int) -> list[int]:
    """Documents of 1 to 6 tokens, every rank's 24 tokens filled by whole ones (4 + 6 + 5 + 1 + 3 + 2 + 3): a mix the
    dispatcher keeps whole, so attention needs no communication."""
    cu = [0]
    for _ in range(world):
        for n in (4, 6, 5, 1, 3, 2, 3):
            cu.append(cu[-1] + n)
    return cu


class _Counting:
    """Launchers that count their calls by kind (dense ones must not run for packed documents)."""

    def __init__(self, real) -> None:
        from longctx.launchers.select import Launchers

        self.counts = {"forward": 0, "backward": 0, "sparse_forward": 0, "sparse_backward": 0}

        def counted(kind):
            def fn(*args, **kw):
                self.counts[kind] += 1
                return getattr(real, kind)(*args, **kw)

            return fn

        self.launchers = Launchers("counting", *(counted(k) for k in self.counts))


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
        received = [sum(n for ranges in plan.needs[r] for _, n in ranges) for r in range(world)]
        assert max(received) > 0, received
        # only the long document's pieces move: every needed range lies in it
        assert all(g + n <= 32 for ranges in plan.needs[rank] for g, n in ranges), plan.needs
    elif name.startswith("whole-"):
        _run_whole(name, rank, world)
    elif name.startswith("launches-"):
        _run_launches(name, rank, world)
    elif name == "p2p-bytes":
        import longctx.distributed.p2p as dispatch_mod

        counted = {"sent": 0, "received": 0}
        real = dispatch_mod.all_to_all_rows

        def counting(info, send, send_counts, recv, recv_counts):
            assert send_counts[info.rank] == recv_counts[info.rank] == 0, "a rank sends nothing to itself"
            counted["sent"] += send.numel() * send.element_size()
            counted["received"] += recv.numel() * recv.element_size()
            return real(info, send, send_counts, recv, recv_counts)

        dispatch_mod.all_to_all_rows = counting
        try:
            plan = _run_p2p(name, cu, MASKS["causal"], 4)
        finally:
            dispatch_mod.all_to_all_rows = real
        tr = plan.traffic("p2p", kv_heads=2, head_dim=8, itemsize=8, grad_itemsize=8)
        assert counted["sent"] == tr.forward_sent[rank] + tr.backward_sent[rank], (counted, tr)
        assert counted["received"] == tr.forward_received[rank] + tr.backward_received[rank], (counted, tr)
        ring = plan.traffic("ring", kv_heads=2, head_dim=8, itemsize=8, grad_itemsize=8)
        # p2p receives what this rank needs; the ring every other rank's export rows, a superset
        assert all(a <= b for a, b in zip(tr.forward_received, ring.forward_received)), (tr, ring)
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
    elif name == "check-once":
        # the arguments of a plan's first call are checked collectively; calls repeating them are not, a call with
        # new ones (another method) is, and so is the first call of the next plan
        import longctx.distributed.dispatch as dispatch_mod

        rows = []
        real = dispatch_mod.agree_or_raise

        def counting(row, *args, **kw):
            rows.append(row[-1])
            return real(row, *args, **kw)

        dispatch_mod.agree_or_raise = counting
        try:
            plan = _run_p2p(name, cu, MASKS["causal"], 4)
            assert len(rows) == 1, rows
            q, k, v, do = _packed(name, cu[-1])
            loc = [plan.dispatch(t) for t in (q, k, v)]
            for _ in range(3):
                plan.attention(*loc, method="p2p", backend="tiled")
            assert len(rows) == 1, rows
            plan.attention(*loc, method="allgather", backend="tiled")
            plan.attention(*loc, method="allgather", backend="tiled")
            assert len(rows) == 2, rows
            plan.attention(*loc, method="p2p", backend="tiled", scale=0.5)
            assert len(rows) == 3, rows
            _run_p2p(name, cu, MASKS["causal"], 4)
            assert len(rows) == 4, rows
        finally:
            dispatch_mod.agree_or_raise = real
    elif name == "p2p-after-errors":
        _run_p2p(name, cu, MASKS["causal_win"], 4)
        dist.barrier()
    else:
        raise KeyError(name)


def _run_whole(name: str, rank: int, world: int) -> None:
    """Documents that all fit whole: the plan exports nothing, no byte crosses ranks in either pass, and the result
    is the float64 oracle's."""
    import longctx.distributed.allgather as ag_mod
    import longctx.distributed.doc_ring as ring_mod
    import longctx.distributed.p2p as p2p_mod
    from longctx.distributed import dispatch_plan

    method = name.split("-")[1]
    cu = _fitting_docs(world)
    plan = dispatch_plan(cu, causal=True)
    assert plan.traffic(method).max_per_rank() == 0, plan.traffic(method)
    assert all(not ranges for row in plan.needs for ranges in row), plan.needs
    moved = []
    saved = (ring_mod.exchange, p2p_mod.all_to_all_rows, ag_mod.gather_flat)

    def spy(fn):
        def wrapped(*args, **kw):
            moved.append(fn.__name__)
            return fn(*args, **kw)

        return wrapped

    ring_mod.exchange, p2p_mod.all_to_all_rows, ag_mod.gather_flat = (spy(f) for f in saved)
    try:
        q, k, v, do = _packed(name, cu[-1])
        out_ref, grads_ref = _varlen_oracle(q, k, v, do, cu, causal=True, window=None)
        loc = [plan.dispatch(t).requires_grad_() for t in (q, k, v)]
        out = plan.attention(*loc, method=method, backend="tiled")
        out.backward(plan.dispatch(do))
    finally:
        ring_mod.exchange, p2p_mod.all_to_all_rows, ag_mod.gather_flat = saved
    errs = {"out": _rel_err(out, plan.dispatch(out_ref))}
    for nm, t, gr in zip("qkv", loc, grads_ref):
        errs["d" + nm] = _rel_err(t.grad, plan.dispatch(gr))
    _check(errs, 1e-10)
    assert not moved, moved


def _run_launches(name: str, rank: int, world: int) -> None:
    """One block-sparse launch per step and pass, never a dense one: the ring at most P forward launches (one per step
    with work) and as many backward ones; all-gather and p2p two; Ulysses one. Counted, with the oracle checked."""
    import longctx.distributed.dispatch as dispatch_mod
    from longctx.distributed import dispatch_plan

    method = name.split("-")[1]
    cu = _isolated_docs(world)  # a document split over ranks: every method has remote work
    plan = dispatch_plan(cu, causal=True, chunk_size=4)
    counting = _Counting(dispatch_mod.resolve_launchers("tiled", torch.device("cpu"), torch.float64))
    real = dispatch_mod.resolve_launchers
    dispatch_mod.resolve_launchers = lambda *a, **kw: counting.launchers
    try:
        q, k, v, do = _packed(name, cu[-1])
        out_ref, grads_ref = _varlen_oracle(q, k, v, do, cu, causal=True, window=None)
        loc = [plan.dispatch(t).requires_grad_() for t in (q, k, v)]
        out = plan.attention(*loc, method=method, backend="tiled")
        fwd = dict(counting.counts)
        out.backward(plan.dispatch(do))
    finally:
        dispatch_mod.resolve_launchers = real
    errs = {"out": _rel_err(out, plan.dispatch(out_ref))}
    for nm, t, gr in zip("qkv", loc, grads_ref):
        errs["d" + nm] = _rel_err(t.grad, plan.dispatch(gr))
    _check(errs, 1e-10)
    c = counting.counts
    assert c["forward"] == c["backward"] == 0, c  # no per-piece dense launches
    most = {"ring": world, "allgather": 2, "p2p": 2, "ulysses": 1}[method]
    assert 1 <= fwd["sparse_forward"] <= most and fwd["sparse_backward"] == 0, (fwd, most)
    assert c["sparse_backward"] == fwd["sparse_forward"], c  # one backward launch for each forward one


@cache
def run_world(world: int) -> dict[str, list[str]]:
    return run_case_world(__name__, world, WORLD_TIMEOUT_S)


@pytest.mark.parametrize("world,name", case_params(WORLDS, case_names, "dispatch_p2p"))
def test_dispatch_p2p_gloo(world: int, name: str) -> None:
    results = run_world(world)[name]
    assert_ranks_ok(results)

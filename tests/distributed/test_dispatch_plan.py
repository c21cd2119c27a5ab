"""Packed documents under context parallelism, the dispatcher and the hybrid Ulysses x ring, on gloo processes.

Each world size is spawned once and runs every case inside it (as test_context_parallel.py). Every rank draws the
same packed inputs from one seed, computes the float64 oracle (`flash_attn_varlen_func` with the math backend, or
`longctx.attention` for dense masks) on the whole sequence, runs the distributed path on its share and compares
its rows of the output and of dq, dk, dv. Bad inputs must raise on every rank, and the group must still work for
the next case.
"""

from __future__ import annotations

import zlib
from functools import cache

import pytest
import torch

from tests.distributed.spawn import assert_ranks_ok, case_params, run_case_world

pytestmark = pytest.mark.distributed

WORLDS = (2, 4)
WORLD_TIMEOUT_S = 150
TOKENS_PER_RANK = 24

MASKS = {
    "full": dict(causal=False, window=None),
    "causal": dict(causal=True, window=None),
    "causal_win": dict(causal=True, window=(5, 0)),
    "win2": dict(causal=False, window=(3, 4)),
}


def _docs(world: int) -> list[int]:
    """cu_seqlens of TOKENS_PER_RANK * world tokens: lengths 1, 2, an empty document, and one longer than a shard."""
    total = TOKENS_PER_RANK * world
    lengths = [1, 7, 0, TOKENS_PER_RANK + 9, 2, 1]
    lengths.append(total - sum(lengths))
    assert lengths[-1] > 0
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def _methods(world: int) -> list[str]:
    # ulysses_ring with groups of 2: at world 2 a ring of one group, at world 4 a ring of two groups
    return ["ring", "allgather", "ulysses", "ulysses_ring"]


def case_names(world: int) -> list[str]:
    names = [f"plan-{m}-{mask}" for m in _methods(world) for mask in MASKS]
    names += [f"cpdocs-{m}-{lay}-{mask}" for m in ("ring", "allgather", "ulysses") for lay in ("zigzag", "contiguous")
              for mask in ("causal", "win2")]  # fmt: skip
    names += ["hybrid-dense-zigzag", "hybrid-dense-contiguous", "hybrid-docs-cp", "plan-bf16-ring"]
    names += ["roundtrip", "plan-agrees", "plan-default-chunks"]
    names += [
        "bad-plan-heads",
        "bad-hybrid-size",
        "bad-hybrid-heads",
        "bad-plan-cu-differs",
        "bad-cp-cu-differs",
        "bad-plan-cu-one-rank",
        "bad-plan-local-len",
        "bad-plan-not-divisible",
        "bad-cp-cu-total",
    ]
    return names


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _expect_error(fn, exc, match: str) -> None:
    try:
        fn()
    except exc as e:
        assert match in str(e), f"error message {str(e)!r} does not contain {match!r}"
        return
    raise AssertionError(f"expected {exc.__name__} matching {match!r}, nothing was raised")


def _packed(name: str, total: int, hq: int = 4, hkv: int = 2, d: int = 8):
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    q = torch.randn(total, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(total, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(total, hkv, d, generator=g, dtype=torch.float64)
    do = torch.randn(total, hq, d, generator=g, dtype=torch.float64)
    return q, k, v, do


def _varlen_oracle(q, k, v, do, cu: list[int], causal: bool, window):
    import longctx

    cut = torch.tensor(cu, dtype=torch.int32)
    mx = max(b - a for a, b in zip(cu, cu[1:]))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out = longctx.flash_attn_varlen_func(
        *ref, cut, cut, mx, mx, causal=causal, window_size=window or (-1, -1), backend="math"
    )
    out.backward(do)
    return out.detach(), [t.grad for t in ref]


def _check(errs: dict, tol: float) -> None:
    bad = {k_: e for k_, e in errs.items() if not e <= tol}
    assert not bad, f"errors above {tol}: {bad} (all: {errs})"


def _run_plan_case(name: str, rank: int, world: int) -> None:
    from longctx.distributed import dispatch_plan

    _, method, mask = name.split("-")
    kw = MASKS[mask]
    cu = _docs(world)
    q, k, v, do = _packed(name, cu[-1])
    out_ref, grads_ref = _varlen_oracle(q, k, v, do, cu, **kw)
    plan = dispatch_plan(torch.tensor(cu, dtype=torch.int32), chunk_size=4, **kw)
    loc = [plan.dispatch(t).requires_grad_() for t in (q, k, v)]
    extra = dict(ulysses_size=2) if method == "ulysses_ring" else {}
    out = plan.attention(*loc, method=method, backend="tiled", **extra)
    assert out.shape == (plan.local_len, 4, 8), out.shape
    out.backward(plan.dispatch(do))
    errs = {"out": _rel_err(out, plan.dispatch(out_ref))}
    for nm, t, gr in zip("qkv", loc, grads_ref):
        errs["d" + nm] = _rel_err(t.grad, plan.dispatch(gr))
    _check(errs, 1e-10)


def _run_cpdocs_case(name: str, rank: int, world: int) -> None:
    """cp_attention(cu_seqlens=...) on the zigzag / contiguous shards (B = 2: the documents apply to every row)."""
    from longctx.distributed import cp_attention, shard

    _, method, layout, mask = name.split("-")
    kw = MASKS[mask]
    cu = _docs(world)
    total = cu[-1]
    outs, grads = [], []
    rows = [_packed(f"{name}-{b}", total) for b in range(2)]
    for q, k, v, do in rows:
        o, gr = _varlen_oracle(q, k, v, do, cu, **kw)
        outs.append(o)
        grads.append(gr)

    def bhsd(ts):  # B rows of (total, H, D) -> (B, H, total, D)
        return torch.stack([t.permute(1, 0, 2) for t in ts])

    full = [bhsd([r[i] for r in rows]) for i in range(4)]
    loc = [shard(t, 2, layout=layout).requires_grad_() for t in full[:3]]
    out = cp_attention(*loc, method=method, layout=layout, backend="tiled", cu_seqlens=cu, **kw)
    out.backward(shard(full[3], 2, layout=layout))
    errs = {"out": _rel_err(out, shard(bhsd(outs), 2, layout=layout))}
    for i, nm in enumerate("qkv"):
        errs["d" + nm] = _rel_err(loc[i].grad, shard(bhsd([g[i] for g in grads]), 2, layout=layout))
    _check(errs, 1e-10)


def _run_hybrid_case(name: str, rank: int, world: int) -> None:
    """ulysses_ring with 2 query heads at P = 4 (Ulysses alone cannot split them) against one process."""
    import longctx
    from longctx.distributed import cp_attention, shard

    hq, hkv = (2, 1) if world == 4 else (2, 2)
    layout = "contiguous" if name.endswith("contiguous") else "zigzag"
    S, B, D = 4 * world * 3, 2, 8
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    q, do = (torch.randn(B, hq, S, D, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, hkv, S, D, generator=g, dtype=torch.float64) for _ in range(2))
    cu = None
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    if name == "hybrid-docs-cp":
        cu = [0, 5, 6, S - 7, S]
        o_ref = torch.stack([
            longctx.flash_attn_varlen_func(
                *(t[b].permute(1, 0, 2) for t in ref), *(torch.tensor(cu, dtype=torch.int32),) * 2, S, S,
                causal=True, backend="math",
            ).permute(1, 0, 2)
            for b in range(B)
        ])  # fmt: skip
    else:
        o_ref = longctx.attention(*ref, causal=True, backend="math")
    o_ref.backward(do)
    loc = [shard(t, 2, layout=layout).requires_grad_() for t in (q, k, v)]
    out = cp_attention(*loc, method="ulysses_ring", ulysses_size=2, layout=layout, causal=True, backend="tiled",
                       cu_seqlens=cu)  # fmt: skip
    out.backward(shard(do, 2, layout=layout))
    errs = {"out": _rel_err(out, shard(o_ref.detach(), 2, layout=layout))}
    for nm, t, r in zip("qkv", loc, ref):
        errs["d" + nm] = _rel_err(t.grad, shard(r.grad, 2, layout=layout))
    _check(errs, 1e-10)


def _run_bf16_case(name: str, rank: int, world: int) -> None:
    """bf16 through the dispatcher: within 2x (+ a floor) of the single-process bf16 varlen kernel's error."""
    import longctx
    from longctx.distributed import dispatch_plan

    cu = _docs(world)
    q, k, v, do = _packed(name, cu[-1])
    out_ref, grads_ref = _varlen_oracle(q, k, v, do, cu, causal=True, window=None)
    cut = torch.tensor(cu, dtype=torch.int32)
    one = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    o1 = longctx.flash_attn_varlen_func(*one, cut, cut, cu[-1], cu[-1], causal=True, backend="tiled")
    o1.backward(do.bfloat16())
    plan = dispatch_plan(cu, causal=True, chunk_size=4)
    loc = [plan.dispatch(t.bfloat16()).requires_grad_() for t in (q, k, v)]
    out = plan.attention(*loc, method="ring", backend="tiled")
    out.backward(plan.dispatch(do.bfloat16()))
    pairs = [(out, o1.detach(), out_ref)] + [(t.grad, s.grad, r) for t, s, r in zip(loc, one, grads_ref)]
    for nm, (a, s, r) in zip(("out", "dq", "dk", "dv"), pairs):
        e_cp = float((a.double() - plan.dispatch(r)).abs().max())
        e_1 = float((plan.dispatch(s).double() - plan.dispatch(r)).abs().max())
        assert e_cp <= 2 * e_1 + 1e-2, f"{nm}: {e_cp:.3e} vs single process {e_1:.3e}"


def _run_other_case(name: str, rank: int, world: int) -> None:
    import torch.distributed as dist

    from longctx.distributed import dispatch_plan

    cu = _docs(world)
    total = cu[-1]
    if name == "roundtrip":
        plan = dispatch_plan(cu, causal=True, chunk_size=4)
        x = torch.arange(total * 3, dtype=torch.float64).reshape(total, 3).requires_grad_()
        loc = plan.dispatch(x)
        assert loc.shape == (total // world, 3)
        assert torch.equal(loc[:, 0].long() // 3, plan.positions())
        full = plan.undispatch(loc)
        assert torch.equal(full, x.detach())
        w = torch.randn(total, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        (full * w).sum().backward()  # the same loss on every rank: x's gradient is w on this rank's rows
        expect = torch.zeros_like(w)
        pos = plan.positions()
        expect[pos] = w[pos]
        assert torch.equal(x.grad, expect)
        # every token on exactly one rank
        allpos = [torch.empty_like(pos) for _ in range(world)]
        dist.all_gather(allpos, pos)
        assert sorted(torch.cat(allpos).tolist()) == list(range(total))
    elif name == "plan-agrees":
        plan = dispatch_plan(cu, causal=True, window=(5, 0), chunk_size=2)
        rows = [None] * world
        dist.all_gather_object(rows, (plan.layout, plan.areas))
        assert all(r == rows[0] for r in rows)
        b = plan.balance()
        assert 1.0 <= b <= 1.25, (b, plan.areas)
    elif name == "plan-default-chunks":
        big = [0, 900, 1000, 1300, 4096 * world]
        plan = dispatch_plan(torch.tensor(big, dtype=torch.int32), causal=True)
        assert plan.chunk_size % 128 == 0 and plan.local_len // plan.chunk_size >= 16, plan.chunk_size
        assert plan.balance() <= 1.1, plan.areas
    else:
        raise KeyError(name)


def _run_bad_case(name: str, rank: int, world: int) -> None:
    from longctx.distributed import cp_attention, dispatch_plan, shard

    cu = _docs(world)
    total = cu[-1]
    if name == "bad-plan-heads":
        plan = dispatch_plan(cu, causal=True, chunk_size=4)
        q = torch.randn(plan.local_len, 3, 8)
        kv = torch.randn(plan.local_len, 3, 8)
        _expect_error(
            lambda: plan.attention(q, kv, kv, method="ulysses"),
            ValueError,
            f"query heads (3) divisible by the context-parallel size ({world})",
        )
    elif name == "bad-hybrid-size":
        q = torch.randn(1, 4, 8, 8)
        _expect_error(
            lambda: cp_attention(q, q, q, method="ulysses_ring", ulysses_size=3), ValueError, "ulysses_size (3)"
        )
        _expect_error(lambda: cp_attention(q, q, q, method="ulysses_ring"), TypeError, "needs ulysses_size")
        _expect_error(lambda: cp_attention(q, q, q, method="ring", ulysses_size=2), ValueError, "ulysses_size is for")
    elif name == "bad-hybrid-heads":
        q = torch.randn(1, 3, 8, 8)
        _expect_error(
            lambda: cp_attention(q, q, q, method="ulysses_ring", ulysses_size=2),
            ValueError,
            "query heads (3) divisible by the ulysses_size (2)",
        )
    elif name == "bad-plan-cu-differs":
        mine = cu if rank == 0 else [0, 2] + cu[2:]
        _expect_error(lambda: dispatch_plan(mine, causal=True, chunk_size=4), ValueError, "different cu_seqlens")
        _expect_error(lambda: dispatch_plan(cu, causal=rank == 0, chunk_size=4), ValueError, "different cu_seqlens")
    elif name == "bad-cp-cu-differs":
        q = torch.randn(1, 2, total // world, 8)
        mine = cu if rank == 0 else [0, 2] + cu[2:]
        _expect_error(lambda: cp_attention(q, q, q, causal=True, cu_seqlens=mine), ValueError, "different shapes")
        _expect_error(
            lambda: cp_attention(q, q, q, causal=True, cu_seqlens=cu if rank else None), ValueError, "different shapes"
        )
    elif name == "bad-plan-cu-one-rank":
        mine = cu if rank != world - 1 else [0, 5, 3, total]
        exp = "non-decreasing" if rank == world - 1 else "invalid arguments on rank(s)"
        _expect_error(lambda: dispatch_plan(mine, chunk_size=4), ValueError, exp)
    elif name == "bad-plan-local-len":
        plan = dispatch_plan(cu, chunk_size=4)
        n = plan.local_len + (1 if rank == 0 else 0)
        q = torch.randn(n, 2, 8)
        exp = "the dispatch plan gives it" if rank == 0 else "invalid input on rank(s) [0]"
        _expect_error(lambda: plan.attention(q, q, q), ValueError, exp)
        _expect_error(lambda: plan.dispatch(torch.randn(total + 1, 2)), ValueError, "whole packed sequence")
    elif name == "bad-plan-not-divisible":
        _expect_error(lambda: dispatch_plan([0, 3, total + 1]), ValueError, "multiple of the context-parallel size")
        _expect_error(lambda: dispatch_plan(cu, chunk_size=0), ValueError, "chunk_size (0)")
    elif name == "bad-cp-cu-total":
        x = shard(torch.randn(1, 2, total, 8), 2)
        _expect_error(
            lambda: cp_attention(x, x, x, cu_seqlens=[0, total // world]),
            ValueError,
            "must equal the number of packed tokens",
        )
    else:
        raise KeyError(name)


def _run_case(name: str, rank: int, world: int) -> None:
    if name.startswith("plan-bf16"):
        _run_bf16_case(name, rank, world)
    elif name.startswith("plan-") and name.count("-") == 2 and name.split("-")[2] in MASKS:
        _run_plan_case(name, rank, world)
    elif name.startswith("cpdocs-"):
        _run_cpdocs_case(name, rank, world)
    elif name.startswith("hybrid-"):
        _run_hybrid_case(name, rank, world)
    elif name.startswith("bad-"):
        _run_bad_case(name, rank, world)
    else:
        _run_other_case(name, rank, world)


@cache
def run_world(world: int) -> dict[str, list[str]]:
    return run_case_world(__name__, world, WORLD_TIMEOUT_S)


@pytest.mark.parametrize("world,name", case_params(WORLDS, case_names, "dispatch_gloo"))
def test_dispatch_gloo(world: int, name: str) -> None:
    results = run_world(world)[name]
    assert_ranks_ok(results)

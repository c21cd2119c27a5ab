"""The dispatcher's pure planning, without processes: mask areas, chunk sizes, the greedy balance, the layouts the
hybrid Ulysses x ring derives, the document-aware call plans, and the errors of a missing init_process_group."""

from __future__ import annotations

import random

import pytest
import torch

from longctx.distributed.blocks import Documents, doc_token_areas, gather_calls, plan_calls
from longctx.distributed.dispatch import balance_chunks, default_chunk_size, plan_layout
from longctx.masks import Band


def _dense_doc_mask(cu: list[int], band: Band) -> torch.Tensor:
    """(total, total) bool: same document and band inside it (the definition)."""
    total = cu[-1]
    doc = torch.empty(total, dtype=torch.int64)
    for d in range(len(cu) - 1):
        doc[cu[d] : cu[d + 1]] = d
    same = doc[:, None] == doc[None, :]
    return same & band.dense_mask(total, total)


CUS = [[0, 1, 7, 7, 40, 42, 48], [0, 48], [0, 1, 2, 3, 48], [0, 20, 21, 48]]
BANDS = [Band(), Band.from_args(1, 1, causal=True), Band.from_args(1, 1, causal=True, window=(5, 0)),
         Band.from_args(1, 1, window=(3, 4))]  # fmt: skip


@pytest.mark.parametrize("cu", CUS)
@pytest.mark.parametrize("band", BANDS)
def test_token_areas_are_the_mask_row_sums(cu, band) -> None:
    assert torch.equal(doc_token_areas(cu, band), _dense_doc_mask(cu, band).sum(1))


@pytest.mark.parametrize("cu", CUS)
@pytest.mark.parametrize("band", BANDS)
def test_doc_calls_cover_the_mask_exactly(cu, band) -> None:
    """The calls planned between two ranks' chunks cover every visible pair once and no masked pair."""
    total = cu[-1]
    docs = Documents(tuple(cu), band)
    layout, _, _ = plan_layout(cu, 4, causal=band.hi == 0, chunk_size=3)
    dense = _dense_doc_mask(cu, band)
    for r in range(4):
        q_chunks = list(layout.chunks[r])
        qpos = torch.cat([torch.arange(g, g + n) for _, n, g in q_chunks])
        got = torch.zeros(total, total, dtype=torch.int64)
        for src in range(4):
            k_chunks = list(layout.chunks[src])
            kpos = torch.cat([torch.arange(g, g + n) for _, n, g in k_chunks])
            for c in plan_calls(docs, q_chunks, k_chunks):
                m = c.band.dense_mask(c.q1 - c.q0, c.k1 - c.k0)
                got[qpos[c.q0 : c.q1][:, None], kpos[c.k0 : c.k1][None, :]] += m.long()
        assert torch.equal(got[qpos], dense[qpos].long()), r
        # the gathered form: keys index the whole sequence
        got = torch.zeros(total, total, dtype=torch.int64)
        for c in gather_calls(docs, q_chunks, total):
            got[qpos[c.q0 : c.q1], c.k0 : c.k1] += c.band.dense_mask(c.q1 - c.q0, c.k1 - c.k0).long()
        assert torch.equal(got[qpos], dense[qpos].long()), r


def test_default_chunk_size() -> None:
    assert default_chunk_size(8192) == 512  # 16 chunks of 4 tiles
    assert default_chunk_size(131072) == 8192
    assert default_chunk_size(1024) == 256  # 4 chunks: no multiple of 128 gives 16
    assert default_chunk_size(1000) == 125  # no multiple of 128 divides it: 8 chunks
    assert default_chunk_size(24) == 3
    assert default_chunk_size(7) == 1


def test_balance_equal_counts_and_greedy() -> None:
    owned = balance_chunks([10, 1, 1, 1, 9, 2, 2, 2], 2)
    assert [len(o) for o in owned] == [4, 4]
    loads = [sum([10, 1, 1, 1, 9, 2, 2, 2][c] for c in o) for o in owned]
    assert loads == [14, 14]


def _sample_cu(total: int, seed: int, cap: int) -> list[int]:
    """Document lengths from a long-tailed distribution (log-normal), capped, packed to exactly ``total``."""
    rng = random.Random(seed)
    cu = [0]
    while cu[-1] < total:
        n = min(cap, max(1, int(rng.lognormvariate(6.0, 1.2))), total - cu[-1])
        cu.append(cu[-1] + n)
    return cu


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("mask", ["causal", "causal_window", "full"])
def test_balance_on_a_realistic_mix(world: int, mask: str) -> None:
    """Long-tailed document lengths up to a quarter of the sequence (LongCA-bench's cap), 8K tokens per rank:
    the dispatcher's max/mean area stays within 1.05 (these seeds give at most 1.006, where a contiguous split of
    the same tokens gives up to 3.0)."""
    total = 8192 * world
    kw = dict(causal=mask != "full", window=(1023, 0) if mask == "causal_window" else None)
    for seed in range(3):
        cu = _sample_cu(total, seed, total // 4)
        layout, areas, cs = plan_layout(cu, world, **kw)
        assert cs == default_chunk_size(total // world)
        assert sorted(g + i for runs in layout.chunks for _, n, g in runs for i in range(n)) == list(range(total))
        balance = max(areas) / (sum(areas) / world)
        tok = doc_token_areas(cu, Band.from_args(1, 1, causal=kw["causal"], window=kw["window"]))
        contiguous = tok.reshape(world, -1).sum(1)
        naive = float(contiguous.max() / contiguous.float().mean())
        assert sum(areas) == int(tok.sum())
        assert balance <= 1.05, (balance, naive, areas)
        assert balance <= naive + 1e-9, (balance, naive)


def test_plan_errors() -> None:
    with pytest.raises(ValueError, match="multiple of the context-parallel size"):
        plan_layout([0, 10], 4)
    with pytest.raises(ValueError, match=r"chunk_size \(3\) must be a positive divisor"):
        plan_layout([0, 16], 2, chunk_size=3)
    with pytest.raises(TypeError, match="chunk_size must be an int"):
        plan_layout([0, 16], 2, chunk_size=2.0)


def test_hybrid_layouts_group_consecutive_ranks() -> None:
    """Zigzag over 4 ranks with all-to-all groups of 2 is zigzag over a ring of 2 groups, each member's runs placed
    in its group's union in global order."""
    from longctx.distributed.attention import _hybrid_layouts

    ring, subs = _hybrid_layouts(16, 4, 2, "zigzag")  # chunks of 2: rank r holds chunks r and 7 - r
    assert ring.chunks == (((0, 4, 0), (4, 4, 12)), ((0, 8, 4),))  # group 1: [4, 8) and [8, 12), one run
    assert subs[0].chunks == (((0, 2, 0), (2, 2, 6)), ((0, 2, 2), (2, 2, 4)))
    assert subs[1].chunks == (((0, 2, 0), (2, 2, 6)), ((0, 2, 2), (2, 2, 4)))


def test_missing_init_process_group_raises() -> None:
    """Without init_process_group the entry points raise (instead of each process attending over its shard as if
    it were the whole sequence); SINGLE_PROCESS runs one process as a group of one, matching varlen attention."""
    import torch.distributed as dist

    import longctx
    from longctx.distributed import SINGLE_PROCESS, cp_attention, dispatch_plan

    assert not (dist.is_available() and dist.is_initialized())
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(RuntimeError, match="init_process_group"):
        cp_attention(q, q, q, causal=True)
    with pytest.raises(RuntimeError, match="SINGLE_PROCESS"):
        dispatch_plan([0, 3, 8])
    cu = [0, 3, 3, 8]
    plan = dispatch_plan(cu, causal=True, group=SINGLE_PROCESS)
    assert plan.balance() == 1.0 and plan.local_len == 8
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(8, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    cut = torch.tensor(cu, dtype=torch.int32)
    ref = longctx.flash_attn_varlen_func(q, k, v, cut, cut, 5, 5, causal=True, backend="math")
    for method in ("ring", "allgather", "ulysses"):
        out = plan.undispatch(plan.attention(*(plan.dispatch(t) for t in (q, k, v)), method=method, backend="tiled"))
        assert torch.allclose(out, ref, atol=1e-12), method


@pytest.mark.parametrize("cu", CUS)
@pytest.mark.parametrize("mask", ["full", "causal", "causal_win", "win2"])
@pytest.mark.parametrize("world,chunk_size", [(2, 4), (4, 3), (4, 1)])
def test_p2p_needs_are_the_visible_chunks(cu, mask, world, chunk_size) -> None:
    """``needs[r][s]`` is exactly the set of rank s's chunks holding a key that some query of rank r sees (the dense
    document mask, brute force), ascending, nothing from rank r itself."""
    from longctx.distributed.dispatch import plan_needs

    kw = {"full": {}, "causal": dict(causal=True), "causal_win": dict(causal=True, window=(5, 0)),
          "win2": dict(window=(3, 4))}[mask]  # fmt: skip
    band = Band.from_args(1, 1, causal=kw.get("causal", False), window=kw.get("window"))
    dense = _dense_doc_mask(cu, band)
    layout, _, cs = plan_layout(cu, world, chunk_size=chunk_size, **kw)
    needs = plan_needs(cu, layout, cs, **kw)
    n_chunks = cu[-1] // cs
    owner = {g // cs + i: r for r, runs in enumerate(layout.chunks) for _, n, g in runs for i in range(n // cs)}
    for r in range(world):
        qpos = torch.cat([torch.arange(g, g + n) for _, n, g in layout.chunks[r]])
        seen = dense[qpos].any(0)  # (total,): keys some query of rank r sees
        for s in range(world):
            expect = [c for c in range(n_chunks) if owner[c] == s != r and bool(seen[c * cs : (c + 1) * cs].any())]
            assert list(needs[r][s]) == expect, (r, s, needs[r][s], expect)


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("mask", ["causal", "causal_window", "full"])
def test_p2p_traffic_at_most_ring(world: int, mask: str) -> None:
    """On long-tailed mixes every rank sends and receives at most what the ring moves (forward and backward), and
    the counts are the plan's chunks times the bytes per token."""
    from longctx.distributed.comm import GroupInfo
    from longctx.distributed.dispatch import DispatchPlan, plan_needs

    total = 8192 * world
    kw = dict(causal=mask != "full", window=(1023, 0) if mask == "causal_window" else None)
    for seed in range(2):
        cu = _sample_cu(total, seed, total // 4)
        layout, areas, cs = plan_layout(cu, world, **kw)
        needs = plan_needs(cu, layout, cs, **kw)
        info = GroupInfo(None, 0, world, "none")
        win = (-1, -1) if kw["window"] is None else kw["window"]
        plan = DispatchPlan(tuple(cu), kw["causal"], win, cs, layout, tuple(areas), needs, info)
        tr = {m: plan.traffic(m, kv_heads=8, head_dim=128) for m in ("p2p", "ring", "allgather")}
        ring = tr["ring"]
        for field in ("forward_sent", "forward_received", "backward_sent", "backward_received"):
            assert all(a <= b for a, b in zip(getattr(tr["p2p"], field), getattr(ring, field))), field
        assert sum(tr["p2p"].forward_sent) == sum(tr["p2p"].forward_received)
        per_tok = 2 * 8 * 128 * 2
        assert tr["p2p"].forward_received[1] == sum(len(ids) for ids in needs[1]) * cs * per_tok
        assert ring.forward_sent[0] == (world - 1) * (total // world) * per_tok == tr["allgather"].forward_sent[0]
        if mask == "causal_window":  # a query chunk of 512 sees at most 3 chunks of 512 before it
            assert tr["p2p"].max_per_rank() < ring.max_per_rank()


def test_p2p_traffic_rejects_other_methods() -> None:
    from longctx.distributed import SINGLE_PROCESS, dispatch_plan

    plan = dispatch_plan([0, 8], causal=True, group=SINGLE_PROCESS)
    with pytest.raises(ValueError, match="traffic is counted for"):
        plan.traffic("ulysses")

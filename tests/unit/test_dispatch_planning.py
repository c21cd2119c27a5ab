"""The dispatcher's pure planning, without processes: mask areas, piece sizes, whole documents and the balance, the
layouts the hybrid Ulysses x ring derives, the document-aware call plans and steps, export rows and needs, and the
errors of a missing init_process_group."""

from __future__ import annotations

import random

import pytest
import torch

from longctx.distributed.blocks import Documents, doc_step, doc_token_areas, export_rows, gather_calls, plan_calls
from longctx.distributed.dispatch import default_chunk_size, plan_layout
from longctx.distributed.placement import doc_band, range_area
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


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, (3, 0)), (False, (2, 5)),
                                           (False, (-1, 4)), (False, (7, -1))])  # fmt: skip
def test_range_area_is_the_sum_of_token_areas(causal, window) -> None:
    band = doc_band(causal, window or (-1, -1))
    for L in (1, 2, 5, 13):
        tok = doc_token_areas([0, L], band)
        for a in range(L + 1):
            for b in range(a, L + 1):
                assert range_area(band, L, a, b) == int(tok[a:b].sum()), (L, a, b)


def _sample_cu(total: int, seed: int, cap: int) -> list[int]:
    """Document lengths from a long-tailed distribution (log-normal), capped, packed to exactly ``total``."""
    rng = random.Random(seed)
    cu = [0]
    while cu[-1] < total:
        n = min(cap, max(1, int(rng.lognormvariate(6.0, 1.2))), total - cu[-1])
        cu.append(cu[-1] + n)
    return cu


def _whole_docs(cu: list[int], layout) -> tuple[int, int]:
    """(documents on one rank, documents in all)."""
    owner = {}
    for r, runs in enumerate(layout.chunks):
        for _, n, g in runs:
            for i in range(g, g + n):
                owner[i] = r
    docs = [(a, b) for a, b in zip(cu, cu[1:]) if b > a]
    return sum(len({owner[i] for i in range(a, b)}) == 1 for a, b in docs), len(docs)


@pytest.mark.parametrize("cu", CUS)
@pytest.mark.parametrize("mask", ["full", "causal", "win2"])
@pytest.mark.parametrize("world,chunk_size", [(2, 4), (4, 3)])
def test_p2p_remote_step_takes_only_the_rows_that_see_received_keys(cu, mask, world, chunk_size) -> None:
    """The p2p remote step runs the local query rows of every piece (a run cut at document boundaries) in which some
    row sees a received key, and no other row (brute force over the dense document mask), laid out in local order
    with their global positions."""
    from longctx.distributed.dispatch import plan_needs
    from longctx.distributed.p2p import routes

    kw = {"full": {}, "causal": dict(causal=True), "win2": dict(window=(3, 4))}[mask]
    band = Band.from_args(1, 1, causal=kw.get("causal", False), window=kw.get("window"))
    dense = _dense_doc_mask(cu, band)
    layout, _, _ = plan_layout(cu, world, chunk_size=chunk_size, **kw)
    needs = plan_needs(cu, layout, **kw)
    docs = Documents(tuple(cu), doc_band(kw.get("causal", False), kw.get("window")))
    for r in range(world):
        rt = routes(layout, needs, docs, r)
        received = [g + i for s_ in range(world) for g, n in needs[r][s_] for i in range(n)]
        local = [(ls + i, g + i) for ls, n, g in layout.chunks[r] for i in range(n)]
        expect = []
        for ls, n, g, _ in docs.pieces(list(layout.chunks[r])):
            if received and bool(dense[g : g + n][:, received].any()):
                expect += range(ls, ls + n)
        expect.sort()
        got = [a + i for a, n in (rt.remote.rows if rt.remote else ()) for i in range(n)]
        assert got == expect, (r, rt.remote)
        if rt.remote is not None:
            pos = [g + i for _, n, g in rt.remote.step.q_chunks for i in range(n)]
            assert pos == [dict(local)[li] for li in got]
        assert (rt.remote is None) == (not got)


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("mask", ["causal", "causal_window", "full"])
def test_balance_on_a_realistic_mix(world: int, mask: str) -> None:
    """Long-tailed document lengths up to a quarter of the sequence (LongCA-bench's cap), 8K tokens per rank: every
    token placed once, the areas counted right, max / mean area within the tolerance (where a contiguous split of
    the same tokens gives up to 3.0), and most documents whole."""
    from longctx.distributed.placement import TOLERANCE

    total = 8192 * world
    kw = dict(causal=mask != "full", window=(1023, 0) if mask == "causal_window" else None)
    for seed in range(3):
        cu = _sample_cu(total, seed, total // 4)
        layout, areas, cs = plan_layout(cu, world, **kw)
        assert cs == default_chunk_size(total // world)
        assert sorted(g + i for runs in layout.chunks for _, n, g in runs for i in range(n)) == list(range(total))
        tok = doc_token_areas(cu, Band.from_args(1, 1, causal=kw["causal"], window=kw["window"]))
        for r in range(world):
            assert areas[r] == sum(int(tok[g : g + n].sum()) for _, n, g in layout.chunks[r])
        balance = max(areas) / (sum(areas) / world)
        assert balance <= 1 + TOLERANCE + 1e-9, (balance, areas)
        whole, n_docs = _whole_docs(cu, layout)
        assert whole >= 0.8 * n_docs, (whole, n_docs)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_documents_that_fit_stay_whole(world: int) -> None:
    """Documents of 1-6 tokens filling every rank exactly: all whole, nothing exported, perfect token balance."""
    cu = [0]
    for _ in range(world):
        for n in (4, 6, 5, 1, 3, 2, 3):
            cu.append(cu[-1] + n)
    for kw in (dict(causal=True), dict(), dict(causal=True, window=(2, 0))):
        layout, areas, _ = plan_layout(cu, world, **kw)
        assert _whole_docs(cu, layout) == (7 * world, 7 * world)
        band = doc_band(kw.get("causal", False), kw.get("window") or (-1, -1))
        assert all(not e for e in export_rows(Documents(tuple(cu), band), layout.chunks))


def test_a_long_document_is_split_and_balanced() -> None:
    """One document of the whole sequence (causal): split into pieces dealt by area, within the tolerance."""
    from longctx.distributed.placement import TOLERANCE

    layout, areas, cs = plan_layout([0, 4096], 4, causal=True)
    assert cs == default_chunk_size(1024) and max(areas) / (sum(areas) / 4) <= 1 + TOLERANCE
    assert all(len(runs) > 1 for runs in layout.chunks)  # every rank holds several pieces


def test_steps_cover_the_mask_exactly() -> None:
    """A `SparseStep` between two ranks' runs covers exactly the keys its calls cover, as one contiguous range."""
    cu = [0, 1, 7, 7, 40, 42, 48]
    for band in BANDS:
        docs = Documents(tuple(cu), band)
        layout, _, _ = plan_layout(cu, 4, causal=band.hi == 0, chunk_size=3)
        for r in range(4):
            for s_ in range(4):
                calls = plan_calls(docs, list(layout.chunks[r]), list(layout.chunks[s_]))
                step = doc_step(docs, layout.chunks[r], layout.chunks[s_])
                if not calls:
                    assert step is None
                    continue
                assert (step.k0, step.k1) == (min(c.k0 for c in calls), max(c.k1 for c in calls))
                assert sum(n for _, n, _ in step.k_chunks) == step.k1 - step.k0


def test_plan_errors() -> None:
    with pytest.raises(ValueError, match="multiple of the context-parallel size"):
        plan_layout([0, 10], 4)
    with pytest.raises(ValueError, match=r"chunk_size \(0\) must be a positive number"):
        plan_layout([0, 16], 2, chunk_size=0)
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
def test_p2p_needs_are_the_visible_tokens(cu, mask, world, chunk_size) -> None:
    """``needs[r][s]`` is exactly the set of rank s's tokens holding a key that some query of rank r sees (the dense
    document mask, brute force), as ascending merged ranges, nothing from rank r itself; the export rows of s are
    the union over r."""
    from longctx.distributed.dispatch import plan_needs

    kw = {"full": {}, "causal": dict(causal=True), "causal_win": dict(causal=True, window=(5, 0)),
          "win2": dict(window=(3, 4))}[mask]  # fmt: skip
    band = Band.from_args(1, 1, causal=kw.get("causal", False), window=kw.get("window"))
    dense = _dense_doc_mask(cu, band)
    layout, _, _ = plan_layout(cu, world, chunk_size=chunk_size, **kw)
    needs = plan_needs(cu, layout, **kw)
    owner = {g + i: r for r, runs in enumerate(layout.chunks) for _, n, g in runs for i in range(n)}
    exports = export_rows(Documents(tuple(cu), band), layout.chunks)
    for r in range(world):
        qpos = torch.cat([torch.arange(g, g + n) for _, n, g in layout.chunks[r]])
        seen = dense[qpos].any(0)  # (total,): keys some query of rank r sees
        for s_ in range(world):
            got = [g + i for g, n in needs[r][s_] for i in range(n)]
            expect = [t for t in range(cu[-1]) if owner[t] == s_ != r and bool(seen[t])]
            assert got == expect, (r, s_, needs[r][s_])
            assert all(a[0] + a[1] < b[0] for a, b in zip(needs[r][s_], needs[r][s_][1:]))  # merged, ascending
    for s_ in range(world):
        union = sorted({g + i for r in range(world) for g, n in needs[r][s_] for i in range(n)})
        assert sorted(g + i for _, n, g in exports[s_] for i in range(n)) == union, s_


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("mask", ["causal", "causal_window", "full"])
def test_traffic_counts(world: int, mask: str) -> None:
    """On long-tailed mixes: p2p receives at most what the ring receives (every other rank's export rows), the
    counts are the plan's tokens times the bytes per token, and sent and received add up over the ranks."""
    from longctx.distributed.comm import GroupInfo
    from longctx.distributed.dispatch import DispatchPlan, plan_needs

    total = 8192 * world
    kw = dict(causal=mask != "full", window=(1023, 0) if mask == "causal_window" else None)
    for seed in range(2):
        cu = _sample_cu(total, seed, total // 4)
        layout, areas, cs = plan_layout(cu, world, **kw)
        needs = plan_needs(cu, layout, **kw)
        info = GroupInfo(None, 0, world, "none")
        win = (-1, -1) if kw["window"] is None else kw["window"]
        plan = DispatchPlan(tuple(cu), kw["causal"], win, cs, layout, tuple(areas), needs, info)
        tr = {m: plan.traffic(m, kv_heads=8, head_dim=128) for m in ("p2p", "ring", "allgather")}
        assert all(a <= b for a, b in zip(tr["p2p"].forward_received, tr["ring"].forward_received))
        for m in ("p2p", "ring"):
            assert sum(tr[m].forward_sent) == sum(tr[m].forward_received), m
            assert sum(tr[m].backward_sent) == sum(tr[m].backward_received), m
        per_tok = 2 * 8 * 128 * 2
        assert tr["p2p"].forward_received[1] == sum(n for ranges in needs[1] for _, n in ranges) * per_tok
        sizes = [sum(n for _, n, _ in e) for e in export_rows(plan.documents, layout.chunks)]
        assert tr["ring"].forward_received[0] == (sum(sizes) - sizes[0]) * per_tok
        assert tr["allgather"].forward_received[0] == (world - 1) * max(sizes) * per_tok


def test_p2p_traffic_rejects_other_methods() -> None:
    from longctx.distributed import SINGLE_PROCESS, dispatch_plan

    plan = dispatch_plan([0, 8], causal=True, group=SINGLE_PROCESS)
    with pytest.raises(ValueError, match="traffic is counted for"):
        plan.traffic("ulysses")

"""Context parallelism on CPU: several gloo processes against single-process `longctx.attention`.

Each world size is spawned once (torch.multiprocessing, a FileStore in a temporary directory, so no port is
needed) and runs every case inside it; each case is then reported as its own test. A case runs on every rank:
all ranks draw the same full-sequence inputs from one seed, compute the single-process reference, shard the
inputs, run `cp_attention` and compare their shard of the output and of dq, dk, dv. Bad inputs must raise on
every rank, and the group must still work for the next case (no rank left hanging).
"""

from __future__ import annotations

import zlib
from functools import cache

import pytest
import torch

from tests.distributed.spawn import CaseSkipped, assert_ranks_ok, case_params, run_case_world

pytestmark = pytest.mark.distributed

WORLDS = (2, 4)
WORLD_TIMEOUT_S = 200


# ---------------------------------------------------------------------------------------------------------
# the cases (each a function run on every rank)
# ---------------------------------------------------------------------------------------------------------


def _heads(world: int) -> list[tuple[int, int]]:
    # MHA, GQA, and (world 4) Hkv < P, which Ulysses handles by kv replication.
    return [(4, 4), (4, 2)] if world == 2 else [(4, 4), (8, 2), (4, 1)]


MASKS = {
    "full": dict(causal=False, window=None),
    "causal": dict(causal=True, window=None),
    "causal_win": dict(causal=True, window=(6, 0)),  # not a multiple of the chunk length
    "win2": dict(causal=False, window=(3, 7)),  # two-sided window
    "causal_win_both": dict(causal=True, window=(6, 6)),  # flash-attn's causal window: the right side taken as 0
}


def _attention_cases(world: int) -> list[str]:
    names = []
    for method in ("ring", "allgather", "ulysses"):
        for layout in ("zigzag", "contiguous"):
            for mask in MASKS:
                for hq, hkv in _heads(world):
                    for dtype in ("float64", "float32"):
                        if dtype == "float32" and mask in ("full", "win2", "causal_win_both"):
                            continue  # float32 on the causal masks is enough; float64 covers every mask
                        if mask == "causal_win_both" and layout != "zigzag":
                            continue  # the same band as causal_win once the call is read
                        names.append(f"attn-{method}-{layout}-{mask}-h{hq}x{hkv}-{dtype}")
    return names


BAD_CASES = [
    "bad-zigzag-odd-length",
    "bad-shard-not-divisible",
    "bad-shapes-differ",
    "bad-args-differ",
    "bad-ulysses-heads",
    "bad-not-4d-on-one-rank",
    "bad-unknown-method",
]
OTHER_CASES = [
    "shard-unshard-roundtrip",
    "merge-two-calls-batch1",
    "gpt-loss-and-grads",
    "gpt-full-recompute",
    "check-through-gloo-twin",
    "ulysses-kv-replication-bf16",
]


def case_names(world: int) -> list[str]:
    if world == 2:
        extra = ["triton-interpreter-ring"]  # the Triton launchers under TRITON_INTERPRET=1
    else:
        extra = ["subgroups-ring", "bench-max-seq"]  # two context-parallel groups of 2 side by side; bench suite --cp
    return _attention_cases(world) + BAD_CASES + OTHER_CASES + extra


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12))


def _run_attention_case(name: str, rank: int, world: int) -> None:
    import longctx
    from longctx.distributed import cp_attention, shard

    _, method, layout, mask, heads, dtype_name = name.split("-")
    hq, hkv = (int(x) for x in heads[1:].split("x"))
    dtype = getattr(torch, dtype_name)
    kw = MASKS[mask]
    chunk = 5  # odd chunk length: ragged against every window
    S = 2 * world * chunk
    B, D = 2, 8
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    q = torch.randn(B, hq, S, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, hkv, S, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, hkv, S, D, generator=g, dtype=torch.float64)
    do = torch.randn(B, hq, S, D, generator=g, dtype=torch.float64)
    # the float64 oracle on the whole sequence (single process)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref = longctx.attention(*ref, backend="math", **kw)
    out_ref.backward(do)
    grads_ref = [t.grad for t in ref]
    # context parallel
    loc = [shard(t.to(dtype), 2, layout=layout).requires_grad_() for t in (q, k, v)]
    out = cp_attention(*loc, method=method, layout=layout, backend="tiled", **kw)
    assert out.dtype == dtype and out.shape == (B, hq, S // world, D), (out.dtype, out.shape)
    out.backward(shard(do.to(dtype), 2, layout=layout))
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    errs = {"out": _rel_err(out, shard(out_ref, 2, layout=layout))}
    for nm, t, gr in zip("qkv", loc, grads_ref):
        errs["d" + nm] = _rel_err(t.grad, shard(gr, 2, layout=layout))
    bad = {k_: e for k_, e in errs.items() if not e <= tol}
    assert not bad, f"errors above {tol}: {bad} (all: {errs})"


def _expect_error(fn, exc, match: str) -> None:
    try:
        fn()
    except exc as e:
        assert match in str(e), f"error message {str(e)!r} does not contain {match!r}"
        return
    raise AssertionError(f"expected {exc.__name__} matching {match!r}, nothing was raised")


def _run_bad_case(name: str, rank: int, world: int) -> None:
    from longctx.distributed import cp_attention, shard

    def qkv(s, hq=4, hkv=2, d=8):
        return torch.randn(1, hq, s, d), torch.randn(1, hkv, s, d), torch.randn(1, hkv, s, d)

    if name == "bad-zigzag-odd-length":
        _expect_error(lambda: cp_attention(*qkv(5), causal=True, layout="zigzag"), ValueError, "divisible by")
    elif name == "bad-shard-not-divisible":
        x = torch.randn(1, 2, 2 * world + 1, 4)
        _expect_error(lambda: shard(x, 2, layout="contiguous"), ValueError, "not divisible by")
        x = torch.randn(1, 2, 3 * world, 4)  # divisible by P, not by 2P
        _expect_error(lambda: shard(x, 2, layout="zigzag"), ValueError, "not divisible by")
    elif name == "bad-shapes-differ":
        s = 4 if rank == 0 else 6
        _expect_error(lambda: cp_attention(*qkv(s), causal=True), ValueError, "different shapes")
    elif name == "bad-args-differ":
        _expect_error(lambda: cp_attention(*qkv(4), causal=rank == 1), ValueError, "different shapes")
    elif name == "bad-ulysses-heads":
        hq, hkv = (3, 3) if world == 2 else (6, 3)
        _expect_error(lambda: cp_attention(*qkv(4, hq, hkv), method="ulysses"), ValueError, "divisible")
    elif name == "bad-not-4d-on-one-rank":
        q, k, v = qkv(4)
        if rank == world - 1:
            q = q[0]
        exc = ValueError
        _expect_error(lambda: cp_attention(q, k, v, causal=True), exc, "invalid input" if rank != world - 1 else "4")
    elif name == "bad-unknown-method":
        _expect_error(lambda: cp_attention(*qkv(4), method="tree"), ValueError, "method must be one of")
    else:
        raise KeyError(name)


def _run_other_case(name: str, rank: int, world: int) -> None:
    from longctx.distributed import cp_attention, shard, unshard

    if name == "shard-unshard-roundtrip":
        for layout in ("zigzag", "contiguous"):
            x = torch.arange(3 * 2 * world * 3).reshape(3, 2 * world * 3)  # same on every rank
            loc = shard(x, 1, layout=layout)
            assert loc.shape == (3, 3 * 2), loc.shape
            assert torch.equal(unshard(loc, 1, layout=layout), x)
        # zigzag gives rank r chunks r and 2P-1-r
        x = torch.arange(2 * world)
        assert shard(x, 0, layout="zigzag").tolist() == [rank, 2 * world - 1 - rank]
        assert shard(x, 0, layout="contiguous").tolist() == [2 * rank, 2 * rank + 1]
    elif name == "merge-two-calls-batch1":
        # longer chunks than a tile of the tiled launcher (128): multi-tile blocks, batch 1, D = 16
        import longctx

        S = 2 * world * 130
        g = torch.Generator().manual_seed(7)
        q, k, v = (torch.randn(1, 4, S, 16, generator=g, dtype=torch.float64) for _ in range(3))
        ref = longctx.attention(q, k, v, causal=True, backend="math")
        for method in ("ring", "allgather", "ulysses"):
            out = cp_attention(*(shard(t, 2) for t in (q, k, v)), causal=True, method=method, backend="tiled")
            assert _rel_err(out, shard(ref, 2)) < 1e-10, method
    elif name == "triton-interpreter-ring":
        import importlib.util

        import longctx

        if importlib.util.find_spec("triton") is None:
            raise CaseSkipped("Triton is not installed: the Triton launchers cannot run under the interpreter")
        S = 2 * world * 9
        g = torch.Generator().manual_seed(3)
        q = torch.randn(1, 4, S, 16, generator=g)
        k, v = (torch.randn(1, 2, S, 16, generator=g) for _ in range(2))
        do = torch.randn(1, 4, S, 16, generator=g)
        ref = [t.double().requires_grad_() for t in (q, k, v)]
        longctx.attention(*ref, causal=True, backend="math").backward(do.double())
        loc = [shard(t, 2).requires_grad_() for t in (q, k, v)]
        out = cp_attention(*loc, causal=True, method="ring", backend="triton")
        out.backward(shard(do, 2))
        for a, r in zip(loc, ref):
            assert _rel_err(a.grad, shard(r.grad, 2)) < 1e-5
    elif name in ("gpt-loss-and-grads", "gpt-full-recompute"):
        _run_gpt_case(name, rank, world)
    elif name == "check-through-gloo-twin":
        _run_twin_case(rank, world)
    elif name == "ulysses-kv-replication-bf16":
        _run_ulysses_bf16_case(rank, world)
    elif name == "subgroups-ring":
        _run_subgroups_case(rank, world)
    elif name == "bench-max-seq":
        _run_bench_max_seq_case(rank, world)
    else:
        raise KeyError(name)


def _run_ulysses_bf16_case(rank: int, world: int) -> None:
    """MQA under Ulysses (one kv head, replicated P times) in bf16: the replicas' dK/dV are summed in float32
    and rounded once, as the single-process kernel does, so the errors against the float64 oracle match the
    kernel's (RMS over the whole sequence within 1%; rounding each replica first measured 0.98x-1.28x)."""
    import torch.distributed as dist

    import longctx
    from longctx.distributed import cp_attention, shard

    S = 2 * world * 16
    g = torch.Generator().manual_seed(21)
    q, do = (torch.randn(1, 4, S, 16, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, 1, S, 16, generator=g, dtype=torch.float64) for _ in range(2))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    longctx.attention(*ref, causal=True, backend="math").backward(do)
    one = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    longctx.attention(*one, causal=True, backend="tiled").backward(do.bfloat16())
    loc = [shard(t.bfloat16(), 2).requires_grad_() for t in (q, k, v)]
    cp_attention(*loc, causal=True, method="ulysses", backend="tiled").backward(shard(do.bfloat16(), 2))
    for name, a, s1, r in zip("qkv", loc, one, ref):
        r_loc = shard(r.grad, 2)
        sq = torch.stack([(a.grad.double() - r_loc).pow(2).sum(), (shard(s1.grad, 2).double() - r_loc).pow(2).sum()])
        dist.all_reduce(sq)
        ratio = float((sq[0] / sq[1]).sqrt())
        assert abs(ratio - 1) < 0.01, f"d{name}: RMS error {ratio:.3f}x the single-process bf16 kernel's"


def _run_twin_case(rank: int, world: int) -> None:
    """The shape check through a gloo twin of the group (what an NCCL group uses): created once, cached, and
    still run on every call (a bad input on one rank raises on all)."""
    import torch.distributed as dist

    import longctx
    import longctx.distributed.attention as cp_attn
    from longctx.distributed import comm, cp_attention, shard

    info = comm.group_info(None)
    assert comm.cpu_group(info) is dist.group.WORLD  # gloo (alone or beside NCCL): the world group itself
    twin = comm.cpu_group(info, reuse_gloo=False)
    assert twin is not None and twin is not info.group and comm.cpu_group(info, reuse_gloo=False) is twin
    saved = cp_attn.cpu_group
    cp_attn.cpu_group = lambda i: comm.cpu_group(i, reuse_gloo=False)
    try:
        S = 2 * world * 4
        g = torch.Generator().manual_seed(11)
        q, k, v = (torch.randn(1, 2, S, 8, generator=g, dtype=torch.float64) for _ in range(3))
        ref = longctx.attention(q, k, v, causal=True, backend="math")
        out = cp_attention(*(shard(t, 2) for t in (q, k, v)), causal=True, backend="tiled")
        assert _rel_err(out, shard(ref, 2)) < 1e-10
        s = 4 if rank == 0 else 6
        bad = [torch.randn(1, 2, s, 8) for _ in range(3)]
        _expect_error(lambda: cp_attention(*bad, causal=True), ValueError, "different shapes")
    finally:
        cp_attn.cpu_group = saved


def _run_subgroups_case(rank: int, world: int) -> None:
    """Two context-parallel groups side by side ({0, 1} and {2, 3}), each with its own sequence; the shape check
    of each goes through its own gloo twin, created by the two pairs at the same time."""
    import torch.distributed as dist

    import longctx
    from longctx.distributed import comm, cp_attention, shard, unshard

    group, _ = dist.new_subgroups(group_size=2)
    info = comm.group_info(group)
    assert info.world == 2 and comm.cpu_group(info, reuse_gloo=False) is not None
    pair = rank // 2
    S = 2 * 2 * 6
    g = torch.Generator().manual_seed(100 + pair)  # a different sequence in each group
    q = torch.randn(1, 4, S, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, S, 8, generator=g, dtype=torch.float64) for _ in range(2))
    ref = longctx.attention(q, k, v, causal=True, backend="math")
    for method in ("ring", "allgather", "ulysses"):
        loc = [shard(t, 2, group=group) for t in (q, k, v)]
        out = cp_attention(*loc, group=group, causal=True, method=method, backend="tiled")
        assert _rel_err(unshard(out, 2, group=group), ref) < 1e-10, method


def _run_bench_max_seq_case(rank: int, world: int) -> None:
    """`bench suite --cp --max-seq` on the CPU: a made-up footprint of 1 KiB per token per process that appears in the
    backward, against a cap of 0.6 MiB, so every search must end at 512 tokens per GPU (over at 768), each
    over-cap try stopping on every rank together in the middle of the backward (1, 2 and 4 processes)."""
    from longctx.bench.suite import cp_longest
    from longctx.bench.suite.cli import config_from_args, cp_stage_args, parser

    parsed = parser().parse_args(
        ["--cp", "--device", "cpu", "--max-seq", "--gpt-preset", "tiny", "--gpt-override", "attention_backend=tiled"]
        + ["--max-seq-gpus", "1,2,4", "--mem-cap-gib", str(0.6 / 1024), "--fake-kib-per-token", "1"]
        + ["--max-seq-start", "512", "--max-seq-warmup-tokens", "256", "--loss-chunk", "200"]
    )
    args = cp_stage_args(parsed, config_from_args(parsed))
    rows = cp_longest.run_max_seq(args)
    assert [r["gpus"] for r in rows] == [1, 2, 4]
    for r in rows:
        assert r["error"] is None, r["error"]
        assert (r["best_tokens_per_gpu"], r["over_tokens_per_gpu"]) == (512, 768), r
        assert r["max_seq"] == 512 * r["gpus"] and r["stop"] == "resolution", r
        over = [t for t in r["tries"] if t["status"] == "over"]
        assert over and all(t["where"].startswith("backward") for t in over), r["tries"]
    for r in rows:  # the warm-up step (256 tokens/GPU) is a point of the line: 512 fits, 768 is predicted over
        assert [(t["n"], t["status"], bool(t["known"])) for t in r["tries"]] == [
            (256, "ok", True), (512, "ok", False), (768, "over", False)], r["tries"]  # fmt: skip
        assert abs(r["gib_per_1k_tokens_per_gpu"] - 1 / 1024) < 1e-9 and abs(r["fixed_gib"]) < 1e-9, r
    md = cp_longest.markdown(rows, args)
    assert "| 4 | 2.0K (0.5K) | 3.0K |" in md, md


def _run_gpt_case(name: str, rank: int, world: int) -> None:
    from longctx.distributed import setup_context_parallel
    from longctx.models.gpt import GPT, GPTConfig, lm_loss

    recompute = {}
    if name == "gpt-full-recompute":
        recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    cfg = GPTConfig.preset("tiny", attention_backend="tiled", **recompute)
    S, B = 4 * world * 4, 2
    torch.manual_seed(1234)
    ref_model = GPT(cfg).double()
    g = torch.Generator().manual_seed(99)
    tokens = torch.randint(0, cfg.vocab_size, (B, S + 1), generator=g)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    mask = torch.rand(B, S, generator=g) < 0.6
    # single process on the whole sequence
    loss_ref = lm_loss(ref_model(inputs), labels, mask)
    loss_ref.backward()
    # context parallel: same initial weights (broadcast from rank 0 anyway)
    for method, layout in (("ring", "zigzag"), ("allgather", "contiguous"), ("ulysses", "zigzag")):
        if method == "ulysses" and (cfg.num_attention_heads % world or (cfg.kv_heads % world and world % cfg.kv_heads)):
            continue
        torch.manual_seed(1234)
        model = GPT(cfg).double()
        model.train()
        cp = setup_context_parallel(model, method=method, layout=layout)
        x, y, m, pos = cp.shard_batch(inputs, labels, mask)
        loss, loss_value = cp.loss(model(x, position_ids=pos), y, m)
        loss.backward()
        cp.allreduce_gradients(model)
        assert abs(float(loss_value) - float(loss_ref)) < 1e-6 * max(1.0, abs(float(loss_ref))), (
            method, float(loss_value), float(loss_ref))  # fmt: skip
        with torch.no_grad():
            logits_ref = ref_model(inputs)
            loss_sum, count, correct = cp.eval_stats(model(x, position_ids=pos), y, m)
        mf = mask.to(torch.float64)
        ref_sum = float((torch.nn.functional.cross_entropy(logits_ref.flatten(0, 1), labels.flatten(), reduction="none")
                         * mf.flatten()).sum())  # fmt: skip
        assert abs(loss_sum - ref_sum) < 1e-6 * abs(ref_sum) and count == float(mf.sum()), (loss_sum, ref_sum, count)
        assert correct == float(((logits_ref.argmax(-1) == labels) & mask).sum()), correct
        for (pn, p), p_ref in zip(model.named_parameters(), ref_model.parameters()):
            err = _rel_err(p.grad, p_ref.grad)
            assert err < 1e-6, f"{method}/{layout}: gradient of {pn} differs, relative error {err:.2e}"


def _run_case(name: str, rank: int, world: int) -> None:
    if name.startswith("attn-"):
        _run_attention_case(name, rank, world)
    elif name.startswith("bad-"):
        _run_bad_case(name, rank, world)
    else:
        _run_other_case(name, rank, world)


# ---------------------------------------------------------------------------------------------------------
# the world: spawned once per size
# ---------------------------------------------------------------------------------------------------------


@cache
def run_world(world: int) -> dict[str, list[str]]:
    """Spawn ``world`` gloo processes once, run every case; returns {case: [result of each rank]}. The interpreter
    is on in the ranks: only the triton case uses it (CPU tensors through the kernels)."""
    return run_case_world(__name__, world, WORLD_TIMEOUT_S, env={"TRITON_INTERPRET": "1"})


@pytest.mark.parametrize("world,name", case_params(WORLDS, case_names, "cp_gloo"))
def test_cp_gloo(world: int, name: str) -> None:
    results = run_world(world)[name]
    assert_ranks_ok(results)


@pytest.mark.parametrize("method", ["ring", "allgather", "ulysses"])
def test_cp_attention_without_torch_distributed(method: str) -> None:
    """torch.distributed not initialised: cp_attention raises unless group=SINGLE_PROCESS, a world of one where
    it is plain attention."""
    import longctx
    from longctx.distributed import SINGLE_PROCESS, cp_attention, shard, unshard

    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, 20, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    with pytest.raises(RuntimeError, match="init_process_group"):
        cp_attention(q, k, v, causal=True, method=method, backend="tiled")
    out = cp_attention(q, k, v, causal=True, method=method, backend="tiled", group=SINGLE_PROCESS)
    ref = longctx.attention(q, k, v, causal=True, backend="math")
    assert torch.allclose(out, ref, atol=1e-12)
    (dq,) = torch.autograd.grad(out.sum(), q)
    (dq_ref,) = torch.autograd.grad(ref.sum(), q)
    assert torch.allclose(dq, dq_ref, atol=1e-12)
    assert torch.equal(unshard(shard(q, 2), 2), q)


def test_ring_plan_skips_masked_blocks_and_fuses_full_ones() -> None:
    """Zigzag causal: every remote step is one dense launcher call of half the pairs; contiguous skips whole steps."""
    from longctx.distributed.blocks import plan_calls
    from longctx.distributed.sharding import local_chunks
    from longctx.masks import Band

    P, c = 4, 8
    S = 2 * P * c
    band = Band.from_args(S, S, causal=True)
    for r in range(P):
        for src in range(P):
            calls = plan_calls(band, local_chunks(S, r, P, "zigzag"), local_chunks(S, src, P, "zigzag"))
            work = sum((cl.q1 - cl.q0) * (cl.k1 - cl.k0) for cl in calls)
            if src == r:  # two causal diagonal blocks and one full block
                assert len(calls) == 3 and work == 3 * c * c
            else:  # all queries x the early key chunk, or the late query chunk x all keys
                assert len(calls) == 1 and calls[0].band == Band() and work == 2 * c * c
            calls = plan_calls(band, local_chunks(S, r, P, "contiguous"), local_chunks(S, src, P, "contiguous"))
            assert len(calls) == (0 if src > r else 1)
    # non-causal: one dense call per step
    calls = plan_calls(Band(), local_chunks(S, 1, P, "zigzag"), local_chunks(S, 2, P, "zigzag"))
    assert len(calls) == 1 and (calls[0].q0, calls[0].q1, calls[0].k0, calls[0].k1) == (0, 2 * c, 0, 2 * c)


def _linear_try(a: float, b: float, cap: float, calls: list):
    def try_fn(n):
        calls.append(n)
        peak = a + b * n
        return dict(status="ok" if peak <= cap else "over", peak=peak, secs=1.0)

    return try_fn


@pytest.mark.parametrize("truth", [700, 5000, 61_000, 250_000])
def test_search_longest_brackets_the_crossing(truth: int) -> None:
    """Doubling, then bisection with the linear prediction: the bracket holds the true crossing, within the
    resolution, in a handful of tries; and started from an earlier result with its line, in two or three."""
    from longctx.bench.search import QUANTUM, search_longest

    a, b = 6e9, 170e3  # fixed bytes, bytes per token
    cap = a + b * (truth + 0.5)
    calls: list[int] = []
    r = search_longest(_linear_try(a, b, cap, calls), start=8192, cap=cap, res=0.08)
    best, over = r["best"], r["over"]
    expect = truth // QUANTUM * QUANTUM
    if expect < QUANTUM:
        assert best is None and r["stop"] == "nothing fits"
        return
    assert best is not None and over is not None and best <= truth < over, r
    assert best % QUANTUM == 0 and over - best <= max(QUANTUM, 0.08 * best), r
    assert r["stop"] == "resolution" and len(calls) <= 9, calls
    calls2: list[int] = []
    r2 = search_longest(_linear_try(a, b, cap, calls2), start=best, cap=cap, res=0.08, prior=(a, b))
    assert (r2["best"], len(calls2) <= 3) == (best, True), (r2, calls2)


def test_search_longest_stops_on_errors_budget_and_limit() -> None:
    from longctx.bench.search import search_longest

    r = search_longest(lambda n: dict(status="error", peak=0.0, secs=1.0), start=1024, cap=1.0)
    assert r["best"] is None and r["stop"] == "error" and len(r["tries"]) == 1
    t = [0.0]

    def slow(n):
        t[0] += n / 1000.0  # seconds grow with n
        return dict(status="ok", peak=0.0, secs=n / 1000.0)

    r = search_longest(slow, start=1024, cap=1.0, budget_s=20.0, clock=lambda: t[0])
    assert r["stop"].startswith("time budget") and r["best"] == 4096 and r["over"] is None, r  # 7 s + 16 s > 20
    r = search_longest(lambda n: dict(status="ok", peak=0.0, secs=0.0), start=1024, cap=1.0, limit=5000)
    assert r["stop"] == "limit" and r["best"] == 4864, r


def test_bench_hidden_states_and_chunked_loss_match_the_gpt() -> None:
    """bench suite --cp --max-seq takes the loss from the final hidden states in chunks: the same loss and gradients as
    the GPT's own logits (the mirror of GPT.forward must not drift from it)."""
    import torch.nn.functional as F

    from longctx.bench.suite.cp_longest import _final_hidden, _output_weight, chunked_lm_loss_sum
    from longctx.models.gpt import GPT, GPTConfig

    recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    for shared in (True, False):
        cfg = GPTConfig.preset(
            "tiny", attention_backend="math", share_embeddings_and_output_weights=shared, **recompute
        )
        torch.manual_seed(0)
        model = GPT(cfg).double()
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, cfg.vocab_size, (2, 41), generator=g)
        x, y = tokens[:, :-1], tokens[:, 1:]
        pos = torch.arange(40)
        ref = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum")
        grads_ref = torch.autograd.grad(ref, list(model.parameters()))
        loss = chunked_lm_loss_sum(_final_hidden(model, x, pos), _output_weight(model), y, chunk=16)
        grads = torch.autograd.grad(loss, list(model.parameters()))
        # the chunks take their cross-entropy in float32 (as under bf16 autocast): float32 agreement
        assert abs(loss.item() - ref.item()) < 1e-6 * abs(ref.item())
        for gr, g0 in zip(grads, grads_ref):
            assert _rel_err(gr, g0) < 1e-5

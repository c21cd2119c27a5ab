"""`longctx bench suite --cp` on the CPU: two gloo processes run the context-parallel mode on tiny shapes; every rank
returns the same rows, band masks and packed documents run, the rest are recorded as unsupported, and rank 0
writes the report folder."""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import traceback

import pytest

from tests.distributed.spawn import spawn_world

pytestmark = pytest.mark.distributed

WORLD = 2


def _worker(rank: int, world: int, store_path: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    result: dict = {}
    try:
        store = dist.FileStore(store_path, world)
        timeout = datetime.timedelta(seconds=120)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        from longctx.bench.suite.cp import run_cp
        from longctx.bench.suite.kernel import SuiteConfig
        from longctx.bench.suite.report import write_report

        cfg = SuiteConfig(
            seqs=[64], masks=["causal", "causal_document", "share_question"], providers=[], seeds=[0], Hq=4, Hkv=2,
            D=16, dtype="fp32", device="cpu", mask_params={"window": 16},
        )  # fmt: skip
        rows = run_cp(cfg, [64], ["ring", "allgather", "ulysses", "p2p"], warmup=1, iters=1, whole=True)
        result["rows"] = rows
        if rank == 0:
            write_report(os.path.join(out_dir, "report"), rows, {"gpu": "cpu", "world": world, "command": "test"})
            result["md"] = pathlib.Path(out_dir, "report", "summary.md").read_text()
        try:
            run_cp(cfg, [64], ["no_such"])
        except ValueError as e:
            result["bad_method"] = str(e)
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported to the test
        result["error"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def test_cp_mode_with_gloo():
    per_rank, hung = spawn_world(_worker, WORLD, timeout_s=150)
    assert not hung, f"ranks {hung} hung"
    for r, res in enumerate(per_rank):
        assert "error" not in res, f"rank {r}:\n{res.get('error')}"
    rows0, rows1 = per_rank[0]["rows"], per_rank[1]["rows"]
    key = lambda r: (r["provider"], r["mask"], r["S"], r["code"])  # noqa: E731
    assert [key(r) for r in rows0] == [key(r) for r in rows1]
    by = {(r["provider"], r["mask"]): r for r in rows0}
    # single GPU at the tokens per GPU, each method at S = 64 x 2
    assert by[("single_gpu", "causal")]["S"] == 64 and by[("ring", "causal")]["S"] == 128
    for meth in ("ring", "allgather", "ulysses", "p2p"):
        for mask in ("causal", "causal_document")[1 if meth == "p2p" else 0 :]:
            r = by[(meth, mask)]
            assert r["code"] == "ok", (meth, mask, r["reason"])
            assert r["world"] == WORLD and r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["fwd_tflops"] > 0
            # the backward is forward + backward minus forward, or empty with the reason (never a made-up time)
            if r["bwd_ms"] is None:
                assert r["bwd_tflops"] is None and r["reason"].startswith("backward not derived"), r
            else:
                assert r["bwd_ms"] == pytest.approx(r["fwd_bwd_ms"] - r["fwd_ms"]) and r["bwd_ms"] > 0, r
            # per-GPU FLOPs: the mask's kept area at S = 128, over 2 ranks
            assert r["fwd_tflops"] == pytest.approx(4 * r["kept_area"] * 4 * 16 / WORLD / r["fwd_ms"] * 1e-9)
        assert by[(meth, "share_question")]["code"] == "unsupported"
    assert by[("ring", "causal")]["kept_area"] == 128 * 129 // 2
    assert by[("single_gpu", "share_question")]["code"] == "ok"
    assert "## Context parallelism: 2 ranks" in per_rank[0]["md"]
    # p2p: packed documents only; one GPU on the whole sequence: the strong-scaling reference of every mask
    assert by[("p2p", "causal_document")]["code"] == "ok" and by[("p2p", "causal")]["code"] == "unsupported"
    one = by[("one_gpu", "causal_document")]
    assert one["code"] == "ok" and one["S"] == 128 and one["world"] == 1 and one["fwd_bwd_ms"] > 0, one
    assert "against one GPU on the whole sequence" in per_rank[0]["md"]
    assert "unknown context-parallel method 'no_such'" in per_rank[0]["bad_method"]


def _check_worker(rank: int, world: int, store_path: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    result: dict = {}
    try:
        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))  # fmt: skip
        from longctx.bench.suite.cli import main

        out = os.path.join(out_dir, "run")
        result["rc"] = main(["--cp", "--device", "cpu", "--cp-check", "--cp-no-sweep", "--check-seqlen", "64",
                             "--heads", "2/2", "--d", "16", "--check-kv-heads", "2", "--cp-backend", "tiled",
                             "--out", out])  # fmt: skip
        if rank == 0:
            result["md"] = pathlib.Path(out, "check.md").read_text()
            result["rows"] = json.loads(pathlib.Path(out, "check.json").read_text())["rows"]
    except Exception:  # noqa: BLE001 - reported to the test
        result["error"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def test_cp_check_through_the_suite_cli():
    """``--cp --cp-check``: every dense method and layout against the float64 oracle, next to the single-process
    kernel, written to check.md / check.json of the run folder; exit status 0 when every row passes."""
    per_rank, hung = spawn_world(_check_worker, WORLD, timeout_s=150)
    assert not hung, f"ranks {hung} hung"
    for r, res in enumerate(per_rank):
        assert "error" not in res, f"rank {r}:\n{res.get('error')}"
        assert res["rc"] == 0, res
    rows = per_rank[0]["rows"]
    combos = {(r["mask"], r["method"], r["layout"]) for r in rows}
    assert len(combos) == 3 * 3 * 2 and all(r["ok"] for r in rows), rows
    assert "| causal | ring | zigzag |" in per_rank[0]["md"] and "| NO |" not in per_rank[0]["md"]

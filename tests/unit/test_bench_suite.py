"""`longctx bench suite`: the report writer, the result codes and ``--quick`` end to end through the CLI (CPU)."""

from __future__ import annotations

import csv
import io
import json
import os
import pathlib
import warnings

import pytest
import torch

from longctx.bench.suite import kernel
from longctx.bench.suite.case import COLUMNS, ERROR, OK, OOM, SKIPPED, UNSUPPORTED, KernelCase, Unsupported
from longctx.bench.suite.kernel import SuiteConfig, run_kernel
from longctx.bench.suite.providers import REGISTRY, get_provider
from longctx.bench.suite.providers.base import Provider
from longctx.bench.suite.report import markdown, write_report
from longctx.masks import make_mask

META = {"gpu": "TestGPU", "command": "longctx bench suite --s 4096", "torch": "9.9", "B": 1, "Hq": 64, "Hkv": 8}


def _row(provider, mask, S, fwd=None, bwd=None, code=OK, seed=None, backend="", reason="", mem=None):
    case = KernelCase(make_mask(mask, S, seed=seed), 1, 64, 8, 128, "bf16", "cpu")
    fwd_ms = None if fwd is None else case.fwd_flops() / fwd * 1e-9  # the ms that gives `fwd` TFLOP/s
    bwd_ms = None if bwd is None else case.bwd_flops() / bwd * 1e-9
    return case.row(
        provider, fwd_tflops=fwd, bwd_tflops=bwd, fwd_ms=fwd_ms, bwd_ms=bwd_ms, code=code, backend=backend,
        reason=reason, peak_extra_mib=mem,
    )  # fmt: skip


def _rows():
    return [
        _row("longctx_triton", "causal", 4096, 400, 300, backend="triton", mem=10),
        _row("cudnn", "causal", 4096, 500, 250, mem=12),
        _row("flex", "causal", 4096, 200, 150, mem=30),
        _row("longctx_triton", "causal_document", 4096, code=UNSUPPORTED, seed=0, reason="needs a block mask"),
        _row("longctx_triton_sparse", "causal_document", 4096, 300, 200, seed=0, backend="triton_sparse"),
        _row("longctx_triton_sparse", "causal_document", 4096, 100, 180, seed=1, backend="triton_sparse"),
        _row("longctx_triton_sparse", "causal_document", 4096, 200, 190, seed=2, backend="triton_sparse"),
        _row("flex", "causal_document", 4096, 100, 100, seed=0),
        _row("flex", "causal_document", 4096, 100, 100, seed=1),
        _row("flex", "causal_document", 4096, code=OOM, seed=2, reason="OutOfMemoryError: CUDA out of memory"),
        _row("cudnn", "causal_document", 4096, code=UNSUPPORTED, seed=0, reason="SDPA expresses only full and causal"),
        _row("longctx_triton", "causal", 16384, 450, 350, backend="triton", mem=40),
        _row("math", "causal", 16384, code=SKIPPED, reason="capped: needs ~64 GiB"),
    ]


def test_report_files_hold_every_row_and_the_summary_the_ratios(tmp_path):
    rows = _rows()
    build = [{"mask": "causal", "S": 16384, "longctx_ms": 1.25, "flex_ms": 9.5, "error": ""}]
    paths = write_report(str(tmp_path), rows, META, build)
    with open(paths["csv"]) as f:
        got = list(csv.DictReader(f))
    assert len(got) == len(rows) and list(got[0]) == list(COLUMNS)
    assert got[0]["provider"] == "longctx_triton" and float(got[0]["fwd_tflops"]) == 400
    assert [r["code"] for r in got].count(UNSUPPORTED) == 2
    with open(paths["json"]) as f:
        payload = json.load(f)
    assert payload["meta"]["gpu"] == "TestGPU" and payload["results"] == rows and payload["mask_build"] == build
    md = pathlib.Path(paths["md"]).read_text()
    assert "# longctx bench suite: TestGPU" in md and "`longctx bench suite --s 4096`" in md
    lines = md.splitlines()
    causal = next(ln for ln in lines if ln.startswith("| causal | 0.500 |"))  # S = 4096, forward
    cells = [c.strip() for c in causal.strip("|").split("|")]
    # mask, kept, longctx_triton, cudnn, flex, triton_sparse, math, best, ours/cuDNN, ours/Flex
    assert cells[2:5] == ["400", "500", "200"] and cells[-3:] == ["cudnn", "0.80", "2.00"]
    doc = next(ln for ln in lines if ln.startswith("| causal_document (3 seeds)"))
    cells = [c.strip() for c in doc.strip("|").split("|")]
    assert cells[2] == "n/a" and cells[3] == "n/a"  # triton: unsupported; cuDNN: unsupported
    assert cells[4] == "OOM"  # flex: one seed of three ran out of memory
    assert cells[5] == "200"  # triton_sparse: the median over the seeds
    assert "| causal | 1.2 | 9.5 |" in md  # mask build
    assert "capped: needs ~64 GiB" in md and "OutOfMemoryError" in md
    assert "## S = 16384: forward TFLOP/s" in md


def test_summary_of_context_parallel_rows():
    rows = [
        _row("single_gpu", "causal", 2048, 400, 400),
        _row("ring", "causal", 4096, 200, 200),
        _row("ulysses", "causal", 4096, code=UNSUPPORTED, reason="heads"),
    ]
    rows[0].update(mode="cp", world=1)
    for r in rows[1:]:
        r.update(mode="cp", world=2)
    md = markdown(rows, META, [])
    assert "| 2048 | 4096 | causal | 400.0 | 200.0 (50%) | n/a |" in md
    # a CP row keeps its measured forward + backward; a backward that cannot be derived stays empty
    fwd_ms = rows[1]["fwd_ms"]
    rows[1].update(bwd_ms=None, bwd_tflops=None, fwd_bwd_ms=fwd_ms * 3.5 / 2, reason="backward not derived")
    md = markdown(rows, META, [])
    assert "| 2048 | 4096 | causal | 400.0 | 400.0 (100%) | n/a |" in md


class _Raises(Provider):
    family = "peer"

    def __init__(self, name, exc):
        self.name, self.exc = name, exc

    def build(self, case):
        def fn(q, k, v):
            raise self.exc

        return fn


class _Unsupported(Provider):
    name = "says_no"

    def supports(self, case):
        return "no kernel for this mask"


class _LateUnsupported(Provider):
    name = "late_no"

    def build(self, case):
        raise Unsupported("found out when building")


def test_result_codes_never_crash_the_run(monkeypatch):
    fakes = {
        "oom": _Raises("oom", torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64 GiB")),
        "boom": _Raises("boom", RuntimeError("an internal failure")),
        "says_no": _Unsupported(),
        "late_no": _LateUnsupported(),
    }
    monkeypatch.setattr(kernel, "get_provider", lambda name: fakes[name] if name in fakes else get_provider(name))
    cfg = SuiteConfig(
        seqs=[64], masks=["causal", "causal_document"], providers=["oom", "boom", "says_no", "late_no", "tiled"],
        seeds=[0], Hq=2, Hkv=1, D=16, dtype="fp32", device="cpu", rep=1, warmup=1,
    )  # fmt: skip
    rows = run_kernel(cfg, stream=io.StringIO())
    by = {(r["provider"], r["mask"]): r for r in rows}
    assert len(rows) == 10
    assert by[("oom", "causal")]["code"] == OOM and "out of memory" in by[("oom", "causal")]["reason"]
    assert by[("boom", "causal")]["code"] == ERROR and "internal failure" in by[("boom", "causal")]["reason"]
    assert by[("says_no", "causal_document")]["code"] == UNSUPPORTED
    assert by[("late_no", "causal")]["code"] == UNSUPPORTED and "building" in by[("late_no", "causal")]["reason"]
    for mask in ("causal", "causal_document"):
        r = by[("tiled", mask)]
        assert r["code"] == OK and r["fwd_ms"] > 0 and r["bwd_ms"] > 0 and r["backend"] == "tiled"
        assert r["fwd_tflops"] == pytest.approx(4 * r["kept_area"] * 2 * 16 / r["fwd_ms"] * 1e-9)
        assert r["bwd_tflops"] == pytest.approx(2.5 * 4 * r["kept_area"] * 2 * 16 / r["bwd_ms"] * 1e-9)
    assert by[("tiled", "causal")]["kept_area"] == 64 * 65 // 2


def test_time_budget_skips_the_rest():
    cfg = SuiteConfig(
        seqs=[64], masks=["causal", "full"], providers=["tiled"], Hq=2, Hkv=1, D=16, dtype="fp32", device="cpu",
        rep=1, warmup=1, budget_s=0.0,
    )  # fmt: skip
    rows = run_kernel(cfg, stream=io.StringIO())
    assert [r["code"] for r in rows] == [SKIPPED, SKIPPED] and "budget" in rows[0]["reason"]


def test_one_run_holds_several_shapes_layouts_and_length_caps():
    cases = [
        KernelCase(make_mask("full", 32), 2, 4, 4, 16, "fp32", "cpu"),
        KernelCase(make_mask("causal", 64), 1, 4, 2, 32, "fp32", "cpu", "bshd"),
    ]
    q, k, v = cases[1].inputs()
    assert q.shape == (1, 4, 64, 32) and k.shape == (1, 2, 64, 32) and q.transpose(1, 2).is_contiguous()
    with pytest.raises(ValueError, match="layout"):
        KernelCase(make_mask("full", 32), 1, 1, 1, 16, "fp32", "cpu", "sbhd")
    cfg = SuiteConfig(
        seqs=[], masks=[], providers=["math", "tiled"], dtype="fp32", device="cpu", rep=1, warmup=1,
        s_caps={"tiled": 32},
    )  # fmt: skip
    rows = kernel.run_cases(cases, cfg, stream=io.StringIO())
    got = [(r["provider"], r["S"], r["B"], r["Hq"], r["Hkv"], r["D"], r["code"]) for r in rows]
    assert got == [
        ("math", 32, 2, 4, 4, 16, OK), ("tiled", 32, 2, 4, 4, 16, OK),
        ("math", 64, 1, 4, 2, 32, OK), ("tiled", 64, 1, 4, 2, 32, SKIPPED),
    ]  # fmt: skip
    assert rows[3]["reason"] == "capped at S <= 32 in this run"
    assert rows[2]["fwd_tflops"] == pytest.approx(4 * (64 * 65 // 2) * 4 * 32 / rows[2]["fwd_ms"] * 1e-9)


def test_gpu_providers_say_why_not_on_the_cpu():
    case = KernelCase(make_mask("causal", 128), 1, 4, 2, 32, "fp32", "cpu")
    for name in ("longctx_triton", "longctx_triton_sparse", "cudnn", "fa2", "flash_attn"):
        assert "CUDA" in get_provider(name).supports(case), name
    doc = KernelCase(make_mask("causal_document", 128), 1, 4, 2, 32, "bf16", "cpu")
    assert "block mask" in get_provider("longctx_triton").supports(doc)
    assert set(REGISTRY) >= {"longctx_auto", "cudnn", "fa2", "flex", "tiled", "math"}
    with pytest.raises(ValueError, match="unknown provider 'cudnn9'"):
        get_provider("cudnn9")


def test_quick_end_to_end_through_the_cli(tmp_path, capsys):
    from longctx.cli.main import main

    out = str(tmp_path / "run")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # FlexAttention's eager-mode warning is not the user's business
        assert main(["bench", "suite", "--quick", "--out", out]) == 0
    names = set(os.listdir(out))
    assert {"results.csv", "results.json", "summary.md"} <= names
    with open(os.path.join(out, "results.json")) as f:
        payload = json.load(f)
    rows = payload["results"]
    masks = {r["mask"] for r in rows}
    assert len(masks) == 15 and {r["provider"] for r in rows} == {"longctx_auto", "tiled", "math", "flex"}
    assert all(r["code"] == OK for r in rows if r["provider"] in ("longctx_auto", "tiled", "math")), [
        (r["provider"], r["mask"], r["reason"]) for r in rows if r["code"] != OK
    ]
    assert all(r["fwd_tflops"] > 0 for r in rows if r["code"] == OK and r["kept_area"] > 0)
    assert payload["meta"]["command"] == f"longctx bench suite --quick --out {out}"
    assert len(payload["mask_build"]) == 15 and all(b["longctx_ms"] is not None for b in payload["mask_build"])
    md = pathlib.Path(out, "summary.md").read_text()
    assert "## S = 256: forward TFLOP/s" in md and "| block_causal_document |" in md
    # every empty section says why: no memory count on the CPU, no plot of what was not measured
    assert "Not measured: peak memory is read from torch.cuda.max_memory_allocated" in md
    assert "- memory.png: not drawn" in md and "- cp.png: not drawn" in md
    try:
        import matplotlib  # noqa: F401

        assert "tflops_fwd.png" in names
    except ImportError:
        pass


def test_cli_rejects_bad_names(capsys):
    from longctx.cli.main import main

    with pytest.raises(SystemExit):
        main(["bench", "suite", "--quick", "--masks", "causal,nope"])
    assert "unknown masks ['nope']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "suite", "--quick", "--heads", "6/4"])


def test_merge_takes_each_length_from_the_run_that_measured_it(tmp_path, capsys):
    from longctx.cli.main import main as cli_main

    first = [_row("longctx_triton", "causal", 4096, 400, 300), _row("flex", "causal", 16384, code=SKIPPED)]
    second = [_row("longctx_triton", "causal", 16384, 450, 350), _row("flex", "causal", 16384, 300, 200)]
    write_report(str(tmp_path / "a"), first, dict(META, command="run a"))
    write_report(str(tmp_path / "b"), second, dict(META, command="run b"))
    out = tmp_path / "merged"
    assert cli_main(["bench", "suite", "--merge", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)]) == 0
    data = json.loads((out / "results.json").read_text())
    got = sorted((r["S"], r["provider"], r["code"]) for r in data["results"])
    assert got == [(4096, "longctx_triton", OK), (16384, "flex", OK), (16384, "longctx_triton", OK)]
    assert data["meta"]["command"] == "run a ; run b"
    with pytest.raises(ValueError, match="no results.json"):
        cli_main(["bench", "suite", "--merge", str(tmp_path), "--out", str(out)])


@pytest.mark.parametrize("other", [dict(gpu="OtherGPU"), dict(torch="9.8"), dict(Hq=32)])
def test_merge_refuses_runs_of_another_gpu_stack_or_shape(tmp_path, other):
    from longctx.cli.main import main as cli_main

    write_report(str(tmp_path / "a"), [_row("longctx_triton", "causal", 4096, 400, 300)], META)
    write_report(str(tmp_path / "b"), [_row("longctx_triton", "causal", 16384, 450, 350)], dict(META, **other))
    key = next(iter(other))
    with pytest.raises(ValueError, match=f"another setup .*{key}"):
        cli_main(["bench", "suite", "--merge", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "m")])
    assert not (tmp_path / "m").exists()

"""`longctx bench attention` as a front end of the suite: end to end on the CPU, the row conversion, the report."""

from __future__ import annotations

import json
import pathlib

import pytest

from longctx.bench import attention
from longctx.bench.suite.case import ERROR, OK, OOM, SKIPPED, UNSUPPORTED
from longctx.cli.main import main

RESULTS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "results"
HEADER = "| case | triton | cudnn | fa2 | flex | tiled | math | ours/cuDNN fwd | ours/FA2 fwd | ours/FA2 bwd |"


def _table(md: str) -> list[str]:
    return [ln for ln in md.splitlines() if ln.startswith("|")]


def test_cpu_run_end_to_end_writes_the_report_with_the_old_provider_names(tmp_path, capsys):
    argv = ["bench", "attention", "--device", "cpu", "--quick", "--providers", "triton,cudnn,fa2,flex,tiled,math"]
    assert main(argv + ["--out-dir", str(tmp_path)]) == 0
    capsys.readouterr()
    md = (tmp_path / "attention_cpu.md").read_text()
    payload = json.loads((tmp_path / "attention_cpu.json").read_text())
    assert (tmp_path / "attention_cpu.partial.json").exists()
    lines = _table(md)
    assert lines[0] == HEADER
    assert "| case | triton | cudnn | fa2 | flex | tiled | math |" in lines  # the memory table
    labels = [ln.split("|")[1].strip() for ln in lines[2:5]]
    assert labels == ["D=32 S=64 full", "D=32 S=64 causal", "D=32 S=64 causal GQA 4/2"]
    assert payload["meta"]["gpu"] == "cpu" and payload["meta"]["dtype"] == "fp32"
    rows = payload["results"]
    assert len(rows) == 3 * 6
    assert {r["provider"] for r in rows} == set(attention.PROVIDERS)
    assert set(rows[0]) == {"case", "provider", "fwd_ms", "bwd_ms", "fwd_tflops", "bwd_tflops", "peak_extra_mib",
                            "note", "extra"}  # fmt: skip
    by = {(r["provider"], attention.Case(**r["case"]).label): r for r in rows}
    for p in ("triton", "cudnn", "fa2"):  # CUDA providers: skipped with the reason, never an error
        r = by[(p, "D=32 S=64 causal")]
        assert r["fwd_tflops"] is None and r["note"].startswith("skip: needs a CUDA device")
        assert r["extra"]["code"] == UNSUPPORTED
    for p in ("tiled", "math"):
        for label in labels:
            r = by[(p, label)]
            assert r["extra"]["code"] == OK and r["fwd_tflops"] > 0 and r["bwd_tflops"] > 0, r
    flex = by[("flex", "D=32 S=64 causal GQA 4/2")]
    assert flex["fwd_tflops"] > 0 and flex["bwd_tflops"] is None and flex["note"].startswith("forward only")
    cells = [c.strip() for c in lines[3].strip("|").split("|")]  # D=32 S=64 causal
    assert cells[1:4] == ["skip", "skip", "skip"] and cells[4].endswith("/ -") and "/" in cells[5]
    # the run's JSON merges back into the same tables
    out = tmp_path / "merged"
    assert main(["bench", "attention", "--merge", str(tmp_path / "attention_cpu.json"), "--out-dir", str(out)]) == 0
    assert _table((out / "attention_cpu.md").read_text()) == lines


@pytest.mark.parametrize("stem", ["attention_H100-80GB-HBM3", "attention_H100-80GB-HBM3_d64-d128"])
def test_committed_gpu_results_rewrite_to_the_same_tables(stem, tmp_path, capsys):
    src = RESULTS / f"{stem}.json"
    if not src.exists():
        pytest.skip(f"{src} is not in this checkout")
    assert main(["bench", "attention", "--merge", str(src), "--out-dir", str(tmp_path)]) == 0  # no --tag
    capsys.readouterr()
    (md,) = tmp_path.glob("attention_*.md")
    assert _table(md.read_text()) == _table((RESULTS / f"{stem}.md").read_text())


def _suite_row(code=OK, fwd_ms=2.0, bwd_ms=4.0, mib=10.0, reason="", mask="causal", provider="longctx_triton"):
    case = attention.Case(d=64, s=1024, causal=mask == "causal", hq=32, hkv=32, b=16)
    kc = attention.kernel_case(case, "bf16", "cpu")
    return case, kc.row(provider, code=code, fwd_ms=fwd_ms, bwd_ms=bwd_ms, peak_extra_mib=mib, reason=reason)


def test_suite_rows_convert_with_this_sweeps_flops_and_peak():
    case, row = _suite_row()
    r = attention.to_result(row)
    assert r.case == case and r.provider == "triton"  # the suite's longctx_triton under its name here
    flops = 4.0 * 16 * 32 * 1024 * 1024 * 64 * 0.5  # causal: half of S x S, not the kept area S (S + 1) / 2
    assert r.fwd_tflops == pytest.approx(flops / 2.0 * 1e-9) and r.bwd_tflops == pytest.approx(2.5 * flops / 4.0 * 1e-9)
    assert r.peak_extra_mib == pytest.approx(10.0 + 16 * 32 * 1024 * 64 * 2 / 2**20)  # + the bf16 upstream gradient
    assert r.note == "" and r.extra == {"code": OK, "backend": ""}
    _, fwd_only = _suite_row(bwd_ms=None, reason="forward only: no backward")
    r = attention.to_result(fwd_only)
    assert r.bwd_tflops is None and r.peak_extra_mib is None and r.note == "forward only: no backward"
    for code, note in ((SKIPPED, "skip: "), (UNSUPPORTED, "skip: "), (OOM, "error: "), (ERROR, "error: ")):
        _, row = _suite_row(code=code, fwd_ms=None, bwd_ms=None, mib=None, reason="why", mask="full", provider="math")
        r = attention.to_result(row)
        assert r.provider == "math" and not r.case.causal and r.note == note + "why" and r.fwd_tflops is None


def test_providers_take_the_old_names_and_the_suites(capsys):
    ap = attention.argparse.ArgumentParser()
    assert attention._provider_list(ap, "triton,cudnn") == ["triton", "cudnn"]
    assert attention._provider_list(ap, "longctx_triton,longctx_auto, math") == ["triton", "longctx_auto", "math"]
    with pytest.raises(SystemExit):
        attention._provider_list(ap, "triton,nope")
    assert "unknown provider 'nope'" in capsys.readouterr().err


def test_cases_follow_the_flashattention_shapes():
    cases = attention.build_cases([64, 128], [1024, 16384], [False, True], gqa=True)
    assert all(c.b * c.s == 16384 for c in cases)
    assert all(c.hq * c.d == 2048 for c in cases if c.hq == c.hkv)
    gqa = [c for c in cases if c.hq != c.hkv]
    assert [(c.hq, c.hkv, c.d, c.causal, c.s) for c in gqa] == [(32, 8, 128, True, 1024), (32, 8, 128, True, 16384)]
    kc = attention.kernel_case(cases[0], "bf16", "cpu", "bshd")
    assert (kc.B, kc.Hq, kc.Hkv, kc.D, kc.S, kc.mask.name, kc.layout) == (16, 32, 32, 64, 1024, "full", "bshd")

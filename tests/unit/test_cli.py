"""The `longctx` command line."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import longctx
from longctx.cli.main import main


def test_info(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "tiled" in out and "math" in out


def test_check_passes(capsys):
    assert main(["check", "--seed", "0"]) == 0
    out = capsys.readouterr().out
    assert "all backends agree with the oracle" in out
    assert out.count(" ok") >= 10  # tiled and math on every case


def test_check_reports_a_backend_that_raises(capsys, monkeypatch):
    """One backend raising (e.g. a peer's compiler on an odd shape) is a failing row; the other rows still run."""
    from longctx.cli import commands as tools

    real = tools.attention

    def flaky(*args, backend=None, **kw):
        if backend == "tiled":
            raise RuntimeError("simulated compiler error\nsecond line")
        return real(*args, backend=backend, **kw)

    monkeypatch.setattr(tools, "attention", flaky)
    assert main(["check", "--seed", "0"]) == 1
    out = capsys.readouterr().out
    assert "ERROR (RuntimeError: simulated compiler error)" in out and "second line" not in out
    assert " ok" in out  # math still checked
    assert "failing rows" in out


@pytest.mark.parametrize("what", ["out", "grad", "inf"])
def test_check_fails_a_backend_returning_garbage(capsys, monkeypatch, what):
    """A NaN output, a NaN gradient or an inf output makes the row fail: a NaN error is never skipped."""
    from longctx.cli import commands as tools

    real = tools.attention

    class _PoisonGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return torch.full_like(g, float("nan"))

    def garbage(q, *args, backend=None, **kw):
        if backend != "tiled":
            return real(q, *args, backend=backend, **kw)
        if what == "grad":
            q = _PoisonGrad.apply(q)
        res = real(q, *args, backend=backend, **kw)
        out, lse = res if isinstance(res, tuple) else (res, None)
        if what in ("out", "inf"):
            out = out + float("nan" if what == "out" else "inf")
        return (out, lse) if isinstance(res, tuple) else out

    monkeypatch.setattr(tools, "attention", garbage)
    assert main(["check", "--seed", "0"]) == 1
    out = capsys.readouterr().out
    tiled_rows = [line for line in out.splitlines() if line.startswith("tiled ")]
    assert tiled_rows and all("FAIL" in line for line in tiled_rows), out
    assert "all backends agree" not in out and "failing rows" in out


def test_failing_skips_only_what_was_not_compared():
    from longctx.cli.commands import failing

    pt = dict(out=1e-3, lse=1e-3, dq=1e-3, dk=1e-3, dv=1e-3)
    ok = dict(out=1e-3, lse=None, dq=1e-3, dk=1e-3, dv=1e-3)
    assert failing(ok, pt, torch.bfloat16) == []
    assert failing({**ok, "dq": float("nan")}, pt, torch.bfloat16) == ["dq"]
    assert failing({**ok, "out": float("inf")}, pt, torch.bfloat16) == ["out"]
    assert failing({**ok, "dv": 2 * 1e-3 + 2e-3 + 1e-6}, pt, torch.bfloat16) == ["dv"]


def test_error_vs_oracle_reports_nan_for_a_nan_among_finite_values():
    """torch's max may skip NaN on some paths; the error must be NaN whenever any element is."""
    from longctx.cli.commands import error_vs_oracle
    from longctx.masks import Band

    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 2, 16, 8, generator=g) for _ in range(4))

    def run(a, b, c):
        out, lse = longctx.attention(a, b, c, backend="math", return_lse=True)
        out = out.clone()
        out[0, 0, 3, 1] = float("nan")
        return out, lse

    ours, _ = error_vs_oracle(q, k, v, do, run, scale=8**-0.5, band=Band.from_args(16, 16, False))
    assert ours["out"] != ours["out"] and ours["lse"] == ours["lse"]


def test_demo_memory_small(capsys):
    assert main(["demo-memory", "--lengths", "128,256"]) == 0
    out = capsys.readouterr().out
    assert "tiled" in out and "256" in out


def test_module_entry_point_help():
    r = subprocess.run([sys.executable, "-m", "longctx", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "info" in r.stdout and "train" in r.stdout


def test_version(capsys):
    import longctx

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"longctx {longctx.__version__}"


def test_module_entry_point_version():
    import longctx

    r = subprocess.run([sys.executable, "-m", "longctx", "--version"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == f"longctx {longctx.__version__}"


@pytest.mark.parametrize("which", ["attention", "recompute", "suite"])
def test_bench_subcommands_are_reachable(which, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", which, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert f"longctx bench {which}" in out
    if which == "suite":  # the one context-parallel benchmark: the sweep, the check, the longest sequence
        assert "--cp-check" in out and "--max-seq" in out


def test_the_older_context_parallel_benchmark_is_gone(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "cp"])
    assert exit_.value.code == 2


def test_train_help_lists_every_flag_with_its_default(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--train-iters", "--resume", "--overwrite", "--on-nonfinite", "--num-layers", "--save"):
        assert flag in out
    assert "(default: 1500)" in out and "metrics.jsonl" in out


@pytest.mark.parametrize(
    "argv",
    [[], ["plan"], ["train"], ["warmup"], ["bench"], ["bench", "suite"], ["bench", "attention"], ["bench", "compile"],
     ["bench", "memory"], ["bench", "recompute"], ["bench", "transformers"], ["check"], ["info"]],
    ids=lambda a: " ".join(a) or "longctx",
)  # fmt: skip
def test_help_is_plain_text_in_whole_sentences(argv, capsys):
    """No reStructuredText markup in --help, and a description that does not stop mid-sentence."""
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "``" not in out, out
    description = out.split("\n\n")[1] if "\n\n" in out else ""
    assert not description.rstrip().endswith(("(", ",", "also")), description


def test_bench_lists_each_benchmark_with_its_description(capsys):
    assert main(["bench"]) == 0
    out = capsys.readouterr().out
    assert "suite" in out and "the Long-Context Attention Benchmark" in out and "compile time seen by training" in out

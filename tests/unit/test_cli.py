"""The `longctx` command line."""

from __future__ import annotations

import subprocess
import sys

import pytest

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


@pytest.mark.parametrize("which", ["attention", "recompute", "cp"])
def test_bench_subcommands_are_reachable(which, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", which, "--help"])
    assert exit_.value.code == 0
    assert f"longctx bench {which}" in capsys.readouterr().out


def test_train_help_lists_every_flag_with_its_default(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--train-iters", "--resume", "--overwrite", "--on-nonfinite", "--num-layers", "--save"):
        assert flag in out
    assert "(default: 1500)" in out and "metrics.jsonl" in out

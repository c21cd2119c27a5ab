"""The `longctx` command line."""

from __future__ import annotations

import subprocess
import sys

from longctx.cli import main


def test_info(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "tiled" in out and "math" in out


def test_check_passes(capsys):
    assert main(["check", "--seed", "0"]) == 0
    out = capsys.readouterr().out
    assert "all backends agree with the oracle" in out
    assert out.count(" ok") >= 10  # tiled and math on every case


def test_demo_memory_small(capsys):
    assert main(["demo-memory", "--lengths", "128,256"]) == 0
    out = capsys.readouterr().out
    assert "tiled" in out and "256" in out


def test_module_entry_point_help():
    r = subprocess.run([sys.executable, "-m", "longctx", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "info" in r.stdout and "train" in r.stdout

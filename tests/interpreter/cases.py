"""The case runner of the interpreter modules: the interpreter must be on before Triton compiles anything in the
process, and another module in the same xdist worker may already have imported Triton, so a module's cases run in
one subprocess started with TRITON_INTERPRET=1 that prints one ``CASE <json>`` line per case."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def run_cases(script: str, cases: dict) -> dict:
    """Run ``script`` (it gets ``json.dumps(cases)`` as its argument) under the interpreter; its records by case
    name, ``__auto__`` for an ``AUTO <json>`` line, and the end of its stderr as ``__stderr__``. Fails the test when
    the subprocess printed no record."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("LONGCTX_ATTN_BACKEND", None)
    env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", script, json.dumps(cases)], env=env, capture_output=True, text=True, timeout=600
    )
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("CASE "):
            rec = json.loads(line[5:])
            results[rec["name"]] = rec
        elif line.startswith("AUTO "):
            results["__auto__"] = json.loads(line[5:])
    if not results:
        pytest.fail(f"interpreter subprocess produced nothing (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    results["__stderr__"] = proc.stderr[-4000:]
    return results

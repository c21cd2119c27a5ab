"""`import longctx` stays cheap: the compiler stack (torch._dynamo) loads only when something compiles."""

from __future__ import annotations

import subprocess
import sys


def test_import_does_not_load_dynamo():
    code = "import longctx, sys; assert 'torch._dynamo' not in sys.modules, 'import longctx imported torch._dynamo'"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]

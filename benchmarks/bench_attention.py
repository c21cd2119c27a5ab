"""Attention benchmark (same as `longctx bench attention`); see `longctx.bench.attention` for the options."""

from __future__ import annotations

import sys

from longctx.bench.attention import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

"""Context-parallel attention benchmark (same as `longctx bench cp`); run it under torchrun:

    PYTHONPATH=src torchrun --nproc-per-node 2 benchmarks/bench_cp.py --check

See `longctx.bench.cp` for the options.
"""

from __future__ import annotations

import sys

from longctx.bench.cp import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

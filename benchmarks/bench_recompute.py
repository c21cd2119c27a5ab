"""Peak memory and step time of a ~350M GPT under activation recomputation (see longctx.bench.recompute).

PYTHONPATH=src python benchmarks/bench_recompute.py            # on the GPU
PYTHONPATH=src python benchmarks/bench_recompute.py --quick    # CPU smoke run
"""

import sys

from longctx.bench.recompute import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

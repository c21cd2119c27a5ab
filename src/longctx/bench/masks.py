"""The mask table, as an alias of ``longctx bench suite``: block-sparse attention and packed documents, longctx's
``triton_sparse`` against FlexAttention (causal sliding window 4096, causal packed documents, random block layouts
at 10% and 50%, causal for scale; B=1, H=16/16, D=128, bf16 by default), plus the mask build times.

It runs the suite's kernel mode on that subset and writes the suite's folder (CSV, JSON, Markdown, PNG) to
``<out-dir>/masks_<gpu>[<tag>]/``. ``longctx bench suite`` covers every mask and provider.

    python -m longctx.bench.masks [--s 16384,65536] [--heads 16] [--d 128] [--no-flex] [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from longctx.bench import result_stem

__all__ = ["main", "MASKS"]

MASKS = "causal_sliding_window,causal_document,block_sparse_10,block_sparse_50,causal"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m longctx.bench.masks", description=__doc__.splitlines()[0])
    ap.add_argument("--s", default="16384,65536", help="sequence lengths")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--quick", action="store_true", help="S=16K only, short timing")
    ap.add_argument("--out-dir", default=os.path.join("benchmarks", "results"))
    ap.add_argument("--tag", default="", help="suffix naming what the run covers (e.g. _64k), not when")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("longctx.bench.masks: needs a CUDA GPU (longctx bench suite --quick is the CPU version)", file=sys.stderr)
        return 1
    from longctx.bench.suite import main as suite_main

    out = result_stem(args.out_dir, "masks", torch.cuda.get_device_name(), args.tag)
    suite_argv = [
        "--s", "16384" if args.quick else args.s, "--masks", MASKS, "--seeds", "0",
        "--providers", "longctx_triton_sparse" + ("" if args.no_flex else ",flex"),
        "--heads", f"{args.heads}/{args.heads}", "--d", str(args.d), "--window", str(args.window), "--out", out,
    ]  # fmt: skip
    if args.quick:
        suite_argv += ["--rep", "20", "--warmup", "5"]
    return suite_main(suite_argv)


if __name__ == "__main__":
    raise SystemExit(main())

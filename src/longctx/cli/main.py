"""The `longctx` command: info | check | demo-memory | bench | plan | train | warmup, and ``--version``.

Subcommands that live in other modules receive the rest of the command line: each such module has a
``main(argv: list[str] | None) -> int``. Those modules load only when their subcommand runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from longctx import __version__

# name -> (module with main(argv), one-line help)
_DELEGATED = {
    "train": ("longctx.training.trainer", "train a GPT (embedded long-context recall task, or --data file.txt)"),
    "plan": ("longctx.memory.plan", "the recompute / offloading plan that fits a memory budget, and its breakdown"),
    "warmup": (
        "longctx.warmup",
        "compile the attention kernels a model needs ahead of training (no first-call stalls)",
    ),
}
_BENCHES = {
    "compile": ("longctx.bench.compile", "compile time seen by training: first calls, new lengths, new packings"),
    "suite": ("longctx.bench.suite", "the Long-Context Attention Benchmark: every mask, provider, length; --cp"),
    "attention": ("longctx.bench.attention", "dense attention at FlashAttention's benchmark shapes (D 64-256)"),
    "recompute": ("longctx.bench.recompute", "memory and step time under activation recomputation"),
    "memory": ("longctx.bench.memory", "longest trainable S, tokens/s and peak memory against transformers"),
    "transformers": (
        "longctx.bench.transformers",
        "a transformers Llama or Gemma 2 with longctx (apply) against plain transformers",
    ),
}


def _run_delegated(module: str, argv: list[str]) -> int:
    return int(importlib.import_module(module).main(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    """Run the ``longctx`` command line.

    Args:
        argv: the arguments after ``longctx`` (None: ``sys.argv[1:]``).

    Returns:
        The exit status of the subcommand (0 on success). ``--help`` and ``--version`` exit through
        ``SystemExit(0)``, as argparse does.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="longctx",
        description="longctx: train transformers on long sequences within the memory of your GPUs. "
        "`longctx COMMAND --help` describes each command.",
    )
    parser.add_argument("--version", action="version", version=f"longctx {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("info", help="versions, the GPU and the available backends")
    p_check = sub.add_parser("check", help="run every available backend against the float64 oracle")
    p_check.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p_check.add_argument("--seed", type=int, default=None)
    p_mem = sub.add_parser("demo-memory", help="memory of tiled vs math attention at growing lengths")
    p_mem.add_argument("--lengths", default="512,1024,2048,4096")
    p_mem.add_argument("--device", default=None)
    for name, (_, help_) in _DELEGATED.items():
        sub.add_parser(name, help=help_, add_help=False)
    p_bench = sub.add_parser(
        "bench",
        help="benchmarks: " + ", ".join(_BENCHES),
        description="The benchmarks; results go to benchmarks/results.",
    )
    benches = p_bench.add_subparsers(dest="which", metavar="BENCHMARK")
    for name, (_, help_) in _BENCHES.items():
        benches.add_parser(name, help=help_, add_help=False)

    if argv and argv[0] in _DELEGATED:
        return _run_delegated(_DELEGATED[argv[0]][0], argv[1:])
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in _BENCHES:
        return _run_delegated(_BENCHES[argv[1]][0], argv[2:])
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "bench":  # `longctx bench` alone: the list of benchmarks
        p_bench.print_help()
        return 0
    from longctx.cli import commands as tools

    if args.command == "info":
        return tools.info()
    if args.command == "check":
        return tools.check(device=args.device, seed=args.seed)
    if args.command == "demo-memory":
        return tools.demo_memory([int(x) for x in args.lengths.split(",")], device=args.device)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())

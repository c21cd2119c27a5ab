"""The command line of ``longctx bench suite``: options, the run folder, the header facts (see the package doc)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys

import torch

from longctx.bench import result_stem
from longctx.bench.suite.case import DTYPES
from longctx.bench.suite.cp_longest import CRITERIA
from longctx.bench.suite.kernel import SuiteConfig, run_build_timing, run_kernel
from longctx.bench.suite.providers import provider_names
from longctx.bench.suite.report import write_report
from longctx.masks import mask_names
from longctx.units import count_arg, counts_arg

GPU_SEQS = [4096, 16384, 65536]
GPU_PROVIDERS = provider_names()
QUICK_SEQS = [256]
QUICK_PROVIDERS = ["longctx_auto", "tiled", "math", "flex"]
QUICK_MASK_PARAMS = {"window": 64, "block": 64, "global_tokens": 16, "block_size": 32}


_ints = counts_arg("a list of sizes")


def _names(all_names: list[str], what: str):
    def parse(s: str) -> list[str]:
        got = [x.strip() for x in s.split(",") if x.strip()]
        if got == ["all"]:
            return list(all_names)
        bad = [x for x in got if x not in all_names]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {what} {bad}; expected 'all' or some of {','.join(all_names)}")
        return got

    return parse


def _heads(s: str) -> tuple[int, int]:
    try:
        hq, hkv = (int(x) for x in s.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--heads takes Hq/Hkv, e.g. 64/8 or 16/16; got {s!r}") from None
    if hq < 1 or hkv < 1 or hq % hkv:
        raise argparse.ArgumentTypeError(f"--heads {s}: Hq and Hkv must be >= 1 with Hq a multiple of Hkv")
    return hq, hkv


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="longctx bench suite",
        description="The Long-Context Attention Benchmark: every mask, provider and length (kernel mode), or "
        "context-parallel methods (--cp, under torchrun).",
    )
    ap.add_argument("--quick", action="store_true", help="a small CPU run of the same code (CI)")
    ap.add_argument("--out", default=None, help="the run folder (default benchmarks/results/suite_<gpu>[x<P>_cp])")
    ap.add_argument("--s", type=_ints, default=None, help="sequence lengths (default 4096,16384,65536)")
    ap.add_argument("--masks", type=_names(mask_names(), "masks"), default=None, help="catalogue names or 'all'")
    ap.add_argument("--providers", type=_names(provider_names(), "providers"), default=None, help="names or 'all'")
    ap.add_argument("--seeds", type=_ints, default=None, help="seeds of the document masks (default 0,1,2)")
    ap.add_argument("--batch", type=count_arg("--batch"), default=1)
    ap.add_argument("--heads", type=_heads, default=None, help="Hq/Hkv (default 64/8; LongCA's other setting: 16/16)")
    ap.add_argument("--d", type=count_arg("--d"), default=None, help="head dim (default 128)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bf16 (fp32 with --quick)")
    ap.add_argument("--window", type=count_arg("--window"), default=None, help="sliding windows (default 1024)")
    ap.add_argument(
        "--block", type=count_arg("--block"), default=None, help="block of block_causal_document (default 512)"
    )
    ap.add_argument(
        "--global-tokens",
        type=count_arg("--global-tokens"),
        default=None,
        help="global tokens of global_sliding_window (128)",
    )
    ap.add_argument(
        "--doc-cap", type=count_arg("--doc-cap"), default=None, help="longest document of the document masks (S / 4)"
    )
    ap.add_argument(
        "--doc-median",
        type=count_arg("--doc-median"),
        default=None,
        help="median document length of the document masks (1024)",
    )
    ap.add_argument("--warmup", type=int, default=None, help="do_bench warm-up ms (default 10)")
    ap.add_argument("--rep", type=int, default=None, help="do_bench ms of repetitions (default 40)")
    ap.add_argument("--no-bwd", action="store_true", help="forward only")
    ap.add_argument("--budget-s", type=float, default=None, help="start no case after this many seconds")
    ap.add_argument("--provider-budget-s", type=float, default=None, help="stop running a provider after this long")
    ap.add_argument("--no-build-timing", action="store_true", help="skip the mask build timings")
    ap.add_argument("--device", default=None, help="cuda or cpu (default cuda; cpu with --quick)")
    ap.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="RUN_DIR",
        help="write one report (to --out) from several run folders, each length taken from the last run with a "
        "measured row at it (runs split by length to fit a time budget)",
    )
    ap.add_argument("--cp", action="store_true", help="context-parallel mode (run under torchrun)")
    ap.add_argument("--tokens-per-gpu", type=_ints, default=[8192], help="--cp: tokens per GPU (weak scaling)")
    ap.add_argument("--cp-methods", default="ring,allgather,ulysses", help="--cp: methods (longctx.bench.suite.cp)")
    ap.add_argument(
        "--cp-iters", type=count_arg("--cp-iters"), default=5, help="--cp: timed calls per point (after 2 untimed)"
    )
    ap.add_argument(
        "--cp-whole",
        action="store_true",
        help="--cp: also time one GPU on the whole sequence (strong scaling: the reference of packed documents)",
    )
    ap.add_argument("--cp-no-sweep", action="store_true", help="--cp: no timed sweep (--cp-check, --max-seq only)")
    c = ap.add_argument_group("--cp-check: NCCL bf16 correctness of cp_attention against a float64 oracle, first")
    c.add_argument("--cp-check", action="store_true", help="--cp: run the check before the sweep")
    c.add_argument("--check-seqlen", type=count_arg("--check-seqlen"), default=8192, help="its sequence length")
    c.add_argument("--check-kv-heads", type=count_arg("--check-kv-heads"), default=4, help="its kv heads (GQA)")
    c.add_argument("--check-layouts", default="zigzag,contiguous", help="its sequence layouts")
    c.add_argument("--cp-backend", default="auto", choices=("auto", "tiled", "triton"), help="the launchers")
    m = ap.add_argument_group("--max-seq: the longest sequence that trains a GPT on 1, ..., P GPUs under a memory cap")
    m.add_argument("--max-seq", action="store_true", help="--cp: search it after the sweep")
    m.add_argument("--gpt-preset", default="gpt2-medium", help="the GPT (longctx.models.PRESETS)")
    m.add_argument("--gpt-override", default="", help="GPTConfig fields, e.g. num_layers=2,hidden_size=64")
    m.add_argument("--max-seq-gpus", type=_ints, default=None, help="GPU counts to search (default 1 and all)")
    m.add_argument("--mem-cap-gib", type=float, default=16.0, help="memory cap per GPU (GiB)")
    m.add_argument("--max-seq-start", type=int, default=8192, help="first try, tokens per GPU")
    m.add_argument("--max-seq-criterion", choices=CRITERIA, default="allocated",
                   help="under the cap: peak allocated + --max-seq-margin-gib, or peak reserved")  # fmt: skip
    m.add_argument("--max-seq-margin-gib", type=float, default=1.0, help="the margin of the allocated criterion")
    m.add_argument("--max-seq-res", type=float, default=0.08, help="stop when [fit, misfit] is within this")
    m.add_argument("--max-seq-budget-s", type=float, default=150.0, help="wall-clock budget of the whole search")
    m.add_argument("--max-seq-limit", type=int, default=1 << 21, help="never try more tokens per GPU than this")
    m.add_argument("--max-seq-warmup-tokens", type=int, default=1024, help="tokens/GPU of the unmeasured first step")
    m.add_argument("--loss", default="chunked", choices=("chunked", "full"), help="how the loss is made")
    m.add_argument("--loss-chunk", type=int, default=1024, help="tokens of logits at a time (--loss chunked)")
    m.add_argument("--fake-kib-per-token", type=float, default=0.0, help="CPU smoke runs/tests: a made-up peak")
    return ap


def config_from_args(args: argparse.Namespace) -> SuiteConfig:
    """Defaults: LongCA's kernel settings on CUDA; tiny fp32 shapes with --quick."""
    quick = args.quick
    device = args.device or ("cpu" if quick else "cuda")
    hq, hkv = args.heads or ((4, 2) if quick else (64, 8))
    params = dict(QUICK_MASK_PARAMS) if quick else {}
    for k in ("window", "block", "global_tokens"):
        if getattr(args, k) is not None:
            params[k] = getattr(args, k)
    for k, name in (("doc_cap", "cap"), ("doc_median", "median")):
        if getattr(args, k) is not None:
            params[name] = getattr(args, k)
    return SuiteConfig(
        seqs=args.s or (QUICK_SEQS if quick else GPU_SEQS),
        masks=args.masks or mask_names(),
        providers=args.providers or (QUICK_PROVIDERS if quick else GPU_PROVIDERS),
        seeds=args.seeds or ([0] if quick else [0, 1, 2]),
        B=args.batch,
        Hq=hq,
        Hkv=hkv,
        D=args.d or (32 if quick else 128),
        dtype=args.dtype or ("fp32" if quick else "bf16"),
        device=device,
        mask_params=params,
        warmup=args.warmup if args.warmup is not None else (1 if quick else 10),
        rep=args.rep if args.rep is not None else (2 if quick else 40),
        bwd=not args.no_bwd,
        budget_s=args.budget_s,
        provider_budget_s=args.provider_budget_s,
        build_timing=not args.no_build_timing,
    )


def meta_for(cfg: SuiteConfig, argv: list[str], world: int = 1) -> dict:
    """The header facts: device name, versions, the exact command and the run's settings."""
    from longctx import __version__

    cuda = cfg.device.startswith("cuda")
    try:
        import triton

        tv = triton.__version__
    except ImportError:
        tv = None
    return {
        "gpu": torch.cuda.get_device_name() if cuda else "cpu",
        "world": world,
        "command": "longctx bench suite " + shlex.join(argv),
        "longctx": __version__,
        "torch": torch.__version__,
        "triton": tv,
        "cuda": torch.version.cuda if cuda else None,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "B": cfg.B,
        "Hq": cfg.Hq,
        "Hkv": cfg.Hkv,
        "D": cfg.D,
        "dtype": cfg.dtype,
        "seqs": cfg.seqs,
        "seeds": cfg.seeds,
        "mask_params": cfg.mask_params,
        "timer": "triton.testing.do_bench medians" if cuda else "perf_counter medians",
    }


def default_out(meta: dict, cp: bool) -> str:
    gpu = meta["gpu"] + (f"x{meta['world']}" if cp else "")
    return result_stem(os.path.join("benchmarks", "results"), "suite", gpu, "_cp" if cp else "")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.merge:
        return _merge(args.merge, args.out)
    cfg = config_from_args(args)
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        print(
            "longctx bench suite: no CUDA device here; run it on a GPU, or pass --quick (or --device cpu) for the "
            "CPU version",
            file=sys.stderr,
        )
        return 1
    if args.cp:
        return _main_cp(args, cfg, argv)
    meta = meta_for(cfg, argv)
    out = args.out or default_out(meta, cp=False)
    print(f"longctx bench suite: {meta['gpu']}, torch {meta['torch']}, writing {out}", file=sys.stderr, flush=True)
    rows = run_kernel(cfg, on_row=lambda rows: write_report(out, rows, meta) if len(rows) % 25 == 0 else None)
    build = run_build_timing(cfg, cfg.providers) if cfg.build_timing else []
    paths = write_report(out, rows, meta, build)
    print(f"wrote {paths['md']}, {paths['csv']}, {paths['json']}" + "".join(f", {p}" for p in paths["png"]))
    return 0


# What two runs must share to be one report (its header states them once).
MERGE_SAME = ("gpu", "world", "torch", "triton", "cuda", "cudnn", "B", "Hq", "Hkv", "D", "dtype", "mask_params")


def _merge(run_dirs: list[str], out: str | None) -> int:
    """One report from several kernel-mode run folders: each sequence length's rows come from the last folder that
    measured something at it (so a run's budget-skipped lengths give way to a run made for them). Runs of another
    GPU, software stack or shape are refused (`MERGE_SAME`)."""
    import json

    if not out:
        raise ValueError("--merge needs --out: the folder of the merged report")
    runs = []
    for d in run_dirs:
        path = os.path.join(d, "results.json")
        if not os.path.exists(path):
            raise ValueError(f"--merge: {d!r} has no results.json (not a longctx bench suite run folder)")
        with open(path) as f:
            runs.append(json.load(f))
    first = runs[0]["meta"]
    for d, run in zip(run_dirs[1:], runs[1:]):
        differ = [k for k in MERGE_SAME if run["meta"].get(k) != first.get(k)]
        if differ:
            what = ", ".join(f"{k} {first.get(k)!r} vs {run['meta'].get(k)!r}" for k in differ)
            raise ValueError(
                f"--merge: {d!r} was measured on another setup than {run_dirs[0]!r} ({what}); merge only runs of "
                "one GPU, one software stack and one shape, and keep the others as reports of their own"
            )
    by_len: dict[int, list[dict]] = {}
    for run in runs:
        for S in sorted({r["S"] for r in run["results"]}):
            rows = [r for r in run["results"] if r["S"] == S]
            if any(r["code"] == "ok" for r in rows):
                by_len[S] = rows
    rows = [r for S in sorted(by_len) for r in by_len[S]]
    meta = dict(runs[0]["meta"])
    meta["command"] = " ; ".join(run["meta"]["command"] for run in runs)
    build = next((run.get("mask_build") for run in reversed(runs) if run.get("mask_build")), None)
    paths = write_report(out, rows, meta, build)
    print(f"wrote {paths['md']}, {paths['csv']}, {paths['json']}")
    return 0


def _main_cp(args: argparse.Namespace, cfg: SuiteConfig, argv: list[str]) -> int:
    import torch.distributed as dist

    from longctx.bench.suite.cp import run_cp
    from longctx.distributed import init_distributed

    init_distributed("nccl" if cfg.device.startswith("cuda") else "gloo")
    if not dist.is_initialized():
        print("longctx bench suite --cp: under torchrun: torchrun --nproc-per-node N -m longctx.bench.suite --cp")
        return 1
    if cfg.device.startswith("cuda"):
        cfg.device = f"cuda:{torch.cuda.current_device()}"
    methods = [m.strip() for m in args.cp_methods.split(",") if m.strip()]
    if args.masks is None:
        cfg.masks = ["full", "causal", "causal_sliding_window", "causal_document"]
    world, rank = dist.get_world_size(), dist.get_rank()
    meta = meta_for(cfg, argv, world)
    out = args.out or default_out(meta, cp=True)

    def save(rows):
        if rank == 0:
            write_report(out, rows, meta)

    stage = cp_stage_args(args, cfg)
    ok = True
    if args.cp_check:
        from longctx.bench.suite import cp_check

        check = cp_check.run_check(stage, stage.backend)
        ok = all(r["ok"] for r in check)
        _write_part(out, "check", check, cp_check.markdown(check, stage) if check else "", meta, rank)
    if not args.cp_no_sweep:
        rows = run_cp(cfg, args.tokens_per_gpu, methods, iters=args.cp_iters, on_row=save, whole=args.cp_whole)
        save(rows)
    if args.max_seq:
        from longctx.bench.suite import cp_longest

        longest = cp_longest.run_max_seq(stage)
        ok = ok and not any(r["error"] for r in longest)
        _write_part(out, "longest", longest, cp_longest.markdown(longest, stage) if longest else "", meta, rank)
    if rank == 0:
        print(f"wrote {out}")
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


def cp_stage_args(args: argparse.Namespace, cfg: SuiteConfig) -> argparse.Namespace:
    """The settings of the check and the longest-sequence search (`cp_check`, `cp_longest`) from the suite's: the
    dense methods among --cp-methods, the check's layouts, heads and head dim, the device type."""
    dense = [m for m in args.cp_methods.split(",") if m.strip() in ("ring", "allgather", "ulysses")]
    stage = dict(
        methods=dense or ["ring"],
        layouts=[x.strip() for x in args.check_layouts.split(",") if x.strip()],
        heads=cfg.Hq,
        kv_heads=args.check_kv_heads,
        head_dim=cfg.D,
        backend=args.cp_backend,
        device=torch.device(cfg.device).type,
    )
    return argparse.Namespace(**{**vars(args), **stage})


def _write_part(out: str, name: str, rows: list[dict], md: str, meta: dict, rank: int) -> None:
    """``<out>/<name>.json`` and ``.md``: a part of a --cp run beside its sweep (the first rank writes)."""
    if rank != 0:
        return
    import json

    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)
    header = f"# {name}: {meta['world']} x {meta['gpu']}, torch {meta['torch']}, triton {meta.get('triton')}\n\n"
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(header + md)
    print(md, flush=True)

"""`longctx bench cp`: the command line and the order of the stages (check, throughput, max-seq)."""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

from longctx.bench.cp.check import run_check
from longctx.bench.cp.common import LAYOUTS, METHODS, ints, log, strs, versions
from longctx.bench.cp.max_seq import CRITERIA, run_max_seq
from longctx.bench.cp.report import write
from longctx.bench.cp.throughput import run_bench

DESCRIPTION = "context-parallel attention on several GPUs (run under torchrun)"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="longctx bench cp", description=DESCRIPTION)
    ap.add_argument("--check", action="store_true", help="NCCL bf16 correctness against a float64 oracle first")
    ap.add_argument("--no-bench", action="store_true", help="skip the throughput sweep")
    ap.add_argument("--max-seq", action="store_true", help="longest trainable sequence of the 350M GPT under a cap")
    ap.add_argument("--tokens-per-gpu", type=ints, default=[8192, 16384, 32768, 65536])
    ap.add_argument("--methods", type=strs, default=list(METHODS))
    ap.add_argument("--layouts", type=strs, default=list(LAYOUTS))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--no-causal", dest="causal", action="store_false")
    ap.add_argument("--backend", default="auto", choices=("auto", "tiled", "triton"))
    ap.add_argument("--check-seqlen", type=int, default=8192)
    ap.add_argument("--check-kv-heads", type=int, default=4, help="kv heads of the check (GQA)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--gpt-preset", default="gpt2-medium", help="--max-seq: the GPT (longctx.models.PRESETS)")
    ap.add_argument("--gpt-override", default="", help="GPTConfig fields, e.g. num_layers=2,hidden_size=64")
    ap.add_argument("--max-seq-gpus", type=ints, default=None, help="GPU counts to search (default 1 and all)")
    ap.add_argument("--mem-cap-gib", type=float, default=16.0, help="--max-seq: memory cap per GPU (GiB)")
    ap.add_argument("--max-seq-start", type=int, default=8192, help="first try, tokens per GPU")
    ap.add_argument(
        "--max-seq-criterion",
        default="allocated",
        choices=CRITERIA,
        help="what is compared with the cap: peak allocated + --max-seq-margin-gib, or peak reserved (both reported)",
    )
    ap.add_argument(
        "--max-seq-margin-gib", type=float, default=1.0, help="--max-seq-criterion allocated: added to the peak"
    )
    ap.add_argument("--max-seq-res", type=float, default=0.08, help="stop when [fit, misfit] is within this")
    ap.add_argument("--max-seq-budget-s", type=float, default=150.0, help="wall-clock budget of the whole search")
    ap.add_argument("--max-seq-limit", type=int, default=1 << 21, help="never try more tokens per GPU than this")
    ap.add_argument("--max-seq-warmup-tokens", type=int, default=1024, help="tokens/GPU of the unmeasured first step")
    ap.add_argument("--loss", default="chunked", choices=("chunked", "full"), help="--max-seq: how the loss is made")
    ap.add_argument("--loss-chunk", type=int, default=1024, help="tokens of logits at a time (--loss chunked)")
    ap.add_argument("--fake-kib-per-token", type=float, default=0.0, help="CPU smoke runs/tests: a made-up peak")
    ap.add_argument("--out-dir", default=os.path.join("benchmarks", "results"))
    ap.add_argument("--tag", default="", help="suffix naming what the run covers (e.g. _check), not when")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a gloo smoke run (tiny sizes)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("longctx bench cp: needs CUDA GPUs (run under torchrun --nproc-per-node N)", file=sys.stderr)
        return 1
    from longctx.distributed import init_distributed
    from longctx.launchers.select import resolve_launchers

    rank, world, _ = init_distributed("nccl" if dev.type == "cuda" else "gloo")
    if not dist.is_initialized():
        print("longctx bench cp: run it under torchrun (e.g. torchrun --nproc-per-node 2 -m longctx bench cp)")
        return 1
    launcher = resolve_launchers(args.backend, dev, torch.bfloat16).name
    meta = versions(dev, world, launcher)
    log(
        f"{world} x {meta['gpu']}  torch {meta['torch']}  triton {meta['triton']}  NCCL {meta['nccl']}  "
        f"launchers {launcher}"
    )
    t0 = time.time()
    check, bench, maxseq = [], [], []
    ok_max_seq = True
    kv_bench = args.kv_heads
    if args.check:
        args.kv_heads = args.check_kv_heads
        check = run_check(args, launcher)
        args.kv_heads = kv_bench
        log(f"check: {sum(r['ok'] for r in check)}/{len(check)} pass ({time.time() - t0:.0f} s)")
        write(meta, check, bench, maxseq, args, quiet=True)
    if not args.no_bench:
        bench = run_bench(args, launcher, on_row=lambda rows: write(meta, check, rows, maxseq, args, quiet=True))
        log(f"sweep done ({time.time() - t0:.0f} s)")
    if args.max_seq:
        write(meta, check, bench, maxseq, args, quiet=True)  # what we have so far, in case this part fails
        try:
            maxseq = run_max_seq(args, on_row=lambda rows: write(meta, check, bench, rows, args, quiet=True))
        except Exception:  # noqa: BLE001 - report it plainly (torchrun's "[rankN]:" prefixes are easy to lose)
            print(f"--max-seq failed on rank {rank}:\n{traceback.format_exc()}", file=sys.stdout, flush=True)
            ok_max_seq = False
        ok_max_seq = ok_max_seq and not any(r["error"] for r in maxseq)
    write(meta, check, bench, maxseq, args)
    ok = all(r["ok"] for r in check) and ok_max_seq
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1

"""`longctx bench cp`: context-parallel attention on several GPUs (run under torchrun).

    torchrun --nproc-per-node 2 -m longctx bench cp --check            # NCCL bf16 correctness, then the sweep
    torchrun --nproc-per-node 2 -m longctx bench cp --tokens-per-gpu 8192,16384 --methods ring

Throughput: per-GPU TFLOP/s of forward+backward of `cp_attention` for every method and layout, at total
lengths S = P x tokens-per-GPU, against the single-GPU kernel (`longctx.attention` with the same launcher
backend) on tokens-per-GPU tokens. FLOPs: forward ``4 B Hq S^2 D`` (halved for causal), backward 2.5x
forward; per-GPU figures divide by P. Times: CUDA events over a fixed number of iterations (the same on every
rank: collectives), the slowest rank's mean.

``--check``: the same `cp_attention` in bf16 against a float64 oracle (`longctx.attention(backend="math")` on
the whole sequence, float64) next to the single-GPU bf16 kernel on the whole sequence, for out, dq, dk, dv:
pass when ``err(cp) <= 2 err(single GPU) + 1e-5`` (the FlashAttention rule).

``--max-seq``: peak memory of one training step of the 350M GPT (preset gpt2-medium, full recomputation,
bf16 autocast) at two lengths per GPU, on 1 GPU and with context parallelism over all P, and the longest
sequence that fits, extrapolated linearly (memory is linear in S with a flash kernel and recomputation).

Writes ``benchmarks/results/cp_<date>_<gpu>.md`` and ``.json`` (rank 0).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
import time

import torch
import torch.distributed as dist

METHODS = ("ring", "allgather", "ulysses")
LAYOUTS = ("zigzag", "contiguous")


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _strs(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


_DEV = torch.device("cuda")  # set by main (--device cpu: a gloo smoke run of this script)


def _sync() -> None:
    if _DEV.type == "cuda":
        torch.cuda.synchronize()


def _versions(world: int, launcher: str) -> dict:
    try:
        import triton

        tv = triton.__version__
    except Exception:  # noqa: BLE001
        tv = None
    cuda = _DEV.type == "cuda"
    return {
        "gpu": torch.cuda.get_device_properties(0).name if cuda else "cpu",
        "gpus": world,
        "torch": torch.__version__,
        "triton": tv,
        "cuda": torch.version.cuda,
        "nccl": ".".join(str(x) for x in torch.cuda.nccl.version()) if cuda else "-",
        "launcher": launcher,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def _empty_cache() -> None:
    if _DEV.type == "cuda":
        torch.cuda.empty_cache()


def _max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=_DEV)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _time_ms(fn, warmup: int, iters: int) -> float:
    """Mean ms per call on the slowest rank; every rank runs exactly warmup + iters calls."""
    for _ in range(warmup):
        fn()
    _sync()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync()
    return _max_over_ranks((time.perf_counter() - t0) * 1e3 / iters)


def _flops(b: int, hq: int, s: int, d: int, causal: bool) -> float:
    """forward + backward (2.5x forward) FLOPs of attention over s tokens."""
    return 3.5 * 4.0 * b * hq * s * s * d * (0.5 if causal else 1.0)


# ---------------------------------------------------------------------------------------------------------
# correctness
# ---------------------------------------------------------------------------------------------------------


def run_check(args, launcher: str) -> list[dict]:
    import longctx
    from longctx.distributed import cp_attention, shard

    P = dist.get_world_size()
    S, B, Hq, Hkv, D = args.check_seqlen, 1, args.heads, args.kv_heads, args.head_dim
    rows = []
    masks = [("causal", True, None), ("full", False, None), ("causal-window", True, (S // 4 - 1, 0))]
    for mask_name, causal, window in masks:
        g = torch.Generator(device=_DEV).manual_seed(1234)  # the same full inputs on every rank
        q, k, v, do = (
            torch.randn(B, h, S, D, generator=g, device=_DEV, dtype=torch.float64) for h in (Hq, Hkv, Hkv, Hq)
        )
        # float64 oracle and the single-GPU bf16 kernel, both on the whole sequence
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        o_ref = longctx.attention(*ref, causal=causal, window=window, backend="math")
        o_ref.backward(do)
        oracle = [o_ref.detach()] + [t.grad for t in ref]
        del ref, o_ref
        one = [t.bfloat16().requires_grad_() for t in (q, k, v)]
        o_one = longctx.attention(*one, causal=causal, window=window, backend=launcher)
        o_one.backward(do.bfloat16())
        single = [o_one.detach()] + [t.grad for t in one]
        del one, o_one
        for method in args.methods:
            for layout in args.layouts:
                loc = [shard(t.bfloat16(), 2, layout=layout).requires_grad_() for t in (q, k, v)]
                out = cp_attention(
                    *loc, causal=causal, window=window, method=method, layout=layout, backend=args.backend
                )
                out.backward(shard(do.bfloat16(), 2, layout=layout))
                cp = [out.detach()] + [t.grad for t in loc]
                row = dict(mask=mask_name, method=method, layout=layout, S=S, P=P, ok=True)
                for name, a, s1, o in zip(("out", "dq", "dk", "dv"), cp, single, oracle):
                    o_loc = shard(o, 2, layout=layout)
                    e_cp = _max_over_ranks(float((a.double() - o_loc).abs().max()))
                    e_1 = _max_over_ranks(float((shard(s1, 2, layout=layout).double() - o_loc).abs().max()))
                    row[f"err_{name}"], row[f"err1_{name}"] = e_cp, e_1
                    row["ok"] &= e_cp <= 2 * e_1 + 1e-5
                rows.append(row)
                _log(
                    f"check {mask_name:13s} {method:9s} {layout:10s} "
                    + " ".join(f"{n} {row['err_' + n]:.2e}/{row['err1_' + n]:.2e}" for n in ("out", "dq", "dk", "dv"))
                    + ("  PASS" if row["ok"] else "  FAIL")
                )
        del q, k, v, do, oracle, single
        _empty_cache()
    return rows


# ---------------------------------------------------------------------------------------------------------
# throughput
# ---------------------------------------------------------------------------------------------------------


def _bench_length(args, launcher: str, n_loc: int) -> list[dict]:
    import longctx
    from longctx.distributed import cp_attention

    P = dist.get_world_size()
    B, Hq, Hkv, D, causal = args.batch, args.heads, args.kv_heads, args.head_dim, args.causal
    S = n_loc * P
    g = torch.Generator(device=_DEV).manual_seed(dist.get_rank())
    q, k, v, do = (
        torch.randn(B, h, n_loc, D, generator=g, device=_DEV, dtype=torch.bfloat16) for h in (Hq, Hkv, Hkv, Hq)
    )
    for t in (q, k, v):
        t.requires_grad_()

    def single():
        out = longctx.attention(q, k, v, causal=causal, backend=launcher)
        torch.autograd.grad(out, (q, k, v), do)

    ms1 = _time_ms(single, args.warmup, args.iters)
    tf1 = _flops(B, Hq, n_loc, D, causal) / (ms1 * 1e-3) / 1e12
    rows = [dict(tokens_per_gpu=n_loc, S=S, P=P, method="single-gpu", layout="-", ms=ms1, tflops_per_gpu=tf1)]
    _log(f"S={S:>7d} ({n_loc}/GPU)  single GPU on {n_loc:>6d} tokens: {ms1:8.2f} ms  {tf1:6.1f} TFLOP/s")
    for method in args.methods:
        for layout in args.layouts:

            def step(method=method, layout=layout):
                out = cp_attention(q, k, v, causal=causal, method=method, layout=layout, backend=args.backend)
                torch.autograd.grad(out, (q, k, v), do)

            ms = _time_ms(step, args.warmup, args.iters)
            tf = _flops(B, Hq, S, D, causal) / P / (ms * 1e-3) / 1e12
            rows.append(
                dict(
                    tokens_per_gpu=n_loc, S=S, P=P, method=method, layout=layout, ms=ms, tflops_per_gpu=tf,
                    efficiency=tf / tf1,
                )
            )  # fmt: skip
            _log(
                f"S={S:>7d} ({n_loc}/GPU)  {method:9s} {layout:10s}: {ms:8.2f} ms  {tf:6.1f} TFLOP/s/GPU {tf / tf1:.0%}"
            )
    return rows


def _gpu_warmup(seconds: float = 2.0) -> None:
    """Run matmuls for a while so the first timing does not see idle clocks."""
    if _DEV.type != "cuda":
        return
    a = torch.randn(8192, 8192, device=_DEV, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()
    dist.barrier()


def run_bench(args, launcher: str, on_row=None) -> list[dict]:
    rows = []
    _gpu_warmup()
    for n_loc in args.tokens_per_gpu:
        rows += _bench_length(args, launcher, n_loc)
        _empty_cache()
        if on_row is not None:
            on_row(rows)
    return rows


# ---------------------------------------------------------------------------------------------------------
# longest trainable sequence of the 350M GPT
# ---------------------------------------------------------------------------------------------------------


def _gpt_step_peak(model, cp, S: int, vocab: int) -> float:
    """Peak GiB of one forward+backward at total length S (CP when cp is given, else the whole sequence)."""
    from longctx.models.gpt import lm_loss

    cuda = _DEV.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (1, S + 1), generator=g).to(_DEV)
    x, y = tokens[:, :-1], tokens[:, 1:]
    with torch.autocast(_DEV.type, dtype=torch.bfloat16):
        if cp is None:
            loss = lm_loss(model(x), y)
        else:
            xs, ys, _, pos = cp.shard_batch(x, y)
            loss, _ = cp.loss(model(xs, position_ids=pos), ys)
    loss.backward()
    if cp is not None:
        cp.allreduce_gradients(model)
    _sync()
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0  # (cpu: a smoke run, no figure)
    model.zero_grad(set_to_none=True)
    return _max_over_ranks(peak)


def run_max_seq(args) -> list[dict]:
    from longctx.distributed import setup_context_parallel
    from longctx.models.gpt import GPT, GPTConfig

    P = dist.get_world_size()
    cfg = GPTConfig.preset(
        args.gpt_preset, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    )
    cap = torch.cuda.get_device_properties(0).total_memory / 2**30 if _DEV.type == "cuda" else 0.0
    rows = []
    for world, use_cp in ((1, False), (P, True)):
        torch.manual_seed(0)
        model = GPT(cfg).to(_DEV)
        cp = setup_context_parallel(model, method="ring", layout="zigzag") if use_cp else None
        pts = []
        for n_loc in args.max_seq_points:
            S = n_loc * world
            pts.append((n_loc, _gpt_step_peak(model, cp, S, cfg.vocab_size)))
            _log(f"350M GPT, {world} GPU(s): S={S} ({n_loc}/GPU) peak {pts[-1][1]:.1f} GiB")
        (n0, m0), (n1, m1) = pts[0], pts[-1]
        slope = (m1 - m0) / (n1 - n0)  # GiB per token per GPU
        n_max = int(n1 + (0.95 * cap - m1) / slope) if slope > 0 else None
        rows.append(
            dict(
                gpus=world, points=pts, gib_per_1k_tokens_per_gpu=slope * 1024, capacity_gib=cap,
                max_tokens_per_gpu=n_max, max_seq=None if n_max is None else n_max * world,
            )
        )  # fmt: skip
        _log(
            f"  -> {slope * 1024:.3f} GiB per 1K tokens per GPU; longest sequence ~{rows[-1]['max_seq']} (extrapolated)"
        )
        del model, cp
        _empty_cache()
    return rows


# ---------------------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------------------


def markdown(meta: dict, check: list[dict], bench: list[dict], maxseq: list[dict], args) -> str:
    P = meta["gpus"]
    lines = [
        f"# Context-parallel attention: {P} x {meta['gpu']}",
        "",
        f"{meta['date']}; torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}, NCCL {meta['nccl']}; "
        f"launchers: `{meta['launcher']}`. B={args.batch}, Hq={args.heads}, Hkv={args.kv_heads}, D={args.head_dim}, "
        f"{'causal' if args.causal else 'full'}, bf16. Forward+backward; FLOPs 3.5 x 4 B Hq S^2 D"
        f"{' / 2 (causal)' if args.causal else ''}, per GPU = / P.",
        "",
    ]
    if check:
        lines += [
            f"## NCCL correctness (bf16, S={check[0]['S']}, Hq={args.heads}, Hkv={args.kv_heads}, D={args.head_dim})",
            "",
            "max |error| against the float64 oracle: context parallel / single-GPU kernel on the whole sequence. "
            "Pass: cp <= 2 x single + 1e-5.",
            "",
            "| mask | method | layout | out | dq | dk | dv | pass |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in check:
            cells = " | ".join(f"{r['err_' + n]:.1e} / {r['err1_' + n]:.1e}" for n in ("out", "dq", "dk", "dv"))
            lines.append(f"| {r['mask']} | {r['method']} | {r['layout']} | {cells} | {'yes' if r['ok'] else 'NO'} |")
        lines.append("")
    if bench:
        combos = [(m, lay) for m in args.methods for lay in args.layouts]
        lines += [
            "## Throughput: per-GPU TFLOP/s (fraction of the single-GPU kernel at the same tokens per GPU)",
            "",
            "| S total | tokens/GPU | single GPU | " + " | ".join(f"{m} {lay}" for m, lay in combos) + " |",
            "|---|---|---|" + "---|" * len(combos),
        ]
        for n_loc in sorted({r["tokens_per_gpu"] for r in bench}):
            rs = [r for r in bench if r["tokens_per_gpu"] == n_loc]
            one = next(r for r in rs if r["method"] == "single-gpu")
            cells = []
            for m, lay in combos:
                r = next((r for r in rs if r["method"] == m and r["layout"] == lay), None)
                cells.append("-" if r is None else f"{r['tflops_per_gpu']:.0f} ({r['efficiency']:.0%})")
            lines.append(
                f"| {one['S'] // 1024}K | {n_loc // 1024}K | {one['tflops_per_gpu']:.0f} | " + " | ".join(cells) + " |"
            )
        lines.append("")
    if maxseq:
        lines += [
            f"## Longest trainable sequence, GPT {args.gpt_preset} (~350M), full recomputation, bf16 autocast, "
            "ring/zigzag",
            "",
            "Peak memory of one training step measured at two lengths per GPU, extrapolated linearly to 95% of the "
            "GPU memory (an estimate, not a run at that length).",
            "",
            "| GPUs | measured (tokens/GPU: peak GiB) | GiB per 1K tokens/GPU | longest sequence (extrapolated) |",
            "|---|---|---|---|",
        ]
        for r in maxseq:
            pts = ", ".join(f"{n // 1024}K: {m:.1f}" for n, m in r["points"])
            ms = "-" if r["max_seq"] is None else f"{r['max_seq'] // 1024}K"
            lines.append(f"| {r['gpus']} | {pts} | {r['gib_per_1k_tokens_per_gpu']:.3f} | {ms} |")
        lines.append("")
    return "\n".join(lines)


def _write(meta, check, bench, maxseq, args, quiet: bool = False) -> None:
    if dist.get_rank() != 0:
        return
    os.makedirs(args.out_dir, exist_ok=True)
    gpu = meta["gpu"].replace("NVIDIA ", "").replace(" ", "-")
    stem = os.path.join(args.out_dir, f"cp_{_dt.date.today().isoformat()}_{gpu}x{meta['gpus']}{args.tag}")
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "args": vars(args), "check": check, "bench": bench, "max_seq": maxseq}, f, indent=1)
    md = markdown(meta, check, bench, maxseq, args)
    with open(stem + ".md", "w") as f:
        f.write(md)
    if not quiet:
        print(md, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="longctx bench cp", description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="NCCL bf16 correctness against a float64 oracle first")
    ap.add_argument("--no-bench", action="store_true", help="skip the throughput sweep")
    ap.add_argument("--max-seq", action="store_true", help="longest trainable sequence of the 350M GPT (estimate)")
    ap.add_argument("--tokens-per-gpu", type=_ints, default=[8192, 16384, 32768, 65536])
    ap.add_argument("--methods", type=_strs, default=list(METHODS))
    ap.add_argument("--layouts", type=_strs, default=list(LAYOUTS))
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
    ap.add_argument("--gpt-preset", default="gpt2-medium")
    ap.add_argument("--max-seq-points", type=_ints, default=[8192, 16384])
    ap.add_argument("--out-dir", default=os.path.join("benchmarks", "results"))
    ap.add_argument("--tag", default="")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a gloo smoke run (tiny sizes)")
    args = ap.parse_args(argv)
    global _DEV
    _DEV = torch.device(args.device)
    if _DEV.type == "cuda" and not torch.cuda.is_available():
        print("longctx bench cp: needs CUDA GPUs (run under torchrun --nproc-per-node N)", file=sys.stderr)
        return 1
    from longctx.distributed import init_distributed
    from longctx.distributed.launchers import resolve_launchers

    rank, world, _ = init_distributed("nccl" if _DEV.type == "cuda" else "gloo")
    if not dist.is_initialized():
        print("longctx bench cp: run it under torchrun (e.g. torchrun --nproc-per-node 2 -m longctx bench cp)")
        return 1
    launcher = resolve_launchers(args.backend, _DEV, torch.bfloat16).name
    meta = _versions(world, launcher)
    _log(
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
        _log(f"check: {sum(r['ok'] for r in check)}/{len(check)} pass ({time.time() - t0:.0f} s)")
        _write(meta, check, bench, maxseq, args, quiet=True)
    if not args.no_bench:
        bench = run_bench(args, launcher, on_row=lambda rows: _write(meta, check, rows, maxseq, args, quiet=True))
        _log(f"sweep done ({time.time() - t0:.0f} s)")
    if args.max_seq:
        _write(meta, check, bench, maxseq, args, quiet=True)  # what we have so far, in case this part fails
        try:
            maxseq = run_max_seq(args)
        except Exception:  # noqa: BLE001 - report it plainly (torchrun's "[rankN]:" prefixes are easy to lose)
            import traceback

            print(f"--max-seq failed on rank {rank}:\n{traceback.format_exc()}", file=sys.stdout, flush=True)
            ok_max_seq = False
    _write(meta, check, bench, maxseq, args)
    ok = all(r["ok"] for r in check) and ok_max_seq
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1

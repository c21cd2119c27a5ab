"""`longctx bench cp` throughput: per-GPU TFLOP/s of context-parallel attention against the single-GPU kernel."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from longctx.bench.cp.common import empty_cache, log, max_over_ranks, sync


def flops(b: int, hq: int, s: int, d: int, causal: bool) -> float:
    """forward + backward (2.5x forward) FLOPs of attention over s tokens."""
    return 3.5 * 4.0 * b * hq * s * s * d * (0.5 if causal else 1.0)


def _time_ms(fn, warmup: int, iters: int, dev: torch.device) -> float:
    """Mean ms per call on the slowest rank; every rank runs exactly warmup + iters calls."""
    for _ in range(warmup):
        fn()
    sync(dev)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(dev)
    return max_over_ranks((time.perf_counter() - t0) * 1e3 / iters, dev)


def _bench_length(args, launcher: str, n_loc: int) -> list[dict]:
    import longctx
    from longctx.distributed import cp_attention

    dev = torch.device(args.device)
    P = dist.get_world_size()
    B, Hq, Hkv, D, causal = args.batch, args.heads, args.kv_heads, args.head_dim, args.causal
    S = n_loc * P
    g = torch.Generator(device=dev).manual_seed(dist.get_rank())
    q, k, v, do = (
        torch.randn(B, h, n_loc, D, generator=g, device=dev, dtype=torch.bfloat16) for h in (Hq, Hkv, Hkv, Hq)
    )
    for t in (q, k, v):
        t.requires_grad_()

    def single():
        out = longctx.attention(q, k, v, causal=causal, backend=launcher)
        torch.autograd.grad(out, (q, k, v), do)

    ms1 = _time_ms(single, args.warmup, args.iters, dev)
    tf1 = flops(B, Hq, n_loc, D, causal) / (ms1 * 1e-3) / 1e12
    rows = [dict(tokens_per_gpu=n_loc, S=S, P=P, method="single-gpu", layout="-", ms=ms1, tflops_per_gpu=tf1)]
    log(f"S={S:>7d} ({n_loc}/GPU)  single GPU on {n_loc:>6d} tokens: {ms1:8.2f} ms  {tf1:6.1f} TFLOP/s")
    for method in args.methods:
        for layout in args.layouts:

            def step(method=method, layout=layout):
                out = cp_attention(q, k, v, causal=causal, method=method, layout=layout, backend=args.backend)
                torch.autograd.grad(out, (q, k, v), do)

            ms = _time_ms(step, args.warmup, args.iters, dev)
            tf = flops(B, Hq, S, D, causal) / P / (ms * 1e-3) / 1e12
            rows.append(
                dict(
                    tokens_per_gpu=n_loc, S=S, P=P, method=method, layout=layout, ms=ms, tflops_per_gpu=tf,
                    efficiency=tf / tf1,
                )
            )  # fmt: skip
            log(
                f"S={S:>7d} ({n_loc}/GPU)  {method:9s} {layout:10s}: {ms:8.2f} ms  {tf:6.1f} TFLOP/s/GPU {tf / tf1:.0%}"
            )
    return rows


def _gpu_warmup(dev: torch.device, seconds: float = 2.0) -> None:
    """Run matmuls for a while so the first timing does not see idle clocks."""
    if dev.type != "cuda":
        return
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()
    dist.barrier()


def run_bench(args, launcher: str, on_row=None) -> list[dict]:
    rows = []
    _gpu_warmup(torch.device(args.device))
    for n_loc in args.tokens_per_gpu:
        rows += _bench_length(args, launcher, n_loc)
        empty_cache(torch.device(args.device))
        if on_row is not None:
            on_row(rows)
    return rows

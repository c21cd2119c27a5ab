"""Short causal attention, every path longctx has for it, beside cuDNN and FA2 in one process (issue: short
sequences at 0.9x cuDNN). Batch x S = 16K tokens; MHA (D=128: 16 heads, D=64: 32 heads) and llama-350m's GQA 16/4
at D=64. Paths:

- ``cudnn`` / ``fa2``: SDPA with that backend on (B, H, S, D), causal.
- ``triton``: `longctx.attention(..., causal=True, backend="triton")`, the dense kernels as dispatch picks them.
- ``ws``: the same with the warp-specialised dense forward forced (``tuning.override(ws=True)``).
- ``sparse``: the causal mask as a `BlockMask` (the persistent warp-specialised block-sparse kernels).
- ``varlen``: `flash_attn_varlen_func` on the B sequences packed as documents of S tokens: what a packed batch of
  equal documents costs through the path packed training takes.

Wall time (`do_bench`: what a lone call costs, the host included) and kernel time (the profiler's sum of the
call's kernels: what it costs inside a GPU-bound step). Each longctx path's output and gradients are compared with
cuDNN's (max abs difference, bf16). TFLOP/s by the attention benchmark's convention (causal halves S x S; backward
2.5x the forward). Prints one JSON line per row and writes them to ``--out``.

    PYTHONPATH=src python dev/short_attention.py --out short.json [--s 1024,2048,4096] [--d 64,128]
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F


def _sdpa(backend):
    from torch.nn.attention import sdpa_kernel

    def fn(q, k, v):
        if k.shape[1] != q.shape[1]:
            g = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return fn


def _paths(S: int):
    import longctx
    from longctx import tuning
    from longctx.masks import causal_mask

    def triton_fn(q, k, v):
        return longctx.attention(q, k, v, causal=True, backend="triton")

    def ws_fn(q, k, v):
        with tuning.override(ws=True):
            return longctx.attention(q, k, v, causal=True, backend="triton")

    masks: dict = {}

    def sparse_fn(q, k, v):
        if "m" not in masks:
            masks["m"] = longctx.block_mask(causal_mask, None, None, S, S, device=q.device)
        return longctx.attention(q, k, v, block_mask=masks["m"])

    cus: dict = {}

    def varlen_fn(q, k, v):  # q, k, v packed (B * S, H, D), as a model's varlen call receives them
        if "cu" not in cus:  # one boundaries tensor for every call, as a model's layers share theirs
            cus["cu"] = torch.arange(0, q.shape[0] + 1, S, device=q.device, dtype=torch.int32)
        cu = cus["cu"]
        return longctx.flash_attn_varlen_func(q, k, v, cu, cu, S, S, causal=True)

    from torch.nn.attention import SDPBackend

    return {
        "cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION),
        "fa2": _sdpa(SDPBackend.FLASH_ATTENTION),
        "triton": triton_fn,
        "ws": ws_fn,
        "sparse": sparse_fn,
        "varlen": varlen_fn,
    }


def _kernel_ms(fn, n: int = 10) -> float:
    """The GPU's kernel time of one ``fn()`` (the sum of its kernels' durations under torch.profiler, over ``n``
    calls): without the host's time between launches, which a short call's wall time can be."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    total_us = sum(e.device_time_total for e in prof.key_averages() if e.device_time_total > 0 and e.key != "")
    return total_us / n / 1000.0


def _run(fn, q, k, v, do, warmup: int, rep: int) -> tuple[tuple, tuple, tuple]:
    """((forward wall ms, kernel ms), (backward wall ms, kernel ms), (output, dq, dk, dv))."""
    import triton

    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    o = fn(qg, kg, vg)
    grads = torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True)
    with torch.no_grad():
        fwd = triton.testing.do_bench(lambda: fn(q, k, v), warmup=warmup, rep=rep, return_mode="median")
    bwd = triton.testing.do_bench(
        lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True), warmup=warmup, rep=rep,
        return_mode="median",
    )  # fmt: skip
    with torch.no_grad():
        fwd_k = _kernel_ms(lambda: fn(q, k, v))
    bwd_k = _kernel_ms(lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True))
    return (fwd, fwd_k), (bwd, bwd_k), (o.detach(), *grads)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--s", default="1024,2048,4096")
    ap.add_argument("--d", default="64,128")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--paths", default="cudnn,fa2,triton,ws,sparse,varlen")
    ap.add_argument("--warmup", type=int, default=25)
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    dev = "cuda"
    rows = []
    shapes = []
    for D in (int(x) for x in args.d.split(",")):
        shapes.append((D, 2048 // D, 2048 // D))
        if D == 64:
            shapes.append((D, 16, 4))
    for D, hq, hkv in shapes:
        for S in (int(x) for x in args.s.split(",")):
            B = max(1, args.tokens // S)
            q = torch.randn(B, hq, S, D, device=dev, dtype=torch.bfloat16)
            k = torch.randn(B, hkv, S, D, device=dev, dtype=torch.bfloat16)
            v = torch.randn(B, hkv, S, D, device=dev, dtype=torch.bfloat16)
            do = torch.randn_like(q)
            flops = 4.0 * B * hq * S * S * D * 0.5
            ref = None
            for name, fn in _paths(S).items():
                if name not in args.paths.split(","):
                    continue
                row = {"D": D, "Hq": hq, "Hkv": hkv, "S": S, "B": B, "path": name}
                try:
                    if name == "varlen":  # packed (B * S, H, D) inputs, made outside the timing
                        packed = [t.transpose(1, 2).reshape(B * S, t.shape[1], D).contiguous() for t in (q, k, v, do)]
                        fwd, bwd, outs = _run(fn, *packed, args.warmup, args.rep)
                        outs = tuple(t.reshape(B, S, t.shape[1], D).transpose(1, 2) for t in outs)
                    else:
                        fwd, bwd, outs = _run(fn, q, k, v, do, args.warmup, args.rep)
                except Exception as exc:  # a path that does not take this shape: recorded, the rest go on
                    row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                    torch.cuda.synchronize()
                else:
                    (fwd, fwd_k), (bwd, bwd_k) = fwd, bwd
                    row.update(fwd_ms=round(fwd, 4), bwd_ms=round(bwd, 4), fwd_kernel_ms=round(fwd_k, 4))
                    row.update(bwd_kernel_ms=round(bwd_k, 4))
                    row.update(fwd_tflops=round(flops / fwd * 1e-9, 1), bwd_tflops=round(2.5 * flops / bwd * 1e-9, 1))
                    row.update(fwd_kernel_tflops=round(flops / fwd_k * 1e-9, 1))
                    row.update(bwd_kernel_tflops=round(2.5 * flops / bwd_k * 1e-9, 1))
                    if name == "cudnn":
                        ref = outs
                    elif ref is not None:
                        errs = [(a.float() - b.float()).abs().max().item() for a, b in zip(outs, ref)]
                        row["max_err_vs_cudnn"] = [float(f"{e:.3g}") for e in errs]
                        row["finite"] = all(math.isfinite(e) for e in errs)
                print(json.dumps(row), flush=True)
                rows.append(row)
                if args.out:
                    with open(args.out, "w") as f:
                        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

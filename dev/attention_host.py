"""The host's time per attention call: what a call costs the CPU before its kernels are queued, on inputs small
enough that the GPU never waits behind (2K tokens), for the paths a model takes: `flash_attn_varlen_func` (packed
documents: `layers.DocumentAttention`, transformers' packed batches), `longctx.attention` with a `BlockMask`, with
``causal=True`` (auto: cuDNN on Hopper; and ``backend="triton"``), and SDPA for reference. Forward alone (no grad)
and forward + backward. Then a Python profile of the forward + backward of each path named by ``--profile``
(default: the varlen path), its top functions by own time and by cumulative time.

A step is host-bound when its host time exceeds its GPU time: under context parallelism at 8K tokens a GPU, every
layer's attention call is a few hundred microseconds of GPU work, the same order as its host time.

    PYTHONPATH=src python dev/attention_host.py [--out host.json] [--calls 200]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import torch
import torch.nn.functional as F


def _per_call_us(fn, calls: int) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t  # before the sync: the host's time to queue ``calls`` calls
    torch.cuda.synchronize()
    return host / calls * 1e6


def inputs(T: int):
    """llama-350m's attention (16 / 4 heads, D=64, bf16) on T tokens: packed (T, H, D) q, k, v that need grad, the
    boundaries of three documents, the same as (1, H, T, D) leaves, and the causal `BlockMask` of T."""
    import longctx
    from longctx.masks import causal_mask

    dev, Hq, Hkv, D = "cuda", 16, 4, 64
    torch.manual_seed(0)
    mk = lambda h: torch.randn(T, h, D, device=dev, dtype=torch.bfloat16, requires_grad=True)  # noqa: E731
    q, k, v = mk(Hq), mk(Hkv), mk(Hkv)
    cu = torch.tensor([0, T // 4, T // 2, T], device=dev, dtype=torch.int32)
    q4, k4, v4 = (t.detach().transpose(0, 1).unsqueeze(0).requires_grad_() for t in (q, k, v))  # (1, H, T, D)
    return q, k, v, cu, (q4, k4, v4), longctx.block_mask(causal_mask, None, None, T, T, device=dev)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--out", default=None)
    ap.add_argument("--top", type=int, default=35)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--compare-op", action="store_true", help="also through the registered ops (no eager twin)")
    ap.add_argument("--profile", default="varlen", help="';'-separated prefixes of the paths to profile")
    args = ap.parse_args(argv)
    import longctx
    from longctx.ops import through_op

    T = args.tokens
    q, k, v, cu, (q4, k4, v4), bm = inputs(T)

    def varlen(q, k, v):
        return longctx.flash_attn_varlen_func(q, k, v, cu, cu, T, T, causal=True)

    paths = {
        "varlen (packed documents)": (varlen, (q, k, v)),
        "attention, block_mask": (lambda q, k, v: longctx.attention(q, k, v, block_mask=bm), (q4, k4, v4)),
        "attention, causal (auto)": (lambda q, k, v: longctx.attention(q, k, v, causal=True), (q4, k4, v4)),
        "attention, causal, triton": (
            lambda q, k, v: longctx.attention(q, k, v, causal=True, backend="triton"), (q4, k4, v4)),
        "sdpa (reference)": (
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), (q4, k4, v4)),
    }  # fmt: skip
    import longctx.ops.flash as op_flash
    import longctx.ops.sparse as op_sparse

    rows = []
    runs = []
    for _ in range(args.rounds):  # the variants interleaved, so that the host's drift falls on both
        for name, (fn, inp) in paths.items():
            runs.append((name, fn, inp, False))
            if args.compare_op and "sdpa" not in name:  # the registered ops' Python autograd wrappers instead
                runs.append((name + " [op]", fn, inp, True))
    for name, fn, inp, op in runs:
        op_flash.through_op = op_sparse.through_op = (lambda q: True) if op else through_op
        do = torch.randn_like(inp[0])

        def fwd(fn=fn, inp=inp):
            with torch.no_grad():
                fn(*inp)

        def fwd_bwd(fn=fn, inp=inp, do=do):
            torch.autograd.backward(fn(*inp), do)

        row = {"path": name, "fwd_us": round(_per_call_us(fwd, args.calls), 1)}
        row["fwd_bwd_us"] = round(_per_call_us(fwd_bwd, args.calls), 1)
        print(json.dumps(row), flush=True)
        rows.append(row)

    op_flash.through_op = op_sparse.through_op = through_op
    buf = io.StringIO()
    for prefix in filter(None, (p.strip() for p in args.profile.split(";"))):
        name = next((n for n in paths if n.startswith(prefix)), None)
        if name is None:
            raise SystemExit(f"--profile: no path starts with {prefix!r}; paths: {list(paths)}")
        fn, inp = paths[name]
        do = torch.randn_like(inp[0])
        pr = cProfile.Profile()
        with torch.autograd.set_multithreading_enabled(False):  # the backward on this thread, so the profile sees it
            pr.enable()
            for _ in range(args.calls):
                torch.autograd.backward(fn(*inp), do)
            pr.disable()
        torch.cuda.synchronize()
        buf.write(f"===== {name}: {args.calls} forward + backward calls\n")
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(args.top)
        pstats.Stats(pr, stream=buf).sort_stats("cumulative").print_stats(args.top + 25)
    print(buf.getvalue())
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f)
        with open(args.out.rsplit(".", 1)[0] + "_profile.txt", "w") as f:
            f.write(buf.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

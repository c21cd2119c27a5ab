"""Where the time of one packed-documents context-parallel call goes (torchrun, NCCL): host time per call against
GPU time, and torch.profiler's top operators on rank 0, per method.

    torchrun --nproc-per-node 4 dev/cp_docs_profile.py --out DIR [--tokens 16384 --cap 16384 --median 1024]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="cp_profile")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--cap", type=int, default=16384)
    ap.add_argument("--median", type=int, default=1024)
    ap.add_argument("--methods", default="p2p,ring,ulysses")
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(dev)
    from longctx.distributed import dispatch_plan
    from longctx.masks import doc_lengths

    total = args.tokens * world
    lengths = doc_lengths(total, seed=0, cap=args.cap, median=args.median)
    cu = [0]
    for L in lengths:
        cu.append(cu[-1] + L)
    t0 = time.perf_counter()
    plan = dispatch_plan(cu, causal=True)
    plan_ms = (time.perf_counter() - t0) * 1e3
    lines = [f"{len(lengths)} documents, longest {max(lengths)}, plan {plan_ms:.1f} ms, balance {plan.balance():.3f}"]
    lines.append(
        f"needs (tokens received per rank): {[sum(n for rs in plan.needs[r] for _, n in rs) for r in range(world)]}"
    )
    g = torch.Generator(device=dev).manual_seed(rank)
    n = plan.local_len
    q, do = (torch.randn(n, 16, 128, generator=g, device=dev, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(n, 4, 128, generator=g, device=dev, dtype=torch.bfloat16) for _ in range(2))
    qg, kg, vg = (t.requires_grad_() for t in (q.clone(), k.clone(), v.clone()))
    for method in args.methods.split(","):

        def step(method=method):
            out = plan.attention(qg, kg, vg, method=method)
            torch.autograd.grad(out, (qg, kg, vg), do)

        def fwd(method=method):
            with torch.no_grad():
                plan.attention(q, k, v, method=method)

        for fn, what in ((fwd, "fwd"), (step, "fwd+bwd")):
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            dist.barrier()
            host = []
            t0 = time.perf_counter()
            for _ in range(10):
                h = time.perf_counter()
                fn()
                host.append(time.perf_counter() - h)
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / 10
            lines.append(
                f"{method:10s} {what:8s} wall {wall * 1e3:7.2f} ms/call, host {sum(host) / 10 * 1e3:7.2f} ms/call"
            )
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        prof.disable()
        if rank == 0:
            for key in ("tottime", "cumulative"):
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(30)
                lines.append(f"--- {method}: Python profile (5 calls of forward + backward) by {key}")
                lines.append(buf.getvalue())
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"profile_{args.cap}_{args.median}.txt"), "w") as f:
            f.write("\n".join(lines))
        print("\n".join(x for x in lines if "ms/call" in x or "documents" in x or "needs" in x), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

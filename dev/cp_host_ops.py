"""The host side of a packed-documents context-parallel call, on the CPU: P gloo processes, a short mix of
documents, each method's forward + backward with the attention launchers replaced by ones that only allocate their
outputs, so what is left is what the call does around its kernels (plans, message packing, the lse merge, the
collectives). Per method: host time per call, the aten operations per call (each one is a dispatch and, on a GPU, a
kernel launch: about 10-20 us of a host's time), and a Python profile of rank 0.

    PYTHONPATH=src python dev/cp_host_ops.py [--world 4 --tokens 4096 --median 256] [--out ops.json]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import tempfile
import time


def _fake_launchers():
    import torch

    from longctx.launchers.select import Launchers

    def fwd(q, k, v, **_):
        return torch.zeros_like(q), torch.zeros(q.shape[:3], dtype=torch.float32)

    def bwd(do, q, k, v, out, lse, **_):
        return tuple(torch.zeros(t.shape, dtype=torch.float32) for t in (q, k, v))

    return Launchers("fake", fwd, bwd, fwd, bwd)


def _worker(rank: int, world: int, store: str, args: dict, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    from longctx.distributed import dispatch_plan
    from longctx.launchers import select
    from longctx.masks import doc_lengths

    fake = _fake_launchers()
    select.resolve_launchers = lambda *a, **k: fake
    for mod in list(__import__("sys").modules.values()):  # the modules that imported the name
        if getattr(mod, "__name__", "").startswith("longctx.") and hasattr(mod, "resolve_launchers"):
            mod.resolve_launchers = select.resolve_launchers

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, a=(), kw=None):
            name = str(func.overloadpacket)
            self.ops[name] = self.ops.get(name, 0) + 1
            return func(*a, **(kw or {}))

    total = args["tokens"] * world
    lengths = doc_lengths(total, seed=0, cap=args["tokens"], median=args["median"])
    cu = [0]
    for L in lengths:
        cu.append(cu[-1] + L)
    plan = dispatch_plan(cu, causal=True)
    n = plan.local_len
    g = torch.Generator().manual_seed(rank)
    q, do = (torch.randn(n, 8, 16, generator=g) for _ in range(2))
    k, v = (torch.randn(n, 2, 16, generator=g) for _ in range(2))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    rows = []
    for method in args["methods"].split(","):

        def step(method=method):
            out = plan.attention(qg, kg, vg, method=method)
            torch.autograd.grad(out, (qg, kg, vg), do)

        with torch.autograd.set_multithreading_enabled(False):
            for _ in range(3):
                step()
            times = []
            for _ in range(args["calls"]):
                dist.barrier()
                t = time.perf_counter()
                step()
                times.append((time.perf_counter() - t) * 1e6)
            mode = Count()
            with mode:
                step()
            prof = cProfile.Profile()
            dist.barrier()
            prof.enable()
            for _ in range(10):
                step()
            prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
        row = {
            "method": method,
            "host_us": round(statistics.median(times), 1),
            "aten_ops": sum(mode.ops.values()),
            "top_ops": dict(sorted(mode.ops.items(), key=lambda x: -x[1])[:15]),
        }
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
            with open(os.path.join(out, f"profile_{method}.txt"), "w") as f:
                f.write(buf.getvalue())
    if rank == 0:
        with open(os.path.join(out, "rows.json"), "w") as f:
            json.dump({"documents": len(lengths), "longest": max(lengths), "rows": rows}, f, indent=1)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens a rank")
    ap.add_argument("--median", type=int, default=256, help="median document length")
    ap.add_argument("--methods", default="ulysses,p2p,allgather,ring")
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--out", default=None, help="a directory for rows.json and rank 0's profiles")
    a = ap.parse_args()
    import torch.multiprocessing as mp

    out = a.out or tempfile.mkdtemp(prefix="cp_host_ops_")
    os.makedirs(out, exist_ok=True)
    store = os.path.join(out, "store")
    if os.path.exists(store):
        os.remove(store)
    args = dict(tokens=a.tokens, median=a.median, methods=a.methods, calls=a.calls)
    mp.start_processes(_worker, args=(a.world, store, args, out), nprocs=a.world, start_method="spawn")
    print("profiles in", out)


if __name__ == "__main__":
    main()

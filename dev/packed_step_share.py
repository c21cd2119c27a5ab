"""The share of a packed-document training step that attention takes on this GPU: `longctx train`'s own step
(llama-350m by default, 32K tokens of packed text, '\\x00' between documents) under torch.profiler.

Attention is every kernel of longctx's attention (the dense and block-sparse Triton and Gluon kernels: names
starting ``attn_``, ``bwd_``, ``sparse_``); the share is their time over the step's wall time, and over all kernel
time. It is what faster short-sequence attention could at most give this step. Prints one JSON line.

Under torchrun, ``--layout`` passes the data- and context-parallel flags to the trainer; rank 0 reports. Where the
step's time goes on the host: ``gpu_busy_share`` (the union of the kernels' intervals over the step's wall time: well
under 1 means the GPU waits for the host), the kernel count, the top kernels, and with ``--python-profile N`` the
top N functions of a Python profile of one step (written next to ``--out``); with ``--sync-debug`` the host
synchronisations of one step (torch.cuda's sync debug mode: each synchronising call and the longctx frames that made
it, counted, written next to ``--out``); with ``--rank-timeline`` one more profiled step on every rank, to see
what the collectives wait for: each rank's NCCL kernels aligned across ranks by their ends (a collective ends on
every rank together), how long each rank's kernels waited for the last rank to arrive, which rank arrived last how
often, and whether that rank's stream was busy just before (GPU-bound) or idle (its host launched late).

    PYTHONPATH=src python dev/packed_step_share.py [--data text.txt] [--preset llama-350m --seq-length 32768]
    PYTHONPATH=src torchrun --nproc-per-node 4 dev/packed_step_share.py --layout "--context-parallel 4" [--dense]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time

ATTENTION = re.compile(r"^(attn_|bwd_(dq|dkdv|preprocess)|sparse_)")


def site_packages_text(path: str, limit: int = 64_000_000) -> int:
    """Write the Python sources of this interpreter's site-packages to ``path``, '\\x00' after each file, until
    ``limit`` bytes (a long-tailed mix of document sizes; `dev/cp_train_gpu.sh` trains on it too); returns the
    bytes written."""
    import pathlib
    import sysconfig

    total = 0
    with open(path, "wb") as out:
        for p in sorted(pathlib.Path(sysconfig.get_paths()["purelib"]).rglob("*.py")):
            data = p.read_bytes().replace(b"\x00", b"")
            if data:
                out.write(data + b"\x00")
                total += len(data) + 1
            if total > limit:
                break
    return total


def _compiled_kernels() -> int:
    """How many binaries the process's Triton (and Gluon) kernels hold: a rise during timed steps is compilation."""
    import gc

    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return 0
    n = 0
    for obj in gc.get_objects():
        if isinstance(obj, JITFunction):
            for cache in getattr(obj, "device_caches", {}).values():
                n += len(cache[0]) if isinstance(cache, tuple) and isinstance(cache[0], dict) else 0
    return n


def _count_syncs(fn, sync) -> dict[str, int]:
    """Run ``fn`` under torch.cuda's sync debug mode; count each synchronising call by the frames that made it."""
    import traceback
    import warnings

    import torch

    counts: dict[str, int] = {}
    with warnings.catch_warnings():  # restores warnings.showwarning
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            # each warning is raised inside the synchronising call: record where it came from there
            def show(message, category, filename, lineno, file=None, line=None):  # warnings.showwarning's signature
                frames = [
                    f"{f.filename.split('src/')[-1]}:{f.lineno}({f.name})"
                    for f in traceback.extract_stack()[:-1]
                    if "longctx" in f.filename or "torch/distributed" in f.filename
                ]
                key = f"{str(message)[:60]} <- " + " <- ".join(reversed(frames[-4:]))
                counts[key] = counts.get(key, 0) + 1

            warnings.showwarning = show
            fn()
            sync()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return counts


def _rank_timeline(fn, sync) -> dict | None:
    """Profile ``fn`` (one training step) on every rank and say, from the NCCL kernels of all ranks (gathered; every
    rank issues the same collectives in the same order), which rank the collectives wait for. None on ranks other
    than 0, and where the ranks' kernel counts differ."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    kernels = sorted(
        (e.time_range.start, e.time_range.end, e.name) for e in prof.events() if e.device_type.name == "CUDA"
    )
    nccl = [(a, b) for a, b, name in kernels if name.startswith("ncclDevKernel")]
    # the idle time of this rank's stream just before each NCCL kernel: from the end of the kernels before it
    idle_before, end = [], float("-inf")
    for a, b, name in kernels:
        if name.startswith("ncclDevKernel"):
            idle_before.append(max(0.0, a - end) if end > float("-inf") else 0.0)
        end = max(end, b)
    span = (kernels[-1][1] - kernels[0][0]) if kernels else 0.0
    mine = {"nccl": nccl, "idle_before": idle_before, "span_us": span,
            "nccl_us": sum(b - a for a, b in nccl)}  # fmt: skip
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() != 0:
        return None
    return _arrivals(every)


def _arrivals(every: list[dict]) -> dict:
    """`_rank_timeline`'s analysis of the ranks' NCCL kernels (each rank: "nccl" [(start, end)], "idle_before",
    "span_us", "nccl_us", on its own clock)."""
    counts = {len(r["nccl"]) for r in every}
    if len(counts) != 1 or not counts.pop():
        return {"error": f"NCCL kernels per rank differ: {[len(r['nccl']) for r in every]}"}
    P, n = len(every), len(every[0]["nccl"])
    # align each rank's clock to rank 0's by the median difference of the collectives' ends
    offsets = [statistics.median(r["nccl"][i][1] - every[0]["nccl"][i][1] for i in range(n)) for r in every]
    wait = [0.0] * P
    last = [0] * P
    late_idle = [0.0] * P  # the last arriver's own stream idle before it: its host launched it late
    for i in range(n):
        starts = [every[r]["nccl"][i][0] - offsets[r] for r in range(P)]
        t_last = max(starts)
        r_last = starts.index(t_last)
        last[r_last] += 1
        late_idle[r_last] += every[r_last]["idle_before"][i]
        for r in range(P):
            wait[r] += t_last - starts[r]
    return {
        "collectives": n,
        "per_rank": [
            {"rank": r, "nccl_kernel_ms": round(every[r]["nccl_us"] / 1e3, 2),
             "waited_for_last_ms": round(wait[r] / 1e3, 2),
             "arrived_last": last[r], "stream_idle_before_when_last_ms": round(late_idle[r] / 1e3, 2),
             "stream_span_ms": round(every[r]["span_us"] / 1e3, 2)}
            for r in range(P)
        ],
    }  # fmt: skip


def _attention_flops(cu, mcfg) -> dict:
    """The causal attention FLOPs of one step over documents ``cu`` (boundaries), all layers: forward 4 x Hq x D x
    the kept scores (L (L + 1) / 2 per document), backward 2.5x that (the attention benchmark's convention); with the
    documents' length quantiles."""
    lengths = sorted(int(n) for n in cu.diff().tolist() if int(n) > 0)
    area = sum(n * (n + 1) / 2 for n in lengths)
    fwd = 4.0 * mcfg.num_attention_heads * mcfg.head_dim * area * mcfg.num_layers
    q = lambda f: lengths[min(len(lengths) - 1, int(f * len(lengths)))]  # noqa: E731
    return {
        "fwd": fwd, "bwd": 2.5 * fwd, "documents": len(lengths),
        "length_quantiles": {"10%": q(0.1), "50%": q(0.5), "90%": q(0.9), "max": lengths[-1]},
        "area_weighted_mean_length": round(sum(n * n * (n + 1) / 2 for n in lengths) / max(area, 1.0)),
    }  # fmt: skip


def _achieved(flops: dict, by_kernel: dict[str, float]) -> dict:
    """TFLOP/s of the step's forward and backward attention kernels (their summed time, us) on ``flops``."""
    fwd_us = sum(us for name, us in by_kernel.items() if "fwd" in name)
    bwd_us = sum(us for name, us in by_kernel.items() if "fwd" not in name)
    rate = lambda f, us: round(f / us * 1e-6, 1) if us else None  # noqa: E731
    out = {k: v for k, v in flops.items() if k not in ("fwd", "bwd")}
    return {**out, "fwd": rate(flops["fwd"], fwd_us), "bwd": rate(flops["bwd"], bwd_us)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--data",
        default=None,
        help="text with '\\x00' between documents (default: the Python sources "
        "of this interpreter's site-packages, as dev/cp_train_gpu.sh packs them)",
    )
    ap.add_argument("--preset", default="llama-350m")
    ap.add_argument("--seq-length", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=4, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="steps before the timed ones (compilation, first plans)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--layout", default="", help="trainer flags of the layout, e.g. '--context-parallel 4'")
    ap.add_argument("--dense", action="store_true", help="one causal sequence: no document separator")
    ap.add_argument("--python-profile", type=int, default=0, help="top functions of a Python profile of one step")
    ap.add_argument("--sync-debug", action="store_true", help="count the host synchronisations of one step")
    ap.add_argument("--rank-timeline", action="store_true", help="which rank the collectives of one step wait for")
    args = ap.parse_args()

    import torch

    if args.data is None:
        args.data = "/tmp/packed_step_share.txt"
        site_packages_text(args.data)
    from longctx.training.config import parse_config
    from longctx.training.trainer import Trainer

    docs = [] if args.dense else ["--doc-separator", "\\x00"]
    cfg = parse_config([
        "--preset", args.preset, "--seq-length", str(args.seq_length), "--micro-batch-size", "1",
        "--data", args.data, *docs, "--steps", str(args.warmup + args.steps + 2), "--eval-iters", "0",
        "--save", "none", "--quiet", *args.layout.split(),
    ])  # fmt: skip
    trainer = Trainer(cfg)
    writer = trainer.rank == 0
    gpu = torch.cuda.is_available()
    sync = torch.cuda.synchronize if gpu else (lambda: None)  # the CPU: a smoke run of this script only
    for step in range(args.warmup):
        trainer.train_step(step)
    sync()
    compiled = _compiled_kernels()
    t0 = time.perf_counter()
    each = []
    for step in range(args.warmup, args.warmup + args.steps):
        t = time.perf_counter()
        trainer.train_step(step)
        sync()
        each.append(round(time.perf_counter() - t, 4))
    step_s = (time.perf_counter() - t0) / args.steps
    compiled = _compiled_kernels() - compiled
    # the steady rate: the median of the timed steps after the first (which may still compile a kernel variant)
    steady_s = round(statistics.median(each[1:] if len(each) > 1 else each), 4)

    from torch.profiler import ProfilerActivity, profile

    seen: list = []  # the profiled step's document boundaries (one GPU: its attention's FLOPs below)
    doc_attention = getattr(trainer, "doc_attention", None)
    if doc_attention is not None:
        plain = doc_attention.set_documents

        def record(cu):
            seen.append(cu.detach().cpu())
            return plain(cu)

        doc_attention.set_documents = record
    with profile(activities=[ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU]) as prof:
        t_prof = time.perf_counter()
        trainer.train_step(args.warmup + args.steps)
        sync()
        t_prof = time.perf_counter() - t_prof
    total = attention = 0.0
    by_kernel: dict[str, float] = {}
    every: dict[str, float] = {}
    spans = []
    for e in prof.events():
        if gpu and e.device_type.name != "CUDA":
            continue
        us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        total += us
        every[e.name] = every.get(e.name, 0.0) + us
        spans.append((e.time_range.start, e.time_range.end))
        if ATTENTION.match(e.name):
            attention += us
            by_kernel[e.name] = by_kernel.get(e.name, 0.0) + us
    if doc_attention is not None:
        doc_attention.set_documents = plain
    flops = _attention_flops(seen[-1], trainer.model_config) if seen and not trainer.distributed else None
    busy, end = 0.0, float("-inf")  # the union of the kernels' intervals (us)
    for a, b in sorted(spans):
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    python_top = None
    if args.python_profile:
        import cProfile
        import io
        import pstats

        pr = cProfile.Profile()
        pr.enable()
        trainer.train_step(args.warmup + args.steps + 1)
        sync()
        pr.disable()
        buf = io.StringIO()
        for key in ("tottime", "cumulative"):
            pstats.Stats(pr, stream=buf).sort_stats(key).print_stats(args.python_profile)
        python_top = buf.getvalue()
    timeline = None
    if args.rank_timeline and gpu and trainer.distributed:
        timeline = _rank_timeline(lambda: trainer.train_step(args.warmup + args.steps + 3), sync)
    syncs = None
    if args.sync_debug and gpu:
        syncs = _count_syncs(lambda: trainer.train_step(args.warmup + args.steps + 2), sync)
    out = {
        "gpu": torch.cuda.get_device_name() if gpu else "cpu", "torch": torch.__version__, "preset": args.preset,
        "seq_length": args.seq_length, "backend": trainer.backend, "step_s": round(step_s, 4),
        "tokens_per_s": round(args.seq_length * cfg.data_parallel / step_s),
        "step_s_median_after_first": steady_s,
        "tokens_per_s_median": round(args.seq_length * cfg.data_parallel / steady_s),
        "kernel_s": round(total / 1e6, 4),
        "attention_s": round(attention / 1e6, 4), "attention_share_of_step": round(attention / 1e6 / step_s, 4),
        "attention_share_of_kernels": round(attention / max(total, 1.0), 4),
        "attention_kernels_ms": {k: round(v / 1e3, 2) for k, v in sorted(by_kernel.items(), key=lambda kv: -kv[1])},
        "step_s_each": each, "kernels_compiled_in_timed_steps": compiled,
        "layout": args.layout, "dense": args.dense, "profiled_step_s": round(t_prof, 4),
        "gpu_busy_share": round(busy / 1e6 / max(t_prof, 1e-9), 4), "kernels": len(spans),
        "host_syncs": None if syncs is None else sum(syncs.values()),
        "rank_timeline": timeline,
        "attention_tflops": None if flops is None else _achieved(flops, by_kernel),
        "top_kernels_ms": {k[:80]: round(v / 1e3, 2) for k, v in sorted(every.items(), key=lambda kv: -kv[1])[:15]},
    }  # fmt: skip
    if not writer:
        return
    line = json.dumps(out)
    print(line, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
        if syncs:
            with open(args.out.rsplit(".", 1)[0] + "_syncs.txt", "w") as f:
                for where, n in sorted(syncs.items(), key=lambda kv: -kv[1]):
                    f.write(f"{n:5d}  {where}\n")
        if python_top:
            with open(args.out.rsplit(".", 1)[0] + "_python.txt", "w") as f:
                f.write(python_top)


if __name__ == "__main__":
    main()

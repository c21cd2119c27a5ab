"""`longctx bench compile`: the time training loses to kernel compilation, from a user's point of view.

Each scenario runs in a fresh Python process with its own Triton cache directory (cold: empty; warm: filled by an
earlier scenario), timing each attention call's forward + backward to completion (``torch.cuda.synchronize``):

Dense calls pin ``backend="triton"`` (auto would take cuDNN on Hopper for these masks, whose compile is not ours);
packed documents go through `flash_attn_varlen_func` (the block-sparse kernels). The CUDA context is created before
the first timed call and reported apart.

- ``cold``: the first call of each (head dim, mask kind) with an empty cache, D in {64, 128, 256}, causal and full;
- ``lengths``: one process calls dense causal attention (D=128, 16 heads, bf16) at S = 4096, 4100, 8192, 3000, 4000,
  12345, 65536 after a cold start: how long each new length takes;
- ``warm``: a fresh process with the cache the ``lengths`` scenario left, calling new lengths: first call of a
  process with a warm on-disk cache;
- ``packing``: 100 batches of random document packings (16K tokens, causal inside documents, long-tailed lengths,
  through `flash_attn_varlen_func`) with a cold cache: total time and the share spent compiling (time above the
  batches' median);
- ``cold_warmup``: `longctx.warmup` (its kernels compiled concurrently) of each (head dim, mask kind) of ``cold``,
  one after the other in one process with an empty cache, ``backend="triton"``, lengths up to 4096 (the 1K, 2K and
  4K buckets), then the calls of ``cold``: the cold-cache cost per (head dim, dtype, mask kind) with a warm-up;
- ``packing_warmup`` (with ``--warmup``): `longctx.warmup` first, then the same loop.

``--pythonpath DIR`` runs the scenarios against another copy of longctx (e.g. an older tree, for a before/after in
one run on the same GPU). Writes ``<out-dir>/compile_<gpu>[<tag>].json`` and ``.md``.

    longctx bench compile [--out-dir benchmarks/results] [--pythonpath DIR --label before] [--warmup]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

__all__ = ["main"]

# The program each scenario runs (only public API, so it also runs against another copy of longctx).
_CHILD = r"""
import json, sys, time
t_start = time.perf_counter()
import torch
import longctx
spec = json.loads(sys.argv[1])
dev = torch.device("cuda")
t_import = time.perf_counter() - t_start
g = torch.Generator().manual_seed(spec.get("seed", 0))

def doc_lengths(total):
    lens, hi = [], max(32.0, total / 2)
    while sum(lens) < total:
        n = int(torch.exp(torch.empty(1).uniform_(2.77, float(torch.log(torch.tensor(hi))), generator=g)))
        lens.append(min(max(1, n), total - sum(lens)))
    return lens

def call(c):
    D, H, Hkv, S = c["d"], c["h"], c.get("hkv", c["h"]), c["s"]
    if c["mask"] == "documents":
        q = torch.randn(S, H, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(S, Hkv, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(S, Hkv, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        lens = doc_lengths(S)
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
        out = longctx.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    else:
        q = torch.randn(1, H, S, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, Hkv, S, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(1, Hkv, S, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        out = longctx.attention(q, k, v, causal=c["mask"] == "causal", backend="triton")
    out.float().sum().backward()  # a scalar loss, as in training (backward(gradient) makes torch import sympy)

misses = [0]  # Triton's kernel-cache misses (a compile, or a load from the on-disk cache)
try:
    import triton
    triton.knobs.runtime.jit_cache_hook = lambda *a, **k: misses.__setitem__(0, misses[0] + 1)
except Exception:  # a Triton without knobs: the report falls back to timing alone
    misses = None

t0 = time.perf_counter()
torch.ones(1, device=dev).sum().item()  # the CUDA context, not a compile
res = {"import_s": t_import, "cuda_init_s": time.perf_counter() - t0, "calls": []}
if spec.get("warmup"):
    from longctx.warmup import warmup
    res["warmups"] = []
    for kw in spec["warmup"]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        rep = warmup(**kw)
        torch.cuda.synchronize()
        res["warmups"].append(dict(kw, seconds=time.perf_counter() - t0, compile_s=rep.compile_s,
                                   kernels=len(rep.kernels), serial_s=sum(k[1] for k in rep.kernels),
                                   failed=[f"{n}: {e}" for n, e in rep.failed]))
    res["warmup_s"] = sum(w["seconds"] for w in res["warmups"])
deadline = time.perf_counter() + spec.get("budget_s", 1e9)
for c in spec["calls"]:
    if time.perf_counter() > deadline:
        res["stopped_early"] = True
        break
    torch.cuda.synchronize()
    before = misses[0] if misses else 0
    t0 = time.perf_counter()
    call(c)
    torch.cuda.synchronize()
    res["calls"].append(dict(c, seconds=time.perf_counter() - t0))
    if misses:
        res["calls"][-1]["misses"] = misses[0] - before
res["process_s"] = time.perf_counter() - t_start
print("RESULT " + json.dumps(res))
"""


def _run(spec: dict, cache: str, pythonpath: str | None, timeout: float) -> dict:
    # Triton's cache and the CUDA driver's JIT cache both live in the scenario's cache folder
    env = dict(os.environ, TRITON_CACHE_DIR=cache, CUDA_CACHE_PATH=os.path.join(cache, "nv"), PYTHONUNBUFFERED="1")
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, json.dumps(spec)], env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s", "wall_s": time.perf_counter() - t0}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            out = json.loads(line[len("RESULT ") :])
            out["wall_s"] = time.perf_counter() - t0
            return out
    return {"error": (proc.stderr or proc.stdout)[-2000:], "wall_s": time.perf_counter() - t0}


def _compile_share(times: list[float], misses: list[int] | None = None) -> tuple[float, float]:
    """(seconds the loop spent compiling, that as a share of the loop's time): the time above the median batch of
    the batches where Triton's kernel cache missed (``misses``, per batch); without miss counts, the time above
    twice the median of every batch (which also counts batches that are slow for their packing's work)."""
    if not times:
        return 0.0, 0.0
    med = sorted(times)[len(times) // 2]
    if misses is not None:
        extra = sum(max(0.0, t - med) for t, m in zip(times, misses) if m)
    else:
        extra = sum(max(0.0, t - 2 * med) for t in times)
    return extra, extra / sum(times)


def scenarios(warmup: bool, n_batches: int, budget_s: float) -> list[tuple[str, str, dict]]:
    """(name, cache: "fresh" or the name of the scenario whose cache it reuses, spec)."""
    cold = [dict(d=d, h=2048 // d, s=4096, mask=m) for d in (64, 128, 256) for m in ("causal", "full")]
    lengths = [dict(d=128, h=16, s=s, mask="causal") for s in (4096, 4100, 8192, 3000, 4000, 12345, 65536)]
    warm = [dict(d=128, h=16, s=s, mask="causal") for s in (5000, 16384, 30000)]
    packing = [dict(d=128, h=16, hkv=4, s=16384, mask="documents") for _ in range(n_batches)]
    cold_wu = [
        dict(head_dim=c["d"], n_heads=c["h"], masks=[c["mask"]], max_seq_len=c["s"], backend="triton") for c in cold
    ]
    out = [
        ("cold", "fresh", {"calls": cold, "budget_s": budget_s}),
        ("cold_warmup", "fresh", {"calls": cold, "warmup": cold_wu, "budget_s": budget_s}),
        ("lengths", "fresh", {"calls": lengths, "budget_s": budget_s}),
        ("warm", "lengths", {"calls": warm, "budget_s": budget_s}),
        ("packing", "fresh", {"calls": packing, "seed": 1, "budget_s": budget_s}),
    ]
    if warmup:
        wu = {"head_dim": 128, "n_heads": 16, "n_kv_heads": 4, "masks": ["documents"], "max_seq_len": 16384}
        out.append(("packing_warmup", "fresh", {"calls": packing, "seed": 1, "warmup": [wu], "budget_s": budget_s}))
    return out


def _markdown(meta: dict, results: dict) -> str:
    lines = [
        f"# Compile time seen by training: {meta['gpu']}",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}; command: `{meta['command']}`",
        "",
        "Each scenario is a fresh process; times are forward + backward of one call, to completion.",
        "",
    ]
    for label, res in results.items():
        lines += [f"## {label}", ""]
        for name, r in res.items():
            if "error" in r:
                lines += [f"- **{name}**: error: `{r['error'][-300:]}`", ""]
                continue
            head = f"- **{name}**: process {r['process_s']:.1f} s (import {r['import_s']:.2f} s"
            head += f", CUDA context {r['cuda_init_s']:.2f} s)" if "cuda_init_s" in r else ")"
            if "warmup_s" in r:
                head += f", `longctx.warmup` {r['warmup_s']:.1f} s"
            if r.get("stopped_early"):
                head += ", stopped at the time budget"
            lines.append(head)
            for w in r.get("warmups", []):
                lines.append(
                    f"  - warmup D={w['head_dim']} {','.join(w['masks'])} S<={w['max_seq_len']}: {w['seconds']:.2f} s"
                    f" ({w['kernels']} kernels compiled in {w['compile_s']:.2f} s, {w['serial_s']:.1f} s one after"
                    " the other)" + "".join(f"; did not compile: {f}" for f in w["failed"])
                )
            calls = r["calls"]
            if name.startswith("packing"):
                times = [c["seconds"] for c in calls]
                counted = bool(calls) and all("misses" in c for c in calls)
                misses = [c["misses"] for c in calls] if counted else None
                extra, share = _compile_share(times, misses)
                med = sorted(times)[len(times) // 2] if times else 0.0
                slow = sum(t > 2 * med for t in times)
                missed = f"{sum(m > 0 for m in misses)} batches met a kernel-cache miss; " if counted else ""
                lines.append(
                    f"  - {len(times)} batches in {sum(times):.1f} s; median {med * 1e3:.1f} ms; {slow} batches over "
                    f"2x the median; {missed}compiling {extra:.1f} s = {100 * share:.1f}% of the loop"
                )
            else:
                lines.append(
                    "  - " + ", ".join(f"D={c['d']} {c['mask']} S={c['s']}: {c['seconds']:.2f} s" for c in calls)
                )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import torch

    ap = argparse.ArgumentParser(prog="longctx bench compile", description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default=os.path.join("benchmarks", "results"))
    ap.add_argument("--tag", default="", help="suffix naming what the run covers, not when")
    ap.add_argument("--pythonpath", action="append", default=[], help="LABEL=DIR: also run against longctx in DIR")
    ap.add_argument("--warmup", action="store_true", help="add the packing loop after longctx.warmup")
    ap.add_argument(
        "--compare-scenarios", default="lengths,packing", help="the scenarios run against each --pythonpath tree"
    )
    ap.add_argument("--batches", type=int, default=100)
    ap.add_argument("--budget-s", type=float, default=150.0, help="per-scenario time budget (seconds)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("longctx bench compile: needs a CUDA GPU", file=sys.stderr)
        return 1
    import triton

    from longctx.bench import result_stem

    trees = [("longctx", None)] + [tuple(p.split("=", 1)) for p in args.pythonpath]
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "command": "longctx bench compile " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, path in trees:
            caches: dict[str, str] = {}
            results[label] = {}
            wanted = set(args.compare_scenarios.split(",")) if path is not None else None
            for name, cache_of, spec in scenarios(args.warmup and path is None, args.batches, args.budget_s):
                if wanted is not None and name not in wanted:
                    continue
                cache = caches[cache_of] if cache_of != "fresh" else tempfile.mkdtemp(dir=tmp)
                caches[name] = cache
                r = _run(spec, cache, path, timeout=args.budget_s + 240)
                results[label][name] = r
                print(f"[{label}] {name}: {r.get('wall_s', 0):.1f} s {r.get('error', '')[:200]}", flush=True)
    stem = result_stem(args.out_dir, "compile", meta["gpu"], args.tag)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(_markdown(meta, results))
    print(f"wrote {stem}.md and .json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

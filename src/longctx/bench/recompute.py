"""`longctx bench recompute`: peak memory and step time of a ~350M GPT under activation recomputation.

For each sequence length S (batch 1), each attention backend and each policy

    none             keep every activation
    selective        recompute the core attention only (Megatron's selective; nothing to do with a flash kernel)
    full-uniform-1   checkpoint every layer's input (uniform, 1 layer per chunk)
    full-block-half  checkpoint the inputs of the first num_layers / 2 layers only (block)

it runs a few training steps (forward + backward, bf16 autocast, fp32 parameters and gradients) and reports
``torch.cuda.max_memory_allocated`` and the median step time; OOM is recorded as OOM. The activation memory
(peak minus parameters and gradients) is compared with two published models:

* NeMo: full recomputation costs ~30% more compute per layer and keeps ~one hidden state (s*b*h) per layer.
* Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (2022): an unfused
  GPT layer keeps ``s*b*h*(34 + 5*a*s/h)`` bytes (16-bit activations, 4h GeLU MLP, dropout masks); with
  selective recomputation (or flash attention) ``34*s*b*h``.

    longctx bench recompute                       # the GPU run (gpt2-medium shape, S = 4K, 8K, 16K)
    longctx bench recompute --quick               # a CPU smoke run of the same code (tiny model)

Writes ``<out-dir>/recompute_<gpu>.json`` and ``.md``, overwriting the previous run on that device.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from longctx.bench import result_stem
from longctx.layers.attention import default_core_attention
from longctx.models.gpt import GPT, GPTConfig, lm_loss

POLICIES = ("none", "selective", "full-uniform-1", "full-block-half")


def policy_settings(name: str, num_layers: int) -> tuple[str | None, str | None, int | None]:
    return {
        "none": (None, None, None),
        "selective": ("selective", None, None),
        "full-uniform-1": ("full", "uniform", 1),
        "full-block-half": ("full", "block", max(1, num_layers // 2)),
    }[name]


def resolve_backend(
    requested: str, cfg: GPTConfig, s: int, device: torch.device, dtype: torch.dtype
) -> tuple[str, str]:
    """(backend actually used, note). A requested backend that is missing or cannot run falls back to auto."""
    import longctx

    q = torch.empty(1, cfg.num_attention_heads, s, cfg.head_dim, device=device, dtype=dtype)
    kv = torch.empty(1, cfg.kv_heads, s, cfg.head_dim, device=device, dtype=dtype)
    if requested not in longctx.backends():
        chosen = longctx.explain(q, kv, kv, causal=True).backend.name
        return "auto", f"{requested} not registered; auto picked {chosen}"
    try:
        longctx.explain(q, kv, kv, causal=True, backend=requested)
    except ValueError as e:
        chosen = longctx.explain(q, kv, kv, causal=True).backend.name
        return "auto", f"{requested} unavailable ({str(e)[:120]}); auto picked {chosen}"
    return requested, ""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    model: GPT, s: int, batch: int, steps: int, warmup: int, device: torch.device, bf16: bool
) -> dict[str, Any]:
    """Median step time (fwd + bwd) and peak memory of ``steps`` steps after ``warmup``."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, model.config.vocab_size, (batch, s + 1), generator=g).to(device)
    inputs, labels = x[:, :-1], x[:, 1:]

    def step() -> None:
        model.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(inputs)
        loss = lm_loss(logits, labels)
        del logits
        loss.backward()

    for _ in range(warmup):
        step()
    model.zero_grad(set_to_none=True)
    _sync(device)
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    times = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    out: dict[str, Any] = {"step_ms": 1e3 * statistics.median(times), "times_ms": [1e3 * t for t in times]}
    if device.type == "cuda":
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        out["peak_bytes"] = torch.cuda.max_memory_allocated(device)
        out["base_bytes"] = base  # parameters (and anything else resident) before the step
        out["activation_bytes"] = out["peak_bytes"] - base - params  # minus the gradients made in backward
    else:
        from longctx.memory.measure import peak_live_bytes

        out["peak_bytes"] = out["activation_bytes"] = peak_live_bytes(step)
        out["base_bytes"] = 0
    model.zero_grad(set_to_none=True)
    return out


def layer_saved_bytes(model: GPT, s: int, batch: int, device: torch.device, bf16: bool, selective: bool) -> int:
    """Bytes one transformer layer saves for backward at sequence length s (activations only, no weights).

    Counted with saved_tensors_hooks, each storage once; a saved tensor counts as an activation when one of its
    dimensions is the sequence length (weights and their bf16 casts never have one).
    """
    layer = model.layers[0]
    attn = layer.self_attention
    old = attn.recompute_core_attention
    attn.recompute_core_attention = selective
    x = torch.randn(batch, s, model.config.hidden_size, device=device, requires_grad=True)
    cos, sin = model.rotary(torch.arange(s, device=device))
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        if s in t.shape:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    try:
        with (
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
            torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16),
        ):
            out = layer(x, cos, sin)
        del out
    finally:
        attn.recompute_core_attention = old
    return sum(seen.values())


_UNIT = {"name": "GiB", "div": 2**30}


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / _UNIT['div']:.2f}"


def korthikanti_bytes(s: int, b: int, h: int, a: int) -> tuple[float, float]:
    """Per-layer activation bytes of the paper's model: unfused s b h (34 + 5 a s / h); selective 34 s b h."""
    return s * b * h * (34 + 5 * a * s / h), 34.0 * s * b * h


def env_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"torch": torch.__version__, "device": str(device)}
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:
        info["triton"] = None
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cudnn"] = torch.backends.cudnn.version()
    else:
        info["gpu"] = "cpu"
    return info


def report(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    cfg = meta["model"]
    L, h, a = cfg["num_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    cuda = meta["env"]["gpu"] != "cpu"
    peaks = [r["peak_bytes"] for r in results if r.get("peak_bytes")]
    _UNIT.update({"name": "GiB", "div": 2**30} if peaks and max(peaks) > 4 * 2**30 else {"name": "MiB", "div": 2**20})
    precision = "bf16 autocast, fp32 parameters and gradients" if cuda else "float32 throughout (CPU)"
    peak = (
        "Peak = torch.cuda.max_memory_allocated; activations = peak - parameters - gradients"
        if cuda
        else "Peak = the most bytes held by live tensors during the step (longctx.memory.peak_live_bytes, a "
        "TorchDispatchMode tracker; PyTorch keeps no allocator statistics on the CPU), so peak = activations"
    )
    lines = [
        f"# Activation recomputation: {meta['params_m']:.1f}M GPT ({meta['preset']}), batch {meta['batch']}",
        "",
        f"{meta['env']['gpu']}, torch {meta['env']['torch']}, triton {meta['env']['triton']}, "
        f"cuDNN {meta['env'].get('cudnn')}; {meta['date']}. {precision}; "
        f"{L} layers, h={h}, {a} heads (head dim {h // a}), SwiGLU F={cfg['ffn']}, vocab {cfg['vocab_size']}. "
        f"Step = forward + backward (no optimizer), median of {meta['steps']} after {meta['warmup']} warm-up. "
        f"{peak} (it includes the logits and the loss, the same for every policy).",
        "",
    ]
    for note in meta.get("notes", []):
        lines.append(f"- {note}")
    if meta.get("notes"):
        lines.append("")
    lines += [
        f"| S | attention | policy | step ms | vs none | peak {_UNIT['name']} | activations {_UNIT['name']} | "
        "per layer MiB (none - this) / L |",
        "|---|---|---|---|---|---|---|---|",
    ]
    by_key = {(r["s"], r["backend_label"], r["policy"]): r for r in results}
    for r in results:
        none = by_key.get((r["s"], r["backend_label"], "none"))
        if r.get("oom") or r.get("error"):
            what = "OOM" if r.get("oom") else "error"
            lines.append(f"| {r['s']} | {r['backend_label']} | {r['policy']} | {what} | - | - | - | - |")
            continue
        rel = per_layer = "-"
        if none and not none.get("oom") and not none.get("error"):
            rel = f"{r['step_ms'] / none['step_ms']:.2f}x"
            per_layer = f"{(none['activation_bytes'] - r['activation_bytes']) / L / 2**20:.0f}"
        lines.append(
            f"| {r['s']} | {r['backend_label']} | {r['policy']} | {r['step_ms']:.0f} | {rel} | "
            f"{_gib(r['peak_bytes'])} | {_gib(r['activation_bytes'])} | {per_layer} |"
        )
    lines += ["", "## Against the published models", ""]
    lines += [
        "| S | attention | measured per-layer activations MiB (none vs full-uniform-1, + the kept input) | "
        "paper unfused s b h (34 + 5 a s / h) MiB | paper 34 s b h MiB | one hidden state s b h x 4 B MiB | "
        "full-uniform-1 step vs none |",
        "|---|---|---|---|---|---|---|",
    ]
    for (s, label, pol), r in by_key.items():
        if pol != "none" or r.get("oom") or r.get("error"):
            continue
        full = by_key.get((s, label, "full-uniform-1"))
        if not full or full.get("oom") or full.get("error"):
            continue
        hidden = s * meta["batch"] * h * 4  # the residual stream is float32 under autocast
        per_layer = (r["activation_bytes"] - full["activation_bytes"]) / L + hidden
        unfused, sel = korthikanti_bytes(s, meta["batch"], h, a)
        lines.append(
            f"| {s} | {label} | {per_layer / 2**20:.0f} | {unfused / 2**20:.0f} | {sel / 2**20:.0f} | "
            f"{hidden / 2**20:.0f} | {full['step_ms'] / r['step_ms']:.2f}x |"
        )
    lines += [
        "",
        "## Bytes one layer saves for backward (saved_tensors_hooks, activations only)",
        "",
        "| S | attention | none MiB | selective MiB | per s*b*h: none | per s*b*h: selective | "
        "paper unfused 34 + 5as/h | paper selective 34 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    saved = meta.get("layer_saved", {})
    for key in saved:
        if not key.endswith("layer_saved_none"):
            continue
        s_str, label, _ = key.split("/")
        s = int(s_str)
        none_b, sel_b = saved[key], saved.get(f"{s_str}/{label}/layer_saved_selective")
        sbh = s * meta["batch"] * h

        def cell(v, div):
            return "OOM" if v is None else f"{v / div:.0f}" if div > 1000 else f"{v / div:.1f}"

        lines.append(
            f"| {s} | {label} | {cell(none_b, 2**20)} | {cell(sel_b, 2**20)} | {cell(none_b, sbh)} | "
            f"{cell(sel_b, sbh)} | {34 + 5 * a * s / h:.0f} | 34 |"
        )
    lines += ["", meta.get("discussion", "").strip(), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="longctx bench recompute", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt2-medium")
    p.add_argument("--override", default="", help="GPTConfig fields, e.g. num_layers=4,hidden_size=256")
    p.add_argument("--seq-lengths", default="4096,8192,16384")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--backends", default="triton,math", help="attention backends to compare")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--device", default=None)
    p.add_argument("--out-dir", default="benchmarks/results")
    p.add_argument("--quick", action="store_true", help="CPU smoke run: tiny model, S = 64, 128")
    p.add_argument("--from-json", help="only rewrite the Markdown report of an earlier run's JSON")
    p.add_argument(
        "--skip-math-above", type=int, default=0, help="skip math above this S (0: try all; OOM is recorded)"
    )
    args = p.parse_args(argv)
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
        md = Path(args.from_json).with_suffix(".md")
        md.write_text(report(data["results"], data["meta"]))
        print(f"wrote {md}")
        return 0

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.quick:
        args.preset, args.seq_lengths, args.steps, args.warmup = "tiny", "64,128", 1, 0
        args.backends = "tiled,math" if args.backends == "triton,math" and device.type == "cpu" else args.backends
    bf16 = device.type == "cuda"
    seqs = [int(x) for x in args.seq_lengths.split(",")]
    policies = [x for x in args.policies.split(",") if x]
    for pol in policies:
        if pol not in POLICIES:
            raise SystemExit(f"unknown policy {pol!r}; expected some of {POLICIES}")
    backends = [x for x in args.backends.split(",") if x]
    overrides: dict[str, Any] = {}
    for item in filter(None, args.override.split(",")):
        k, _, v = item.partition("=")
        overrides[k.strip()] = int(v) if v.strip().lstrip("-").isdigit() else v.strip()
    cfg = GPTConfig.preset(args.preset, **{"seq_length": max(seqs), **overrides})
    torch.manual_seed(0)
    with torch.device(device):  # initialise on the GPU: seconds instead of a minute for 350M parameters
        model = GPT(cfg)
    env = env_info(device)
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    stem = result_stem(args.out_dir, "recompute", env["gpu"])
    meta: dict[str, Any] = {
        "preset": args.preset + (f" with {args.override}" if args.override else ""),
        "params_m": model.num_parameters() / 1e6,
        "batch": args.batch,
        "steps": args.steps,
        "warmup": args.warmup,
        "date": date,
        "env": env,
        "model": {
            "num_layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size,
            "num_attention_heads": cfg.num_attention_heads,
            "ffn": cfg.ffn_size,
            "vocab_size": cfg.vocab_size,
        },
        "notes": []
        if bf16
        else [
            "The paper's formula counts 16-bit activations (and 1-byte dropout masks; this model has no dropout); "
            "in float32 expect about twice its figure per s*b*h."
        ],
    }
    print(f"recompute bench: {meta['params_m']:.0f}M params, {env['gpu']}, torch {env['torch']}", flush=True)
    results: list[dict[str, Any]] = []
    dtype = torch.bfloat16 if bf16 else torch.float32
    for s in seqs:
        for requested in backends:
            backend, note = resolve_backend(requested, cfg, s, device, dtype)
            label = requested if backend == requested else f"{requested}->auto"
            if note and note not in meta["notes"]:
                meta["notes"].append(f"S={s}: {note}")
            model.set_core_attention(default_core_attention(backend))
            model.train()
            for selective in (False, True):
                key = f"layer_saved_{'selective' if selective else 'none'}"
                try:
                    meta.setdefault("layer_saved", {})[f"{s}/{label}/{key}"] = layer_saved_bytes(
                        model, s, args.batch, device, bf16, selective
                    )
                except torch.cuda.OutOfMemoryError:
                    meta.setdefault("layer_saved", {})[f"{s}/{label}/{key}"] = None
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            for pol in policies:
                g, m, n = policy_settings(pol, cfg.num_layers)
                model.set_recompute(g, m, n)
                rec: dict[str, Any] = {"s": s, "backend": backend, "backend_label": label, "policy": pol}
                if args.skip_math_above and backend == "math" and s > args.skip_math_above:
                    rec["oom"] = True
                    rec["skipped"] = True
                else:
                    try:
                        rec.update(measure(model, s, args.batch, args.steps, args.warmup, device, bf16))
                    except torch.cuda.OutOfMemoryError:
                        rec["oom"] = True
                    except RuntimeError as e:
                        if "out of memory" in str(e).lower():
                            rec["oom"] = True
                        else:
                            rec["error"] = str(e)[:300]
                model.zero_grad(set_to_none=True)
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                results.append(rec)
                msg = (
                    "OOM"
                    if rec.get("oom")
                    else rec.get("error")
                    or (
                        f"{rec['step_ms']:.1f} ms, peak {_gib(rec['peak_bytes'])} GiB, "
                        f"act {_gib(rec['activation_bytes'])} GiB"
                    )
                )
                print(f"S={s:6d} {label:12s} {pol:16s} {msg}", flush=True)
                Path(stem + ".json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    Path(stem + ".md").write_text(report(results, meta))
    print(f"wrote {stem}.json and .md", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

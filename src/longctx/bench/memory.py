"""`longctx bench memory`: how long a sequence trains on this GPU, and at what speed and memory, against transformers.

For a preset (default llama-350m: hidden 1024, 24 layers, 16 query / 4 kv heads, ffn 2816, vocab 32000), batch 1,
bf16 autocast, fp32 parameters, fused AdamW; a step is forward, backward and the optimizer step:

- ``longctx``: the longctx GPT with a memory plan per S (`longctx.plan`): given by ``--plans FILE.json``
  (``{"S": {"settings": {...GPTConfig memory fields}}}``, e.g. written by ``longctx plan --json``) or chosen
  here for ``--budget``. Each row also gives the memory model's predicted peak against the measured one.
- ``hf``: transformers' `LlamaForCausalLM` of the same shape with SDPA and gradient checkpointing, the loss through
  the logits: what a user has without longctx (`longctx.bench.transformers`). transformers is optional: without
  it the column is left out.

Every row: tokens/s (S / the median step), peak ``torch.cuda.max_memory_allocated``, and for longctx the predicted
peak. ``--longest S1,S2`` also tries single steps at those lengths (the first step of a length includes its
kernels' compilation). Writes ``memory_<gpu>[tag].json``, ``.md`` and ``.png`` (tokens/s and peak GiB against S).

    longctx bench memory --plans benchmarks/plans_llama-350m.json --seq-lengths 8192,32768,65536 --longest 524288
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from longctx.bench import result_stem
from longctx.bench.steps import adamw, time_steps, training_step

__all__ = ["main"]


def _gpt_step_runner(config, S: int, device: torch.device):
    """A training step of the longctx GPT of ``config`` on one sequence of S tokens."""
    from longctx.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(config).to(device)
    x = torch.randint(0, config.vocab_size, (1, S), generator=torch.Generator().manual_seed(S)).to(device)
    return training_step(lambda: model(x, labels=x), adamw(model, device), device)


def _hf_step_runner(config, S: int, device: torch.device):
    """A training step of transformers' LlamaForCausalLM (SDPA, gradient checkpointing) of ``config``'s shape."""
    from longctx.bench.transformers import build

    shape = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.ffn_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.kv_heads,
    )  # fmt: skip
    model = build("hf-sdpa-ckpt", shape, S, device)
    x = torch.randint(0, config.vocab_size, (1, S), generator=torch.Generator().manual_seed(S)).to(device)
    return training_step(lambda: model(input_ids=x, labels=x).loss, adamw(model, device), device)


def _measure(make, config, S: int, steps: int, warmup: int, device: torch.device) -> dict[str, Any]:
    """One row's cell: `time_steps` of ``make(config, S, device)`` as a dict (status ok / oom / error)."""
    r = time_steps(lambda: make(config, S, device), tokens=S, steps=steps, warmup=warmup, device=device)
    if r.ok:
        return {"s": S, "status": "ok", "step_s": r.step_s, "tokens_per_s": r.tokens_per_s,
                "peak_bytes": r.peak_bytes, "secs": r.secs}  # fmt: skip
    return {"s": S, "status": r.code, "error": r.error, "secs": r.secs}


def _gib(b) -> str:
    return "-" if b is None else f"{b / 2**30:.1f}"


def report(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    e = meta["env"]
    lines = [
        f"# Longest context and memory: {meta['preset']} on {e['gpu']}",
        "",
        f"torch {e['torch']}, triton {e.get('triton')}, transformers {e.get('transformers', '-')}; batch 1, bf16 "
        "autocast, fp32 parameters, fused AdamW; a step is forward, backward and the optimizer step; tokens/s from "
        f"the median of {meta['steps']} steps after {meta['warmup']} warm-up; peak = torch.cuda.max_memory_allocated.",
        f"Command: `{meta['command']}`",
        "",
        "| S | longctx plan | longctx tokens/s | longctx peak GiB | predicted GiB | predicted / measured |"
        " HF + SDPA + checkpointing tokens/s | HF peak GiB | speed vs HF | memory vs HF |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    star = " \\*"
    for r in rows:
        o, h = r.get("longctx", {}), r.get("hf", {})
        ok_o, ok_h = o.get("status") == "ok", h.get("status") == "ok"
        pred = r.get("predicted_bytes")
        if pred and r.get("first_step"):  # a first step's peak comes before AdamW's states exist
            pred -= r.get("predicted_optimizer_bytes", 0)
        lines.append(
            f"| {r['s']:,}{star if r.get('first_step') else ''} | {r.get('plan', '-')} | "
            + (f"{o['tokens_per_s']:,.0f} | {_gib(o['peak_bytes'])} | " if ok_o else f"{o.get('status', '-')} | - | ")
            + f"{_gib(pred)} | "
            + (f"{pred / o['peak_bytes']:.3f} | " if ok_o and pred else "- | ")
            + (f"{h['tokens_per_s']:,.0f} | {_gib(h['peak_bytes'])} | " if ok_h else f"{h.get('status', '-')} | - | ")
            + (f"{o['tokens_per_s'] / h['tokens_per_s']:.2f}x | {o['peak_bytes'] / h['peak_bytes']:.2f}x |"
               if ok_o and ok_h else "- | - |")
        )  # fmt: skip
    if any(r.get("first_step") for r in rows):
        lines += [
            "",
            "\\* one step without warm-up: its time includes compiling the kernels for that length, and its peak "
            "comes before AdamW's states exist, so it is compared with the predicted peak less those states.",
        ]
    return "\n".join(lines) + "\n"


def _plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in (("longctx", "longctx"), ("hf", "HF + SDPA + checkpointing")):
        pts = [(r["s"], r[key]) for r in rows if r.get(key, {}).get("status") == "ok"]
        if pts:
            a.plot([p[0] for p in pts], [p[1]["tokens_per_s"] / 1e3 for p in pts], "o-", label=label)
            b.plot([p[0] for p in pts], [p[1]["peak_bytes"] / 2**30 for p in pts], "o-", label=label)
    for ax, ylab in ((a, "thousand tokens/s"), (b, "peak GiB")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_ylabel(ylab)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="longctx bench memory", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-350m", help="a GPTConfig preset")
    ap.add_argument("--seq-lengths", default="8192,32768,65536", help="S of the side-by-side rows")
    ap.add_argument("--longest", default="", help="longer S to try with one step each (longctx only)")
    ap.add_argument("--plans", default=None, help="JSON file: S -> {'settings': {...}} (else --budget plans here)")
    ap.add_argument("--budget", default="70GiB", help="memory budget of the plans chosen here")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--no-hf", action="store_true", help="leave out the transformers baseline")
    ap.add_argument("--out-dir", default=str(Path("benchmarks") / "results"))
    ap.add_argument("--tag", default="", help="suffix naming what the run covers, not when")
    ap.add_argument("--report", default=None, help="only rewrite the Markdown and PNG of this result JSON")
    args = ap.parse_args(argv)
    if args.report:
        data = json.loads(Path(args.report).read_text())
        stem = args.report[: -len(".json")]
        Path(stem + ".md").write_text(report(data["meta"], data["rows"]))
        _plot(data["rows"], stem + ".png", f"{data['meta']['preset']}, batch 1, {data['meta']['env']['gpu']}")
        return 0
    if not torch.cuda.is_available():
        ap.error("longctx bench memory measures a CUDA GPU; `longctx plan` predicts memory without one")
    from longctx.memory.model import step_memory
    from longctx.memory.plan import describe, plan
    from longctx.models.gpt import GPTConfig

    device = torch.device("cuda")
    base = GPTConfig.preset(args.preset)
    plans = json.loads(Path(args.plans).read_text()) if args.plans else {}
    seqs = [int(x) for x in args.seq_lengths.split(",") if x]
    longest = [int(x) for x in args.longest.split(",") if x]
    env = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    hf = not args.no_hf
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        hf = False
    meta = {"preset": args.preset, "env": env, "steps": args.steps, "warmup": args.warmup,
            "command": "longctx bench memory " + " ".join(argv if argv is not None else sys.argv[1:])}  # fmt: skip
    rows = []
    for S in seqs + longest:
        if str(S) in plans:
            cfg = base.replace(**plans[str(S)]["settings"])
        else:
            cfg = plan(base, seq_length=S, budget=args.budget).config
        row: dict[str, Any] = {"s": S, "plan": describe(cfg), "settings": {k: getattr(cfg, k) for k in (
            "recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_skip_core_attention",
            "sequence_chunk_size", "cpu_offloading", "cpu_offloading_num_layers")}}  # fmt: skip
        pred = step_memory(cfg, seq_length=S)
        row["predicted_bytes"], row["predicted_optimizer_bytes"] = pred.total, pred.optimizer_states
        is_long = S in longest and S not in seqs
        row["first_step"] = is_long  # one step, no warm-up: AdamW's states do not exist yet at its peak
        steps, warm = (1, 0) if is_long else (args.steps, args.warmup)
        row["longctx"] = _measure(_gpt_step_runner, cfg, S, steps, warm, device)
        if hf and not is_long:
            row["hf"] = _measure(_hf_step_runner, base, S, steps, warm, device)
        rows.append(row)
        print(json.dumps(row, default=str), flush=True)
        stem = result_stem(args.out_dir, "memory", env["gpu"], args.tag)
        Path(stem).parent.mkdir(parents=True, exist_ok=True)
        Path(stem + ".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
        Path(stem + ".md").write_text(report(meta, rows))
    _plot(rows, stem + ".png", f"{args.preset}, batch 1, {env['gpu']}")
    print(report(meta, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

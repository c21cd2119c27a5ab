"""`longctx bench memory`: how long a sequence trains on this GPU, and at what speed and memory, against transformers.

For a preset (default llama-350m: hidden 1024, 24 layers, 16 query / 4 kv heads, ffn 2816, vocab 32000), batch 1,
bf16 autocast, fp32 parameters, fused AdamW; a step is forward, backward and the optimizer step:

- ``longctx``: the longctx GPT with a memory plan per S (`longctx.plan`): given by ``--plans FILE.json``
  (``{"S": {"settings": {...GPTConfig memory fields}}}``, e.g. written by ``longctx plan --json``) or chosen
  here for ``--budget``. Each row also gives the memory model's predicted peak against the measured one.
- ``hf``: transformers' `LlamaForCausalLM` of the same shape with SDPA and gradient checkpointing, the loss through
  the logits: what a user has without longctx (`longctx.bench.transformers`). transformers is optional: without
  it the column is left out.

Every row: tokens/s (S / the median step), peak ``torch.cuda.max_memory_allocated`` (the JSON also gives
``torch.cuda.max_memory_reserved``, what the allocator held), and for longctx the predicted peak. ``--longest
S1,S2`` also tries single steps at those lengths (the first step of a length includes its kernels' compilation).
Writes ``memory_<gpu>[tag].json``, ``.md`` and ``.png`` (tokens/s and peak GiB against S).

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

CLIP_GRAD = 1.0  # `longctx train`'s default --clip-grad: the offloaded steps clip as training does


def _gpt_step_runner(config, S: int, device: torch.device, offload_params: bool = False, overlap: bool = True,
                     resident_units: int = 0):  # fmt: skip
    """A training step of the longctx GPT of ``config`` on one sequence of S tokens; ``offload_params``: its
    parameters, gradients and AdamW states in host memory (`longctx.distributed.offload`), the host's part taken as
    `longctx train` takes it: the gradient norm (`host_grad_norm`), then the clipped AdamW step on the CPU, behind
    the next step's forward (`OverlappedHostStep`), or at once with ``overlap=False``; ``resident_units`` of the
    units keep their states on the GPU (`apply_fsdp`)."""
    from longctx.models.gpt import GPT

    torch.manual_seed(0)
    host_step = None
    if offload_params:
        from longctx.distributed.offload import build_device, host_adamw, offload_model
        from longctx.memory.plan import parameter_count

        with build_device(parameter_count(config)[1], device):
            model = GPT(config)
        offload_model(model, resident_units=resident_units)
        opt = host_adamw(model, lr=1e-5, max_grad_norm=CLIP_GRAD, overlap=overlap)  # a HostAdamW
        host_step = opt.host_step
    else:
        model = GPT(config).to(device)
        opt = adamw(model, device)
    x = torch.randint(0, config.vocab_size, (1, S), generator=torch.Generator().manual_seed(S)).to(device)
    return training_step(lambda: model(x, labels=x), opt, device, host_step)


def model_flops(config, S: int) -> float:
    """The useful FLOPs of a training step on S tokens: 6 x the matmul parameters (all but the input embedding, a
    lookup) x S, plus causal attention's (forward 2 S^2 Hq D, backward twice that); recomputation not counted."""
    from longctx.memory.plan import parameter_count

    n = parameter_count(config)[0] - config.vocab_size * config.hidden_size
    attn = 3 * 2 * S * S * config.num_attention_heads * config.head_dim * config.num_layers
    return 6.0 * n * S + attn


PEAK_BF16_FLOPS = 989e12  # dense bf16 tensor-core peak of the H100 SXM and the H200


def _copy_profile(step) -> dict[str, float]:
    """One more step under torch.profiler: the seconds of host <-> device copies, of kernels (their union: time the
    GPU computes), and the step's wall time; what of the copies the compute did not hide is at most wall - kernels."""
    import time

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    wall = time.perf_counter() - t
    copies, spans = 0.0, []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = e.name.lower()
        start, dur = e.time_range.start, e.time_range.elapsed_us()
        if "memcpy htod" in name or "memcpy dtoh" in name:
            copies += dur
        elif "memcpy" not in name and "memset" not in name:
            spans.append((start, start + dur))
    busy, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            busy += b - max(a, end)
            end = b
    return {"copies_s": copies / 1e6, "kernels_s": busy / 1e6, "wall_s": wall}


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


def _measure(make, config, S: int, steps: int, warmup: int, device: torch.device, **kw) -> dict[str, Any]:
    """One row's cell: `time_steps` of ``make(config, S, device, **kw)`` as a dict (status ok / oom / error)."""
    # the copies' profile is one more step: not for the one-step rows of --longest, whose step can take minutes
    probe = _copy_profile if kw.get("offload_params") and steps + warmup > 1 and device.type == "cuda" else None
    r = time_steps(lambda: make(config, S, device, **kw), tokens=S, steps=steps, warmup=warmup, device=device,
                   probe=probe)  # fmt: skip
    if r.ok:
        return {"s": S, "status": "ok", "step_s": r.step_s, "tokens_per_s": r.tokens_per_s,
                "peak_bytes": r.peak_bytes, "reserved_bytes": r.reserved_bytes, "host_peak_bytes": r.host_peak_bytes,
                "phases": r.phases,
                "copies": r.probe, "secs": r.secs}  # fmt: skip
    return {"s": S, "status": r.code, "error": r.error, "secs": r.secs}


def _first_step_prediction(r: dict[str, Any]) -> int:
    """The predicted GPU peak of a first step (`StepMemory.first_step_peak`; rows written before it was recorded:
    the predicted peak less AdamW's states)."""
    return r.get("predicted_first_step_bytes") or r["predicted_bytes"] - r.get("predicted_optimizer_bytes", 0)


def _gib(b) -> str:
    return "-" if b is None else f"{b / 2**30:.1f}"


def report(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    e = meta["env"]
    lines = [
        f"# Longest context and memory: {meta['preset']} on {e['gpu']}",
        "",
        f"torch {e['torch']}, triton {e.get('triton')}, transformers {e.get('transformers', '-')}; batch 1, bf16 "
        "autocast, fp32 parameters, fused AdamW; a step is forward, backward and the optimizer step; tokens/s from "
        f"the median of {meta['steps']} steps after {meta['warmup']} warm-up; peak = torch.cuda.max_memory_allocated; "
        "MFU = model FLOPs (6 x matmul parameters x tokens + causal attention; recomputation not counted) / step "
        "time / 989 TFLOP/s.",
        f"Command: `{meta['command']}`",
    ]
    star = " \\*"
    offloaded = [r for r in rows if r.get("offload_params")]
    rows = [r for r in rows if not r.get("offload_params")]
    if rows:  # the states on the GPU, against transformers
        lines += [
            "",
            "| S | longctx plan | longctx tokens/s | MFU | longctx peak GiB | predicted GiB | predicted / measured |"
            " HF + SDPA + checkpointing tokens/s | HF peak GiB | speed vs HF | memory vs HF |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
    for r in rows:
        o, h = r.get("longctx", {}), r.get("hf", {})
        ok_o, ok_h = o.get("status") == "ok", h.get("status") == "ok"
        pred = r.get("predicted_bytes")
        if pred and r.get("first_step"):  # a first step: AdamW's states exist only from its optimizer step on
            pred = _first_step_prediction(r)
        lines.append(
            f"| {r['s']:,}{star if r.get('first_step') else ''} | {r.get('plan', '-')} | "
            + (f"{o['tokens_per_s']:,.0f} | {_mfu(r, o)} | {_gib(o['peak_bytes'])} | " if ok_o
               else f"{o.get('status', '-')} | - | - | ")
            + f"{_gib(pred)} | "
            + (f"{pred / o['peak_bytes']:.3f} | " if ok_o and pred else "- | ")
            + (f"{h['tokens_per_s']:,.0f} | {_gib(h['peak_bytes'])} | " if ok_h else f"{h.get('status', '-')} | - | ")
            + (f"{o['tokens_per_s'] / h['tokens_per_s']:.2f}x | {o['peak_bytes'] / h['peak_bytes']:.2f}x |"
               if ok_o and ok_h else "- | - |")
        )  # fmt: skip
    if offloaded:
        lines += _offload_table(meta, offloaded)
    if any(r.get("first_step") for r in rows + offloaded):
        lines += [
            "",
            "\\* one step without warm-up: its time includes compiling the kernels for that length, and AdamW's "
            "states exist only from its optimizer step on, so it is compared with the predicted peak of a first "
            "step: the forward and backward's without the states, or the optimizer step's, where the states are "
            "created beside the weights and gradients on the GPU, whichever is higher.",
        ]
    return "\n".join(lines) + "\n"


def _mfu(row: dict[str, Any], measured: dict[str, Any]) -> str:
    """Model FLOPs utilisation of a measured step (`model_flops` / step time / the bf16 peak), or "-"."""
    if not row.get("model_flops") or not measured.get("step_s"):
        return "-"
    return f"{row['model_flops'] / measured['step_s'] / PEAK_BF16_FLOPS:.1%}"


def _seconds(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _offload_table(meta: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """The rows whose parameters, gradients and AdamW states were in host memory: speed (model FLOPs utilisation
    against the bf16 peak), the optimizer step and the host copies beside it, both memories against the plan."""
    lines = [
        "",
        f"## Parameters, gradients and optimizer states in host memory ({meta['preset']})",
        "",
        f"Host memory of the machine: {meta['env'].get('host_memory_gib', '-')} GiB. optimizer s: the host's "
        "work between the backward and the next forward (the gradient norm, then the clipped AdamW step, or only "
        "its start where it runs behind the next forward); host step s: that step's own time, and of it, waited s: "
        "what the next forward waited for (the part not hidden). The copies and the GPU's compute are from one "
        "more step under torch.profiler: copies = host <-> device copy time; GPU idle = wall - kernel time (at most "
        "what the copies failed to hide).",
        "",
        "| S | plan | tokens/s | step s | fwd+bwd s | optimizer s | host step s | waited s | MFU | GPU peak GiB |"
        " predicted | pred / meas | host peak GiB | predicted | pred / meas | copies s | GPU idle s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        o = r.get("longctx", {})
        pred, host_pred = r.get("predicted_bytes"), r.get("predicted_host_bytes")
        if pred and r.get("first_step"):
            pred = _first_step_prediction(r)
        if o.get("status") != "ok":
            lines.append(f"| {r['s']:,} | {r.get('plan', '-')} | {o.get('status', '-')} |" + " - |" * 14)
            continue
        ph, cp = o.get("phases") or {}, o.get("copies") or {}
        host = o.get("host_peak_bytes")
        star = " \\*" if r.get("first_step") else ""
        lines.append(
            f"| {r['s']:,}{star} | {r.get('plan', '-')} | {o['tokens_per_s']:,.0f} | "
            f"{o['step_s']:.2f} | {ph.get('forward_backward_s', float('nan')):.2f} | "
            f"{ph.get('optimizer_s', float('nan')):.2f} | {_seconds(ph.get('host_step_s'))} | "
            f"{_seconds(ph.get('forward_waited_s'))} | {_mfu(r, o)} | {_gib(o['peak_bytes'])} | {_gib(pred)} | "
            + (f"{pred / o['peak_bytes']:.3f} | " if pred else "- | ")
            + f"{_gib(host)} | {_gib(host_pred)} | "
            + (f"{host_pred / host:.3f} | " if host and host_pred else "- | ")
            + (f"{cp['copies_s']:.2f} | {max(0.0, cp['wall_s'] - cp['kernels_s']):.2f} |" if cp else "- | - |")
        )  # fmt: skip
    return lines


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
    from longctx.memory.measure import expandable_segments

    allocator = expandable_segments()  # as `longctx train` runs: every row under the same allocator
    ap = argparse.ArgumentParser(prog="longctx bench memory", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-350m", help="a GPTConfig preset")
    ap.add_argument("--seq-lengths", default="8192,32768,65536", help="S of the side-by-side rows")
    ap.add_argument("--longest", default="", help="longer S to try with one step each (longctx only)")
    ap.add_argument("--plans", default=None, help="JSON file: S -> {'settings': {...}} (else --budget plans here)")
    ap.add_argument("--budget", default="70GiB", help="memory budget of the plans chosen here")
    ap.add_argument("--host-budget", default=None, help="host memory the plans chosen here may use (default: any)")
    ap.add_argument("--offload-params", choices=("auto", "on", "off"), default="auto",
                    help="parameters, gradients and AdamW states in host memory: auto lets each plan choose; a "
                    "--plans file's entry says it with offload_params (default auto)")  # fmt: skip
    ap.add_argument(
        "--host-step",
        choices=("overlapped", "in-place"),
        default="overlapped",
        help="offloaded rows: the host's clipped AdamW step behind the next step's forward, as longctx train takes "
        "it (distributed.offload.OverlappedHostStep; the optimizer column is then the norm and the step's start), "
        "or all of it before the next step (the optimizer column is its whole time) (default overlapped)",
    )
    ap.add_argument(
        "--resident-units",
        type=int,
        default=None,
        help="offloaded plans: units kept on the GPU (default: what the plan fits)",
    )
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
    env = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "allocator": allocator}
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
    from longctx.layers.offload import host_memory_total

    env["host_memory_gib"] = round(host_memory_total() / 2**30)
    offload = {"auto": None, "on": True, "off": False}[args.offload_params]
    meta = {"preset": args.preset, "env": env, "steps": args.steps, "warmup": args.warmup,
            "command": "longctx bench memory " + " ".join(argv if argv is not None else sys.argv[1:])}  # fmt: skip
    rows = []
    for S in seqs + longest:
        if str(S) in plans:
            cfg = base.replace(**plans[str(S)]["settings"])
            off = bool(plans[str(S)].get("offload_params", offload))
            resident = int(plans[str(S)].get("resident_units", args.resident_units or 0)) if off else 0
        else:
            chosen = plan(base, seq_length=S, budget=args.budget, host_budget=args.host_budget, offload_params=offload,
                          resident_units=args.resident_units)  # fmt: skip
            cfg, off, resident = chosen.config, chosen.offload_params, chosen.resident_units
        row: dict[str, Any] = {"s": S, "plan": describe(cfg, off, resident), "offload_params": off,
                               "resident_units": resident, "settings": {
            k: getattr(cfg, k) for k in ("recompute_granularity", "recompute_method", "recompute_num_layers",
                                         "recompute_skip_core_attention", "sequence_chunk_size", "cpu_offloading",
                                         "cpu_offloading_num_layers")}}  # fmt: skip
        pred = step_memory(cfg, seq_length=S, offload_params=off, resident_units=resident)
        row["predicted_bytes"], row["predicted_optimizer_bytes"] = pred.total, pred.optimizer_states
        row["predicted_first_step_bytes"] = pred.first_step_peak
        row["predicted_host_bytes"], row["model_flops"] = pred.host_total, model_flops(cfg, S)
        is_long = S in longest and S not in seqs
        row["first_step"] = is_long  # one step, no warm-up: AdamW's states do not exist yet at its peak
        steps, warm = (1, 0) if is_long else (args.steps, args.warmup)
        overlap = args.host_step == "overlapped"
        if off:
            row["plan"] += ", the host's AdamW step " + ("behind the next forward" if overlap else "in place")
        row["longctx"] = _measure(_gpt_step_runner, cfg, S, steps, warm, device, offload_params=off, overlap=overlap,
                                  resident_units=resident)  # fmt: skip
        if hf and not is_long and not off:
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

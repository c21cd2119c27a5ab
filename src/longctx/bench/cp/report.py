"""The Markdown and JSON report of `longctx bench cp` (rank 0 writes it)."""

from __future__ import annotations

import json
import os

import torch.distributed as dist

from longctx.bench import result_stem
from longctx.bench.cp.common import GIB
from longctx.bench.cp.search import QUANTUM


def markdown(meta: dict, check: list[dict], bench: list[dict], maxseq: list[dict], args) -> str:
    P = meta["gpus"]
    lines = [
        f"# Context-parallel attention: {P} x {meta['gpu']}",
        "",
        f"{meta['date']}; torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}, NCCL {meta['nccl']}; "
        f"launchers: `{meta['launcher']}`.",
        "",
    ]
    if check:
        lines += [
            f"## NCCL correctness (bf16, S={check[0]['S']}, Hq={args.heads}, Hkv={args.check_kv_heads}, "
            f"D={args.head_dim})",
            "",
            "max |error| against the float64 oracle: context parallel / single-GPU kernel on the whole sequence. "
            "Pass: cp <= 2 x single + 1e-5.",
            "",
            "| mask | method | layout | out | dq | dk | dv | pass |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in check:
            cells = " | ".join(f"{r['err_' + n]:.1e} / {r['err1_' + n]:.1e}" for n in ("out", "dq", "dk", "dv"))
            lines.append(f"| {r['mask']} | {r['method']} | {r['layout']} | {cells} | {'yes' if r['ok'] else 'NO'} |")
        lines.append("")
    if bench:
        combos = [(m, lay) for m in args.methods for lay in args.layouts]
        lines += [
            "## Throughput: per-GPU TFLOP/s (fraction of the single-GPU kernel at the same tokens per GPU)",
            "",
            f"B={args.batch}, Hq={args.heads}, Hkv={args.kv_heads}, D={args.head_dim}, "
            f"{'causal' if args.causal else 'full'}, bf16. Forward+backward; FLOPs 3.5 x 4 B Hq S^2 D"
            f"{' / 2 (causal)' if args.causal else ''}, per GPU = / P; {args.iters} timed calls after {args.warmup} "
            "warm-up, the slowest rank's mean.",
            "",
            "| S total | tokens/GPU | single GPU | " + " | ".join(f"{m} {lay}" for m, lay in combos) + " |",
            "|---|---|---|" + "---|" * len(combos),
        ]
        for n_loc in sorted({r["tokens_per_gpu"] for r in bench}):
            rs = [r for r in bench if r["tokens_per_gpu"] == n_loc]
            one = next(r for r in rs if r["method"] == "single-gpu")
            cells = []
            for m, lay in combos:
                r = next((r for r in rs if r["method"] == m and r["layout"] == lay), None)
                cells.append("-" if r is None else f"{r['tflops_per_gpu']:.0f} ({r['efficiency']:.0%})")
            lines.append(
                f"| {one['S'] // 1024}K | {n_loc // 1024}K | {one['tflops_per_gpu']:.0f} | " + " | ".join(cells) + " |"
            )
        lines.append("")
    if maxseq:
        lines += _max_seq_markdown(maxseq, args)
    return "\n".join(lines)


def _k(n) -> str:
    return "-" if n is None else f"{n / 1024:.1f}K"


def _criterion_text(r: dict) -> str:
    if r.get("criterion", "reserved") == "allocated":
        return (
            f"the peak memory allocated plus a margin of {r.get('margin_gib', 0):g} GiB (criterion `allocated`: "
            "before it raises out-of-memory, PyTorch's caching allocator waits for pending frees, releases its "
            "cached blocks and retries, so a step needs what it allocates plus what fragmentation wastes; the margin "
            "covers that, with expandable segments)"
        )
    return (
        "the peak memory reserved by PyTorch's allocator (criterion `reserved`, what "
        "`torch.cuda.set_per_process_memory_fraction` caps; it includes cached blocks the allocator would free "
        "before failing, so it overstates what a step needs)"
    )


def _max_seq_markdown(rows: list[dict], args) -> list[str]:
    r0 = rows[0]
    one = next((r for r in rows if r["gpus"] == 1 and r["max_seq"]), None)
    name = args.gpt_preset + (f" with {args.gpt_override}" if args.gpt_override else "")
    lines = [
        f"## Longest trainable sequence: GPT {name} ({r0.get('params_m', 0):.3g}M parameters) under a cap of "
        f"{r0['cap_gib']:g} GiB per GPU",
        "",
        "Each try is one full training step: forward, backward, AdamW step; full recomputation (uniform, 1 layer), "
        "bf16 autocast, batch 1; ring attention with the zigzag layout on P > 1 GPUs (gradients all-reduced). "
        f"Tokens per GPU are multiples of {QUANTUM}. The search doubles, then bisects to {args.max_seq_res:.0%}; "
        f"a try fits when {_criterion_text(r0)} on every GPU stayed within the cap (checked by all ranks together "
        "at every layer boundary, where they all stop: no rank is left in a ring exchange). **Measured**: the longest "
        "S that ran and the shortest that did not. **Extrapolated** (not run): the line (criterion's peak) = fixed + "
        "slope x tokens/GPU through the tries that fit, to 95% of the GPU's memory. The CUDA context and NCCL's "
        "own buffers come on top.",
        "",
    ]
    if args.loss == "full":
        lines += [
            "Loss: the GPT's own forward, which returns the logits of the whole local sequence (B, S/P, vocab) "
            "and takes their float32 cross-entropy.",
            "",
        ]
    else:
        lines += [
            "Loss: from the final hidden states, "
            f"{args.loss_chunk} tokens of logits at a time (each chunk recomputed in the backward). The GPT's own "
            "forward returns the logits of the whole sequence: with a 50K vocabulary that is ~6 bytes x vocab = "
            "0.3 MB per token for the bf16 logits and their float32 copy alone, more than the saved activations "
            "of all layers under full recomputation; `--loss full` measures that path.",
            "",
        ]
    lines += [
        "| GPUs | longest S run (tokens/GPU) | shortest S over the cap | peak GiB at the longest (reserved / "
        "allocated) | GiB per 1K tokens/GPU | fixed GiB | longest S vs 1 GPU | S at 95% of the GPU (extrapolated) "
        "| tries, s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        P = r["gpus"]
        run = "-" if r["max_seq"] is None else f"{_k(r['max_seq'])} ({_k(r['best_tokens_per_gpu'])})"
        over = "-" if r["over_tokens_per_gpu"] is None else _k(r["over_tokens_per_gpu"] * P)
        peak = (
            "-" if r["peak_reserved_gib"] is None else f"{r['peak_reserved_gib']:.2f} / {r['peak_allocated_gib']:.2f}"
        )
        slope = "-" if r["gib_per_1k_tokens_per_gpu"] is None else f"{r['gib_per_1k_tokens_per_gpu']:.3f}"
        fixed = "-" if r["fixed_gib"] is None else f"{r['fixed_gib']:.2f}"
        ratio = "-" if one is None or not r["max_seq"] else f"{r['max_seq'] / one['max_seq']:.2f}x"
        ext = (
            "-" if r["extrapolated_max_seq"] is None else f"~{_k(r['extrapolated_max_seq'])} of {r['gpu_gib']:.0f} GiB"
        )
        lines.append(
            f"| {P} | {run} | {over} | {peak} | {slope} | {fixed} | {ratio} | {ext} | {len(r['tries'])}, "
            f"{r['search_secs']:.0f} |"
        )
    lines += [
        "",
        "Tries (tokens/GPU: outcome, step seconds, peak GiB reserved / allocated), and why each search stopped:",
        "",
    ]

    def gib(t, key):
        return "-" if t.get(key) is None else f"{t[key] / GIB:.2f}"

    for r in rows:
        tries = ", ".join(
            f"{_k(t['n'])}: {t['status']} {t['secs']:.1f} s {gib(t, 'reserved')} / {gib(t, 'allocated')}"
            + (" (warm-up)" if t.get("known") else "")
            for t in r["tries"]
        )
        lines.append(f"- {r['gpus']} GPU(s): {tries}; stopped: {r['stop']}")
        if r["error"]:
            lines.append(f"  - error: `{r['error'].strip().splitlines()[-1]}`")
    lines.append("")
    return lines


def write(meta, check, bench, maxseq, args, quiet: bool = False) -> None:
    if dist.get_rank() != 0:
        return
    os.makedirs(args.out_dir, exist_ok=True)
    stem = result_stem(args.out_dir, "cp", f"{meta['gpu']}x{meta['gpus']}", args.tag)
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "args": vars(args), "check": check, "bench": bench, "max_seq": maxseq}, f, indent=1)
    md = markdown(meta, check, bench, maxseq, args)
    with open(stem + ".md", "w") as f:
        f.write(md)
    if not quiet:
        print(md, flush=True)

"""The run folder: ``results.csv``, ``results.json``, ``summary.md`` and PNG plots (when matplotlib is installed).

``summary.md`` opens with the GPU, the versions and the exact command; then, per sequence length, forward and
backward TFLOP/s of every provider on every mask (median over the seeds of the document masks), the best provider
and the ratios of longctx's kernels to cuDNN and to FlexAttention; peak extra memory; the mask build times; the
context-parallel table; and the reason behind every "n/a" and error.
"""

from __future__ import annotations

import csv
import json
import os
import statistics

from longctx.bench.suite.case import COLUMNS, OK, OOM, SKIPPED, UNSUPPORTED

# longctx's own kernels, for the ratio columns (auto counts only where it picked one of them)
OURS = ("longctx_triton", "longctx_triton_sparse")
OURS_BACKENDS = ("triton", "triton_sparse", "tiled")
CELL = {OOM: "OOM", UNSUPPORTED: "n/a", SKIPPED: "skip"}


def write_report(out_dir: str, rows: list[dict], meta: dict, build_rows: list[dict] | None = None) -> dict:
    """Write the run folder; returns {"csv": path, "json": path, "md": path, "png": [paths]}."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {k: os.path.join(out_dir, n) for k, n in (("csv", "results.csv"), ("json", "results.json"))}
    paths["md"] = os.path.join(out_dir, "summary.md")
    with open(paths["csv"], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(COLUMNS))
        w.writeheader()
        for r in rows:
            w.writerow({c: r.get(c) for c in COLUMNS})
    with open(paths["json"], "w") as f:
        json.dump({"meta": meta, "results": rows, "mask_build": build_rows or []}, f, indent=1)
    paths["png"], not_drawn = plot(out_dir, rows, meta)
    with open(paths["md"], "w") as f:
        f.write(markdown(rows, meta, build_rows or [], plots=(paths["png"], not_drawn)))
    return paths


# ----------------------------------------------------------------------------------------------------------
# Aggregation
# ----------------------------------------------------------------------------------------------------------


def _groups(rows: list[dict]) -> dict[tuple, list[dict]]:
    """(mode, S, mask, provider/method) -> rows (one per seed)."""
    g: dict[tuple, list[dict]] = {}
    for r in rows:
        g.setdefault((r["mode"], r["S"], r["mask"], r["provider"]), []).append(r)
    return g


def _agg(rs: list[dict], key: str) -> float | None:
    """Median over the seeds that ran; None unless every seed ran."""
    vals = [r[key] for r in rs if r["code"] == OK and r.get(key) is not None]
    return statistics.median(vals) if vals and len(vals) == len(rs) else None


def _code(rs: list[dict]) -> str:
    for c in (OOM, "error", UNSUPPORTED, SKIPPED):
        if any(r["code"] == c for r in rs):
            return c
    return OK


def _num(v: float) -> str:
    """Three significant figures at most, no exponent above 1 (TFLOP/s of a GPU and of a CPU alike)."""
    return f"{v:.0f}" if v >= 100 else f"{v:.3g}"


def _cell(rs: list[dict] | None, key: str) -> str:
    if not rs:
        return ""
    v = _agg(rs, key)
    if v is not None:
        return _num(v)
    c = _code(rs)
    return CELL.get(c, "err") if c != OK else "-"


def _ours(g: dict, mode: str, S: int, mask: str, key: str) -> float | None:
    best = None
    for p, rs in ((p, g.get((mode, S, mask, p))) for p in OURS + ("longctx_auto",)):
        if not rs or (p == "longctx_auto" and any(r["backend"] not in OURS_BACKENDS for r in rs)):
            continue
        v = _agg(rs, key)
        if v is not None and (best is None or v > best):
            best = v
    return best


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}"


def _order(values) -> list:
    out = []
    for v in values:
        if v not in out:
            out.append(v)
    return out


# ----------------------------------------------------------------------------------------------------------
# Markdown
# ----------------------------------------------------------------------------------------------------------


def _header(meta: dict) -> list[str]:
    lines = [
        f"# longctx bench suite: {meta.get('gpu', '?')}" + (f" x {meta['world']}" if meta.get("world", 1) > 1 else ""),
        "",
        f"Command: `{meta.get('command', '?')}`",
        "",
        "Versions: "
        + ", ".join(f"{k} {meta[k]}" for k in ("longctx", "torch", "triton", "cuda", "cudnn") if meta.get(k))
        + ".",
        "",
        f"Shape: batch {meta.get('B')}, {meta.get('Hq')} query / {meta.get('Hkv')} kv heads, head dim {meta.get('D')}, "
        f"{meta.get('dtype')}; masks: {meta.get('mask_params') or 'catalogue defaults'}; document seeds "
        f"{meta.get('seeds')}. FLOPs over the mask's kept area: forward 4 x area x Hq x D, backward 2.5x forward "
        "(kernel mode: the backward timed alone, autograd.grad of a saved graph). "
        f"Times: {meta.get('timer', '?')}. Peak memory: bytes "
        "allocated during one forward + backward above the inputs. Cells: TFLOP/s (median over seeds); n/a = the "
        "provider cannot run the mask, OOM = out of memory, skip = capped or over the time budget, err = it raised.",
        "",
        f"`longctx` in the ratio columns: the best of {', '.join(OURS)} (and longctx_auto where it picked one of "
        "longctx's kernels).",
        "",
    ]
    return lines


def _kernel_tables(rows: list[dict], meta: dict) -> list[str]:
    kr = [r for r in rows if r["mode"] == "kernel"]
    if not kr:
        return []
    g = _groups(kr)
    provs = _order(r["provider"] for r in kr)
    out = []
    for S in sorted(_order(r["S"] for r in kr)):
        masks = _order(r["mask"] for r in kr if r["S"] == S)
        for key, title in (("fwd_tflops", "forward TFLOP/s"), ("bwd_tflops", "backward TFLOP/s")):
            if not any(r.get(key) is not None for r in kr if r["S"] == S) and key == "bwd_tflops":
                continue
            out += [f"## S = {S}: {title}", ""]
            out.append("| mask | kept | " + " | ".join(provs) + " | best | longctx / cuDNN | longctx / Flex |")
            out.append("|---|---|" + "---|" * (len(provs) + 3))
            for m in masks:
                any_r = next(r for r in kr if r["S"] == S and r["mask"] == m)
                cells = [_cell(g.get(("kernel", S, m, p)), key) for p in provs]
                vals = {p: _agg(g.get(("kernel", S, m, p)) or [], key) for p in provs}
                vals = {p: v for p, v in vals.items() if v is not None}
                best = max(vals, key=vals.get) if vals else "-"
                ours = _ours(g, "kernel", S, m, key)
                cu = _agg(g.get(("kernel", S, m, "cudnn")) or [], key)
                fl = _agg(g.get(("kernel", S, m, "flex")) or [], key)
                nseeds = max(len(g.get(("kernel", S, m, p)) or []) for p in provs)
                name = m + (f" ({nseeds} seeds)" if nseeds > 1 else "")
                out.append(
                    f"| {name} | {any_r['kept_fraction']:.3f} | "
                    + " | ".join(cells)
                    + f" | {best} | {_ratio(ours, cu)} | {_ratio(ours, fl)} |"
                )
            out.append("")
    out += ["## Peak extra memory of forward + backward (MiB)", ""]
    if not any(r.get("peak_extra_mib") is not None for r in kr):
        return out + [f"Not measured: {_no_memory_reason(meta)}.", ""]
    out.append("| S | mask | " + " | ".join(provs) + " |")
    out.append("|---|---|" + "---|" * len(provs))
    for S in sorted(_order(r["S"] for r in kr)):
        for m in _order(r["mask"] for r in kr if r["S"] == S):
            out.append(f"| {S} | {m} | " + " | ".join(_mem_cell(g.get(("kernel", S, m, p))) for p in provs) + " |")
    out.append("")
    return out


def _no_memory_reason(meta: dict) -> str:
    if meta.get("gpu") == "cpu":
        return "peak memory is read from torch.cuda.max_memory_allocated, on CUDA devices only; this run was on the CPU"
    return "no provider's forward + backward completed with a memory count"


def _mem_cell(rs: list[dict] | None) -> str:
    if not rs:
        return ""
    vals = [r["peak_extra_mib"] for r in rs if r["code"] == OK and r.get("peak_extra_mib") is not None]
    if vals:
        return f"{max(vals):.0f}"
    c = _code(rs)
    return CELL.get(c, "err") if c != OK else "-"


def _peak(rs: list[dict]) -> float | None:
    vals = [r["peak_extra_mib"] for r in rs if r["code"] == OK and r.get("peak_extra_mib") is not None]
    return max(vals) if vals else None


def _build_table(build_rows: list[dict]) -> list[str]:
    if not build_rows:
        return []
    out = [
        f"## Mask build at S = {build_rows[0]['S']} (ms, median wall time after a first call)",
        "",
        "| mask | longctx.block_mask | Flex create_block_mask | note |",
        "|---|---|---|---|",
    ]
    for r in build_rows:
        lm = "-" if r.get("longctx_ms") is None else f"{r['longctx_ms']:.1f}"
        fm = "-" if r.get("flex_ms") is None else f"{r['flex_ms']:.1f}"
        out.append(f"| {r['mask']} | {lm} | {fm} | {r.get('error', '')} |")
    return out + [""]


def _cp_table(rows: list[dict]) -> list[str]:
    cr = [r for r in rows if r["mode"] == "cp"]
    if not cr:
        return []
    g = _groups(cr)
    world = max(r["world"] for r in cr)
    methods = [m for m in _order(r["provider"] for r in cr) if m not in ("single_gpu", "one_gpu")]
    out = [
        f"## Context parallelism: {world} ranks, per-GPU TFLOP/s of forward + backward (time: the slowest rank)",
        "",
        "Weak scaling: S = tokens per GPU x ranks; `single GPU` is longctx.attention on one rank's tokens with the "
        "same mask. In brackets: per-GPU throughput over the single GPU's. Forward + backward is timed as one "
        "(3.5x the forward FLOPs over that time); the backward columns of the CSV are that time minus the forward "
        "alone, empty where noise makes the difference non-positive.",
        "",
        "| tokens/GPU | S | mask | single GPU | " + " | ".join(methods) + " |",
        "|---|---|---|---|" + "---|" * len(methods),
    ]
    for S in sorted(_order(r["S"] for r in cr if r["provider"] != "single_gpu")):
        for m in _order(r["mask"] for r in cr if r["S"] == S):
            ref = (g.get(("cp", S // world, m, "single_gpu")) or [None])[0]
            ref_tf = _tot(ref)
            cells = []
            for meth in methods:
                rs = g.get(("cp", S, m, meth))
                if not rs:
                    cells.append("")
                    continue
                r = rs[0]
                tf = _tot(r)
                cells.append(
                    CELL.get(r["code"], "err")
                    if tf is None
                    else f"{tf:.1f}" + (f" ({tf / ref_tf:.0%})" if ref_tf else "")
                )
            ref_cell = "-" if ref_tf is None else f"{ref_tf:.1f}"
            out.append(f"| {S // world} | {S} | {m} | {ref_cell} | " + " | ".join(cells) + " |")
    return out + [""] + _strong_table(cr, g, world, methods)


def _ms(r: dict | None) -> float | None:
    if r is None or r["code"] != OK:
        return None
    return r.get("fwd_bwd_ms") or (r["fwd_ms"] + r["bwd_ms"] if r.get("fwd_ms") and r.get("bwd_ms") else None)


def _strong_table(cr: list[dict], g: dict, world: int, methods: list[str]) -> list[str]:
    """Forward + backward ms of each method against one GPU on the whole sequence (rows ``one_gpu``)."""
    whole = [r for r in cr if r["provider"] == "one_gpu"]
    if not whole:
        return []
    out = [
        f"## Context parallelism against one GPU on the whole sequence: forward + backward ms ({world} ranks)",
        "",
        "`one GPU`: longctx.attention on the whole sequence on one GPU of the same machine. In brackets: per-GPU "
        f"efficiency, one GPU's time / ({world} x the method's time); above 100% when the sequence does not fit "
        "the one GPU's caches as well, below when communication or imbalance costs.",
        "",
        "| S | mask | one GPU | " + " | ".join(methods) + " |",
        "|---|---|---|" + "---|" * len(methods),
    ]
    for ref in whole:
        S, m = ref["S"], ref["mask"]
        one = _ms(ref)
        cells = []
        for meth in methods:
            r = (g.get(("cp", S, m, meth)) or [None])[0]
            ms = _ms(r)
            if r is None:
                cells.append("")
            elif ms is None:
                cells.append(CELL.get(r["code"], "err"))
            else:
                cells.append(f"{ms:.1f}" + (f" ({one / (world * ms):.0%})" if one else ""))
        one_cell = CELL.get(ref["code"], "err") if one is None else f"{one:.1f}"
        out.append(f"| {S} | {m} | {one_cell} | " + " | ".join(cells) + " |")
    return out + [""]


def _tot(r: dict | None) -> float | None:
    """Per-GPU TFLOP/s of forward + backward together (3.5x the forward FLOPs over their measured time)."""
    if r is None or r["code"] != OK or not r.get("fwd_ms"):
        return None
    both = r.get("fwd_bwd_ms") or (r["fwd_ms"] + r["bwd_ms"] if r.get("bwd_ms") else None)
    if not both:
        return None
    fwd_flops = r["fwd_tflops"] * r["fwd_ms"]  # TFLOP/s x ms, per GPU
    return 3.5 * fwd_flops / both


def _notes(rows: list[dict]) -> list[str]:
    seen: dict[tuple, list[str]] = {}
    for r in rows:
        if r.get("reason"):
            masks = seen.setdefault((r["provider"], r["code"], r["reason"]), [])
            if r["mask"] not in masks:
                masks.append(r["mask"])
    if not seen:
        return []
    out = ["## Notes: why a cell is empty or partial", ""]
    for (p, c, reason), masks in seen.items():
        out.append(f"- {p} ({c}): {reason} [{', '.join(masks)}]")
    return out + [""]


def markdown(rows: list[dict], meta: dict, build_rows: list[dict], plots: tuple | None = None) -> str:
    lines = _header(meta) + _kernel_tables(rows, meta) + _build_table(build_rows) + _cp_table(rows) + _notes(rows)
    if plots is not None:
        lines += _plot_notes(*plots)
    return "\n".join(lines).rstrip() + "\n"


def _plot_notes(written: list[str], not_drawn: dict[str, str]) -> list[str]:
    out = ["## Plots", ""]
    out += [f"- {os.path.basename(p)}" for p in written]
    out += [f"- {name}: not drawn, {why}" for name, why in not_drawn.items()]
    return out + [""]


# ----------------------------------------------------------------------------------------------------------
# Plots
# ----------------------------------------------------------------------------------------------------------


def plot(out_dir: str, rows: list[dict], meta: dict) -> tuple[list[str], dict[str, str]]:
    """Bar charts of TFLOP/s per mask and provider (one panel per S, forward and backward), peak memory against
    S, and the context-parallel bars. Returns (paths written, {plot: why it was not drawn})."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], {"every plot": "matplotlib is not installed"}
    written: list[str] = []
    not_drawn: dict[str, str] = {}
    kr = [r for r in rows if r["mode"] == "kernel"]
    g = _groups(kr)
    provs = _order(r["provider"] for r in kr)
    seqs = sorted(_order(r["S"] for r in kr))
    for key, title in (("fwd_tflops", "forward"), ("bwd_tflops", "backward")):
        if not seqs or not any(r.get(key) for r in kr):
            if kr:
                not_drawn[f"tflops_{key[:3]}.png"] = "no provider measured it"
            continue
        masks = _order(r["mask"] for r in kr)
        fig, axes = plt.subplots(len(seqs), 1, figsize=(max(8, 0.7 * len(masks) + 3), 3.2 * len(seqs)), squeeze=False)
        width = 0.8 / max(1, len(provs))
        for ax, S in zip(axes[:, 0], seqs):
            for pi, p in enumerate(provs):
                vals = [_agg(g.get(("kernel", S, m, p)) or [], key) or 0.0 for m in masks]
                ax.bar([i + pi * width for i in range(len(masks))], vals, width, label=p)
            ax.set_title(f"{title}, S = {S} ({meta.get('gpu', '?')}, {meta.get('dtype')})", fontsize=9)
            ax.set_ylabel("TFLOP/s")
            ax.set_xticks([i + 0.4 for i in range(len(masks))])
            ax.set_xticklabels(masks, rotation=40, ha="right", fontsize=7)
        axes[0, 0].legend(fontsize=7, ncol=3)
        fig.tight_layout()
        path = os.path.join(out_dir, f"tflops_{key[:3]}.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    mem = [r for r in kr if r.get("peak_extra_mib") is not None]
    if not kr:
        pass
    elif not mem:
        not_drawn["memory.png"] = _no_memory_reason(meta)
    elif len(seqs) < 2:
        not_drawn["memory.png"] = "peak memory against S needs at least two lengths"
    if mem and len(seqs) > 1:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for p in provs:
            for m in ("causal", "causal_document"):
                pts = [(S, _peak(g.get(("kernel", S, m, p)) or [])) for S in seqs]
                pts = [(s, v) for s, v in pts if v is not None]
                if pts:
                    ax.plot([s for s, _ in pts], [v for _, v in pts], marker="o", label=f"{p}, {m}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("S")
        ax.set_ylabel("peak extra MiB (forward + backward)")
        ax.legend(fontsize=6)
        fig.tight_layout()
        path = os.path.join(out_dir, "memory.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    cr = [r for r in rows if r["mode"] == "cp" and _tot(r) is not None]
    if not cr:
        not_drawn["cp.png"] = "this run has no context-parallel point (longctx bench suite --cp)"
    if cr:
        labels = _order(f"{r['mask']}\nS={r['S']}" for r in cr if r["provider"] != "single_gpu")
        methods = _order(r["provider"] for r in cr)
        fig, ax = plt.subplots(figsize=(max(7, 0.9 * len(labels) + 3), 4.5))
        width = 0.8 / max(1, len(methods))
        world = max(r["world"] for r in cr)
        for mi, meth in enumerate(methods):
            vals = []
            for lab in labels:
                mask, s = lab.split("\nS=")
                S = int(s) // world if meth == "single_gpu" else int(s)
                r = next((r for r in cr if r["provider"] == meth and r["mask"] == mask and r["S"] == S), None)
                vals.append(_tot(r) or 0.0)
            ax.bar([i + mi * width for i in range(len(labels))], vals, width, label=meth)
        ax.set_xticks([i + 0.4 for i in range(len(labels))])
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_ylabel("per-GPU TFLOP/s (fwd + bwd)")
        ax.set_title(f"context parallelism, {world} ranks ({meta.get('gpu', '?')})", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(out_dir, "cp.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written, not_drawn

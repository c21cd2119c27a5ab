"""`longctx bench attention`: TFLOP/s of forward and backward, and peak memory, of dense attention at the
FlashAttention benchmark's shapes. Masks, the LongCA conventions and context parallelism: ``longctx bench suite``.

A front end of the suite: every (case, provider) runs through `longctx.bench.suite.kernel.run_cases` and the
suite's providers, and this module turns the suite's rows into its own report.

Shapes follow the FlashAttention benchmarks: batch x seqlen = 16384 tokens and heads x head_dim = 2048, for
D in {64, 128, 256} and S in {1K, 2K, 4K, 8K, 16K}, causal and not, plus GQA (Hq=32, Hkv=8, D=128, causal).
FLOPs: forward ``4 * B * Hq * S * S * D``, halved for causal; backward 2.5x forward, timed alone (the
forward graph is built once and ``autograd.grad`` is timed with ``retain_graph``). Times are
`triton.testing.do_bench` medians on random bf16 inputs. Peak memory: bytes allocated by one forward + backward
above the inputs, the upstream gradient included.

Providers (the suite's, under their names in this report): ``triton`` (``longctx_triton``, ours), ``cudnn`` and
``fa2`` (SDPA pinned to cuDNN / FlashAttention-2), ``flex`` (compiled FlexAttention), ``tiled`` (longctx's
PyTorch FlashAttention, up to S=2K here) and ``math`` (the dense reference, up to 4K where its scores fit); any
other suite provider by its suite name. ``--device cpu`` runs the same code on tiny shapes (256 tokens, heads x
head_dim = 64, fp32; flex eager, tiled, math) with ``perf_counter`` medians.

Writes ``<out-dir>/attention_<gpu>[<tag>].json``, ``.md`` and ``.png`` (overwriting the previous run on that
GPU) with the GPU name and the torch, triton and cuDNN versions. ``--masks`` also runs ``longctx.bench.masks``
(sliding window, documents, block-sparse: a subset of ``longctx bench suite``).

    longctx bench attention --quick                      # D=128, S in {2K, 8K}, ours vs cudnn/fa2
    longctx bench attention --d 128 --s 4096,16384 --providers triton,cudnn --no-bwd
    longctx bench attention --device cpu --quick --out-dir /tmp/att      # the CPU version (CI)
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
from dataclasses import asdict, dataclass, field, replace

import torch

from longctx.bench import result_stem
from longctx.bench.suite.case import DTYPES, OK, SKIPPED, UNSUPPORTED, KernelCase
from longctx.bench.suite.kernel import SuiteConfig, run_cases
from longctx.bench.suite.providers import provider_names
from longctx.masks import make_mask
from longctx.units import counts_arg

PROVIDERS = ("triton", "cudnn", "fa2", "flex", "tiled", "math")
SUITE_NAMES = {"triton": "longctx_triton"}  # this report's name -> the suite's; the others are the same
REPORT_NAMES = {v: k for k, v in SUITE_NAMES.items()}
S_CAPS = {"tiled": 2048, "math": 4096}  # the slow references: longer S is skipped


@dataclass(frozen=True)
class Profile:
    """The sweep's shapes and defaults on one kind of device (``--quick``: a smaller one)."""

    tokens: int  # batch x S
    hidden: int  # heads x head dim
    gqa: tuple[int, int, int]  # (Hq, Hkv, D) of the GQA cases (causal; run when D is among --d)
    d: list[int]
    s: list[int]
    providers: tuple[str, ...]
    dtype: str
    warmup: int
    rep: int


GPU = Profile(16384, 2048, (32, 8, 128), [64, 128, 256], [1024, 2048, 4096, 8192, 16384], PROVIDERS, "bf16", 25, 100)
CPU = Profile(256, 64, (4, 2, 32), [16, 32], [64, 128], ("flex", "tiled", "math"), "fp32", 1, 2)
PROFILES = {  # (device, --quick) -> profile
    ("cuda", False): GPU,
    ("cuda", True): replace(GPU, d=[128], s=[2048, 8192], providers=("triton", "cudnn", "fa2"), warmup=10, rep=50),
    ("cpu", False): CPU,
    ("cpu", True): replace(CPU, d=[32], s=[64]),
}


@dataclass
class Case:
    d: int
    s: int
    causal: bool
    hq: int
    hkv: int
    b: int

    @property
    def label(self) -> str:
        g = f" GQA {self.hq}/{self.hkv}" if self.hq != self.hkv else ""
        return f"D={self.d} S={self.s} {'causal' if self.causal else 'full'}{g}"

    def fwd_flops(self) -> float:
        f = 4.0 * self.b * self.hq * self.s * self.s * self.d
        return f * (0.5 if self.causal else 1.0)


@dataclass
class Result:
    case: Case
    provider: str
    fwd_ms: float | None = None
    bwd_ms: float | None = None
    fwd_tflops: float | None = None
    bwd_tflops: float | None = None
    peak_extra_mib: float | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)


def build_cases(ds: list[int], ss: list[int], causal: list[bool], gqa: bool, profile: Profile = GPU) -> list[Case]:
    """MHA cases by head dim, length and causal-ness (heads = hidden // D, batch = tokens // S), then GQA."""
    cases = []
    for d in ds:
        for s in ss:
            for c in causal:
                h = profile.hidden // d
                cases.append(Case(d, s, c, h, h, max(1, profile.tokens // s)))
    if gqa:
        hq, hkv, d = profile.gqa
        for s in ss:
            cases.append(Case(d, s, True, hq, hkv, max(1, profile.tokens // s)))
    return cases


def kernel_case(case: Case, dtype: str, device: str, layout: str = "bhsd") -> KernelCase:
    """The suite's case for one of this sweep's: the full or causal mask at (B, Hq, Hkv, D)."""
    mask = make_mask("causal" if case.causal else "full", case.s)
    return KernelCase(mask, case.b, case.hq, case.hkv, case.d, dtype, device, layout)


def to_result(row: dict) -> Result:
    """A suite row as this report's result: the case read back from the row's shape, TFLOP/s by this sweep's FLOP
    convention (causal halves S x S), the peak with the upstream gradient (B, Hq, S, D) counted in, and the
    result code as a note."""
    case = Case(row["D"], row["S"], row["mask"] == "causal", row["Hq"], row["Hkv"], row["B"])
    provider = REPORT_NAMES.get(row["provider"], row["provider"])
    res = Result(case, provider, extra={"code": row["code"], "backend": row.get("backend") or ""})
    if row.get("fwd_ms"):
        res.fwd_ms = row["fwd_ms"]
        res.fwd_tflops = case.fwd_flops() / res.fwd_ms * 1e-9
    if row.get("bwd_ms"):
        res.bwd_ms = row["bwd_ms"]
        res.bwd_tflops = 2.5 * case.fwd_flops() / res.bwd_ms * 1e-9
        if row.get("peak_extra_mib") is not None:
            grad_bytes = case.b * case.hq * case.s * case.d * DTYPES[row["dtype"]].itemsize
            res.peak_extra_mib = row["peak_extra_mib"] + grad_bytes / 2**20
    if row["code"] in (SKIPPED, UNSUPPORTED):
        res.note = f"skip: {row['reason']}"
    elif row["code"] != OK:
        res.note = f"error: {row['reason']}"
    else:
        res.note = row.get("reason") or ""
    return res


def run_sweep(
    cases: list[Case], providers: list[str], cfg: SuiteConfig, layout: str = "bhsd", on_result=None
) -> list[Result]:
    """Every provider (this report's names) on every case, through the suite's runner with ``cfg``'s timing and
    device; ``on_result(results)`` after each one."""
    cfg.providers = [SUITE_NAMES.get(p, p) for p in providers]
    results: list[Result] = []

    def on_row(rows: list[dict]) -> None:
        results.append(to_result(rows[-1]))
        if on_result is not None:
            on_result(results)

    run_cases([kernel_case(c, cfg.dtype, cfg.device, layout) for c in cases], cfg, on_row=on_row)
    return results


def _versions(device: str) -> dict:
    try:
        import triton

        tv = triton.__version__
    except ImportError:
        tv = None
    cuda = device.startswith("cuda")
    props = torch.cuda.get_device_properties(0) if cuda else None
    return {
        "gpu": props.name if cuda else "cpu",
        "sms": props.multi_processor_count if cuda else None,
        "torch": torch.__version__,
        "triton": tv,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "cuda": torch.version.cuda if cuda else None,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def _fmt(x: float | None) -> str:
    """Whole numbers from 1 up (a GPU's TFLOP/s and MiB); two significant figures below (a CPU's)."""
    return "-" if x is None else f"{x:.0f}" if x >= 1 else f"{x:.2g}"


def markdown(results: list[Result], providers: list[str], meta: dict) -> str:
    lines = [
        f"# Attention benchmark: {meta['gpu']}",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}, cuDNN {meta['cudnn']}, CUDA {meta['cuda']}; {meta['date']}.",
        f"{meta.get('dtype', 'bf16')}, batch x S = {meta.get('tokens', GPU.tokens)} tokens, heads x D = "
        f"{meta.get('hidden', GPU.hidden)}; forward TFLOP/s / backward TFLOP/s (backward timed alone,",
        "2.5x forward FLOPs, causal halves them); "
        + ("`triton.testing.do_bench` median." if meta["gpu"] != "cpu" else "`time.perf_counter` median."),
        "Input memory layout: "
        + ("(B, S, H, D), viewed as (B, H, S, D)." if meta.get("layout") == "bshd" else "(B, H, S, D)."),
        "",
    ]
    if meta.get("merged_from"):
        lines += [f"Merged from several runs on this machine kind: {', '.join(meta['merged_from'])}.", ""]
    if meta.get("note"):
        lines += [meta["note"], ""]
    lines += [
        "| case | " + " | ".join(providers) + " | ours/cuDNN fwd | ours/FA2 fwd | ours/FA2 bwd |",
        "|---|" + "---|" * (len(providers) + 3),
    ]
    by_case: dict[str, dict[str, Result]] = {}
    order = []
    for r in results:
        if r.case.label not in by_case:
            order.append(r.case.label)
        by_case.setdefault(r.case.label, {})[r.provider] = r

    def ratio(a: Result | None, b: Result | None, attr: str) -> str:
        x = getattr(a, attr, None) if a else None
        y = getattr(b, attr, None) if b else None
        return "-" if not x or not y else f"{x / y:.2f}"

    for label in order:
        row = by_case[label]
        cells = []
        for p in providers:
            r = row.get(p)
            if r is None:
                cells.append("")
            elif r.fwd_tflops is None:
                cells.append("skip" if r.note.startswith("skip") else "err")
            else:
                cells.append(f"{_fmt(r.fwd_tflops)} / {_fmt(r.bwd_tflops)}")
        ours = row.get("triton")
        cells += [ratio(ours, row.get("cudnn"), "fwd_tflops"), ratio(ours, row.get("fa2"), "fwd_tflops")]
        cells.append(ratio(ours, row.get("fa2"), "bwd_tflops"))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "Extra peak memory of forward + backward over the inputs (MiB):", ""]
    lines.append("| case | " + " | ".join(providers) + " |")
    lines.append("|---|" + "---|" * len(providers))
    for label in order:
        row = by_case[label]
        cells = [_fmt(row[p].peak_extra_mib) if p in row else "" for p in providers]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    notes = [f"- {r.provider} {r.case.label}: {r.note}" for r in results if r.note]
    if notes:
        lines += ["", "Notes:", ""] + notes
    return "\n".join(lines) + "\n"


def plot(results: list[Result], providers: list[str], path: str, meta: dict) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels = []
    for r in results:
        if r.case.label not in labels:
            labels.append(r.case.label)
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 0.5 * len(labels) + 4), 9), sharex=True)
    width = 0.8 / max(1, len(providers))
    for ax, attr, title in ((axes[0], "fwd_tflops", "forward"), (axes[1], "bwd_tflops", "backward")):
        for pi, p in enumerate(providers):
            vals = []
            for lab in labels:
                r = next((r for r in results if r.provider == p and r.case.label == lab), None)
                vals.append((getattr(r, attr) if r else None) or 0.0)
            ax.bar([i + pi * width for i in range(len(labels))], vals, width, label=p)
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"{title} ({meta['gpu']}, bf16)")
        ax.legend(fontsize=7)
    axes[1].set_xticks([i + 0.4 for i in range(len(labels))])
    axes[1].set_xticklabels(labels, rotation=70, ha="right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _write(results: list[Result], providers: list[str], meta: dict, out_dir: str, tag: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    stem = result_stem(out_dir, "attention", meta["gpu"], tag)
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "results": [asdict(r) for r in results]}, f, indent=1)
    md = markdown(results, providers, meta)
    with open(stem + ".md", "w") as f:
        f.write(md)
    plot(results, providers, stem + ".png", meta)
    return md


def _partial(results: list[Result], meta: dict, out_dir: str, tag: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(result_stem(out_dir, "attention", meta["gpu"], tag) + ".partial.json", "w") as f:
        json.dump({"meta": meta, "results": [asdict(r) for r in results]}, f, indent=1)


def _merge(paths: list[str], out_dir: str, tag: str, note: str = "") -> int:
    """Several partial runs (e.g. FlexAttention measured in a separate device call) in one report."""
    results: list[Result] = []
    providers: list[str] = []
    meta: dict = {}
    for path in paths:
        with open(path) as f:
            payload = json.load(f)
        meta = meta or payload["meta"]
        for r in payload["results"]:
            res = Result(Case(**r.pop("case")), **r)
            results.append(res)
            if res.provider not in providers:
                providers.append(res.provider)
    # a case measured again in a later file replaces the earlier measurement
    latest = {(r.case.label, r.provider): r for r in results}
    results = [r for r in results if latest[(r.case.label, r.provider)] is r]
    providers.sort(key=lambda p: PROVIDERS.index(p) if p in PROVIDERS else len(PROVIDERS))

    # rows as a single run orders them: MHA by head dim, length, causal-ness; then GQA by length
    def row_key(r: Result) -> tuple:
        return (r.case.hq != r.case.hkv, r.case.d, r.case.s, r.case.causal, providers.index(r.provider))

    results.sort(key=row_key)
    meta = {**meta, "merged_from": [os.path.basename(p) for p in paths]}
    if note:
        meta["note"] = note
    print(_write(results, providers, meta, out_dir, tag))
    return 0


_ints = counts_arg("a list of sizes")


def _provider_list(ap: argparse.ArgumentParser, text: str) -> list[str]:
    """This report's provider names from ``--providers`` (the suite's names are taken too)."""
    known = set(PROVIDERS) | set(provider_names())
    out = []
    for p in (x.strip() for x in text.split(",")):
        if not p:
            continue
        if p not in known:
            ap.error(f"unknown provider {p!r}; expected a subset of {','.join(PROVIDERS)} (or suite providers)")
        out.append(REPORT_NAMES.get(p, p))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="longctx bench attention",
        description="TFLOP/s of forward and backward, and peak memory, of dense attention at the FlashAttention "
        "benchmark's shapes (masks, the LongCA conventions and context parallelism: longctx bench suite).",
    )
    ap.add_argument("--d", type=_ints, default=None, help="head dims, e.g. 64,128 (default 64,128,256)")
    ap.add_argument("--s", type=_ints, default=None, help="sequence lengths (default 1024,...,16384)")
    ap.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    ap.add_argument("--no-gqa", action="store_true", help="skip the GQA case (Hq=32, Hkv=8, D=128, causal)")
    ap.add_argument("--gqa-only", action="store_true", help="only the GQA cases (Hq=32, Hkv=8, D=128, causal)")
    ap.add_argument("--providers", default=None, help=f"subset of {','.join(PROVIDERS)} (default all of them)")
    ap.add_argument("--no-bwd", action="store_true", help="forward only")
    ap.add_argument("--quick", action="store_true", help="D=128, S in {2K, 8K}, triton/cudnn/fa2, short timing")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: tiny shapes, fp32 (CI)")
    ap.add_argument("--warmup", type=int, default=None, help="do_bench warmup (ms; default 25)")
    ap.add_argument("--rep", type=int, default=None, help="do_bench repetitions (ms; default 100)")
    ap.add_argument("--out-dir", default=os.path.join("benchmarks", "results"))
    ap.add_argument("--tag", default="", help="suffix naming what the run covers (e.g. _d64), not when")
    ap.add_argument("--masks", action="store_true", help="also run longctx.bench.masks")
    ap.add_argument(
        "--layout",
        choices=("bhsd", "bshd"),
        default="bhsd",
        help="input memory layout: (B, H, S, D) contiguous, or flash_attn_func's (B, S, H, D) viewed as (B, H, S, D)",
    )
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="combine the JSON files of earlier runs into one report")
    ap.add_argument("--note", default="", help="--merge: a paragraph for the report (where its rows come from)")
    args = ap.parse_args(argv)
    if args.merge:
        return _merge(args.merge, args.out_dir, args.tag, args.note)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("longctx bench attention: needs a CUDA GPU (--device cpu runs tiny shapes on the CPU)", file=sys.stderr)
        return 1
    prof = PROFILES[(args.device, args.quick)]
    providers = _provider_list(ap, args.providers) if args.providers is not None else list(prof.providers)
    ds, ss = args.d or prof.d, args.s or prof.s
    causal = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    gqa_d = prof.gqa[2]
    cases = build_cases(ds, ss, causal, gqa=not args.no_gqa and gqa_d in ds, profile=prof)
    if args.gqa_only:
        cases = [c for c in build_cases([gqa_d], ss, [True], gqa=True, profile=prof) if c.hq != c.hkv]
    cfg = SuiteConfig(
        seqs=ss, masks=[], providers=[], dtype=prof.dtype, device=args.device, bwd=not args.no_bwd,
        warmup=prof.warmup if args.warmup is None else args.warmup, rep=prof.rep if args.rep is None else args.rep,
        build_timing=False, s_caps=dict(S_CAPS),
    )  # fmt: skip
    meta = _versions(args.device)
    meta.update(layout=args.layout, dtype=prof.dtype, tokens=prof.tokens, hidden=prof.hidden)
    print(f"{meta['gpu']}  torch {meta['torch']}  triton {meta['triton']}  cuDNN {meta['cudnn']}", flush=True)

    def on_result(results: list[Result]) -> None:
        r = results[-1]
        print(
            f"{r.case.label:28s} {r.provider:7s} fwd {_fmt(r.fwd_tflops):>5s} bwd {_fmt(r.bwd_tflops):>5s} TFLOP/s"
            f"  mem {_fmt(r.peak_extra_mib):>6s} MiB {r.note}",
            flush=True,
        )
        _partial(results, meta, args.out_dir, args.tag)  # a run cut short still leaves its numbers

    results = run_sweep(cases, providers, cfg, layout=args.layout, on_result=on_result)
    print(_write(results, providers, meta, args.out_dir, args.tag))
    if args.masks:
        from longctx.bench import masks

        return int(masks.main(["--out-dir", args.out_dir]) or 0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

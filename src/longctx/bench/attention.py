"""`longctx bench attention`: TFLOP/s of forward and backward, and peak memory, of dense attention at the
FlashAttention benchmark's shapes. Masks, the LongCA conventions and context parallelism: ``longctx bench suite``.

Shapes follow the FlashAttention benchmarks: batch x seqlen = 16384 tokens and heads x head_dim = 2048, for
D in {64, 128, 256} and S in {1K, 2K, 4K, 8K, 16K}, causal and not, plus GQA (Hq=32, Hkv=8, D=128, causal).
FLOPs: forward ``4 * B * Hq * S * S * D``, halved for causal; backward 2.5x forward, timed alone (the
forward graph is built once and ``autograd.grad`` is timed with ``retain_graph``). Times are
`triton.testing.do_bench` medians on random bf16 inputs.

Providers: ``triton`` (ours), ``cudnn`` and ``fa2`` (SDPA pinned to SDPBackend.CUDNN_ATTENTION /
FLASH_ATTENTION), ``flex`` (compiled FlexAttention, dynamo's recompile limit raised so it never falls back to
eager), ``tiled`` (longctx's PyTorch FlashAttention; only up to 2K, it is slow) and ``math`` (the dense
reference, up to 4K where its S x S scores fit in memory).

Writes ``<out-dir>/attention_<gpu>[<tag>].json``, ``.md`` and ``.png`` (overwriting the previous run on that
GPU) with the GPU name and the torch, triton and cuDNN versions. ``--masks`` also runs ``longctx.bench.masks``
(sliding window, documents, block-sparse: a subset of ``longctx bench suite``).

    longctx bench attention --quick                      # D=128, S in {2K, 8K}, ours vs cudnn/fa2
    longctx bench attention --d 128 --s 4096,16384 --providers triton,cudnn --no-bwd
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field

import torch

from longctx.bench import result_stem

PROVIDERS = ("triton", "cudnn", "fa2", "flex", "tiled", "math")
TOKENS = 16384
HIDDEN = 2048


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


def build_cases(ds: list[int], ss: list[int], causal: list[bool], gqa: bool) -> list[Case]:
    cases = []
    for d in ds:
        for s in ss:
            for c in causal:
                cases.append(Case(d, s, c, HIDDEN // d, HIDDEN // d, max(1, TOKENS // s)))
    if gqa:
        for s in ss:
            cases.append(Case(128, s, True, 32, 8, max(1, TOKENS // s)))
    return cases


def _provider_fn(name: str, case: Case):
    """A callable (q, k, v) -> out for one provider, or raises RuntimeError('skip: why')."""
    import torch.nn.functional as F

    scale = 1.0 / math.sqrt(case.d)
    gqa = case.hq != case.hkv
    if name == "triton":
        from longctx.masks import Band
        from longctx.ops.flash import triton_attention

        band = Band.from_args(case.s, case.s, causal=case.causal)
        return lambda q, k, v: triton_attention(q, k, v, scale=scale, band=band)[0]
    if name in ("cudnn", "fa2"):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        which = SDPBackend.CUDNN_ATTENTION if name == "cudnn" else SDPBackend.FLASH_ATTENTION

        def fn(q, k, v):
            with sdpa_kernel(which):
                kw = {"enable_gqa": True} if gqa else {}
                return F.scaled_dot_product_attention(q, k, v, is_causal=case.causal, scale=scale, **kw)

        return fn
    if name == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        dyn = torch._dynamo.config
        dyn.cache_size_limit = max(dyn.cache_size_limit, 1024)
        if hasattr(dyn, "recompile_limit"):
            dyn.recompile_limit = max(dyn.recompile_limit, 1024)
        if hasattr(dyn, "accumulated_recompile_limit"):
            dyn.accumulated_recompile_limit = max(dyn.accumulated_recompile_limit, 4096)
        compiled = torch.compile(flex_attention, dynamic=False)
        bm = None
        if case.causal:
            bm = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, case.s, case.s, device="cuda")
        kw = {"enable_gqa": True} if gqa else {}
        return lambda q, k, v: compiled(q, k, v, block_mask=bm, scale=scale, **kw)
    if name == "tiled":
        if case.s > 2048:
            raise RuntimeError("skip: tiled (PyTorch loops) only up to S=2048")
        import longctx

        return lambda q, k, v: longctx.attention(q, k, v, causal=case.causal, scale=scale, backend="tiled")
    if name == "math":
        # scores, probabilities and their grads in float32: about 4 S x S tensors per head
        need = 4 * 4 * case.b * case.hq * case.s * case.s
        free = torch.cuda.mem_get_info()[0]
        if case.s > 4096 or need > 0.6 * free:
            raise RuntimeError(f"skip: math needs ~{need / 2**30:.0f} GiB")
        import longctx

        return lambda q, k, v: longctx.attention(q, k, v, causal=case.causal, scale=scale, backend="math")
    raise ValueError(f"unknown provider {name!r}; expected one of {PROVIDERS}")


def _bench(fn, warmup: int, rep: int) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def _inputs(case: Case, layout: str, dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q (B, Hq, S, D), k and v (B, Hkv, S, D). ``layout="bshd"``: the memory is flash_attn_func's
    (B, S, H, D) and the tensors are transposed views of it (every provider takes strided inputs)."""
    torch.manual_seed(0)

    def make(h: int) -> torch.Tensor:
        if layout == "bshd":
            return torch.randn(case.b, case.s, h, case.d, device="cuda", dtype=dtype).transpose(1, 2)
        return torch.randn(case.b, h, case.s, case.d, device="cuda", dtype=dtype)

    return make(case.hq), make(case.hkv), make(case.hkv)


def run_case(
    case: Case, provider: str, *, bwd: bool, warmup: int, rep: int, dtype=torch.bfloat16, layout: str = "bhsd"
) -> Result:
    res = Result(case, provider)
    try:
        fn = _provider_fn(provider, case)
    except RuntimeError as exc:
        res.note = str(exc)
        return res
    q, k, v = _inputs(case, layout, dtype)  # q (B, Hq, S, D); k, v (B, Hkv, S, D)
    try:
        with torch.no_grad():
            fn(q, k, v)  # compile / autotune outside the timing
        torch.cuda.synchronize()
        with torch.no_grad():
            res.fwd_ms = _bench(lambda: fn(q, k, v), warmup, rep)
        res.fwd_tflops = case.fwd_flops() / res.fwd_ms * 1e-9
        if bwd:
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            out = fn(qg, kg, vg)
            do = torch.randn_like(out)
            torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True)
            torch.cuda.synchronize()
            res.peak_extra_mib = (torch.cuda.max_memory_allocated() - base) / 2**20
            res.bwd_ms = _bench(lambda: torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True), warmup, rep)
            res.bwd_tflops = 2.5 * case.fwd_flops() / res.bwd_ms * 1e-9
            del out, do, qg, kg, vg
    except Exception as exc:  # a peer without a kernel for this case, out of memory, ...
        res.note = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    torch.cuda.empty_cache()
    return res


def _versions() -> dict:
    import triton

    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "cuda": torch.version.cuda,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def markdown(results: list[Result], providers: list[str], meta: dict) -> str:
    lines = [
        f"# Attention benchmark: {meta['gpu']}",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}, cuDNN {meta['cudnn']}, CUDA {meta['cuda']}; {meta['date']}.",
        "bf16, batch x S = 16384 tokens, heads x D = 2048; forward TFLOP/s / backward TFLOP/s (backward timed alone,",
        "2.5x forward FLOPs, causal halves them); `triton.testing.do_bench` median.",
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


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="longctx bench attention", description=" ".join(__doc__.splitlines()[:2]))
    ap.add_argument("--d", type=_ints, default=[64, 128, 256], help="head dims, e.g. 64,128")
    ap.add_argument("--s", type=_ints, default=[1024, 2048, 4096, 8192, 16384], help="sequence lengths")
    ap.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    ap.add_argument("--no-gqa", action="store_true", help="skip the GQA case (Hq=32, Hkv=8, D=128, causal)")
    ap.add_argument("--gqa-only", action="store_true", help="only the GQA cases (Hq=32, Hkv=8, D=128, causal)")
    ap.add_argument("--providers", default=",".join(PROVIDERS), help=f"subset of {','.join(PROVIDERS)}")
    ap.add_argument("--no-bwd", action="store_true", help="forward only")
    ap.add_argument("--quick", action="store_true", help="D=128, S in {2K, 8K}, triton/cudnn/fa2, short timing")
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warmup (ms)")
    ap.add_argument("--rep", type=int, default=100, help="do_bench repetitions (ms)")
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
    if not torch.cuda.is_available():
        print("longctx bench attention: needs a CUDA GPU", file=sys.stderr)
        return 1
    providers = [p.strip() for p in args.providers.split(",") if p.strip()]
    for p in providers:
        if p not in PROVIDERS:
            ap.error(f"unknown provider {p!r}; expected a subset of {','.join(PROVIDERS)}")
    if args.quick:
        args.d, args.s, args.rep, args.warmup = [128], [2048, 8192], 50, 10
        if args.providers == ",".join(PROVIDERS):
            providers = ["triton", "cudnn", "fa2"]
    causal = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    cases = build_cases(args.d, args.s, causal, gqa=not args.no_gqa and 128 in args.d)
    if args.gqa_only:
        cases = [c for c in build_cases([128], args.s, [True], gqa=True) if c.hq != c.hkv]
    meta = _versions()
    meta["layout"] = args.layout
    print(f"{meta['gpu']}  torch {meta['torch']}  triton {meta['triton']}  cuDNN {meta['cudnn']}", flush=True)
    results = []
    for case in cases:
        for p in providers:
            r = run_case(case, p, bwd=not args.no_bwd, warmup=args.warmup, rep=args.rep, layout=args.layout)
            results.append(r)
            print(
                f"{case.label:28s} {p:7s} fwd {_fmt(r.fwd_tflops):>5s} bwd {_fmt(r.bwd_tflops):>5s} TFLOP/s"
                f"  mem {_fmt(r.peak_extra_mib):>6s} MiB {r.note}",
                flush=True,
            )
            _partial(results, meta, args.out_dir, args.tag)  # a run cut short still leaves its numbers
    print(_write(results, providers, meta, args.out_dir, args.tag))
    if args.masks:
        from longctx.bench import masks

        return int(masks.main(["--out-dir", args.out_dir]) or 0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

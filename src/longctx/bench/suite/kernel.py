"""Kernel mode: every (provider, mask, S) on one device, forward and backward timed, peak memory, result codes."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from longctx.bench.suite.case import ERROR, OOM, SKIPPED, UNSUPPORTED, KernelCase, Unsupported
from longctx.bench.suite.providers import get_provider
from longctx.bench.suite.timing import PeakMemory, bench_ms, free_memory, is_oom, sync, wall_ms
from longctx.masks import SEEDED_MASKS, MaskCase, make_mask


@dataclass
class SuiteConfig:
    """Everything a kernel-mode run depends on (the CLI fills it; tests build it directly)."""

    seqs: list[int]
    masks: list[str]
    providers: list[str]
    seeds: list[int] = field(default_factory=lambda: [0])
    B: int = 1
    Hq: int = 64
    Hkv: int = 8
    D: int = 128
    dtype: str = "bf16"
    device: str = "cuda"
    mask_params: dict = field(default_factory=dict)  # window, block, global_tokens, cap: passed to make_mask
    warmup: int = 25
    rep: int = 100
    bwd: bool = True
    budget_s: float | None = None  # no case starts after this many seconds of the run
    provider_budget_s: float | None = None  # a provider that has used this much stops being run
    build_timing: bool = True
    s_caps: dict[str, int] = field(default_factory=dict)  # provider -> the largest S it runs (beyond: skipped)


def mask_cases(cfg: SuiteConfig, S: int) -> list[MaskCase]:
    """The run's masks at length S: every seed of the seeded (document) masks, one instance of the others."""
    out = []
    for name in cfg.masks:
        seeds = cfg.seeds if name in SEEDED_MASKS else [None]
        for seed in seeds:
            out.append(make_mask(name, S, device=cfg.device, seed=seed, **cfg.mask_params))
    return out


class Progress:
    """A one-line progress bar on stderr (rewritten in place on a terminal, one line per case otherwise)."""

    def __init__(self, total: int, stream=None):
        self.total, self.done, self.t0 = total, 0, time.perf_counter()
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()

    def step(self, what: str) -> None:
        self.done += 1
        el = time.perf_counter() - self.t0
        eta = el / self.done * (self.total - self.done)
        n = 24 * self.done // max(1, self.total)
        line = f"[{'#' * n}{'.' * (24 - n)}] {self.done}/{self.total} {el:5.0f}s eta {eta:4.0f}s  {what}"
        if self.tty:
            self.stream.write("\r" + line[:150].ljust(150))
            if self.done == self.total:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def _short(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {msg}"[:300]


def measure(fn: Callable, case: KernelCase, q, k, v, cfg: SuiteConfig, bwd: bool = True) -> dict:
    """fwd_ms / bwd_ms / peak_extra_mib of ``fn`` on q, k, v; the backward is ``autograd.grad`` of one saved
    forward graph (``retain_graph``), timed alone."""
    dev = cfg.device
    with torch.no_grad():
        fn(q, k, v)  # compile / autotune / first-call work outside the timing
    sync(dev)
    with torch.no_grad():
        fwd_ms = bench_ms(lambda: fn(q, k, v), dev, cfg.warmup, cfg.rep)
    out = {"fwd_ms": fwd_ms, "fwd_tflops": case.fwd_flops() / fwd_ms * 1e-9}
    if not (cfg.bwd and bwd):
        with torch.no_grad(), PeakMemory(dev) as pm:
            fn(q, k, v)
        out["peak_extra_mib"] = pm.mib
        return out
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    do = torch.randn_like(q)
    with PeakMemory(dev) as pm:
        o = fn(qg, kg, vg)
        grads = torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True)
        del grads
    bwd_ms = bench_ms(lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True), dev, cfg.warmup, cfg.rep)
    out.update(bwd_ms=bwd_ms, bwd_tflops=case.bwd_flops() / bwd_ms * 1e-9, peak_extra_mib=pm.mib)
    return out


def run_one(name: str, case: KernelCase, cfg: SuiteConfig, spent: dict, t_start: float) -> dict:
    """One provider on one case: a row with its result code (never raises for what the provider does)."""
    if cfg.budget_s is not None and time.perf_counter() - t_start > cfg.budget_s:
        return case.row(name, code=SKIPPED, reason=f"the run's time budget ({cfg.budget_s:.0f} s) was spent")
    if cfg.provider_budget_s is not None and spent.get(name, 0.0) > cfg.provider_budget_s:
        return case.row(name, code=SKIPPED, reason=f"{name} used its time budget ({cfg.provider_budget_s:.0f} s)")
    cap = cfg.s_caps.get(name)
    if cap is not None and cap < case.S:
        return case.row(name, code=SKIPPED, reason=f"capped at S <= {cap} in this run")
    prov = get_provider(name)
    reason = prov.supports(case)
    if reason:
        return case.row(name, code=SKIPPED if reason.startswith("capped") else UNSUPPORTED, reason=reason)
    t0 = time.perf_counter()
    row = case.row(name)
    q = k = v = fn = None
    try:
        fn = prov.build(case)
        q, k, v = case.inputs()
        row["backend"] = prov.backend(case, q, k, v)
        no_bwd = prov.no_backward(case) if cfg.bwd else None
        row.update(measure(fn, case, q, k, v, cfg, bwd=no_bwd is None))
        if no_bwd:
            row["reason"] = f"forward only: {no_bwd}"
    except Unsupported as e:
        row.update(code=UNSUPPORTED, reason=str(e))
    except Exception as e:  # noqa: BLE001 - recorded as a result code, the run goes on
        row.update(code=OOM if is_oom(e) else ERROR, reason=_short(e))
        for key in ("fwd_ms", "bwd_ms", "fwd_tflops", "bwd_tflops", "peak_extra_mib"):
            row[key] = None
    finally:
        del q, k, v, fn
        free_memory(cfg.device)
        spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
    return row


def kernel_cases(cfg: SuiteConfig) -> list[KernelCase]:
    """The run's cases: every length x every mask case (`mask_cases`) at the config's one (B, Hq, Hkv, D)."""
    return [
        KernelCase(m, cfg.B, cfg.Hq, cfg.Hkv, cfg.D, cfg.dtype, cfg.device)
        for S in cfg.seqs
        for m in mask_cases(cfg, S)
    ]


def run_cases(
    cases: list[KernelCase], cfg: SuiteConfig, on_row: Callable[[list[dict]], None] | None = None, stream=None
) -> list[dict]:
    """Every provider of ``cfg`` on each case, in order; the cases may differ in shape (B, Hq, Hkv, D) and layout.
    Timing, budgets and the device come from ``cfg``; ``on_row(rows)`` after every row (partial reports)."""
    rows: list[dict] = []
    prog = Progress(len(cases) * len(cfg.providers), stream)
    spent: dict[str, float] = {}
    t_start = time.perf_counter()
    for case in cases:
        for name in cfg.providers:
            row = run_one(name, case, cfg, spent, t_start)
            rows.append(row)
            tf = row["fwd_tflops"]
            prog.step(f"S={case.S} {case.mask.label} {name}: {row['code']}" + (f" {tf:.3g} TFLOP/s" if tf else ""))
            if on_row is not None:
                on_row(rows)
        case._bm = None
        free_memory(cfg.device)
    return rows


def run_kernel(cfg: SuiteConfig, on_row: Callable[[list[dict]], None] | None = None, stream=None) -> list[dict]:
    """Kernel mode over ``cfg.seqs`` x masks x providers; ``on_row(rows)`` after every row (partial reports)."""
    return run_cases(kernel_cases(cfg), cfg, on_row, stream)


def run_build_timing(cfg: SuiteConfig, providers: list[str]) -> list[dict]:
    """For each mask at the largest S: wall time of longctx's block-mask build and of Flex's create_block_mask."""
    S = max(cfg.seqs)
    flex_on = "flex" in providers
    rows = []
    for name in cfg.masks:
        seed = cfg.seeds[0] if name in SEEDED_MASKS else None
        m = make_mask(name, S, device=cfg.device, seed=seed, **cfg.mask_params)
        r = {"mask": name, "S": S, "longctx_ms": None, "flex_ms": None, "error": ""}
        try:
            r["longctx_ms"] = wall_ms(lambda m=m: m.block_mask(cfg.device), cfg.device)
        except Exception as e:  # noqa: BLE001
            r["error"] = f"longctx: {_short(e)}"
        if flex_on:
            from longctx.bench.suite.providers.flex import flex_available, flex_block_mask

            if flex_available() is None and name != "full":
                case = KernelCase(m, cfg.B, cfg.Hq, cfg.Hkv, cfg.D, cfg.dtype, cfg.device)
                try:
                    r["flex_ms"] = wall_ms(lambda case=case: flex_block_mask(case), cfg.device, n=1)
                except Exception as e:  # noqa: BLE001
                    r["error"] += f" flex: {_short(e)}"
        rows.append(r)
        free_memory(cfg.device)
    return rows

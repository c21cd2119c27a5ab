"""Context-parallel mode: per-GPU TFLOP/s of each method on each mask at a fixed number of tokens per GPU.

Runs inside an initialised process group (torchrun with NCCL on GPUs, or gloo on the CPU for tiny shapes). For
every tokens-per-GPU value n and mask, the sequence is S = n x ranks; every rank draws its own shard of q, k, v
(values do not matter for timing), and each method in `CP_METHODS` runs forward alone and forward + backward; the
time of a point is the slowest rank's. The backward is not timed alone (a method's backward needs its forward's
communication state): ``bwd_ms`` is forward + backward minus forward, left empty with a reason when noise makes that
non-positive; ``fwd_bwd_ms`` is the measured forward + backward. ``single_gpu`` is ``longctx.attention`` on one
rank's n tokens with the same mask (at length n: documents drawn for n tokens), the reference of weak scaling.

A method is one entry of `CP_METHODS`: ``supports(mask, world, case) -> reason or None`` and ``build(case, group)
-> fn(q_loc, k_loc, v_loc) -> out_loc``. The band masks (full, causal, sliding windows) go through
``longctx.distributed.cp_attention``; packed documents (``document``, ``causal_document``) through the work-balanced
``longctx.distributed.dispatch_plan(cu_seqlens).attention``; other masks are recorded as unsupported.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

import longctx
from longctx.bench.suite.case import ERROR, OK, OOM, UNSUPPORTED, KernelCase
from longctx.bench.suite.kernel import SuiteConfig, mask_cases
from longctx.bench.suite.timing import free_memory, is_oom, sync


@dataclass(frozen=True)
class CPMethod:
    """A context-parallel method as the suite runs it."""

    name: str
    supports: Callable[[KernelCase, int], str | None]
    build: Callable[[KernelCase, object], Callable]


PLAN_MASKS = ("document", "causal_document")  # packed documents as flash_attn_varlen_func computes them


def _ulysses_size(world: int) -> int | None:
    """The all-to-all group size of "ulysses_ring": two ranks (a ring of world / 2 groups); None below 4 ranks."""
    return 2 if world >= 4 and world % 2 == 0 else None


def _supports(method: str, layout: str) -> Callable[[KernelCase, int], str | None]:
    def supports(case: KernelCase, world: int) -> str | None:
        from longctx.distributed.dispatch import PLAN_METHODS

        if method not in PLAN_METHODS:
            return f"longctx.distributed has no method {method!r} (it has {', '.join(PLAN_METHODS)})"
        if method == "ulysses_ring" and _ulysses_size(world) is None:
            return f"ulysses_ring runs all-to-all groups of 2 in a ring of at least 2: 4 ranks or more, not {world}"
        if case.mask.band is not None and method == "p2p":
            return "p2p is the dispatcher's method for packed documents; band masks go through the ring"
        if case.mask.band is None:
            if case.mask.name not in PLAN_MASKS:
                return f"cp_attention takes bands and packed documents (full or causal inside), not {case.mask.name}"
            if not hasattr(longctx.distributed, "dispatch_plan"):
                return "packed documents need longctx.distributed.dispatch_plan, which this longctx does not have"
            if case.B != 1:
                return "packed documents: batch 1"
            return None if case.S % world == 0 else f"S={case.S} is not divisible by {world} ranks"
        n = 2 if layout == "zigzag" else 1
        if case.S % (n * world):
            return f"S={case.S} is not divisible by {n * world} ({layout} layout over {world} ranks)"
        return None

    return supports


def _build(method: str, layout: str) -> Callable[[KernelCase, object], Callable]:
    def build(case: KernelCase, group) -> Callable:
        from longctx.distributed import cp_attention

        if case.mask.band is None:  # packed documents: the work-balanced dispatch plan
            from longctx.distributed import dispatch_plan

            cu = [0]
            for L in case.mask.doc_lengths:
                cu.append(cu[-1] + L)
            plan = dispatch_plan(cu, group=group, causal=case.mask.causal)
            extra = {"ulysses_size": _ulysses_size(plan.world)} if method == "ulysses_ring" else {}

            def fn(q, k, v):  # (1, H, n, D) <-> the plan's packed (n, H, D)
                out = plan.attention(
                    q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), method=method,
                    scale=case.scale, **extra,
                )  # fmt: skip
                return out.transpose(0, 1)[None]

            return fn
        kw = case.mask.attention_kwargs()
        if method == "ulysses_ring":
            kw["ulysses_size"] = _ulysses_size(dist.get_world_size(group))
        return lambda q, k, v: cp_attention(q, k, v, group=group, method=method, layout=layout, scale=case.scale, **kw)

    return build


def band_method(method: str, layout: str = "zigzag") -> CPMethod:
    """A method of ``longctx.distributed`` (``cp_attention`` on band masks, ``dispatch_plan(...).attention`` on
    packed documents)."""
    return CPMethod(method, _supports(method, layout), _build(method, layout))


# name -> method; adding one (e.g. a hybrid "ulysses_ring" or a packed-document plan) is one entry here.
CP_METHODS: dict[str, CPMethod] = {
    "ring": band_method("ring"),
    "allgather": band_method("allgather"),
    "ulysses": band_method("ulysses"),
    "ulysses_ring": band_method("ulysses_ring"),
    "p2p": band_method("p2p"),  # packed documents only: the K/V rows some query sees, point to point
}


def _max_over_ranks(x: float, device: str, group) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _time(fn: Callable, warmup: int, iters: int, device: str, group) -> float:
    """Mean ms per call on the slowest rank (every rank runs warmup + iters calls, starting the timed ones together)."""
    ms = _time_local(fn, warmup, iters, device, before=lambda: dist.barrier(group=group))
    return _max_over_ranks(ms, device, group)


def _measure(fn: Callable, case: KernelCase, world: int, cfg: SuiteConfig, warmup: int, iters: int, group) -> dict:
    n_loc = case.S // world
    g = torch.Generator(device=cfg.device).manual_seed(1000 + dist.get_rank(group))

    def rnd(h):
        return torch.randn(case.B, h, n_loc, case.D, generator=g, device=cfg.device, dtype=case.torch_dtype)

    q, k, v, do = rnd(case.Hq), rnd(case.Hkv), rnd(case.Hkv), rnd(case.Hq)
    with torch.no_grad():
        fwd = _time(lambda: fn(q, k, v), warmup, iters, cfg.device, group)
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

    def step():
        torch.autograd.grad(fn(qg, kg, vg), (qg, kg, vg), do)

    if cfg.device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    both = _time(step, warmup, iters, cfg.device, group)
    peak = None
    if cfg.device.startswith("cuda"):
        peak = _max_over_ranks((torch.cuda.max_memory_allocated() - base) / 2**20, cfg.device, group)
    fl = case.fwd_flops() / world  # per GPU
    out = dict(fwd_ms=fwd, fwd_bwd_ms=both, fwd_tflops=fl / fwd * 1e-9, peak_extra_mib=peak)
    bwd = both - fwd  # the backward is not timed alone here: it is what forward + backward adds to the forward
    if bwd > 0:
        out.update(bwd_ms=bwd, bwd_tflops=2.5 * fl / bwd * 1e-9)
    else:
        out.update(reason=f"backward not derived: forward + backward {both:.3f} ms <= forward {fwd:.3f} ms (noise)")
    return out


def _agree(ok: bool, device: str, group) -> bool:
    """True on every rank only if ``ok`` on every rank (a failure on one rank is a failure of the point)."""
    t = torch.tensor([0 if ok else 1], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item()) == 0


def _single_fn(case: KernelCase) -> Callable:
    kw = case.mask.attention_kwargs() if case.mask.band is not None else {"block_mask": case.block_mask()}
    return lambda q, k, v: longctx.attention(q, k, v, scale=case.scale, **kw)


def _one_gpu(case: KernelCase, cfg: SuiteConfig, warmup: int, iters: int, group) -> dict:
    """``one_gpu``: ``longctx.attention`` on the whole sequence on rank 0 alone (the others wait), the reference of
    strong scaling: per-GPU efficiency = one GPU's time / (ranks x the method's time). The row is the same on
    every rank."""
    row = case.row("one_gpu", mode="cp", world=1, method="one_gpu")
    res = torch.zeros(4, dtype=torch.float64, device=cfg.device)  # fwd, fwd+bwd, peak, failed
    if dist.get_rank(group) == 0:
        try:
            g = torch.Generator(device=cfg.device).manual_seed(7)
            q, k, v, do = (
                torch.randn(case.B, h, case.S, case.D, generator=g, device=cfg.device, dtype=case.torch_dtype)
                for h in (case.Hq, case.Hkv, case.Hkv, case.Hq)
            )
            fn = _single_fn(case)
            with torch.no_grad():
                fwd = _time_local(lambda: fn(q, k, v), warmup, iters, cfg.device)
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
            both = _time_local(lambda: torch.autograd.grad(fn(qg, kg, vg), (qg, kg, vg), do), warmup, iters, cfg.device)
            res.copy_(torch.tensor([fwd, both, 0.0, 0.0], dtype=torch.float64))
            del q, k, v, do, qg, kg, vg
        except Exception as e:  # noqa: BLE001 - recorded as a code
            res[3] = 2.0 if is_oom(e) else 1.0
            row["reason"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    dist.broadcast(res, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    fwd, both, _, failed = res.tolist()
    if failed:
        row.update(code=OOM if failed == 2.0 else ERROR, reason=row["reason"] or "failed on rank 0")
        return row
    fl = case.fwd_flops()
    row.update(fwd_ms=fwd, fwd_bwd_ms=both, fwd_tflops=fl / fwd * 1e-9)
    if both > fwd:
        row.update(bwd_ms=both - fwd, bwd_tflops=2.5 * fl / (both - fwd) * 1e-9)
    return row


def _time_local(fn: Callable, warmup: int, iters: int, device: str, before: Callable | None = None) -> float:
    """Mean ms per call on this rank, after ``warmup`` untimed calls (and ``before()``, between the two)."""
    for _ in range(warmup):
        fn()
    sync(device)
    if before is not None:
        before()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - t0) * 1e3 / iters


def _point(name: str, case: KernelCase, w: int, cfg: SuiteConfig, warmup: int, iters: int, group) -> dict:
    """One (method, mask, S) point on every rank; the same row everywhere (a failure anywhere fails it)."""
    row = case.row(name, mode="cp", world=w, method=name)
    reason = None if name == "single_gpu" else CP_METHODS[name].supports(case, w)
    if reason:
        row.update(code=UNSUPPORTED, reason=reason)
        return row
    err = None
    try:
        fn = _single_fn(case) if name == "single_gpu" else CP_METHODS[name].build(case, group)
        row.update(_measure(fn, case, w, cfg, warmup, iters, group))
    except Exception as e:  # noqa: BLE001 - recorded as a code
        err = e
    if _agree(err is None, cfg.device, group):
        row["code"] = OK
        return row
    code = OOM if err is not None and is_oom(err) else ERROR
    why = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}" if err is not None else "failed on another rank"
    none = dict.fromkeys(("fwd_ms", "bwd_ms", "fwd_bwd_ms", "fwd_tflops", "bwd_tflops", "peak_extra_mib"))
    row.update(code=code, reason=why, **none)
    return row


def run_cp(
    cfg: SuiteConfig,
    tokens_per_gpu: list[int],
    methods: list[str],
    *,
    group=None,
    warmup: int = 2,
    iters: int = 5,
    on_row: Callable[[list[dict]], None] | None = None,
    whole: bool = False,
) -> list[dict]:
    """Context-parallel mode on the current process group; every rank returns the same rows.

    Per tokens-per-GPU value n and mask: ``single_gpu`` (n tokens on one GPU, weak scaling), ``one_gpu`` with
    ``whole=True`` (the whole sequence of n x ranks tokens on one GPU, strong scaling: what the per-GPU efficiency
    of packed documents is measured against, since a mix drawn for n tokens is another mix), then each method.
    """
    for m in methods:
        if m not in CP_METHODS:
            raise ValueError(f"unknown context-parallel method {m!r}; expected some of {', '.join(CP_METHODS)}")
    world = dist.get_world_size(group)
    rows: list[dict] = []
    for n in tokens_per_gpu:
        singles = mask_cases(SuiteConfig(**{**cfg.__dict__, "seqs": [n]}), n)
        fulls = mask_cases(SuiteConfig(**{**cfg.__dict__, "seqs": [n * world]}), n * world)
        for m1, mP in zip(singles, fulls):
            points = [("single_gpu", m1, 1)] + ([("one_gpu", mP, 1)] if whole else [])
            points += [(meth, mP, world) for meth in methods]
            for name, mcase, w in points:
                case = KernelCase(mcase, cfg.B, cfg.Hq, cfg.Hkv, cfg.D, cfg.dtype, cfg.device)
                if name == "one_gpu":
                    rows.append(_one_gpu(case, cfg, warmup, iters, group))
                else:
                    rows.append(_point(name, case, w, cfg, warmup, iters, group))
                free_memory(cfg.device)
                if on_row is not None:
                    on_row(rows)
    return rows

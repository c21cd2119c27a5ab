"""`longctx bench cp`: context-parallel attention on several GPUs (run under torchrun).

    torchrun --nproc-per-node 2 -m longctx bench cp --check            # NCCL bf16 correctness, then the sweep
    torchrun --nproc-per-node 2 -m longctx bench cp --tokens-per-gpu 8192,16384 --methods ring

Throughput: per-GPU TFLOP/s of forward+backward of `cp_attention` for every method and layout, at total
lengths S = P x tokens-per-GPU, against the single-GPU kernel (`longctx.attention` with the same launcher
backend) on tokens-per-GPU tokens. FLOPs: forward ``4 B Hq S^2 D`` (halved for causal), backward 2.5x
forward; per-GPU figures divide by P. Times: wall clock between device syncs over a fixed number of calls
(the same on every rank: collectives), the slowest rank's mean.

``--check``: the same `cp_attention` in bf16 against a float64 oracle (`longctx.attention(backend="math")` on
the whole sequence, float64) next to the single-GPU bf16 kernel on the whole sequence, for out, dq, dk, dv:
pass when ``err(cp) <= 2 err(single GPU) + 1e-5`` (the FlashAttention rule).

``--max-seq``: the longest sequence that trains the 350M GPT (preset gpt2-medium, full recomputation uniform
1 layer, bf16 autocast, AdamW) on 1, ..., P GPUs (``--max-seq-gpus``; subgroups of the world, ring/zigzag)
under a memory cap per GPU (``--mem-cap-gib``, default 16): full GPU memory would need steps of minutes.
Each try is one whole training step; the search doubles, then bisects to ``--max-seq-res`` within
``--max-seq-budget-s``. Reported: the longest S measured to fit, the shortest measured not to, GiB per 1K
tokens per GPU (a line through the peaks of the tries that fit), and that line extrapolated to the whole GPU,
labelled as such. The cap is enforced by all ranks together at layer boundaries (`_CapWatch`), so a try over
it stops on every rank at once and no rank is left waiting in a ring exchange.

Writes ``benchmarks/results/cp_<date>_<gpu>x<P><tag>.md`` and ``.json`` (rank 0; ``--out-dir``, ``--tag``).
All stages on 4 GPUs in one go: ``bash scripts/cp_suite.sh``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

METHODS = ("ring", "allgather", "ulysses")
LAYOUTS = ("zigzag", "contiguous")


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _strs(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


_DEV = torch.device("cuda")  # set by main (--device cpu: a gloo smoke run of this script)


def _sync() -> None:
    if _DEV.type == "cuda":
        torch.cuda.synchronize()


def _versions(world: int, launcher: str) -> dict:
    try:
        import triton

        tv = triton.__version__
    except Exception:  # noqa: BLE001
        tv = None
    cuda = _DEV.type == "cuda"
    return {
        "gpu": torch.cuda.get_device_properties(0).name if cuda else "cpu",
        "gpus": world,
        "torch": torch.__version__,
        "triton": tv,
        "cuda": torch.version.cuda,
        "nccl": ".".join(str(x) for x in torch.cuda.nccl.version()) if cuda else "-",
        "launcher": launcher,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def _empty_cache() -> None:
    if _DEV.type == "cuda":
        torch.cuda.empty_cache()


def _max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=_DEV)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _time_ms(fn, warmup: int, iters: int) -> float:
    """Mean ms per call on the slowest rank; every rank runs exactly warmup + iters calls."""
    for _ in range(warmup):
        fn()
    _sync()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync()
    return _max_over_ranks((time.perf_counter() - t0) * 1e3 / iters)


def _flops(b: int, hq: int, s: int, d: int, causal: bool) -> float:
    """forward + backward (2.5x forward) FLOPs of attention over s tokens."""
    return 3.5 * 4.0 * b * hq * s * s * d * (0.5 if causal else 1.0)


# ---------------------------------------------------------------------------------------------------------
# correctness
# ---------------------------------------------------------------------------------------------------------


def run_check(args, launcher: str) -> list[dict]:
    import longctx
    from longctx.distributed import cp_attention, shard

    P = dist.get_world_size()
    S, B, Hq, Hkv, D = args.check_seqlen, 1, args.heads, args.kv_heads, args.head_dim
    rows = []
    masks = [("causal", True, None), ("full", False, None), ("causal-window", True, (S // 4 - 1, 0))]
    for mask_name, causal, window in masks:
        g = torch.Generator(device=_DEV).manual_seed(1234)  # the same full inputs on every rank
        q, k, v, do = (
            torch.randn(B, h, S, D, generator=g, device=_DEV, dtype=torch.float64) for h in (Hq, Hkv, Hkv, Hq)
        )
        # float64 oracle and the single-GPU bf16 kernel, both on the whole sequence
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        o_ref = longctx.attention(*ref, causal=causal, window=window, backend="math")
        o_ref.backward(do)
        oracle = [o_ref.detach()] + [t.grad for t in ref]
        del ref, o_ref
        one = [t.bfloat16().requires_grad_() for t in (q, k, v)]
        o_one = longctx.attention(*one, causal=causal, window=window, backend=launcher)
        o_one.backward(do.bfloat16())
        single = [o_one.detach()] + [t.grad for t in one]
        del one, o_one
        for method in args.methods:
            for layout in args.layouts:
                loc = [shard(t.bfloat16(), 2, layout=layout).requires_grad_() for t in (q, k, v)]
                out = cp_attention(
                    *loc, causal=causal, window=window, method=method, layout=layout, backend=args.backend
                )
                out.backward(shard(do.bfloat16(), 2, layout=layout))
                cp = [out.detach()] + [t.grad for t in loc]
                row = dict(mask=mask_name, method=method, layout=layout, S=S, P=P, ok=True)
                for name, a, s1, o in zip(("out", "dq", "dk", "dv"), cp, single, oracle):
                    o_loc = shard(o, 2, layout=layout)
                    e_cp = _max_over_ranks(float((a.double() - o_loc).abs().max()))
                    e_1 = _max_over_ranks(float((shard(s1, 2, layout=layout).double() - o_loc).abs().max()))
                    row[f"err_{name}"], row[f"err1_{name}"] = e_cp, e_1
                    row["ok"] &= e_cp <= 2 * e_1 + 1e-5
                rows.append(row)
                _log(
                    f"check {mask_name:13s} {method:9s} {layout:10s} "
                    + " ".join(f"{n} {row['err_' + n]:.2e}/{row['err1_' + n]:.2e}" for n in ("out", "dq", "dk", "dv"))
                    + ("  PASS" if row["ok"] else "  FAIL")
                )
        del q, k, v, do, oracle, single
        _empty_cache()
    return rows


# ---------------------------------------------------------------------------------------------------------
# throughput
# ---------------------------------------------------------------------------------------------------------


def _bench_length(args, launcher: str, n_loc: int) -> list[dict]:
    import longctx
    from longctx.distributed import cp_attention

    P = dist.get_world_size()
    B, Hq, Hkv, D, causal = args.batch, args.heads, args.kv_heads, args.head_dim, args.causal
    S = n_loc * P
    g = torch.Generator(device=_DEV).manual_seed(dist.get_rank())
    q, k, v, do = (
        torch.randn(B, h, n_loc, D, generator=g, device=_DEV, dtype=torch.bfloat16) for h in (Hq, Hkv, Hkv, Hq)
    )
    for t in (q, k, v):
        t.requires_grad_()

    def single():
        out = longctx.attention(q, k, v, causal=causal, backend=launcher)
        torch.autograd.grad(out, (q, k, v), do)

    ms1 = _time_ms(single, args.warmup, args.iters)
    tf1 = _flops(B, Hq, n_loc, D, causal) / (ms1 * 1e-3) / 1e12
    rows = [dict(tokens_per_gpu=n_loc, S=S, P=P, method="single-gpu", layout="-", ms=ms1, tflops_per_gpu=tf1)]
    _log(f"S={S:>7d} ({n_loc}/GPU)  single GPU on {n_loc:>6d} tokens: {ms1:8.2f} ms  {tf1:6.1f} TFLOP/s")
    for method in args.methods:
        for layout in args.layouts:

            def step(method=method, layout=layout):
                out = cp_attention(q, k, v, causal=causal, method=method, layout=layout, backend=args.backend)
                torch.autograd.grad(out, (q, k, v), do)

            ms = _time_ms(step, args.warmup, args.iters)
            tf = _flops(B, Hq, S, D, causal) / P / (ms * 1e-3) / 1e12
            rows.append(
                dict(
                    tokens_per_gpu=n_loc, S=S, P=P, method=method, layout=layout, ms=ms, tflops_per_gpu=tf,
                    efficiency=tf / tf1,
                )
            )  # fmt: skip
            _log(
                f"S={S:>7d} ({n_loc}/GPU)  {method:9s} {layout:10s}: {ms:8.2f} ms  {tf:6.1f} TFLOP/s/GPU {tf / tf1:.0%}"
            )
    return rows


def _gpu_warmup(seconds: float = 2.0) -> None:
    """Run matmuls for a while so the first timing does not see idle clocks."""
    if _DEV.type != "cuda":
        return
    a = torch.randn(8192, 8192, device=_DEV, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()
    dist.barrier()


def run_bench(args, launcher: str, on_row=None) -> list[dict]:
    rows = []
    _gpu_warmup()
    for n_loc in args.tokens_per_gpu:
        rows += _bench_length(args, launcher, n_loc)
        _empty_cache()
        if on_row is not None:
            on_row(rows)
    return rows


# ---------------------------------------------------------------------------------------------------------
# longest trainable sequence of the 350M GPT under a memory cap per process
# ---------------------------------------------------------------------------------------------------------

QUANTUM = 256  # tokens per GPU: S = P x tokens/GPU is then a multiple of 2P x 128 (zigzag chunks of 128 tokens)
GIB = 2**30
CRITERIA = ("allocated", "reserved")  # --max-seq-criterion


def _linfit(pts: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares line ``y = a + b x`` through (x, y) points (at least two distinct x)."""
    n = len(pts)
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    b = sum((x - mx) * (y - my) for x, y in pts) / sxx
    return my - b * mx, b


def search_longest(
    try_fn,
    *,
    start: int,
    cap: float,
    res: float = 0.08,
    limit: int = 1 << 21,
    budget_s: float = float("inf"),
    quantum: int = QUANTUM,
    prior: tuple[float, float] | None = None,
    known: list[dict] | None = None,
    clock=time.perf_counter,
) -> dict:
    """The longest n (a multiple of ``quantum``, at most ``limit``) for which ``try_fn(n)`` fits under ``cap``.

    ``try_fn(n)`` runs one try and returns a dict with ``status`` ("ok", "over" or "error"), ``peak`` (the
    figure compared with ``cap``) and ``secs``. The search doubles from ``start`` until a try does not fit
    (halves while the first ones do not), then bisects until the bracket [longest fit, shortest misfit] is
    within ``res`` of the longest fit. Peaks are close to linear in n (flash attention, full recomputation):
    once two fits are known, or from ``prior`` = (peak at n = 0, peak per token) of an earlier search, the next
    try aims just below the predicted crossing of the cap instead of doubling blindly (up to 4x instead of 2x);
    the tries still decide. ``known``: tries already made (with "n"; e.g. a warm-up step) that count as points
    of the line and as fits, but are neither repeated nor used to estimate the time of the next try.
    Stops early, with what it has, when the next try would not end within ``budget_s`` (its time estimated
    from the longest fit, quadratic in n) or a try fails with an error.

    Returns dict(best=longest fit or None, over=shortest misfit or None, tries=[try dicts with "n"],
    stop=why it stopped, secs).
    """
    t0 = clock()
    tries: list[dict] = [dict(t, known=True) for t in known or []]
    lo = max((t["n"] for t in tries if t["status"] == "ok"), default=None)
    hi = min((t["n"] for t in tries if t["status"] == "over"), default=None)
    n = max(quantum, start // quantum * quantum)
    limit = max(quantum, limit // quantum * quantum)
    if hi is not None and n >= hi:  # a known try already misfits below the start
        if hi <= quantum:
            return dict(best=lo, over=hi, tries=tries, stop="nothing fits", secs=clock() - t0)
        n = max(quantum, hi // 2 // quantum * quantum)
    if lo is not None and n <= lo:  # nor repeat what is known to fit
        n = min(2 * lo, limit)
    while True:
        r = dict(try_fn(n))
        r["n"] = n
        tries.append(r)
        if r["status"] == "error":
            stop = "error"
            break
        if r["status"] == "ok":
            lo = n if lo is None else max(lo, n)
        else:
            hi = n if hi is None else min(hi, n)
        if lo is not None and hi is not None and hi - lo <= max(quantum, res * lo):
            stop = "resolution"
            break
        if lo is None and hi is not None and hi <= quantum:
            stop = "nothing fits"
            break
        if hi is None and lo is not None and lo >= limit:
            stop = "limit"
            break
        pred = _predict(tries, cap, prior)
        if hi is None:  # growing: double, or aim just below the predicted crossing
            nxt = 2.0 * lo
            if pred is not None and pred > lo:
                nxt = min(4.0 * lo, max(lo * (1 + res), pred * (1 - res / 3)))
            nxt = min(nxt, limit)
        elif lo is None:  # shrinking: halve, or aim below the prediction
            nxt = hi / 2
            if pred is not None:
                nxt = max(nxt, min(hi * (1 - res), pred * (1 - res / 3)))
        else:  # bisect, towards the prediction when it lies inside the bracket
            w = hi - lo
            nxt = (lo + hi) / 2
            if pred is not None and lo < pred < hi:
                nxt = min(max(pred, lo + w / 4), hi - w / 4)
        nxt = int(nxt) // quantum * quantum
        if lo is not None:  # at least one quantum away from both ends
            nxt = max(nxt, lo + quantum)
        if hi is not None:
            nxt = min(nxt, hi - quantum)
        if hi is None and nxt > limit:
            stop = "limit"
            break
        mine = [t for t in tries if not t.get("known")]
        ref = max((t for t in mine if t["status"] == "ok"), key=lambda t: t["n"], default=mine[-1])
        est = ref["secs"] * (nxt / ref["n"]) ** 2
        if clock() - t0 + est > budget_s:
            stop = f"time budget ({budget_s:.0f} s; the next try, {nxt} tokens, was estimated at {est:.0f} s)"
            break
        n = nxt
    return dict(best=lo, over=hi, tries=tries, stop=stop, secs=clock() - t0)


def _predict(tries: list[dict], cap: float, prior: tuple[float, float] | None) -> float | None:
    """n where the line through the fitting tries' peaks (or the prior's slope) reaches the cap."""
    pts = [(t["n"], t["peak"]) for t in tries if t["status"] == "ok"]
    ab = None
    if len(pts) >= 2:
        ab = _linfit(pts)
    elif prior is not None:
        ab = prior
        if pts:  # the prior's slope through our own point
            ab = (pts[0][1] - prior[1] * pts[0][0], prior[1])
    if ab is None or ab[1] <= 0:
        return None
    return (cap - ab[0]) / ab[1]


class _OverCap(Exception):
    """Raised on every rank at the same point of a step once some rank's peak memory has passed the cap."""


class _CapWatch:
    """The memory cap of a training step, enforced by every rank together at layer boundaries.

    A CUDA out-of-memory error inside a context-parallel step would strike one rank alone, possibly in the
    middle of a ring exchange, and leave its peers waiting for it forever (NCCL): no flag exchanged after the
    step can rescue that. So the steps run without an allocator limit and this watch enforces the cap: after
    every layer's forward, and when the gradient of every layer's output is complete in the backward - points
    where no collective is in flight - each rank compares its peak memory since the try began (``criterion``:
    reserved, or allocated + a margin) with the cap, the verdicts are all-reduced (MAX) through gloo on the
    host (the allocator's statistics are host data: no GPU sync), and all ranks raise `_OverCap` at the same
    point. Under "reserved", a step that fits is one that ``torch.cuda.set_per_process_memory_fraction`` at
    the cap would have run unchanged. Under "allocated", one that such a limit would have run too, unless
    fragmentation wasted more than the margin: near the limit the allocator waits for pending frees and
    releases its cached blocks before it fails, so reserved memory above allocated is no hard requirement.
    """

    def __init__(
        self, cap_bytes: float, group, fake_bytes_per_token: float = 0.0, criterion: str = "reserved", margin=0.0
    ) -> None:
        if criterion not in CRITERIA:
            raise ValueError(f"--max-seq-criterion must be one of {CRITERIA}, got {criterion!r}")
        self.cap = cap_bytes
        self.criterion = criterion  # "reserved": the allocator's peak reserved; "allocated": peak allocated + margin
        self.margin = float(margin)
        self.group = group  # a gloo group over the world
        self.fake = fake_bytes_per_token
        self.enabled = False
        self.phase = "idle"
        self.n_loc = 0
        self.in_backward = False  # this step has reached its backward (the made-up CPU peak appears there)

    def peak(self) -> float:
        """The figure compared with the cap: see ``criterion``."""
        if _DEV.type == "cuda":
            if self.criterion == "allocated":
                return float(torch.cuda.max_memory_allocated()) + self.margin
            return float(torch.cuda.max_memory_reserved())
        # CPU (smoke runs, tests): a made-up footprint that appears in the backward, to exercise the abort there.
        return self.fake * self.n_loc if self.in_backward else 0.0

    def check(self, where: str) -> None:
        if not self.enabled:
            return
        t = torch.tensor([int(self.peak() > self.cap)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        if t.item():
            raise _OverCap(where)

    def install(self, model) -> list:
        """Forward hooks on every layer of ``model``; returns their handles."""

        def hook(mod, inp, out, i):
            if self.phase != "forward":  # the recomputation inside the backward: not one of our boundaries
                return
            self.check(f"forward, after layer {i}")
            if out.requires_grad:
                out.register_hook(lambda g: self.check(f"backward, gradient of layer {i}'s output"))

        return [
            layer.register_forward_hook(lambda m, a, o, i=i: hook(m, a, o, i)) for i, layer in enumerate(model.layers)
        ]


def _final_hidden(model, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """``GPT.forward`` up to the final norm: the hidden states (B, S, h) its output layer turns into logits."""
    from longctx.layers.recompute import recompute_active, run_layers

    cos, sin = model.rotary(position_ids)
    x = model.embedding_dropout(model.embedding(tokens))
    x = run_layers(model.layers, x, model._chunks, cos, sin, active=recompute_active(model))
    return model.final_layernorm(x)


def _output_weight(model) -> torch.Tensor:
    return model.embedding.weight if model.output_layer is None else model.output_layer.weight


def _ce_sum(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(h, w).float().flatten(0, 1), y.flatten(), reduction="sum")


def chunked_lm_loss_sum(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
    """Sum of the token losses of hidden states h (B, S, hidden) against labels (B, S), ``chunk`` tokens of
    logits at a time, each chunk recomputed in the backward: the logits of the whole sequence never exist."""
    from longctx.layers.recompute import checkpoint_call

    total = None
    for s in range(0, h.shape[1], chunk):
        part = checkpoint_call(_ce_sum, h[:, s : s + chunk], weight, labels[:, s : s + chunk])
        total = part if total is None else total + part
    return total


def _train_step(model, opt, cp, n_loc: int, P: int, watch: _CapWatch, args) -> None:
    """One training step at n_loc tokens per GPU: forward, backward, (CP: gradient all-reduce), AdamW step."""
    S = n_loc * P
    g = torch.Generator().manual_seed(S)
    tokens = torch.randint(0, model.config.vocab_size, (1, S + 1), generator=g).to(_DEV)
    x, y = tokens[:, :-1], tokens[:, 1:]
    if cp is None:
        pos = torch.arange(S, device=_DEV)
    else:
        x, y, _, pos = cp.shard_batch(x, y)
    watch.n_loc = n_loc
    watch.in_backward = False
    watch.phase = "forward"
    try:
        with torch.autocast(_DEV.type, dtype=torch.bfloat16):
            if args.loss == "full":  # the GPT's own forward: logits (1, S/P, vocab)
                logits = model(x, position_ids=pos)
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum") / S
                del logits
            else:
                h = _final_hidden(model, x, pos)
                loss = chunked_lm_loss_sum(h, _output_weight(model), y, args.loss_chunk) / S
                del h
        watch.phase = "backward"
        watch.in_backward = True
        loss.backward()
        del loss
        if cp is not None:
            cp.allreduce_gradients(model)
        opt.step()
        watch.phase = "end"
        watch.check("end of the step")
    finally:
        watch.phase = "idle"
        opt.zero_grad(set_to_none=True)


def _try_step(model, opt, cp, n_loc: int, P: int, watch: _CapWatch, args, rank: int) -> dict:
    """One measured try; the outcome, peaks and time agreed on by every rank (MAX over the world)."""
    cuda = _DEV.type == "cuda"
    gc.collect()
    _empty_cache()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    _sync()
    t0 = time.perf_counter()
    code, where = 0, ""
    try:
        _train_step(model, opt, cp, n_loc, P, watch, args)
    except _OverCap as e:
        code, where = 1, str(e)
    except torch.cuda.OutOfMemoryError:  # not expected (the watch stops first); safe where P = 1 (no collectives)
        code, where = 1, "CUDA out of memory"
    except Exception:  # noqa: BLE001 - reported, then the search for this P stops on every rank
        code, where = 2, traceback.format_exc()
        print(f"--max-seq: the step at {n_loc} tokens/GPU on {P} GPU(s) failed on rank {rank}:\n{where}", flush=True)
    _sync()
    secs = time.perf_counter() - t0
    peak = watch.peak()  # the criterion's figure
    reserved = float(torch.cuda.max_memory_reserved()) if cuda else peak
    allocated = float(torch.cuda.max_memory_allocated()) if cuda else peak
    t = torch.tensor([code, peak, reserved, allocated, secs], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=watch.group)
    status = ("ok", "over", "error")[int(t[0])]
    if status != "ok" and not where:
        where = "on another rank"
    return dict(
        status=status,
        peak=float(t[1]),
        reserved=float(t[2]),
        allocated=float(t[3]),
        secs=float(t[4]),
        where=where.strip(),
    )


def run_max_seq(args, on_row=None) -> list[dict]:
    """The longest sequence that trains the GPT on 1, ..., P GPUs under ``--mem-cap-gib`` per GPU (see the
    module docstring); every rank runs the same tries (P = 1: each on its own GPU; P < world: subgroups)."""
    from longctx.distributed import setup_context_parallel
    from longctx.distributed.comm import cpu_group, group_info
    from longctx.models.gpt import GPT, GPTConfig

    t_start = time.perf_counter()
    world, rank = dist.get_world_size(), dist.get_rank()
    gpus = sorted(set(args.max_seq_gpus or (1, world)))
    bad = [p for p in gpus if p < 1 or world % p]
    if bad:
        raise ValueError(f"--max-seq-gpus {bad}: every entry must divide the world size {world}")
    cuda = _DEV.type == "cuda"
    cap = args.mem_cap_gib * GIB
    total = torch.cuda.get_device_properties(_DEV).total_memory if cuda else 0
    if cuda and cap > 0.8 * total:
        raise ValueError(
            f"--mem-cap-gib {args.mem_cap_gib} is more than 80% of the GPU's {total / GIB:.0f} GiB: the tries run "
            "without an allocator limit and may pass the cap by one layer's working memory before they stop"
        )
    cfg = GPTConfig.preset(
        args.gpt_preset,
        **{
            **_overrides(args.gpt_override),
            "recompute_granularity": "full",
            "recompute_method": "uniform",
            "recompute_num_layers": 1,
        },
    )
    torch.manual_seed(0)
    with torch.device(_DEV):  # initialised on the GPU: seconds, not a minute on the CPU for 350M parameters
        model = GPT(cfg)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda)
    watch = _CapWatch(
        cap,
        cpu_group(group_info(None)),
        fake_bytes_per_token=args.fake_kib_per_token * 1024,
        criterion=args.max_seq_criterion,
        margin=args.max_seq_margin_gib * GIB,
    )
    handles = watch.install(model)
    n_params = model.num_parameters()
    _log(
        f"--max-seq: GPT {args.gpt_preset} ({n_params / 1e6:.3g}M parameters), cap {args.mem_cap_gib:g} GiB per "
        f"GPU, GPUs {gpus}, loss {args.loss}; model and optimizer built in {time.perf_counter() - t_start:.1f} s"
    )
    rows: list[dict] = []
    prior, start = None, args.max_seq_start
    weights = {p: 1 + p for p in gpus}  # a try on P GPUs costs about (1 + P) tries on one: linear + attention
    try:
        for i, P in enumerate(gpus):
            t_p = time.perf_counter()
            left = args.max_seq_budget_s - (t_p - t_start)
            budget = left * weights[P] / sum(weights[p] for p in gpus[i:])
            cp = None
            if P > 1:
                group = None if world == P else dist.new_subgroups(group_size=P)[0]
                cp = setup_context_parallel(model, group=group, method="ring", layout="zigzag")
            else:
                model.set_core_attention(None)
            watch.enabled = False  # warm-up: compiles the kernels and allocates the optimizer state; not measured
            warm = _try_step(model, opt, cp, args.max_seq_warmup_tokens, P, watch, args, rank)
            watch.enabled = True
            _log(f"{P} GPU(s): warm-up step at {args.max_seq_warmup_tokens} tokens/GPU: {warm['status']}, "
                 f"{time.perf_counter() - t_p:.1f} s")  # fmt: skip
            if warm["status"] != "ok":
                warm["n"] = args.max_seq_warmup_tokens
                res = dict(best=None, over=None, tries=[warm], stop="the warm-up step failed", secs=warm["secs"])
                rows.append(
                    {
                        **_max_seq_row(P, res, cap, total, prior, watch.criterion, watch.margin),
                        "params_m": n_params / 1e6,
                    }
                )
                _log(_max_seq_line(rows[-1]))
                continue

            def try_fn(n, P=P, cp=cp):
                r = _try_step(model, opt, cp, n, P, watch, args, rank)
                _log(
                    f"{P} GPU(s): {n:>7d} tokens/GPU (S = {n * P:>7d}): {r['status']:5s} peak "
                    f"{r['reserved'] / GIB:6.2f} GiB reserved, {r['allocated'] / GIB:6.2f} allocated, "
                    f"step {r['secs']:5.1f} s"
                    + (f"  [stopped: {r['where']}]" if r["status"] == "over" else "")
                    + f"  ({time.perf_counter() - t_start:.0f} s)"
                )
                return r

            res = search_longest(
                try_fn,
                start=start,
                cap=cap,
                res=args.max_seq_res,
                limit=args.max_seq_limit,
                budget_s=max(0.0, budget - (time.perf_counter() - t_p)),
                prior=prior,
                known=[dict(warm, n=args.max_seq_warmup_tokens, status="ok" if warm["peak"] <= cap else "over")],
            )
            row = _max_seq_row(P, res, cap, total, prior, watch.criterion, watch.margin)
            row["secs"] = time.perf_counter() - t_p
            row["params_m"] = n_params / 1e6
            rows.append(row)
            if row["fit"] is not None:
                prior = row["fit"]
            if res["best"] is not None:
                start = res["best"]
            _log(_max_seq_line(row))
            if on_row is not None:
                on_row(rows)
    finally:
        for h in handles:
            h.remove()
        model = opt = None  # freed before the cache is emptied
        gc.collect()
        _empty_cache()
    _log(f"--max-seq done in {time.perf_counter() - t_start:.0f} s")
    return rows


def _overrides(spec: str) -> dict:
    """``"num_layers=2,hidden_size=64"`` -> GPTConfig fields (ints where they parse as ints, else strings)."""
    out: dict = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        k, eq, v = item.partition("=")
        if not eq or not k.strip():
            raise ValueError(f"--gpt-override entries are field=value, got {item!r}")
        v = v.strip()
        out[k.strip()] = int(v) if v.lstrip("-").isdigit() else v
    return out


def _max_seq_row(
    P: int, res: dict, cap: float, total: float, prior, criterion: str = "reserved", margin: float = 0.0
) -> dict:
    ok = [t for t in res["tries"] if t["status"] == "ok"]
    fit = _linfit([(t["n"], t["peak"]) for t in ok]) if len({t["n"] for t in ok}) >= 2 else None
    best = next((t for t in ok if t["n"] == res["best"]), None)
    ext = None
    if fit is not None and fit[1] > 0 and total:
        ext = int((0.95 * total - fit[0]) / fit[1]) // QUANTUM * QUANTUM
    err = next((t["where"] for t in res["tries"] if t["status"] == "error"), None)
    return dict(
        gpus=P,
        cap_gib=cap / GIB,
        best_tokens_per_gpu=res["best"],
        max_seq=None if res["best"] is None else res["best"] * P,
        over_tokens_per_gpu=res["over"],
        resolution=None if res["best"] is None or res["over"] is None else res["over"] / res["best"] - 1,
        criterion=criterion,
        margin_gib=margin / GIB,
        peak_reserved_gib=None if best is None else best["reserved"] / GIB,
        peak_allocated_gib=None if best is None else best["allocated"] / GIB,
        fit=fit,
        gib_per_1k_tokens_per_gpu=None if fit is None else fit[1] * 1024 / GIB,
        fixed_gib=None if fit is None else fit[0] / GIB,
        gpu_gib=total / GIB,
        extrapolated_tokens_per_gpu=ext,
        extrapolated_max_seq=None if ext is None else ext * P,
        tries=[
            {k: t.get(k) for k in ("n", "status", "peak", "reserved", "allocated", "secs", "where", "known")}
            for t in res["tries"]
        ],
        search_secs=res["secs"],
        stop=res["stop"],
        error=err,
    )


def _max_seq_line(r: dict) -> str:
    if r["best_tokens_per_gpu"] is None:
        return f"  -> {r['gpus']} GPU(s): nothing fits under the cap ({r['stop']})"
    over = "-" if r["over_tokens_per_gpu"] is None else r["over_tokens_per_gpu"] * r["gpus"]
    line = (
        f"  -> {r['gpus']} GPU(s): longest S run {r['max_seq']} ({r['best_tokens_per_gpu']}/GPU; S = {over} did not "
        f"fit), peak {r['peak_reserved_gib']:.2f} GiB reserved, {r['peak_allocated_gib']:.2f} allocated; "
        f"{r['search_secs']:.0f} s, stopped: {r['stop']}"
    )
    if r["gib_per_1k_tokens_per_gpu"] is not None:
        line += f"; {r['gib_per_1k_tokens_per_gpu']:.3f} GiB per 1K tokens/GPU + {r['fixed_gib']:.2f} GiB"
    if r["extrapolated_max_seq"] is not None:
        line += f"; extrapolated to 95% of {r['gpu_gib']:.0f} GiB: S ~ {r['extrapolated_max_seq']}"
    return line


# ---------------------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------------------


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


def _write(meta, check, bench, maxseq, args, quiet: bool = False) -> None:
    if dist.get_rank() != 0:
        return
    os.makedirs(args.out_dir, exist_ok=True)
    gpu = meta["gpu"].replace("NVIDIA ", "").replace(" ", "-")
    stem = os.path.join(args.out_dir, f"cp_{_dt.date.today().isoformat()}_{gpu}x{meta['gpus']}{args.tag}")
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "args": vars(args), "check": check, "bench": bench, "max_seq": maxseq}, f, indent=1)
    md = markdown(meta, check, bench, maxseq, args)
    with open(stem + ".md", "w") as f:
        f.write(md)
    if not quiet:
        print(md, flush=True)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="longctx bench cp", description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="NCCL bf16 correctness against a float64 oracle first")
    ap.add_argument("--no-bench", action="store_true", help="skip the throughput sweep")
    ap.add_argument("--max-seq", action="store_true", help="longest trainable sequence of the 350M GPT under a cap")
    ap.add_argument("--tokens-per-gpu", type=_ints, default=[8192, 16384, 32768, 65536])
    ap.add_argument("--methods", type=_strs, default=list(METHODS))
    ap.add_argument("--layouts", type=_strs, default=list(LAYOUTS))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--no-causal", dest="causal", action="store_false")
    ap.add_argument("--backend", default="auto", choices=("auto", "tiled", "triton"))
    ap.add_argument("--check-seqlen", type=int, default=8192)
    ap.add_argument("--check-kv-heads", type=int, default=4, help="kv heads of the check (GQA)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--gpt-preset", default="gpt2-medium", help="--max-seq: the GPT (longctx.models.PRESETS)")
    ap.add_argument("--gpt-override", default="", help="GPTConfig fields, e.g. num_layers=2,hidden_size=64")
    ap.add_argument("--max-seq-gpus", type=_ints, default=None, help="GPU counts to search (default 1 and all)")
    ap.add_argument("--mem-cap-gib", type=float, default=16.0, help="--max-seq: memory cap per GPU (GiB)")
    ap.add_argument("--max-seq-start", type=int, default=8192, help="first try, tokens per GPU")
    ap.add_argument(
        "--max-seq-criterion",
        default="allocated",
        choices=CRITERIA,
        help="what is compared with the cap: peak allocated + --max-seq-margin-gib, or peak reserved (both reported)",
    )
    ap.add_argument(
        "--max-seq-margin-gib", type=float, default=1.0, help="--max-seq-criterion allocated: added to the peak"
    )
    ap.add_argument("--max-seq-res", type=float, default=0.08, help="stop when [fit, misfit] is within this")
    ap.add_argument("--max-seq-budget-s", type=float, default=150.0, help="wall-clock budget of the whole search")
    ap.add_argument("--max-seq-limit", type=int, default=1 << 21, help="never try more tokens per GPU than this")
    ap.add_argument("--max-seq-warmup-tokens", type=int, default=1024, help="tokens/GPU of the unmeasured first step")
    ap.add_argument("--loss", default="chunked", choices=("chunked", "full"), help="--max-seq: how the loss is made")
    ap.add_argument("--loss-chunk", type=int, default=1024, help="tokens of logits at a time (--loss chunked)")
    ap.add_argument("--fake-kib-per-token", type=float, default=0.0, help="CPU smoke runs/tests: a made-up peak")
    ap.add_argument("--out-dir", default=os.path.join("benchmarks", "results"))
    ap.add_argument("--tag", default="")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a gloo smoke run (tiny sizes)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    global _DEV
    _DEV = torch.device(args.device)
    if _DEV.type == "cuda" and not torch.cuda.is_available():
        print("longctx bench cp: needs CUDA GPUs (run under torchrun --nproc-per-node N)", file=sys.stderr)
        return 1
    from longctx.distributed import init_distributed
    from longctx.distributed.launchers import resolve_launchers

    rank, world, _ = init_distributed("nccl" if _DEV.type == "cuda" else "gloo")
    if not dist.is_initialized():
        print("longctx bench cp: run it under torchrun (e.g. torchrun --nproc-per-node 2 -m longctx bench cp)")
        return 1
    launcher = resolve_launchers(args.backend, _DEV, torch.bfloat16).name
    meta = _versions(world, launcher)
    _log(
        f"{world} x {meta['gpu']}  torch {meta['torch']}  triton {meta['triton']}  NCCL {meta['nccl']}  "
        f"launchers {launcher}"
    )
    t0 = time.time()
    check, bench, maxseq = [], [], []
    ok_max_seq = True
    kv_bench = args.kv_heads
    if args.check:
        args.kv_heads = args.check_kv_heads
        check = run_check(args, launcher)
        args.kv_heads = kv_bench
        _log(f"check: {sum(r['ok'] for r in check)}/{len(check)} pass ({time.time() - t0:.0f} s)")
        _write(meta, check, bench, maxseq, args, quiet=True)
    if not args.no_bench:
        bench = run_bench(args, launcher, on_row=lambda rows: _write(meta, check, rows, maxseq, args, quiet=True))
        _log(f"sweep done ({time.time() - t0:.0f} s)")
    if args.max_seq:
        _write(meta, check, bench, maxseq, args, quiet=True)  # what we have so far, in case this part fails
        try:
            maxseq = run_max_seq(args, on_row=lambda rows: _write(meta, check, bench, rows, args, quiet=True))
        except Exception:  # noqa: BLE001 - report it plainly (torchrun's "[rankN]:" prefixes are easy to lose)
            print(f"--max-seq failed on rank {rank}:\n{traceback.format_exc()}", file=sys.stdout, flush=True)
            ok_max_seq = False
        ok_max_seq = ok_max_seq and not any(r["error"] for r in maxseq)
    _write(meta, check, bench, maxseq, args)
    ok = all(r["ok"] for r in check) and ok_max_seq
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1

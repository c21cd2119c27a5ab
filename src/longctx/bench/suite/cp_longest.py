"""`longctx bench suite --cp --cp-longest`: the longest sequence that trains the GPT on 1, ..., P GPUs under a memory
cap (ring attention, zigzag, full recomputation), and its Markdown section (`markdown`)."""

from __future__ import annotations

import gc
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

from longctx.bench.search import QUANTUM, _linfit, search_longest
from longctx.bench.suite.ranks import GIB, empty_cache, log, sync

CRITERIA = ("allocated", "reserved")  # --max-seq-criterion


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
        self,
        cap_bytes: float,
        group,
        fake_bytes_per_token: float = 0.0,
        criterion: str = "reserved",
        margin=0.0,
        device: torch.device | None = None,
    ) -> None:
        if criterion not in CRITERIA:
            raise ValueError(f"--max-seq-criterion must be one of {CRITERIA}, got {criterion!r}")
        self.cap = cap_bytes
        self.criterion = criterion  # "reserved": the allocator's peak reserved; "allocated": peak allocated + margin
        self.margin = float(margin)
        self.group = group  # a gloo group over the world
        self.device = torch.device("cuda") if device is None else device
        self.fake = fake_bytes_per_token
        self.enabled = False
        self.phase = "idle"
        self.n_loc = 0
        self.in_backward = False  # this step has reached its backward (the made-up CPU peak appears there)

    def peak(self) -> float:
        """The figure compared with the cap: see ``criterion``."""
        if self.device.type == "cuda":
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
    dev = watch.device
    S = n_loc * P
    g = torch.Generator().manual_seed(S)
    tokens = torch.randint(0, model.config.vocab_size, (1, S + 1), generator=g).to(dev)
    x, y = tokens[:, :-1], tokens[:, 1:]
    if cp is None:
        pos = torch.arange(S, device=dev)
    else:
        x, y, _, pos = cp.shard_batch(x, y)
    watch.n_loc = n_loc
    watch.in_backward = False
    watch.phase = "forward"
    try:
        with torch.autocast(dev.type, dtype=torch.bfloat16):
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
    dev = watch.device
    cuda = dev.type == "cuda"
    gc.collect()
    empty_cache(dev)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    sync(dev)
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
    sync(dev)
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
    package docstring); every rank runs the same tries (P = 1: each on its own GPU; P < world: subgroups)."""
    from longctx.distributed import setup_context_parallel
    from longctx.distributed.comm import cpu_group, group_info
    from longctx.models.gpt import GPT, GPTConfig

    t_start = time.perf_counter()
    dev = torch.device(args.device)
    world, rank = dist.get_world_size(), dist.get_rank()
    gpus = sorted(set(args.max_seq_gpus or (1, world)))
    bad = [p for p in gpus if p < 1 or world % p]
    if bad:
        raise ValueError(f"--max-seq-gpus {bad}: every entry must divide the world size {world}")
    cuda = dev.type == "cuda"
    cap = args.mem_cap_gib * GIB
    total = torch.cuda.get_device_properties(dev).total_memory if cuda else 0
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
    with torch.device(dev):  # initialised on the GPU: seconds, not a minute on the CPU for 350M parameters
        model = GPT(cfg)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda)
    watch = _CapWatch(
        cap,
        cpu_group(group_info(None)),
        fake_bytes_per_token=args.fake_kib_per_token * 1024,
        criterion=args.max_seq_criterion,
        margin=args.max_seq_margin_gib * GIB,
        device=dev,
    )
    handles = watch.install(model)
    n_params = model.num_parameters()
    log(
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
            log(f"{P} GPU(s): warm-up step at {args.max_seq_warmup_tokens} tokens/GPU: {warm['status']}, "
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
                log(_max_seq_line(rows[-1]))
                continue

            def try_fn(n, P=P, cp=cp):
                r = _try_step(model, opt, cp, n, P, watch, args, rank)
                log(
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
            log(_max_seq_line(row))
            if on_row is not None:
                on_row(rows)
    finally:
        for h in handles:
            h.remove()
        model = opt = None  # freed before the cache is emptied
        gc.collect()
        empty_cache(dev)
    log(f"--max-seq done in {time.perf_counter() - t_start:.0f} s")
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


# -- the report --------------------------------------------------------------------------------------------------


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


def markdown(rows: list[dict], args) -> str:
    """The Markdown section of the search's rows."""
    return "\n".join(_max_seq_markdown(rows, args))

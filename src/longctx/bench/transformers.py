"""`longctx bench transformers`: a HuggingFace causal LM with longctx (`apply`) against plain transformers.

Models (``--model``): ``llama``, the Llama-shaped 336M of the memory benchmark (`LlamaForCausalLM`: hidden 1024,
24 layers, 16 query / 4 kv heads, ffn 2816, vocab 32000); ``llama-8b``, Llama-3.1-8B's shape (hidden 4096, 32
layers, 32 query / 8 kv heads, ffn 14336, vocab 128256; random weights, no download); ``gemma2``, a Gemma-2-shaped
one (`Gemma2ForCausalLM`: hidden 1024, 16 layers, 8 query / 4 kv heads of head dim 256, attention logit softcap 50,
sliding-window layers of 4096 alternating with full ones, ffn 4096, vocab 32000, no final logit softcap). Batch 1,
bf16 autocast, fp32 parameters, AdamW; one training step is forward, backward and the optimizer step. Providers:

    hf-sdpa-ckpt          transformers as a user has it: attn_implementation="sdpa", gradient checkpointing,
                          the loss through the (S, vocab) logits (Gemma 2: transformers' SDPA path drops the
                          attention softcap, so this is another model; shown for its speed)
    hf-eager-ckpt         the same with attn_implementation="eager" (what transformers advises for Gemma 2: the
                          softcap computed, the (S, S) scores materialised)
    longctx-apply         attn_implementation="longctx" + longctx.integrations.transformers.apply: full
                          recomputation (uniform, 1 layer), the logits-free loss
    longctx-apply-offload the same with the checkpointed layer inputs offloaded to pinned host memory
    longctx-apply-offload-chunks  the same with each layer's MLP in chunks of 4096 tokens (sequence_chunk_size)
    longctx-apply-keep    longctx-apply keeping each layer's attention output and lse for the recomputation
                          (recompute_skip_core_attention: attention's forward runs once a step, not twice)
    longctx-apply-offload-keep    longctx-apply-offload with the attention kept the same way
    longctx-apply-offload-params  longctx-apply-offload-chunks with the parameters, gradients and AdamW states in
                          host memory (`apply(offload_params=True)`: FSDP2's CPU offload, the AdamW step on the CPU;
                          its rows also give the host's peak, measured and predicted)

``--lora``: long-context LoRA fine-tuning, every provider the same way: the base in bf16 and frozen, PEFT's LoRA
adapters (rank ``--lora-rank``, alpha twice that, on q, k, v, o, gate, up and down; float32) the only parameters
that train (AdamW over them); the longctx providers get `apply` on the PEFT model. Every longctx row also gives the
predicted peak (`longctx.integrations.transformers.memory.step_memory`: the step traced on the model itself).

For every provider: tokens/s (S / the median step time) and peak memory (``torch.cuda.max_memory_allocated``, and in
the JSON ``max_memory_reserved``; on the CPU the peak of live tensors) at each S of ``--seq-lengths``, then
(``--longest``) the longest S that trains one whole step, searched by doubling and bisection
(`longctx.bench.search.search_longest`; a try that runs out of memory, or exceeds ``--memory-cap-gib``, does not
fit).

    longctx bench transformers                               # the GPU run
    longctx bench transformers --seq-lengths 8192,32768 --longest
    longctx bench transformers --model gemma2 --seq-lengths 4096,8192,16384
    python -m longctx.bench.transformers --quick             # a CPU check of the same code on a tiny model

Writes ``<out-dir>/transformers_<gpu><tag>.json`` and ``.md`` (the tag gains ``_<model>`` for models other than
llama).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from longctx.bench import result_stem
from longctx.bench.steps import ERROR, OOM, StepResult, adamw, free, is_oom, time_steps, training_step
from longctx.memory.model import LORA_TARGETS
from longctx.units import counts_arg

PROVIDERS = ("hf-sdpa-ckpt", "hf-eager-ckpt", "longctx-apply", "longctx-apply-offload", "longctx-apply-offload-chunks",
             "longctx-apply-keep", "longctx-apply-offload-keep", "longctx-apply-offload-params")  # fmt: skip
OFFLOAD_PARAMS = "longctx-apply-offload-params"


def apply_settings(provider: str) -> dict[str, Any]:
    """The `apply` settings of a longctx provider: full recomputation (uniform, 1 layer), the logits-free loss, and
    offloading / MLP chunks / kept attention / the states in host memory where its name says."""
    params = provider == OFFLOAD_PARAMS
    settings = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
                    cpu_offloading="offload" in provider, fused_loss=True,
                    recompute_skip_core_attention=provider.endswith("keep"),
                    sequence_chunk_size=4096 if provider.endswith("chunks") or params else None)  # fmt: skip
    if params:
        settings["offload_params"] = True
    return settings


SHAPE_336M = dict(
    vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=24, num_attention_heads=16,
    num_key_value_heads=4,
)  # fmt: skip
SHAPE_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8,
)  # fmt: skip
SHAPE_QUICK = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2,
)  # fmt: skip
_GEMMA2 = dict(attn_logit_softcapping=50.0, final_logit_softcapping=None)
SHAPE_GEMMA2 = dict(
    vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=16, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256, sliding_window=4096, **_GEMMA2,
)  # fmt: skip
SHAPE_GEMMA2_QUICK = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32, sliding_window=48, **_GEMMA2,
)  # fmt: skip
# model -> (config class, class name in the report, GPU shape, --quick shape, default providers)
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", SHAPE_336M, SHAPE_QUICK,
              ("hf-sdpa-ckpt", "longctx-apply", "longctx-apply-offload")),
    "llama-8b": ("LlamaConfig", "LlamaForCausalLM", SHAPE_8B, SHAPE_QUICK,
                 ("hf-sdpa-ckpt", "longctx-apply", "longctx-apply-offload")),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", SHAPE_GEMMA2, SHAPE_GEMMA2_QUICK,
               ("hf-eager-ckpt", "hf-sdpa-ckpt", "longctx-apply")),
}  # fmt: skip


def lora_config(rank: int):
    """The benchmark's adapters: rank ``rank``, alpha twice that, on q, k, v, o, gate, up and down."""
    import peft

    return peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(LORA_TARGETS), lora_dropout=0.0)


def _config(shape: dict[str, Any], max_len: int, model: str):
    import transformers

    config_cls = getattr(transformers, MODELS[model][0])
    return config_cls(**shape, max_position_embeddings=max_len, use_cache=False, tie_word_embeddings=False)


def build(
    provider: str,
    shape: dict[str, Any],
    max_len: int,
    device: torch.device,
    model: str = "llama",
    lora_rank: int | None = None,
):
    """The ``model`` of ``provider`` (fp32 parameters on ``device``; with ``lora_rank``, a frozen bf16 base under
    PEFT's float32 LoRA adapters), with its settings applied."""
    from transformers import AutoModelForCausalLM

    import longctx.integrations.transformers as lt

    if provider not in PROVIDERS:
        raise ValueError(f"unknown provider {provider!r}; expected one of {', '.join(PROVIDERS)}")
    cfg = _config(shape, max_len, model)
    torch.manual_seed(0)
    impl = {"hf-sdpa-ckpt": "sdpa", "hf-eager-ckpt": "eager"}.get(provider, "longctx")
    where = device
    if provider == OFFLOAD_PARAMS:
        from longctx.distributed.offload import build_device

        if lora_rank:
            raise ValueError(
                f"{OFFLOAD_PARAMS} trains every weight with its states in host memory; with LoRA only the adapters "
                "have states: use longctx-apply-offload-chunks"
            )
        with torch.device("meta"):
            probe = AutoModelForCausalLM.from_config(cfg, attn_implementation=impl, dtype=torch.float32)
        where = build_device(4 * sum(p.numel() for p in probe.parameters()), device)  # fp32 weights: on the host
        del probe  # when they would take half the GPU; FSDP2 moves each unit into its pinned host shard either way
    with torch.device(where):
        net = AutoModelForCausalLM.from_config(
            cfg, attn_implementation=impl, dtype=torch.bfloat16 if lora_rank else torch.float32
        )
    net.train()
    if provider.startswith("hf-"):
        net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora_rank:
        import peft

        net = peft.get_peft_model(net, lora_config(lora_rank))  # adapters in float32 (PEFT's autocast_adapter_dtype)
    if not provider.startswith("hf-"):
        lt.apply(net, **apply_settings(provider))
    return net


def measure(model, opt: torch.optim.Optimizer, s: int, steps: int, warmup: int, device: torch.device) -> StepResult:
    """`time_steps` of ``steps`` training steps of ``model`` at sequence length ``s`` (batch 1)."""
    g = torch.Generator().manual_seed(s)
    x = torch.randint(0, model.config.vocab_size, (1, s), generator=g).to(device)  # (1, S)
    step = training_step(lambda: model(input_ids=x, labels=x).loss, opt, device)
    return time_steps(lambda: step, tokens=s, steps=steps, warmup=warmup, device=device)


class Runner:
    """One provider's model and optimizer, rebuilt after an out-of-memory error."""

    def __init__(
        self,
        provider: str,
        shape: dict[str, Any],
        max_len: int,
        device: torch.device,
        model: str = "llama",
        lora_rank: int | None = None,
    ) -> None:
        self.provider, self.shape, self.max_len, self.device, self.arch = provider, shape, max_len, device, model
        self.lora_rank = lora_rank
        self.model = self.opt = None

    def _ensure(self) -> None:
        if self.model is None:
            self.model = build(self.provider, self.shape, self.max_len, self.device, self.arch, self.lora_rank)
            if self.provider == OFFLOAD_PARAMS:  # AdamW on the host's fp32 master weights
                from longctx.distributed.offload import host_adamw

                self.opt = host_adamw(self.model, lr=1e-5)
            else:
                self.opt = adamw(self.model, self.device)  # the adapters only, under LoRA

    def release(self) -> None:
        self.model = self.opt = None
        free(self.device)

    def run(self, s: int, steps: int, warmup: int, cap_bytes: float | None) -> dict[str, Any]:
        """One try at ``s``: status ``ok``, ``over`` (out of memory, or a peak above ``cap_bytes``) or ``error``."""
        t0 = time.perf_counter()
        try:
            self._ensure()
        except Exception as e:  # noqa: BLE001 - building can run out of memory too
            r = StepResult(s, OOM if is_oom(e) else ERROR, error=f"{type(e).__name__}: {str(e)[:300]}")
        else:
            from longctx.distributed.offload import HostPeak

            with HostPeak() as host:  # the process's resident host memory: offloaded checkpoints and states
                r = measure(self.model, self.opt, s, steps, warmup, self.device)
        secs = time.perf_counter() - t0
        if not r.ok:
            self.release()
            return {"s": s, "status": "over" if r.oom else "error", "error": r.error, "secs": secs,
                    "peak": float("inf")}  # fmt: skip
        over = cap_bytes is not None and r.peak_bytes > cap_bytes
        row = {"s": s, "step_ms": 1e3 * r.step_s, "tokens_per_s": r.tokens_per_s, "peak_bytes": r.peak_bytes,
               "reserved_bytes": r.reserved_bytes, "status": "over" if over else "ok", "secs": secs,
               "peak": r.peak_bytes}  # fmt: skip
        if "offload" in self.provider:
            row["host_peak_bytes"] = host.peak
        return row


def predicted_step(provider: str, shape: dict[str, Any], s: int, model: str, lora_rank: int | None):
    """The predicted peaks of a longctx provider's step (`longctx.integrations.transformers.memory.step_memory` on
    the transformers model itself, with the provider's `apply` settings and the same adapters): a ``StepPeak``,
    ``.total`` the GPU's, ``.host`` the host's."""
    from longctx.integrations.transformers.memory import step_memory

    settings = apply_settings(provider)
    return step_memory(
        _config(shape, s, model), seq_length=s, dtype=torch.bfloat16 if lora_rank else torch.float32,
        lora=lora_config(lora_rank) if lora_rank else None, apply_kwargs=settings,
    )  # fmt: skip


def predicted_peak(provider: str, shape: dict[str, Any], s: int, model: str, lora_rank: int | None) -> int:
    """The predicted GPU peak of a longctx provider's step (`predicted_step`)."""
    return predicted_step(provider, shape, s, model, lora_rank).total


def _env(device: torch.device) -> dict[str, Any]:
    import transformers

    info: dict[str, Any] = {"torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        info["triton"] = None
    info["gpu"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if device.type == "cuda":
        info["cudnn"] = torch.backends.cudnn.version()
        info["memory_gib"] = torch.cuda.get_device_properties(device).total_memory / 2**30
    return info


def _gib(b: float | None) -> str:
    if b is None or b == float("inf"):
        return "-"
    return f"{b / 2**30:.2f}" if b >= 2**27 else f"{b / 2**30:.5f}"  # tiny (--quick) peaks keep their digits


def report(meta: dict[str, Any], ladder: dict[str, list[dict]], longest: dict[str, dict]) -> str:
    """The Markdown report: tokens/s and peak GiB per S and provider, then the longest S of each provider."""
    provs = meta["providers"]
    env = meta["env"]
    lines = [
        f"# HuggingFace {MODELS[meta.get('model', 'llama')][1]} ({meta['params_m']:.0f}M) with longctx vs plain "
        "transformers",
        "",
        f"{env['gpu']}, torch {env['torch']}, transformers {env['transformers']}, triton {env.get('triton')}, "
        f"cuDNN {env.get('cudnn')}. Batch 1, bf16 autocast, fp32 parameters, AdamW; one step = forward + backward + "
        "optimizer step; median of the timed steps. hf-sdpa-ckpt / hf-eager-ckpt: SDPA / eager attention + "
        "transformers' gradient checkpointing + the loss through the logits; longctx-apply: "
        "attn_implementation='longctx' + apply(full uniform 1, fused_loss); -offload: with cpu_offloading; -keep: "
        "with recompute_skip_core_attention; -chunks: with sequence_chunk_size=4096; -offload-params: -offload-chunks "
        "with the parameters, gradients and AdamW states in host memory (FSDP2's CPU offload, AdamW on the CPU), the "
        "host's peak resident memory beside the GPU's."
        + (
            f" LoRA: a frozen bf16 base, PEFT adapters of rank {meta['lora_rank']} on q, k, v, o, gate, up, down "
            "(float32) train, AdamW over them."
            if meta.get("lora_rank")
            else ""
        )
        + (
            " Gemma 2: transformers' SDPA path drops the attention logit softcap (another model, shown for its "
            "speed); eager and longctx compute it."
            if meta.get("model") == "gemma2"
            else ""
        ),
        "",
        "| S | " + " | ".join(f"{p} tokens/s | {p} peak GiB" for p in provs) + " |",
        "|---|" + "---|---|" * len(provs),
    ]
    seqs = sorted({r["s"] for rs in ladder.values() for r in rs})
    for s in seqs:
        cells = []
        for p in provs:
            r = next((r for r in ladder.get(p, []) if r["s"] == s), None)
            if r is None:
                cells += ["-", "-"]
            elif r["status"] != "ok":
                cells += [r["status"].upper() if r["status"] == "over" else "error", "-"]
            else:
                pred = f" (predicted {_gib(r['predicted_bytes'])})" if r.get("predicted_bytes") else ""
                if r.get("predicted_host_bytes"):  # the states in host memory: both memories
                    pred += f"; host {_gib(r.get('host_peak_bytes'))} (predicted {_gib(r['predicted_host_bytes'])})"
                cells += [f"{r['tokens_per_s']:.0f}", _gib(r["peak_bytes"]) + pred]
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    if longest:
        head = "| provider | longest S that trains | peak GiB there | tokens/s there | shortest S that does not |"
        lines += ["", head, "|---|---|---|---|---|"]
        for p in provs:
            res = longest.get(p)
            if res is None:
                continue
            best = next((t for t in res["tries"] if t["n"] == res["best"] and t["status"] == "ok"), None)
            lines.append(
                f"| {p} | {res['best'] or '-'} | {_gib(best['peak_bytes']) if best else '-'} | "
                f"{best['tokens_per_s']:.0f} | {res['over'] or '-'} |"
                if best
                else f"| {p} | - | - | - | {res['over'] or '-'} |"
            )
        lines += ["", f"Search: doubling then bisection to {meta['resolution']:.0%}, multiples of {meta['quantum']}."]
    return "\n".join(lines) + "\n"


_ints = counts_arg("--seq-lengths")


def main(argv: list[str] | None = None) -> int:
    """Run the comparison; returns the exit status."""
    from longctx.memory.measure import expandable_segments

    allocator = expandable_segments()  # as `longctx train` runs: every provider under the same allocator
    ap = argparse.ArgumentParser(prog="longctx bench transformers", description=__doc__.splitlines()[0])
    ap.add_argument("--seq-lengths", type=_ints, default=[8192, 32768, 65536], help="the ladder of S")
    ap.add_argument("--model", choices=list(MODELS), default="llama", help="the model family (module docstring)")
    ap.add_argument(
        "--providers", default=None, help=f"subset of {','.join(PROVIDERS)} (default: the model's, see MODELS)"
    )
    ap.add_argument("--steps", type=int, default=3, help="timed steps per S")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per S")
    ap.add_argument("--longest", action="store_true", help="also search the longest S that trains")
    ap.add_argument("--search-start", type=int, default=65536)
    ap.add_argument("--search-limit", type=int, default=1 << 21)
    ap.add_argument("--search-budget-s", type=float, default=900.0, help="per provider")
    ap.add_argument("--memory-cap-gib", type=float, default=None, help="a try above this peak does not fit")
    ap.add_argument("--lora", action="store_true", help="LoRA fine-tuning: frozen bf16 base, PEFT adapters train")
    ap.add_argument("--lora-rank", type=int, default=16, help="the adapters' rank with --lora (default 16)")
    ap.add_argument("--quick", action="store_true", help="CPU check: tiny model, S=64,128, a tiny search")
    ap.add_argument("--out-dir", default=str(Path("benchmarks") / "results"))
    ap.add_argument("--tag", default="", help="suffix naming what the run covers, not when")
    args = ap.parse_args(argv)

    providers = [p for p in (args.providers or ",".join(MODELS[args.model][4])).split(",") if p]
    bad = [p for p in providers if p not in PROVIDERS]
    if bad:
        ap.error(f"unknown providers {bad}; expected a subset of {','.join(PROVIDERS)}")
    if args.quick:
        device, shape, quantum = torch.device("cpu"), MODELS[args.model][3], 64
        seqs, steps, warmup = [64, 128], 1, 0
        cap = (args.memory_cap_gib or 0.003) * 2**30  # about 3 MiB: the search brackets
        start, limit, budget = 64, 1024, 60.0
    else:
        if not torch.cuda.is_available():
            ap.error("the comparison runs on a CUDA GPU; use --quick for the CPU check")
        from longctx.bench.search import QUANTUM

        device, shape, quantum = torch.device("cuda"), MODELS[args.model][2], QUANTUM
        seqs, steps, warmup = args.seq_lengths, args.steps, args.warmup
        cap = args.memory_cap_gib * 2**30 if args.memory_cap_gib else None
        start, limit, budget = args.search_start, args.search_limit, args.search_budget_s
    max_len = max([*seqs, limit])
    lora_rank = args.lora_rank if args.lora else None
    if lora_rank is not None and lora_rank < 1:
        ap.error(f"--lora-rank must be a positive int, got {lora_rank}")
    if lora_rank is not None and OFFLOAD_PARAMS in providers:
        ap.error(f"{OFFLOAD_PARAMS} trains every weight; with --lora use longctx-apply-offload-chunks")
    env = {**_env(device), "allocator": allocator}
    h, L, V, f = shape["hidden_size"], shape["num_hidden_layers"], shape["vocab_size"], shape["intermediate_size"]
    hd = shape.get("head_dim", h // shape["num_attention_heads"])
    qo, kv = hd * shape["num_attention_heads"], hd * shape["num_key_value_heads"]
    params = 2 * V * h + L * (2 * h * qo + 2 * h * kv + 3 * h * f + 2 * h) + h
    meta: dict[str, Any] = {
        "benchmark": "transformers", "model": args.model, "env": env, "shape": shape, "params_m": params / 1e6,
        "providers": providers,
        "seq_lengths": seqs, "steps": steps, "warmup": warmup, "quantum": quantum, "resolution": 0.08,
        "memory_cap_bytes": cap, "date": _dt.date.today().isoformat(), "lora_rank": lora_rank,
    }  # fmt: skip
    ladder: dict[str, list[dict]] = {}
    longest: dict[str, dict] = {}
    tag = args.tag + ("" if args.model == "llama" else f"_{args.model}") + ("_lora" if lora_rank else "")
    tag += "_quick" if args.quick else ""
    stem = result_stem(args.out_dir, "transformers", env["gpu"], tag)
    Path(stem).parent.mkdir(parents=True, exist_ok=True)

    def write() -> str:
        """The report of the rows so far, written after every row: a run stopped by a time limit keeps them."""
        text = report(meta, ladder, longest)
        clean = {p: {k: v for k, v in res.items() if k != "tries"} | {"tries": res["tries"]}
                 for p, res in longest.items()}  # fmt: skip
        Path(stem + ".json").write_text(json.dumps({"meta": meta, "ladder": ladder, "longest": clean}, indent=1,
                                                   default=str))  # fmt: skip
        Path(stem + ".md").write_text(text)
        return text

    for p in providers:
        runner = Runner(p, shape, max_len, device, args.model, lora_rank)
        ladder[p] = []
        for s in seqs:
            r = runner.run(s, steps, warmup, cap)
            if p.startswith("longctx"):
                pred = predicted_step(p, shape, s, args.model, lora_rank)
                r["predicted_bytes"] = pred.total
                if p == OFFLOAD_PARAMS:
                    r["predicted_host_bytes"] = pred.host
            ladder[p].append(r)
            write()
            print(f"{p:>22} S={s:>8}: {r['status']:>5} " + (
                f"{r['tokens_per_s']:9.0f} tokens/s {_gib(r['peak_bytes'])} GiB" if r["status"] == "ok"
                else r.get("error", "")), flush=True)  # fmt: skip
        if args.longest or args.quick:
            from longctx.bench.search import search_longest

            def try_fn(n: int, _runner: Runner = runner) -> dict[str, Any]:
                return _runner.run(n, 1, 1 if device.type == "cuda" else 0, cap)

            search_cap = cap if cap is not None else torch.cuda.get_device_properties(device).total_memory
            known = [dict(r, n=r["s"]) for r in ladder[p] if r["status"] in ("ok", "over")]
            res = search_longest(
                try_fn, start=start, cap=search_cap, limit=limit, budget_s=budget, quantum=quantum, known=known
            )
            longest[p] = res
            write()
            print(f"{p:>22} longest S: {res['best']} (does not fit: {res['over']}; {res['stop']})", flush=True)
        runner.release()
    text = write()
    print(text)
    print(f"wrote {stem}.md and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())

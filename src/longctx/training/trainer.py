"""`longctx train`: train a GPT on the embedded long-context recall task (default) or a text file.

    longctx train                                   # CPU: a few minutes, recall accuracy far above chance
    longctx train --config configs/recall_cpu.yaml  # the same from YAML
    longctx train --data book.txt --train-iters 2000
    longctx train --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
    longctx train --save runs/x --resume            # continue from runs/x/checkpoint.pt

Settings come from, in increasing priority: the defaults below, the ``--preset`` model shape, the YAML
file (``--config``, read with yaml.safe_load), and flags given on the command line. Names follow
Megatron-LM (flags ``--train-iters``, ``--micro-batch-size``, ``--recompute-granularity`` ...; YAML keys
with underscores); NeMo's spellings are accepted too (``activations_checkpoint_granularity``,
``activations_checkpoint_method``, ``activations_checkpoint_num_layers``, ``max_steps``,
``gradient_clip_val`` ...). An unknown key is an error that names it.

AdamW with linear warmup and cosine decay to ``min_lr``, gradient clipping, bf16 autocast on CUDA,
evaluation on held-out data, a progress line (loss, tokens/s, peak memory), checkpoints written
atomically, and ``--resume`` that continues to the same losses as an uninterrupted run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import json
import math
import resource
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from longctx.models.gpt import GPT, PRESETS, GPTConfig, lm_loss
from longctx.training.checkpoint import (
    CheckpointError,
    capture_rng,
    config_diff,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
)
from longctx.training.data import ByteText, RecallTask

__all__ = ["TrainConfig", "TrainResult", "main", "run", "parse_config"]

# Model fields that may be set directly (the rest of GPTConfig comes from the preset).
MODEL_FIELDS = tuple(f.name for f in fields(GPTConfig))


@dataclass
class TrainConfig:
    """Everything a training run needs; model fields left None come from the preset."""

    # model
    preset: str = "demo"
    model: dict[str, Any] = field(default_factory=dict)  # GPTConfig overrides (Megatron names)
    # data
    data: str | None = None  # a text file for byte-level LM; None = the embedded recall task
    num_pairs: int = RecallTask.num_pairs  # the task's own defaults, stated once in longctx.training.data
    num_queries: int = RecallTask.num_queries
    num_keys: int = RecallTask.num_keys
    num_values: int = RecallTask.num_values
    # optimisation
    train_iters: int = 1500
    micro_batch_size: int = 32
    lr: float = 3e-3
    min_lr: float = 3e-4
    lr_warmup_iters: int = 50
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    clip_grad: float = 1.0
    # evaluation, logging, checkpoints
    eval_interval: int = 250
    eval_iters: int = 8
    log_interval: int = 50
    save: str | None = "runs/recall"
    save_interval: int = 500
    resume: str | None = None  # "auto" = <save>/checkpoint.pt, or a path
    halt_after: int | None = None  # stop (saving a checkpoint) after this many steps, as an interruption would
    seed: int = 1234
    # context parallelism (run under torchrun with --nproc-per-node = context_parallel; see longctx.distributed)
    context_parallel: int = 1
    cp_method: str = "ring"  # ring, allgather or ulysses
    cp_layout: str = "zigzag"  # zigzag or contiguous
    device: str = "auto"  # auto: cuda if available
    bf16: bool | None = None  # autocast to bfloat16; default: on CUDA only
    quiet: bool = False

    def model_config(self, vocab_size: int | None = None) -> GPTConfig:
        overrides = {k: v for k, v in self.model.items() if v is not None}
        if vocab_size is not None:
            overrides["vocab_size"] = vocab_size
        return GPTConfig.preset(self.preset, **overrides)


# -- names: Megatron (ours), NeMo and a few common spellings --------------------------------------------

ALIASES: dict[str, str] = {
    "activations_checkpoint_granularity": "recompute_granularity",
    "activations_checkpoint_method": "recompute_method",
    "activations_checkpoint_num_layers": "recompute_num_layers",
    "encoder_seq_length": "seq_length",
    "max_steps": "train_iters",
    "steps": "train_iters",
    "batch_size": "micro_batch_size",
    "warmup_steps": "lr_warmup_iters",
    "gradient_clip_val": "clip_grad",
    "val_check_interval": "eval_interval",
    "limit_val_batches": "eval_iters",
    "tie_word_embeddings": "share_embeddings_and_output_weights",
    "num_kv_heads": "num_query_groups",
    "checkpoint_dir": "save",
}
TRAIN_FIELDS = tuple(f.name for f in fields(TrainConfig) if f.name != "model")
ALL_KEYS = set(TRAIN_FIELDS) | set(MODEL_FIELDS)


def _canonical(key: str) -> str:
    key = key.replace("-", "_")
    return ALIASES.get(key, key)


def _unknown_key_error(unknown: list[str], where: str) -> ValueError:
    hints = []
    for k in unknown:
        close = difflib.get_close_matches(k, sorted(ALL_KEYS | set(ALIASES)), n=1)
        hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return ValueError(
        f"unknown configuration key(s) in {where}: {', '.join(hints)}. Known keys: the Megatron names of "
        f"GPTConfig ({', '.join(MODEL_FIELDS)}), the training keys ({', '.join(TRAIN_FIELDS)}) and the NeMo "
        f"spellings {sorted(ALIASES)}"
    )


def load_yaml(path: str | Path) -> dict[str, Any]:
    """A flat mapping of settings, or NeMo's nesting (``model:``, ``trainer:``, ``optim:`` sections) flattened."""
    import yaml

    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except OSError as e:
        raise ValueError(f"cannot read config file {str(path)!r}: {e}") from e
    except yaml.YAMLError as e:
        raise ValueError(f"config file {str(path)!r} is not valid YAML: {e}") from e
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(f"config file {str(path)!r} must hold a mapping of settings, got {type(raw).__name__}")
    flat: dict[str, Any] = {}
    for key, val in raw.items():
        if key in ("model", "trainer", "optim", "exp_manager") and isinstance(val, dict):
            flat.update(val)  # NeMo-style sections
        else:
            flat[key] = val
    out: dict[str, Any] = {}
    unknown = []
    for key, val in flat.items():
        c = _canonical(str(key))
        if c not in ALL_KEYS:
            unknown.append(str(key))
        out[c] = val
    if unknown:
        raise _unknown_key_error(unknown, repr(str(path)))
    return out


def _none_or(typ):
    def conv(s: str):
        return None if s.lower() in ("none", "null") else typ(s)

    conv.__name__ = typ.__name__
    return conv


def _bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {s!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="longctx train",
        description="Train a GPT on the embedded long-context recall task (default) or a text file (--data).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--config", help="YAML file of settings (Megatron or NeMo names)")
    p.add_argument("--preset", choices=sorted(PRESETS), help="model shape (default: demo)")
    p.add_argument("--data", help="text file for byte-level language modelling instead of the recall task")
    g = p.add_argument_group("model (GPTConfig fields, Megatron names)")
    hints = {f.name: f.type for f in fields(GPTConfig)}
    for name in MODEL_FIELDS:
        t = str(hints[name])
        if "bool" in t:
            conv = _bool
        elif "float" in t:
            conv = float
        elif "int" in t:
            conv = _none_or(int)
        else:
            conv = _none_or(str)
        g.add_argument("--" + name.replace("_", "-"), dest=name, type=conv, default=None)
    t = p.add_argument_group("training")
    for name, conv in [
        ("train_iters", int),
        ("micro_batch_size", int),
        ("lr", float),
        ("min_lr", float),
        ("lr_warmup_iters", int),
        ("weight_decay", float),
        ("adam_beta1", float),
        ("adam_beta2", float),
        ("clip_grad", float),
        ("eval_interval", int),
        ("eval_iters", int),
        ("log_interval", int),
        ("save_interval", int),
        ("seed", int),
        ("num_pairs", int),
        ("num_queries", int),
        ("num_keys", int),
        ("num_values", int),
        ("halt_after", int),
        ("context_parallel", int),
    ]:
        t.add_argument("--" + name.replace("_", "-"), dest=name, type=conv, default=None)
    t.add_argument("--steps", dest="train_iters", type=int, default=None, help="alias of --train-iters")
    t.add_argument("--batch-size", dest="micro_batch_size", type=int, default=None, help="alias of --micro-batch-size")
    t.add_argument("--save", default=None, help="checkpoint directory (default runs/recall; 'none' disables)")
    t.add_argument(
        "--resume", nargs="?", const="auto", default=None, help="resume from <save>/checkpoint.pt, or from PATH"
    )
    t.add_argument("--cp-method", default=None, help="context-parallel method: ring, allgather or ulysses")
    t.add_argument("--cp-layout", default=None, help="context-parallel sequence layout: zigzag or contiguous")
    t.add_argument("--device", default=None, help="auto, cpu or cuda")
    t.add_argument("--bf16", type=_bool, default=None, help="bf16 autocast (default: on CUDA)")
    t.add_argument("--quiet", action="store_true", default=None)
    return p


def parse_config(argv: list[str] | None) -> TrainConfig:
    """Defaults < preset < YAML < flags. Raises ValueError for unknown YAML keys or invalid model settings."""
    args = build_parser().parse_args(argv)
    settings: dict[str, Any] = {}
    if args.config:
        settings.update(load_yaml(args.config))
    for key, val in vars(args).items():
        if key != "config" and val is not None:
            settings[key] = val
    if isinstance(settings.get("save"), str) and settings["save"].lower() == "none":
        settings["save"] = None
    train_kw = {k: v for k, v in settings.items() if k in TRAIN_FIELDS}
    model_kw = {k: v for k, v in settings.items() if k in MODEL_FIELDS}
    cfg = TrainConfig(**train_kw, model=model_kw)
    if cfg.preset not in PRESETS:
        raise ValueError(f"unknown preset {cfg.preset!r}; expected one of {sorted(PRESETS)}")
    cfg.model_config()  # validate the model settings now (ValueError names the field)
    return cfg


# -- the loop --------------------------------------------------------------------------------------------


@dataclass
class TrainResult:
    losses: list[float]  # training loss per step run in this process, in order
    first_step: int
    eval_loss: float | None = None
    recall_accuracy: float | None = None
    chance_accuracy: float | None = None
    seconds: float = 0.0
    tokens_per_second: float = 0.0
    peak_memory_bytes: int = 0
    backend: str = ""
    checkpoint: str | None = None


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup over lr_warmup_iters, then cosine from lr to min_lr at train_iters."""
    if step < cfg.lr_warmup_iters:
        return cfg.lr * (step + 1) / cfg.lr_warmup_iters
    span = max(1, cfg.train_iters - cfg.lr_warmup_iters)
    frac = min(1.0, (step - cfg.lr_warmup_iters) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * frac))


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but CUDA is not available; use --device cpu")
    return torch.device(name)


def _peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak RSS (Linux reports KiB)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit in ("B", "KiB") else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _fmt_time(s: float) -> str:
    s = int(s)
    return f"{s // 60:02d}:{s % 60:02d}"


class Progress:
    """One line, rewritten in place on a terminal and printed every log_interval steps otherwise."""

    def __init__(self, total: int, quiet: bool, log_interval: int) -> None:
        self.total, self.quiet, self.log_interval = total, quiet, max(1, log_interval)
        self.tty = sys.stdout.isatty()

    def update(self, step: int, text: str, force: bool = False) -> None:
        if self.quiet:
            return
        done = step / self.total
        width = 20
        bar = "#" * int(done * width) + "." * (width - int(done * width))
        line = f"[{bar}] {step}/{self.total} | {text}"
        if self.tty:
            print("\r" + line + "\x1b[K", end="" if step < self.total else "\n", flush=True)
        elif force or step % self.log_interval == 0 or step == self.total:
            print(line, flush=True)

    def message(self, text: str) -> None:
        if not self.quiet:
            print(("\n" if self.tty else "") + text, flush=True)


def _optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), fused=device.type == "cuda")


@torch.no_grad()
def evaluate(model: GPT, task, cfg: TrainConfig, device: torch.device, autocast, cp=None) -> dict[str, float]:
    """Mean loss over eval_iters held-out batches; answer accuracy for the recall task."""
    was_training = model.training
    model.eval()
    total_loss, total_tokens, correct = 0.0, 0.0, 0.0
    for i in range(cfg.eval_iters):
        b = task.batch(cfg.micro_batch_size, i, cfg.seed, "eval").to(device)
        mask = b.loss_mask if b.loss_mask is not None else torch.ones_like(b.labels, dtype=torch.bool)
        if cp is not None:
            inputs, labels, mask, pos = cp.shard_batch(b.inputs, b.labels, mask)
            with autocast():
                logits = model(inputs, position_ids=pos)
            loss_sum, count, hits = cp.eval_stats(logits, labels, mask)
            total_loss, total_tokens, correct = total_loss + loss_sum, total_tokens + count, correct + hits
            continue
        with autocast():
            logits = model(b.inputs)
        total_loss += float(lm_loss(logits, b.labels, mask, reduction="sum"))
        total_tokens += float(mask.sum())
        correct += float(((logits.argmax(-1) == b.labels) & mask).sum())
    model.train(was_training)
    out = {"eval_loss": total_loss / max(total_tokens, 1.0)}
    if isinstance(task, RecallTask):
        out["recall_accuracy"] = correct / max(total_tokens, 1.0)
    else:
        out["bits_per_byte"] = out["eval_loss"] / math.log(2)
    return out


def _attention_probe(c: GPTConfig, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised q (1, Hq, S, D) and k/v (1, Hkv, S, D) of the model's attention, for `longctx.explain`."""
    q = torch.empty(1, c.num_attention_heads, c.seq_length, c.head_dim, device=device, dtype=dtype)
    kv = torch.empty(1, c.kv_heads, c.seq_length, c.head_dim, device=device, dtype=dtype)
    return q, kv


def _default_backend(mcfg: GPTConfig, device: torch.device, use_bf16: bool) -> str:
    """The attention backend when none was configured: our Triton kernels on a GPU where they run the model's
    attention (the point of this command), else ``auto``. ``--attention-backend auto`` restores the measured
    fastest choice (cuDNN through SDPA on the H100, for plain causal attention)."""
    if device.type != "cuda":
        return "auto"
    import longctx

    q, kv = _attention_probe(mcfg, device, torch.bfloat16 if use_bf16 else torch.float32)
    try:
        longctx.explain(q, kv, kv, causal=True, backend="triton")
    except ValueError:
        return "auto"
    return "triton"


def _chosen_backend(model: GPT, device: torch.device, dtype: torch.dtype) -> str:
    import longctx

    c = model.config
    q, kv = _attention_probe(c, device, dtype)
    try:
        return longctx.explain(q, kv, kv, causal=True, backend=c.attention_backend).backend.name
    except ValueError as e:
        raise ValueError(f"attention backend {c.attention_backend!r}: {e}") from e


def run(cfg: TrainConfig) -> TrainResult:
    """Train as configured; returns the losses and final figures. Raises CheckpointError/ValueError on bad input."""
    rank, cp = 0, None
    if cfg.context_parallel > 1:
        from longctx.distributed.model import init_distributed

        rank, world, device = init_distributed()
        if world != cfg.context_parallel:
            raise ValueError(
                f"--context-parallel {cfg.context_parallel} needs as many processes, got world size {world}; "
                f"run: torchrun --nproc-per-node {cfg.context_parallel} -m longctx train --context-parallel "
                f"{cfg.context_parallel} ..."
            )
        if rank != 0:
            cfg = dataclasses.replace(cfg, quiet=True)
    else:
        device = _device(cfg.device)
    use_bf16 = cfg.bf16 if cfg.bf16 is not None else device.type == "cuda"
    torch.manual_seed(cfg.seed)

    if cfg.data:
        base = GPTConfig.preset(cfg.preset, **{k: v for k, v in cfg.model.items() if v is not None})
        task: RecallTask | ByteText = ByteText(cfg.data, base.seq_length)
        mcfg = cfg.model_config(vocab_size=ByteText.vocab_size)
    else:
        mcfg = cfg.model_config()
        task = RecallTask(
            seq_length=mcfg.seq_length,
            vocab_size=mcfg.vocab_size,
            num_pairs=cfg.num_pairs,
            num_queries=cfg.num_queries,
            num_keys=cfg.num_keys,
            num_values=cfg.num_values,
        )
    if cfg.model.get("attention_backend") is None:
        mcfg = dataclasses.replace(mcfg, attention_backend=_default_backend(mcfg, device, use_bf16))
    model = GPT(mcfg).to(device)
    opt = _optimizer(model, cfg, device)
    backend = _chosen_backend(model, device, torch.bfloat16 if use_bf16 else torch.float32)
    if cfg.context_parallel > 1:
        from longctx.distributed.model import setup_context_parallel

        cp = setup_context_parallel(model, method=cfg.cp_method, layout=cfg.cp_layout)
        cp.check_seq_len(mcfg.seq_length)
        backend = f"context-parallel {cfg.cp_method}/{cfg.cp_layout} over {cfg.context_parallel} ranks ({cp.backend})"

    def autocast():
        if use_bf16:
            return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    ckpt_path = Path(cfg.save) / "checkpoint.pt" if cfg.save else None
    writer = rank == 0  # under context parallelism only the first rank writes checkpoints and metrics
    start = 0
    if cfg.resume:
        path = ckpt_path if cfg.resume == "auto" else Path(cfg.resume)
        if path is None:
            raise ValueError("--resume without a path needs --save DIR (the checkpoint is DIR/checkpoint.pt)")
        state = load_checkpoint(path)
        # How the model is computed (attention backend, recomputation) may change on resume; what it is may not.
        how = ("attention_backend", "recompute_granularity", "recompute_method", "recompute_num_layers")
        saved_cfg = {k: v for k, v in state["model_config"].items() if k not in how}
        diff = config_diff(saved_cfg, {k: v for k, v in mcfg.to_dict().items() if k not in how})
        if diff:
            raise CheckpointError(
                f"checkpoint {str(path)!r} was written for another model configuration ({'; '.join(diff)}); "
                "pass the same model settings, or start a new run in another --save directory"
            )
        try:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as e:
            raise CheckpointError(f"checkpoint {str(path)!r} does not fit this model: {e}") from e
        restore_rng(state["rng"])
        start = int(state["step"])
        if start > cfg.train_iters:
            raise ValueError(f"checkpoint is at step {start}, beyond --train-iters {cfg.train_iters}")

    def save(step: int, extra: dict[str, Any]) -> None:
        if ckpt_path is None or not writer:
            return
        save_checkpoint(
            ckpt_path,
            {
                "step": step,
                "model": model.state_dict(),
                "optimizer": opt.state_dict(),
                "rng": capture_rng(),
                "model_config": mcfg.to_dict(),
                "train_config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "model"},
                "extra": extra,
            },
        )

    metrics_file = None
    if cfg.save and writer:
        Path(cfg.save).mkdir(parents=True, exist_ok=True)
        metrics_file = open(Path(cfg.save) / "metrics.jsonl", "a")  # noqa: SIM115

    progress = Progress(cfg.train_iters, cfg.quiet, cfg.log_interval)
    what = (
        f"byte-level LM on {cfg.data}"
        if cfg.data
        else (
            f"recall: {cfg.num_pairs} key-value pairs in {mcfg.seq_length} tokens, {cfg.num_queries} queries "
            f"(chance {1 / cfg.num_values:.1%})"
        )
    )
    progress.message(
        f"longctx train | {what} | GPT {cfg.preset}: {model.num_parameters() / 1e6:.2f}M params, "
        f"{mcfg.num_layers} layers, h={mcfg.hidden_size}, heads {mcfg.num_attention_heads}/{mcfg.kv_heads} | "
        f"attention {backend} | recompute {mcfg.recompute_granularity or 'none'} | {device}"
        + (" bf16" if use_bf16 else " fp32")
        + (f" | resumed at step {start}" if start else "")
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    model.train()
    losses: list[float] = []
    tokens_per_step = cfg.micro_batch_size * mcfg.seq_length
    last_eval: dict[str, float] = {}
    t0 = time.perf_counter()
    step = start
    stop = cfg.train_iters if cfg.halt_after is None else min(cfg.train_iters, cfg.halt_after)
    for step in range(start, stop):
        lr = lr_at(step, cfg)
        for gr in opt.param_groups:
            gr["lr"] = lr
        b = task.batch(cfg.micro_batch_size, step, cfg.seed, "train").to(device)
        if cp is not None:  # this rank's shard of every sequence, with its global positions
            inputs, labels, mask, pos = cp.shard_batch(b.inputs, b.labels, b.loss_mask)
            with autocast():
                logits = model(inputs, position_ids=pos)
            loss, loss_report = cp.loss(logits, labels, mask)
            loss.backward()
            cp.allreduce_gradients(model)
        else:
            with autocast():
                logits = model(b.inputs)
            loss = loss_report = lm_loss(logits, b.labels, b.loss_mask)
            loss.backward()
        if cfg.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_val = loss_report.item()
        losses.append(loss_val)
        done = step + 1
        elapsed = time.perf_counter() - t0
        tps = tokens_per_step * (done - start) / max(elapsed, 1e-9)
        record: dict[str, Any] = {"step": done, "loss": loss_val, "lr": lr}
        is_last = done == cfg.train_iters
        if cfg.eval_iters > 0 and ((cfg.eval_interval > 0 and done % cfg.eval_interval == 0) or is_last):
            last_eval = evaluate(model, task, cfg, device, autocast, cp)
            record.update(last_eval)
        if metrics_file:
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
        eta = elapsed / (done - start) * (stop - done)
        text = f"loss {loss_val:.4f} | lr {lr:.2e} | {tps / 1e3:.1f}k tok/s | peak {_fmt_bytes(_peak_memory(device))}"
        if "recall_accuracy" in last_eval:
            text += f" | eval recall {last_eval['recall_accuracy']:.1%}"
        elif "eval_loss" in last_eval:
            text += f" | eval loss {last_eval['eval_loss']:.3f}"
        text += f" | {_fmt_time(elapsed)} < {_fmt_time(eta)}"
        progress.update(done, text, force="eval_loss" in record)
        if ckpt_path and ((cfg.save_interval > 0 and done % cfg.save_interval == 0) or done == stop):
            save(done, {"last_eval": last_eval})
    if metrics_file:
        metrics_file.close()
    if cp is not None:
        import torch.distributed as dist

        dist.barrier()

    elapsed = time.perf_counter() - t0
    result = TrainResult(
        losses=losses,
        first_step=start,
        eval_loss=last_eval.get("eval_loss"),
        recall_accuracy=last_eval.get("recall_accuracy"),
        chance_accuracy=None if cfg.data else 1 / cfg.num_values,
        seconds=elapsed,
        tokens_per_second=tokens_per_step * len(losses) / max(elapsed, 1e-9),
        peak_memory_bytes=_peak_memory(device),
        backend=backend,
        checkpoint=str(ckpt_path) if ckpt_path else None,
    )
    if cfg.halt_after is not None and stop < cfg.train_iters:
        progress.message(f"halted after step {stop} (--halt-after); continue with --resume")
        return result
    summary = [
        "",
        "summary",
        f"  steps             {start} -> {stop}  ({len(losses)} in this run, {_fmt_time(elapsed)}, "
        f"{result.tokens_per_second / 1e3:.1f}k tokens/s)",
        f"  final train loss  {losses[-1]:.4f}" if losses else "  final train loss  -",
    ]
    if result.eval_loss is not None:
        summary.append(f"  held-out loss     {result.eval_loss:.4f}")
    if "bits_per_byte" in last_eval:
        summary.append(f"  bits per byte     {last_eval['bits_per_byte']:.3f}")
    if result.recall_accuracy is not None:
        summary.append(
            f"  recall accuracy   {result.recall_accuracy:.1%} on held-out sequences "
            f"(chance {result.chance_accuracy:.1%}; "
            f"guessing among the {cfg.num_pairs} values present {1 / cfg.num_pairs:.1%})"
        )
    summary += [
        f"  peak memory       {_fmt_bytes(result.peak_memory_bytes)}"
        + (" (torch.cuda.max_memory_allocated)" if device.type == "cuda" else " (peak RSS of the process)"),
        f"  attention         {backend}",
    ]
    if ckpt_path:
        summary.append(f"  checkpoint        {ckpt_path}")
    progress.message("\n".join(summary))
    return result


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``longctx train``; returns the exit status (2 for bad settings or checkpoints)."""
    try:
        cfg = parse_config(argv)
        run(cfg)
    except (ValueError, TypeError) as e:  # includes CheckpointError
        print(f"longctx train: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nlongctx train: interrupted; the last checkpoint is intact (continue with --resume)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`longctx train`: train a GPT on the embedded long-context recall task (default) or a text file.

    longctx train                                   # CPU: a few minutes, recall accuracy far above chance
    longctx train --config configs/recall_cpu.yaml  # the same from YAML
    longctx train --data book.txt --train-iters 2000
    longctx train --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
    longctx train --save runs/x --resume            # continue from runs/x/checkpoint.pt
    torchrun --nproc-per-node 2 -m longctx train --context-parallel 2

AdamW with linear warmup and cosine decay to ``min_lr``, gradient clipping, bf16 autocast on CUDA, evaluation
on held-out data, a progress line (loss, tokens/s, peak memory), checkpoints written atomically, and
``--resume`` that continues to the same losses as an uninterrupted run. Settings: `longctx.training.config`.

`Trainer` builds everything in its constructor (device, data, model, optimizer, the attention backend, context
parallelism, the resumed state); `Trainer.train_step` is one optimiser step; `Trainer.train` is the loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from longctx.api import explain
from longctx.models.gpt import GPT, GPTConfig, lm_loss
from longctx.training.checkpoint import load_training_state, save_training_state
from longctx.training.config import TrainConfig, parse_config
from longctx.training.data import Batch, ByteText, RecallTask
from longctx.training.metrics import (
    MetricsLog,
    Progress,
    format_bytes,
    format_time,
    peak_memory_bytes,
    step_line,
)

if TYPE_CHECKING:
    from longctx.distributed.model import ContextParallel

__all__ = ["Trainer", "TrainResult", "run", "main", "lr_at", "build_optimizer"]


@dataclass
class TrainResult:
    """What a run returns: the losses of the steps it ran and its final figures."""

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
    """The learning rate of ``step``: linear warmup over lr_warmup_iters, then cosine to min_lr at train_iters."""
    if step < cfg.lr_warmup_iters:
        return cfg.lr * (step + 1) / cfg.lr_warmup_iters
    span = max(1, cfg.train_iters - cfg.lr_warmup_iters)
    frac = min(1.0, (step - cfg.lr_warmup_iters) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * frac))


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norms and biases); fused on CUDA."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), fused=device.type == "cuda")


class Trainer:
    """A training run: everything built from a `TrainConfig`, then `train`.

    Under context parallelism (``cfg.context_parallel > 1``, launched by torchrun) every rank builds the same
    model and reads the same full batches; each computes its shard of every sequence (`longctx.distributed`),
    and only the first rank writes checkpoints, metrics and the progress line.

    Args:
        cfg: the run's settings.

    Raises:
        ValueError: a device that is not available, a world size other than ``cfg.context_parallel``, an
            attention backend that cannot run the model, or data that does not fit the model.
        CheckpointError: ``cfg.resume`` names a checkpoint that is missing, corrupt or of another model.
    """

    def __init__(self, cfg: TrainConfig) -> None:
        self.rank = 0
        if cfg.context_parallel > 1:
            self.rank, self.device = _init_context_parallel(cfg.context_parallel)
            if self.rank != 0:
                cfg = dataclasses.replace(cfg, quiet=True)
        else:
            self.device = _device(cfg.device)
        self.cfg = cfg
        self.use_bf16 = cfg.bf16 if cfg.bf16 is not None else self.device.type == "cuda"
        torch.manual_seed(cfg.seed)  # the model's initial weights

        self.task, mcfg = _build_task(cfg)
        if cfg.model.get("attention_backend") is None:
            mcfg = dataclasses.replace(mcfg, attention_backend=_default_backend(mcfg, self.device, self.use_bf16))
        self.model_config = mcfg
        self.model = GPT(mcfg).to(self.device)
        self.optimizer = build_optimizer(self.model, cfg, self.device)
        self.backend = _chosen_backend(self.model, self.device, self.compute_dtype)
        self.cp: ContextParallel | None = None
        if cfg.context_parallel > 1:
            from longctx.distributed.model import setup_context_parallel

            self.cp = setup_context_parallel(self.model, method=cfg.cp_method, layout=cfg.cp_layout)
            self.cp.check_seq_len(mcfg.seq_length)
            self.backend = (
                f"context-parallel {cfg.cp_method}/{cfg.cp_layout} over {cfg.context_parallel} ranks "
                f"({self.cp.backend})"
            )

        self.is_writer = self.rank == 0  # the rank that writes checkpoints and metrics
        self.checkpoint_path = Path(cfg.save) / "checkpoint.pt" if cfg.save else None
        self.start_step = self._resume() if cfg.resume else 0
        self.tokens_per_step = cfg.micro_batch_size * mcfg.seq_length

    @property
    def compute_dtype(self) -> torch.dtype:
        """bfloat16 under bf16 autocast, else float32."""
        return torch.bfloat16 if self.use_bf16 else torch.float32

    def autocast(self) -> contextlib.AbstractContextManager:
        """bf16 autocast when configured, else nothing."""
        if self.use_bf16:
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # -- one step ------------------------------------------------------------------------------------------

    def train_step(self, step: int) -> tuple[float, float]:
        """One optimiser step on the batch of ``step``; returns ``(training loss, learning rate)``."""
        cfg = self.cfg
        lr = lr_at(step, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        batch = self.task.batch(cfg.micro_batch_size, step, cfg.seed, "train").to(self.device)
        loss = self.forward_backward(batch)
        if cfg.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.clip_grad)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item(), lr

    def forward_backward(self, batch: Batch) -> torch.Tensor:
        """Loss of ``batch`` and its gradients; returns the loss over the whole batch (detached)."""
        if self.cp is None:
            with self.autocast():  # the loss without the (B, S, V) logits: longctx.linear_cross_entropy
                loss = self.model(batch.inputs, labels=batch.labels, loss_mask=batch.loss_mask)
            loss.backward()
            return loss.detach()
        # Context parallelism: this rank's shard of every sequence, at its global positions. The loss this rank
        # differentiates is its part of the global mean; the one it reports is the global mean itself.
        inputs, labels, mask, pos = self.cp.shard_batch(batch.inputs, batch.labels, batch.loss_mask)
        with self.autocast():
            local_sum = self.model(inputs, position_ids=pos, labels=labels, loss_mask=mask, reduction="sum")
        count = labels.numel() if mask is None else mask.sum()
        loss, loss_report = self.cp.share_of_mean(local_sum, count)
        loss.backward()
        self.cp.allreduce_gradients(self.model)
        return loss_report.detach()

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean loss over ``eval_iters`` held-out batches; answer accuracy (recall) or bits per byte (text)."""
        cfg, model = self.cfg, self.model
        was_training = model.training
        model.eval()
        total_loss, total_tokens, correct = 0.0, 0.0, 0.0
        for i in range(cfg.eval_iters):
            b = self.task.batch(cfg.micro_batch_size, i, cfg.seed, "eval").to(self.device)
            mask = b.loss_mask if b.loss_mask is not None else torch.ones_like(b.labels, dtype=torch.bool)
            if self.cp is not None:
                inputs, labels, mask, pos = self.cp.shard_batch(b.inputs, b.labels, mask)
                with self.autocast():
                    logits = model(inputs, position_ids=pos)
                loss_sum, count, hits = self.cp.eval_stats(logits, labels, mask)
                total_loss, total_tokens, correct = total_loss + loss_sum, total_tokens + count, correct + hits
                continue
            with self.autocast():
                logits = model(b.inputs)
            total_loss += float(lm_loss(logits, b.labels, mask, reduction="sum"))
            total_tokens += float(mask.sum())
            correct += float(((logits.argmax(-1) == b.labels) & mask).sum())
        model.train(was_training)
        out = {"eval_loss": total_loss / max(total_tokens, 1.0)}
        if isinstance(self.task, RecallTask):
            out["recall_accuracy"] = correct / max(total_tokens, 1.0)
        else:
            out["bits_per_byte"] = out["eval_loss"] / math.log(2)
        return out

    # -- checkpoints ---------------------------------------------------------------------------------------

    def save(self, step: int, extra: dict[str, Any]) -> None:
        """Checkpoint after ``step`` steps (first rank only; nothing without ``--save``)."""
        if self.checkpoint_path is None or not self.is_writer:
            return
        save_training_state(
            self.checkpoint_path,
            step=step,
            model=self.model,
            optimizer=self.optimizer,
            model_config=self.model_config.to_dict(),
            train_config=self.cfg.to_dict(),
            extra=extra,
        )

    def _resume(self) -> int:
        cfg = self.cfg
        path = self.checkpoint_path if cfg.resume == "auto" else Path(cfg.resume)
        if path is None:
            raise ValueError("--resume without a path needs --save DIR (the checkpoint is DIR/checkpoint.pt)")
        start = load_training_state(path, self.model, self.optimizer, self.model_config.to_dict())
        if start > cfg.train_iters:
            raise ValueError(f"checkpoint is at step {start}, beyond --train-iters {cfg.train_iters}")
        return start

    # -- the loop ------------------------------------------------------------------------------------------

    def train(self) -> TrainResult:
        """Run from the start (or resumed) step to ``train_iters`` (or ``halt_after``); returns the result."""
        cfg, start = self.cfg, self.start_step
        stop = cfg.train_iters if cfg.halt_after is None else min(cfg.train_iters, cfg.halt_after)
        progress = Progress(cfg.train_iters, cfg.quiet, cfg.log_interval)
        progress.message(self._banner())
        metrics_path = Path(cfg.save) / "metrics.jsonl" if cfg.save and self.is_writer else None
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

        self.model.train()
        losses: list[float] = []
        last_eval: dict[str, float] = {}
        t0 = time.perf_counter()
        with MetricsLog(metrics_path) as metrics:
            for step in range(start, stop):
                loss, lr = self.train_step(step)
                losses.append(loss)
                done = step + 1
                elapsed = time.perf_counter() - t0
                record: dict[str, Any] = {"step": done, "loss": loss, "lr": lr}
                if self._eval_due(done):
                    last_eval = self.evaluate()
                    record.update(last_eval)
                metrics.write(record)
                tokens_per_second = self.tokens_per_step * (done - start) / max(elapsed, 1e-9)
                eta = elapsed / (done - start) * (stop - done)
                peak = peak_memory_bytes(self.device)
                text = step_line(loss, lr, tokens_per_second, peak, last_eval, elapsed, eta)
                progress.update(done, text, force="eval_loss" in record)
                if self.checkpoint_path and ((cfg.save_interval > 0 and done % cfg.save_interval == 0) or done == stop):
                    self.save(done, {"last_eval": last_eval})
        if self.cp is not None:
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
            tokens_per_second=self.tokens_per_step * len(losses) / max(elapsed, 1e-9),
            peak_memory_bytes=peak_memory_bytes(self.device),
            backend=self.backend,
            checkpoint=str(self.checkpoint_path) if self.checkpoint_path else None,
        )
        if stop < cfg.train_iters:
            progress.message(f"halted after step {stop} (--halt-after); continue with --resume")
        else:
            progress.message(self._summary(result, last_eval, stop))
        return result

    def _eval_due(self, done: int) -> bool:
        cfg = self.cfg
        periodic = cfg.eval_interval > 0 and done % cfg.eval_interval == 0
        return cfg.eval_iters > 0 and (periodic or done == cfg.train_iters)

    def _banner(self) -> str:
        cfg, mcfg = self.cfg, self.model_config
        if cfg.data:
            what = f"byte-level LM on {cfg.data}"
        else:
            what = (
                f"recall: {cfg.num_pairs} key-value pairs in {mcfg.seq_length} tokens, {cfg.num_queries} queries "
                f"(chance {1 / cfg.num_values:.1%})"
            )
        return (
            f"longctx train | {what} | GPT {cfg.preset}: {self.model.num_parameters() / 1e6:.2f}M params, "
            f"{mcfg.num_layers} layers, h={mcfg.hidden_size}, heads {mcfg.num_attention_heads}/{mcfg.kv_heads} | "
            f"attention {self.backend} | recompute {mcfg.recompute_granularity or 'none'} | {self.device}"
            + (" bf16" if self.use_bf16 else " fp32")
            + (f" | resumed at step {self.start_step}" if self.start_step else "")
        )

    def _summary(self, result: TrainResult, last_eval: dict[str, float], stop: int) -> str:
        cfg, losses = self.cfg, result.losses
        lines = [
            "",
            "summary",
            f"  steps             {result.first_step} -> {stop}  ({len(losses)} in this run, "
            f"{format_time(result.seconds)}, {result.tokens_per_second / 1e3:.1f}k tokens/s)",
            f"  final train loss  {losses[-1]:.4f}" if losses else "  final train loss  -",
        ]
        if result.eval_loss is not None:
            lines.append(f"  held-out loss     {result.eval_loss:.4f}")
        if "bits_per_byte" in last_eval:
            lines.append(f"  bits per byte     {last_eval['bits_per_byte']:.3f}")
        if result.recall_accuracy is not None:
            lines.append(
                f"  recall accuracy   {result.recall_accuracy:.1%} on held-out sequences "
                f"(chance {result.chance_accuracy:.1%}; "
                f"guessing among the {cfg.num_pairs} values present {1 / cfg.num_pairs:.1%})"
            )
        how = " (torch.cuda.max_memory_allocated)" if self.device.type == "cuda" else " (peak RSS of the process)"
        lines += [
            f"  peak memory       {format_bytes(result.peak_memory_bytes)}{how}",
            f"  attention         {self.backend}",
        ]
        if self.checkpoint_path:
            lines.append(f"  checkpoint        {self.checkpoint_path}")
        return "\n".join(lines)


# -- building blocks of the constructor ----------------------------------------------------------------------


def _init_context_parallel(ranks: int) -> tuple[int, torch.device]:
    """This process's rank and device under torchrun; ValueError unless the world size is ``ranks``."""
    from longctx.distributed.model import init_distributed

    rank, world, device = init_distributed()
    if world != ranks:
        raise ValueError(
            f"--context-parallel {ranks} needs as many processes, got world size {world}; "
            f"run: torchrun --nproc-per-node {ranks} -m longctx train --context-parallel {ranks} ..."
        )
    return rank, device


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but CUDA is not available; use --device cpu")
    return torch.device(name)


def _build_task(cfg: TrainConfig) -> tuple[RecallTask | ByteText, GPTConfig]:
    """The data and the model configuration that fits it (byte-level text sets the vocabulary to 256)."""
    if cfg.data:
        task = ByteText(cfg.data, cfg.model_config().seq_length)
        return task, cfg.model_config(vocab_size=ByteText.vocab_size)
    mcfg = cfg.model_config()
    recall = RecallTask(
        seq_length=mcfg.seq_length,
        vocab_size=mcfg.vocab_size,
        num_pairs=cfg.num_pairs,
        num_queries=cfg.num_queries,
        num_keys=cfg.num_keys,
        num_values=cfg.num_values,
    )
    return recall, mcfg


def _attention_probe(c: GPTConfig, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised q (1, Hq, S, D) and k/v (1, Hkv, S, D) of the model's attention, for `longctx.explain`."""
    q = torch.empty(1, c.num_attention_heads, c.seq_length, c.head_dim, device=device, dtype=dtype)
    kv = torch.empty(1, c.kv_heads, c.seq_length, c.head_dim, device=device, dtype=dtype)
    return q, kv


def _default_backend(mcfg: GPTConfig, device: torch.device, use_bf16: bool) -> str:
    """The attention backend when none was configured: our Triton kernels on a GPU where they run the model's
    attention (the point of this command), else ``auto``. ``--attention-backend auto`` picks the fastest
    backend for the inputs instead (cuDNN through SDPA, for plain causal attention on the H100)."""
    if device.type != "cuda":
        return "auto"
    q, kv = _attention_probe(mcfg, device, torch.bfloat16 if use_bf16 else torch.float32)
    try:
        explain(q, kv, kv, causal=True, backend="triton")
    except ValueError:
        return "auto"
    return "triton"


def _chosen_backend(model: GPT, device: torch.device, dtype: torch.dtype) -> str:
    """The backend that will run the model's attention; ValueError (with the reasons) if the configured one can't."""
    c = model.config
    q, kv = _attention_probe(c, device, dtype)
    try:
        return explain(q, kv, kv, causal=True, backend=c.attention_backend).backend.name
    except ValueError as e:
        raise ValueError(f"attention backend {c.attention_backend!r}: {e}") from e


# -- entry points ------------------------------------------------------------------------------------------


def run(cfg: TrainConfig) -> TrainResult:
    """Train as configured.

    Args:
        cfg: the settings (`parse_config` reads them from a command line).

    Returns:
        The losses of the steps run in this process and the final figures.

    Raises:
        ValueError: bad settings or data (CheckpointError, a ValueError, for unusable checkpoints).
    """
    return Trainer(cfg).train()


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``longctx train``; returns the exit status (2 for bad settings or checkpoints)."""
    try:
        run(parse_config(argv))
    except (ValueError, TypeError) as e:  # includes CheckpointError
        print(f"longctx train: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nlongctx train: interrupted; the last checkpoint is intact (continue with --resume)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

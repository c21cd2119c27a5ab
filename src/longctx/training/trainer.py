"""`longctx train`: train a GPT on the embedded long-context recall task (default) or a text file.

    longctx train                                   # CPU: a few minutes, recall accuracy far above chance
    longctx train --config configs/recall_cpu.yaml  # the same from YAML
    longctx train --data book.txt --train-iters 2000
    longctx train --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
    longctx train --save runs/x --resume            # continue from runs/x/checkpoint.pt
    torchrun --nproc-per-node 2 -m longctx train --context-parallel 2
    torchrun --nproc-per-node 8 -m longctx train --data-parallel 4 --context-parallel 2
    longctx train --data book.txt --doc-separator '\n\n'   # packed documents: attention and RoPE per document

AdamW with linear warmup and cosine decay to ``min_lr``, gradient clipping, bf16 autocast on CUDA, evaluation
on held-out data, a progress line (loss, tokens/s, peak memory), checkpoints written atomically, and
``--resume`` that continues to the same losses as an uninterrupted run. Settings: `longctx.training.config`.

What protects the work of a run:

- SIGINT (Ctrl-C) and SIGTERM (how clusters preempt jobs) end the current step, write a checkpoint and exit with
  130 / 143, saying where the checkpoint is; a second signal abandons the step at once (the last checkpoint
  written stays intact). Under context parallelism the ranks agree on the step to stop after.
- The ``--save`` folder belongs to one run: a fresh run refuses a folder holding another run's checkpoint or
  metrics unless ``--resume`` (continue it) or ``--overwrite`` (delete them first).
- A non-finite loss or gradient norm stops the run before the optimiser step, naming the step, with a checkpoint
  of the last finite state (``--on-nonfinite skip`` skips such steps instead); no checkpoint with NaN or
  infinity is ever written, and checksums catch corrupted checkpoints on load.
- Under a mesh (data and/or context parallelism) every rank checks, before anything else, that all ranks run the
  same settings and that the world holds data_parallel x context_parallel ranks; checkpoints are sharded
  (`torch.distributed.checkpoint`) and resume on another number of ranks.

`Trainer` builds everything in its constructor (device, data, model, optimizer, the attention backend, context
parallelism, the resumed state); `Trainer.train_step` is one optimiser step; `Trainer.train` is the loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from longctx.layers.attention import DocumentAttention
from longctx.memory.measure import expandable_segments
from longctx.models.gpt import GPT, GPTConfig, lm_loss
from longctx.training.checkpoint import (
    load_sharded_state,
    load_training_state,
    remove_partial_dirs,
    remove_partial_files,
    save_sharded_state,
    save_training_state,
)
from longctx.training.config import TrainConfig, parse_config
from longctx.training.data import (
    Batch,
    RecallTask,
    document_positions,
    packed_cu_seqlens,
)
from longctx.training.metrics import (
    MetricsLog,
    Progress,
    RecentRate,
    format_bytes,
    format_time,
    peak_memory_bytes,
    plot_metrics,
    step_line,
)
from longctx.training.setup import (
    RUN_FILES,
    SHARDED_DIR,
    build_task,
    chosen_backend,
    default_backend,
    device_of,
    init_mesh_for,
    run_folder_error,
    world_size,
)

if TYPE_CHECKING:
    from longctx.distributed.documents import DocumentParallel
    from longctx.distributed.model import ContextParallel

__all__ = [
    "Trainer",
    "TrainResult",
    "NonFiniteError",
    "Abandoned",
    "run",
    "main",
    "lr_at",
    "build_optimizer",
    "cpu_threads",
]


class NonFiniteError(RuntimeError):
    """A step whose loss or gradient norm is NaN or infinite (with ``on_nonfinite="stop"``)."""


class Abandoned(BaseException):
    """A second SIGINT/SIGTERM during a step or a save: the step is abandoned, nothing more is written.

    A BaseException, like KeyboardInterrupt, so that no ``except Exception`` on the way swallows it.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _StopSignals:
    """While active, SIGINT and SIGTERM set `signum` (the loop stops after the step); a second one raises
    `Abandoned`. Handlers are installed only in the main thread (Python delivers signals there)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum is not None:
            raise Abandoned(signum)
        self.signum = signum

    def __enter__(self) -> _StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


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
    checkpoint: str | None = None  # the checkpoint this run wrote last (None if it wrote none)
    interrupted_by: int | None = None  # the signal (SIGINT/SIGTERM) that stopped the run early
    last_step: int = 0  # steps done when the run ended
    skipped_steps: list[int] = dataclasses.field(default_factory=list)  # steps skipped as non-finite


def lr_at(step: int, cfg: TrainConfig) -> float:
    """The learning rate of ``step``: linear warmup over lr_warmup_iters, then cosine to min_lr at train_iters."""
    if step < cfg.lr_warmup_iters:
        return cfg.lr * (step + 1) / cfg.lr_warmup_iters
    span = max(1, cfg.train_iters - cfg.lr_warmup_iters)
    frac = min(1.0, (step - cfg.lr_warmup_iters) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * frac))


def cpu_threads(mcfg: GPTConfig) -> int | None:
    """The torch thread count for training ``mcfg`` on the CPU: 1 for small models, None (torch's default) else.

    Small models (hidden size below 256) do GEMMs too small for intra-op threads to pay for their
    synchronisation, and on a machine shared with other jobs the threads wait for each other: docs/training.md
    (CPU threads) has the measurement. The `Trainer` applies it (``torch.set_num_threads``, for the
    process) unless ``OMP_NUM_THREADS`` is set, which then decides.
    """
    return 1 if mcfg.hidden_size < 256 else None


def build_optimizer(
    model: torch.nn.Module, cfg: TrainConfig, device: torch.device, fused: bool | None = None
) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norms and biases); fused on CUDA unless ``fused=False``
    (FSDP2's sharded parameters take the foreach implementation)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = device.type == "cuda" if fused is None else fused
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), fused=fused)


class Trainer:
    """A training run: everything built from a `TrainConfig`, then `train`.

    Under a mesh (``data_parallel * context_parallel > 1``, or a torchrun world of several processes) the ranks form
    a 2D DeviceMesh ("dp", "cp") (`longctx.distributed.mesh`): every rank builds the same model, FSDP2 shards it
    over "dp" (with one dp rank it stays whole, gradients all-reduced over "cp"), each dp rank reads its
    ``micro_batch_size`` sequences of the global batch of the step and each rank of a cp group computes its shard of
    them; the loss is the token-weighted mean over the global batch. Checkpoints are sharded
    (``<save>/checkpoint/step-N``, written by every rank); only the first rank writes metrics and the progress line.

    Args:
        cfg: the run's settings.

    Raises:
        ValueError: a device that is not available, a world size other than ``data_parallel *
            context_parallel``, ranks started with different settings (on every rank), an attention backend
            that cannot run the model, or data that does not fit the model.
        CheckpointError: ``cfg.resume`` names a checkpoint that is missing, corrupt or of another model.
    """

    def __init__(self, cfg: TrainConfig) -> None:
        self.rank = 0
        self.mesh: Any = None
        self.distributed = cfg.data_parallel * cfg.context_parallel > 1 or world_size() > 1
        if self.distributed:
            self.rank, self.device, self.mesh = init_mesh_for(cfg)
            if self.rank != 0:
                cfg = dataclasses.replace(cfg, quiet=True)
        else:
            self.device = device_of(cfg.device)
            folder_error = run_folder_error(cfg)
            if folder_error:
                raise ValueError(folder_error)
        self.cfg = cfg
        self.use_bf16 = cfg.bf16 if cfg.bf16 is not None else self.device.type == "cuda"
        torch.manual_seed(cfg.seed)  # the model's initial weights

        self.task, mcfg = build_task(cfg)
        threads = cpu_threads(mcfg) if self.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ else None
        if threads is not None:
            torch.set_num_threads(threads)
        if cfg.model.get("attention_backend") is None:
            mcfg = dataclasses.replace(mcfg, attention_backend=default_backend(mcfg, self.device, self.use_bf16))
        self.offload = cfg.offload_params  # parameters, gradients and optimizer states in host memory
        self.resident_units = cfg.offload_resident_units or 0  # of them, the units kept on the GPU
        if cfg.memory_budget is not None:  # the plan's memory settings replace the configured ones
            from longctx.layers.offload import host_memory_available
            from longctx.memory.plan import plan

            # the host memory this machine has available, unless bounded (every rank of the host shares it)
            host = cfg.host_memory_budget or host_memory_available()
            chosen = plan(mcfg, seq_length=mcfg.seq_length, budget=cfg.memory_budget,
                          micro_batch_size=cfg.micro_batch_size, host_budget=host,
                          data_parallel=cfg.data_parallel, context_parallel=cfg.context_parallel,
                          cp_method=cfg.context_parallel_method(),
                          offload_params=True if cfg.offload_params else None,
                          resident_units=cfg.offload_resident_units)  # fmt: skip
            mcfg, self.offload = chosen.config, chosen.offload_params
            self.resident_units = chosen.resident_units
            if not cfg.quiet:
                print(f"memory plan for {cfg.memory_budget}: {chosen.describe()} (predicted peak "
                      f"{chosen.memory.total / 2**30:.2f} GiB, host {chosen.memory.host_total / 2**30:.2f} GiB)",
                      flush=True)  # fmt: skip
        if self.offload and cfg.memory_budget is None:  # a plan checked the host already
            host_check(mcfg, cfg, self.distributed)
        if self.offload and not self.distributed:  # FSDP2 over a one-rank mesh keeps the states on the host
            from longctx.distributed.mesh import init_mesh

            self.mesh = init_mesh(1, 1, device_type=self.device.type)
            self.distributed = True
        self.model_config = mcfg
        if self.offload:  # FSDP2 moves each unit into its pinned host shard (apply_fsdp below)
            from longctx.distributed.offload import build_device
            from longctx.memory.plan import parameter_count

            with build_device(parameter_count(mcfg)[1], self.device):
                self.model = GPT(mcfg)
        else:
            self.model = GPT(mcfg).to(self.device)
        self.backend = chosen_backend(self.model, self.device, self.compute_dtype)
        self.cp: ContextParallel | None = None
        self.cp_docs: DocumentParallel | None = None  # context parallelism over packed documents
        self.doc_attention: DocumentAttention | None = None  # packed documents in one process (or cp size 1)
        self.dp_strategy: str | None = None  # "fsdp2" or "allreduce" under a mesh
        documents = cfg.doc_separator is not None
        if documents and not (self.distributed and cfg.context_parallel > 1):
            self.doc_attention = DocumentAttention(mcfg.attention_backend)
            self.model.set_core_attention(self.doc_attention)
            self.backend = f"packed documents (flash_attn_varlen_func, {self.doc_attention.varlen_backend})"
        if self.distributed:
            from longctx.distributed.mesh import apply_fsdp, cp_group
            from longctx.distributed.model import setup_context_parallel

            cp_method = cfg.context_parallel_method()
            if cfg.context_parallel > 1 and documents:  # the dispatcher plans every batch's documents
                from longctx.distributed.documents import setup_document_parallel

                self.cp_docs = setup_document_parallel(
                    self.model, group=cp_group(self.mesh), method=cp_method, ulysses_size=cfg.cp_ulysses_size
                )
                self.backend = (
                    f"context-parallel {cp_method} over packed documents (dispatch_plan) over "
                    f"{cfg.context_parallel} ranks ({self.cp_docs.cp_backend})"
                )
            elif cfg.context_parallel > 1:  # every rank holds the same initial weights: the seed is agreed
                self.cp = setup_context_parallel(
                    self.model, group=cp_group(self.mesh), method=cp_method, layout=cfg.cp_layout,
                    broadcast=False, ulysses_size=cfg.cp_ulysses_size,
                )  # fmt: skip
                self.cp.check_seq_len(mcfg.seq_length)
                self.backend = (
                    f"context-parallel {cp_method}/{cfg.cp_layout} over {cfg.context_parallel} ranks "
                    f"({self.cp.backend})"
                )
            # offloaded units compute in bf16 (FSDP2's mixed precision) under bf16, else in the parameters' dtype;
            # one data-parallel rank without offload keeps the parameters whole ("allreduce": nothing to shard)
            unit_dtype = torch.bfloat16 if self.offload and self.use_bf16 else None
            if cfg.dp_shard == "replicate" and self.offload:  # the plan of --memory-budget turned offloading on
                raise ValueError(
                    "the plan for --memory-budget offloads the parameters to host memory, which shards them: drop "
                    "--dp-shard replicate (or raise --memory-budget)"
                )
            if cfg.dp_shard == "replicate":  # whole parameters, gradients all-reduced over every rank
                self.dp_strategy = "allreduce"
            else:
                self.dp_strategy = apply_fsdp(
                    self.model,
                    self.mesh,
                    offload_params=self.offload,
                    param_dtype=unit_dtype,
                    resident_units=self.resident_units if self.offload else 0,
                )
            self.backend += f" | data-parallel {cfg.data_parallel} ({self.dp_strategy})"
        # on the host: torch's fused CPU AdamW; FSDP2's sharded GPU parameters: the foreach implementation; whole
        # parameters: fused on a GPU
        sharded = self.distributed and self.dp_strategy != "allreduce"
        fused = True if self.offload else False if sharded else None
        self.optimizer = build_optimizer(self.model, cfg, self.device, fused=fused)
        # offloaded: the CPU step on this rank's share of the host's cores (not torchrun's one thread), unit by unit
        # behind the next step's forward
        self.host_step = None
        if self.offload:
            from longctx.distributed.offload import OverlappedHostStep, step_on_host_threads

            step_on_host_threads(self.optimizer)
            self.host_step = OverlappedHostStep(self.optimizer, self.model)

        self.is_writer = self.rank == 0  # the rank that writes metrics (and the single-process checkpoint)
        self.checkpoint_path: Path | None = None
        if cfg.save:
            self.checkpoint_path = Path(cfg.save) / (SHARDED_DIR if self.distributed else "checkpoint.pt")
        if cfg.save and self.is_writer:
            folder = Path(cfg.save)
            remove_partial_files(folder / "checkpoint.pt")  # temporary files of a save that was killed
            remove_partial_dirs(folder / SHARDED_DIR)
            if cfg.overwrite:
                for name in RUN_FILES:
                    (folder / name).unlink(missing_ok=True)
                shutil.rmtree(folder / SHARDED_DIR, ignore_errors=True)
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()  # the run folder is clean before any rank reads or writes it
        self.start_step = self._resume() if cfg.resume else 0
        resumed_here = (
            cfg.resume and self.checkpoint_path and self._resume_path().resolve() == self.checkpoint_path.resolve()
        )
        self.saved_step: int | None = self.start_step if resumed_here else None  # the checkpoint in --save
        self.tokens_per_step = cfg.micro_batch_size * cfg.data_parallel * mcfg.seq_length  # the global batch
        self.last_step_skipped = False
        self.host_step_times: list[tuple[float, float]] = []  # offloaded: (host step s, of it not hidden s) a step

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
        """One optimiser step on the batch of ``step``; returns ``(training loss, learning rate)``.

        A loss or gradient norm that is NaN or infinite never reaches the weights: with ``on_nonfinite="stop"``
        it raises `NonFiniteError` (the weights stay those before the step), with ``"skip"`` the step is
        skipped (``last_step_skipped``) and its loss returned as it is.
        """
        cfg = self.cfg
        lr = lr_at(step, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        batch = self.task.batch(cfg.micro_batch_size * cfg.data_parallel, step, cfg.seed, "train").to(self.device)
        loss = self.forward_backward(batch)
        # max_norm=inf measures the norm without clipping; under a mesh the gradients are already reduced (and
        # the norm of sharded ones is reduced over the shards), so every rank takes the same decision
        max_norm = cfg.clip_grad if cfg.clip_grad > 0 else math.inf
        if self.host_step is not None:  # a norm over host shards on the host's cores; the clipping is the host step's
            from longctx.distributed.offload import clip_scale, host_grad_norm

            norm = host_grad_norm(self.model.parameters())
        else:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        loss_value = loss.item()
        self.last_step_skipped = not (math.isfinite(loss_value) and math.isfinite(grad_norm))
        if self.last_step_skipped:
            self.optimizer.zero_grad(set_to_none=True)
            if cfg.on_nonfinite == "stop":
                raise NonFiniteError(
                    f"step {step + 1}: the loss is {loss_value} and the gradient norm {grad_norm}; the run stopped "
                    f"before the optimizer step, so the weights are those after step {step}. Lower --lr, check "
                    "the data, or pass --on-nonfinite skip to skip such steps"
                )
            return loss_value, lr
        if self.host_step is not None:  # returns at once; each unit's next forward waits for its step
            self.host_step.step(grad_scale=clip_scale(grad_norm, max_norm))
            hs = self.host_step
            if hs.last_host_step_s is not None and hs.last_waited_s is not None:  # the step before this one's
                self.host_step_times.append((hs.last_host_step_s, hs.last_waited_s))
        else:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return loss_value, lr

    def finish_step(self) -> None:
        """Wait for the optimizer step still running behind this process (offloaded runs), so that the weights and
        the optimizer's states are those after the last step: before a checkpoint, an evaluation, and the end."""
        if self.host_step is not None:
            self.host_step.wait()

    def forward_backward(self, batch: Batch) -> torch.Tensor:
        """Loss of the global ``batch`` and its gradients; returns the loss over the whole batch (detached)."""
        if not self.distributed:
            inputs, labels, mask, pos = self._local_batch(batch.inputs, batch.labels, batch.loss_mask, batch.doc_starts)
            with self.autocast():  # the loss without the (B, S, V) logits: longctx.linear_cross_entropy
                loss = self.model(inputs, position_ids=pos, labels=labels, loss_mask=mask)
            loss.backward()
            return loss.detach()
        from longctx.distributed.mesh import reduce_gradients, share_of_mean

        # This dp rank's sequences; under CP this rank's shard of each, at its global positions. The loss this
        # rank differentiates is its part of the token mean over the global batch; the one it reports is that
        # mean itself.
        inputs, labels, mask, pos = self._local_batch(batch.inputs, batch.labels, batch.loss_mask, batch.doc_starts)
        with self.autocast():
            local_sum = self.model(inputs, position_ids=pos, labels=labels, loss_mask=mask, reduction="sum")
        count = labels.numel() if mask is None else mask.sum()
        loss, loss_report = share_of_mean(local_sum, count)
        loss.backward()
        reduce_gradients(self.model, self.mesh, self.dp_strategy)
        return loss_report.detach()

    def _local_batch(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        mask: torch.Tensor | None,
        doc_starts: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """This rank's part of a global (B, S) batch: its dp rank's rows, then its cp shard of them (with the
        (S/P,) global positions; None without CP).

        With documents (``doc_starts``): under CP the rows packed end to end and dispatched by mask area, each
        tensor (1, B S / P) with document-local positions; otherwise the rows themselves with their (B, S)
        document-local positions, the document attention set to their boundaries."""
        if self.distributed:
            from longctx.distributed.mesh import batch_rows

            inputs, labels, mask, doc_starts = (batch_rows(t, self.mesh) for t in (inputs, labels, mask, doc_starts))
        if doc_starts is not None:
            if self.cp_docs is not None:
                return self.cp_docs.shard_batch(inputs, labels, mask, doc_starts)
            self.doc_attention.set_documents(packed_cu_seqlens(doc_starts))
            return inputs, labels, mask, document_positions(doc_starts)
        if self.cp is None:
            return inputs, labels, mask, None
        return self.cp.shard_batch(inputs, labels, mask)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean loss over ``eval_iters`` held-out batches; answer accuracy (recall) or bits per byte (text)."""
        cfg, model = self.cfg, self.model
        self.finish_step()
        was_training = model.training
        model.eval()
        total_loss, total_tokens, correct = 0.0, 0.0, 0.0
        for i in range(cfg.eval_iters):
            b = self.task.batch(cfg.micro_batch_size * cfg.data_parallel, i, cfg.seed, "eval").to(self.device)
            mask = b.loss_mask if b.loss_mask is not None else torch.ones_like(b.labels, dtype=torch.bool)
            inputs, labels, pos = b.inputs, b.labels, None
            if self.distributed or b.doc_starts is not None:
                inputs, labels, mask, pos = self._local_batch(inputs, labels, mask, b.doc_starts)
            with self.autocast():
                logits = model(inputs, position_ids=pos)
            total_loss += float(lm_loss(logits, labels, mask, reduction="sum"))
            total_tokens += float(mask.sum())
            correct += float(((logits.argmax(-1) == labels) & mask).sum())
        if self.distributed:  # the sums over every rank's tokens
            import torch.distributed as dist

            stats = torch.tensor([total_loss, total_tokens, correct], dtype=torch.float64, device=self.device)
            dist.all_reduce(stats)
            total_loss, total_tokens, correct = stats.tolist()
        model.train(was_training)
        out = {"eval_loss": total_loss / max(total_tokens, 1.0)}
        if isinstance(self.task, RecallTask):
            out["recall_accuracy"] = correct / max(total_tokens, 1.0)
        else:
            out["bits_per_byte"] = out["eval_loss"] / math.log(2)
        return out

    # -- checkpoints ---------------------------------------------------------------------------------------

    def save(self, step: int, extra: dict[str, Any]) -> None:
        """Checkpoint after ``step`` steps (nothing without ``--save``); records `saved_step`. Single process:
        ``checkpoint.pt``; under a mesh every rank writes its shards of ``checkpoint/step-N``.

        Raises:
            CheckpointError: the state holds NaN or infinity (nothing is written).
        """
        if self.checkpoint_path is None:
            return
        self.finish_step()
        # under a mesh every rank writes its shards; in one process the writer writes the single file
        save = save_sharded_state if self.distributed else save_training_state if self.is_writer else None
        if save is not None:
            save(
                self.checkpoint_path,
                step=step,
                model=self.model,
                optimizer=self.optimizer,
                model_config=self.model_config.to_dict(),
                train_config=self.cfg.to_dict(),
                extra=extra,
            )
        self.saved_step = step

    def checkpoint_note(self) -> str:
        """Where the last checkpoint of this run is, or that there is none: what a message after a stop promises."""
        if self.checkpoint_path is None:
            return "no checkpoint: --save is none"
        if self.saved_step is None:
            return f"no checkpoint was written in {self.checkpoint_path.parent}"
        return f"the checkpoint {self.checkpoint_path} (step {self.saved_step}) is intact; continue with --resume"

    def _resume_path(self) -> Path | None:
        return self.checkpoint_path if self.cfg.resume == "auto" else Path(self.cfg.resume)

    def _resume(self) -> int:
        cfg = self.cfg
        path = self._resume_path()
        if path is None:
            raise ValueError("--resume without a path needs --save DIR (the checkpoint is DIR/checkpoint.pt)")
        if path.is_dir():  # a sharded checkpoint, written on any number of ranks
            start = load_sharded_state(path, self.model, self.optimizer, self.model_config.to_dict())
        else:  # a single process's file: every rank reads it and takes its shard
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
        self._compile_ahead(progress)  # before the peak-memory count starts: its tensors are not the run's
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

        self.model.train()
        losses: list[float] = []
        skipped: list[int] = []
        last_eval: dict[str, float] = {}
        interrupted_by: int | None = None
        done = start
        t0 = time.perf_counter()
        recent = RecentRate()
        recent.mark(done, t0)
        with _StopSignals() as signals, MetricsLog(metrics_path, start if cfg.resume else None) as metrics:
            for step in range(start, stop):
                try:
                    loss, lr = self.train_step(step)
                except NonFiniteError as e:
                    self.save(step, {"last_eval": last_eval})  # the last finite state: resumable with skip
                    raise NonFiniteError(f"{e}. {self.checkpoint_note()}") from None
                losses.append(loss)
                done = step + 1
                elapsed = time.perf_counter() - t0
                recent.mark(done, t0 + elapsed)
                record: dict[str, Any] = {"step": done, "loss": loss, "lr": lr}
                if self.last_step_skipped:
                    skipped.append(done)
                    record["loss"] = loss if math.isfinite(loss) else None
                    record["skipped"] = "non-finite loss or gradient"
                    progress.message(f"step {done}: non-finite loss or gradient ({loss}); step skipped")
                if self._eval_due(done):
                    t_eval = time.perf_counter()
                    last_eval = self.evaluate()
                    record.update(last_eval)
                    recent.skip(time.perf_counter() - t_eval)  # evaluation is not training throughput
                metrics.write(record)
                tokens_per_second = self.tokens_per_step * recent.steps_per_second()  # the last steps' rate
                eta = elapsed / (done - start) * (stop - done)
                peak = peak_memory_bytes(self.device)
                text = step_line(loss, lr, tokens_per_second, peak, last_eval, elapsed, eta)
                progress.update(done, text, force="eval_loss" in record)
                interrupted_by = self._agreed_signal(signals.signum)
                periodic = cfg.save_interval > 0 and done % cfg.save_interval == 0
                if self.checkpoint_path and (periodic or done == stop or interrupted_by):
                    self.save(done, {"last_eval": last_eval})
                if interrupted_by:
                    break
            self.finish_step()
            if self.distributed:
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
            checkpoint=str(self.checkpoint_path) if self.checkpoint_path and self.saved_step is not None else None,
            interrupted_by=interrupted_by,
            last_step=done,
            skipped_steps=skipped,
        )
        if metrics_path is not None:
            png, why_not = plot_metrics(metrics_path)
            progress.message(f"loss curve: {png}" if png else f"note: {why_not}")
        # after a signal, main() says where the checkpoint is, on stderr (even with --quiet)
        if not interrupted_by and start >= stop and cfg.halt_after is not None and start > 0:
            # on stderr even with --quiet: a run that trained nothing must not look like one that did
            print(
                f"nothing trained: the run is already at step {start}, past --halt-after {cfg.halt_after}; "
                f"{self.checkpoint_note()}",
                file=sys.stderr,
            )
        elif not interrupted_by and stop < cfg.train_iters:
            progress.message(f"halted after step {stop} (--halt-after); {self.checkpoint_note()}")
        elif not interrupted_by:
            progress.message(self._summary(result, last_eval, stop))
        return result

    def _compile_ahead(self, progress: Progress) -> None:
        """Compile, before the first step and concurrently, the attention kernels of the length this run calls
        attention at (`longctx.warmup` with the model's heads, head dim, dtype, mask and backend), so that no step
        stalls on a compile. Only on a GPU with bf16 compute and one process's attention (context parallelism
        calls the kernels on its ranks' chunks), with a backend that runs longctx's kernels ("auto", "triton",
        "triton_sparse"; the others compile nothing of longctx's, and "math" would materialise the scores)."""
        cfg, mcfg = self.cfg, self.model_config
        if not cfg.compile_ahead or self.device.type != "cuda" or self.compute_dtype != torch.bfloat16:
            return
        if mcfg.attention_backend not in ("auto", "triton", "triton_sparse"):
            return
        if self.cp is not None or self.cp_docs is not None:
            return
        from longctx.warmup import warmup

        documents = self.doc_attention is not None
        # the one length training calls attention at: packed documents run as one varlen call over the
        # micro-batch's tokens
        length = mcfg.seq_length * (cfg.micro_batch_size if documents else 1)
        report = warmup(
            head_dim=mcfg.head_dim,
            n_heads=mcfg.num_attention_heads,
            n_kv_heads=mcfg.kv_heads,
            dtype=self.compute_dtype,
            masks=["documents"] if documents else ["causal"],
            max_seq_len=max(16, length),
            lengths=[length],
            backend=mcfg.attention_backend,
            device=self.device,
        )
        t0 = time.perf_counter()
        pointwise = self._compile_pointwise_ahead(documents)
        pointwise_s = time.perf_counter() - t0
        torch.cuda.empty_cache()  # the warm-up's tensors, not kept from training
        failed = [n for n, _ in report.failed] + [n for n, _, err in pointwise if err]
        failed_note = f"; did not compile: {', '.join(failed)}" if failed else ""
        progress.message(
            f"kernels compiled ahead: {len(report.kernels)} of attention in {report.seconds:.1f} s, "
            f"{len(pointwise)} position-wise in {pointwise_s:.1f} s (--compile-ahead false skips this){failed_note}"
        )

    def _compile_pointwise_ahead(self, documents: bool) -> list[tuple[str, float, str]]:
        """Compile the position-wise kernels (RMSNorm, rotary, SwiGLU: `longctx.ops.pointwise`) of the model's first
        layer and final norm, concurrently: their launches are recorded (`launchers.runtime.compile_ahead`) from
        one forward and backward of that layer on a stand-in sequence of 256 tokens (the kernels are not
        specialised on token counts: one binary serves every length), the core attention a stand-in that launches
        nothing, the positions shaped as training's. Only where the layer's parameters are plain tensors on this
        device (not FSDP2's shards: their forward would gather). Returns `compile_launches`' report."""
        from longctx.launchers.runtime import compile_ahead, compile_launches

        model = self.model
        layers = getattr(model, "layers", None)
        if not layers or not hasattr(model, "rotary") or not hasattr(model, "embedding"):
            return []
        layer = layers[0]
        params = [*layer.parameters(), *model.final_layernorm.parameters()]
        # by type: the run's device may be "cuda" where the parameters say "cuda:0"
        if any(hasattr(p, "to_local") or p.device.type != self.device.type for p in params):
            return []
        S = 256
        attn = layer.self_attention
        kept = attn.core_attention
        # (B, Hq, S, D) and no attention kernel; gradients for q and k both, so that the rotary backward of k's
        # heads (another BLOCK_H under GQA: another binary) is recorded too
        attn.core_attention = lambda q, k, v: q * 1.0 + (k.mean() + v.mean()) * 0.0
        try:
            with compile_ahead() as launches:
                with self.autocast():
                    tokens = torch.zeros(1, S, dtype=torch.long, device=self.device)
                    positions = torch.arange(S, device=self.device)
                    cos, sin = model.rotary(positions.unsqueeze(0) if documents else positions)
                    x = model.embedding(tokens).detach().requires_grad_()
                    y = model.final_layernorm(layer(x, cos, sin))
                trainable = [p for p in params if p.requires_grad]
                torch.autograd.grad(y.float().sum(), [x, *trainable])  # returned, not accumulated into .grad
        finally:
            attn.core_attention = kept
        return compile_launches(launches, self.device)

    def _agreed_signal(self, signum: int | None) -> int | None:
        """The stop signal, agreed over every rank of the mesh (each may have seen it at another step)."""
        if not self.distributed:
            return signum
        import torch.distributed as dist

        flag = torch.tensor([signum or 0], dtype=torch.int64, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item()) or None

    def _eval_due(self, done: int) -> bool:
        cfg = self.cfg
        periodic = cfg.eval_interval > 0 and done % cfg.eval_interval == 0
        return cfg.eval_iters > 0 and (periodic or done == cfg.train_iters)

    def _banner(self) -> str:
        cfg, mcfg = self.cfg, self.model_config
        if cfg.data:
            what = f"byte-level LM on {cfg.data}"
            if cfg.doc_separator is not None:
                what += f" (packed documents ending in {cfg.doc_separator!r})"
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
        how = " (peak RSS of the process)"
        if self.device.type == "cuda":
            reserved = format_bytes(torch.cuda.max_memory_reserved(self.device))
            retries = torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0)
            # A retry: the allocator found no free block, released its cached ones and allocated again (a device
            # synchronisation each); with expandable segments this is how a fragmented cache gives memory back.
            again = f"; {retries} allocations retried after releasing the cache" if retries else ""
            how = f" (torch.cuda.max_memory_allocated; {reserved} reserved{again})"
        lines += [
            f"  peak memory       {format_bytes(result.peak_memory_bytes)}{how}",
            f"  attention         {self.backend}",
        ]
        if self.host_step_times:
            step_s = statistics.median(t for t, _ in self.host_step_times)
            waited = statistics.median(w for _, w in self.host_step_times)
            lines.append(f"  host step         {step_s:.2f} s a step (the AdamW step in host memory), {waited:.2f} s "
                         "of it not hidden behind the next forward")  # fmt: skip
        if self.checkpoint_path:
            lines.append(f"  checkpoint        {self.checkpoint_path}")
        return "\n".join(lines)


# -- entry points ------------------------------------------------------------------------------------------


def host_check(mcfg: GPTConfig, cfg: TrainConfig, distributed: bool) -> None:
    """Refuse, before anything is allocated, an ``offload_params`` run whose host memory (the ranks of this machine
    together: their shards of the states, their offloaded checkpoints, the processes) exceeds what the machine has
    available: a run that meets the limit later is killed by the kernel with its work, where this is a ValueError,
    on every rank together."""
    from longctx.layers.offload import host_memory_available
    from longctx.memory.plan import host_need

    avail = host_memory_available()
    ranks = cfg.data_parallel * cfg.context_parallel
    local = int(os.environ.get("LOCAL_WORLD_SIZE", ranks))  # the ranks sharing this machine's memory
    need = host_need(mcfg, True, ranks, cfg.micro_batch_size, mcfg.seq_length // cfg.context_parallel,
                     cfg.offload_resident_units or 0)  # fmt: skip
    need = need // ranks * local
    error = None
    if avail is not None and need > avail:
        error = (
            f"offload_params needs about {need / 2**30:.1f} GiB of host memory on this machine ({local} rank(s): "
            f"the float32 weights and gradients in pinned memory, AdamW's states"
            + (", the offloaded checkpoints" if mcfg.cpu_offloading else "")
            + f"), but {avail / 2**30:.1f} GiB is available: spread the states over more ranks "
            "(--data-parallel / --context-parallel), offload fewer checkpoints or use a shorter --seq-length, or "
            "pass --memory-budget to let the planner choose within both memories"
        )
    if distributed:
        from longctx.distributed.model import check_agreement

        check_agreement({}, error)  # the same verdict on every rank
    elif error:
        raise ValueError(error)


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


def _report(text: str) -> None:
    # One write per message: the ranks of a context-parallel run share stderr, and print() writes the text and
    # its newline separately, which interleaves two ranks' messages on one line.
    rank = os.environ.get("RANK") if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None
    prefix = f"[rank {rank}] " if rank is not None else ""
    sys.stderr.write(f"{prefix}longctx train: {text}\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``longctx train``; returns the exit status.

    0 when the run finished (or halted with ``--halt-after``); 2 for bad settings or checkpoints; 1 when a step
    was non-finite; 128 + the signal (130 for SIGINT, 143 for SIGTERM) when a signal stopped the run, after
    its checkpoint was written.
    """
    expandable_segments()  # the plan counts allocated bytes (a user's own PYTORCH_CUDA_ALLOC_CONF wins)
    trainer: Trainer | None = None
    previous = _abandon_on_sigterm()  # until the loop installs its own handlers: nothing to save yet
    try:
        cfg = parse_config(argv)
        trainer = Trainer(cfg)
        result = trainer.train()
    except (ValueError, TypeError) as e:  # includes CheckpointError
        _report(f"error: {e}")
        return 2
    except NonFiniteError as e:
        _report(f"error: {e}")
        return 1
    except (KeyboardInterrupt, Abandoned) as e:
        signum = e.signum if isinstance(e, Abandoned) else signal.SIGINT
        if trainer is None:
            _report(f"{signal.Signals(signum).name}: stopped during start-up; nothing was written")
        else:
            _report(f"{signal.Signals(signum).name}: stopped before a step could end; {trainer.checkpoint_note()}")
        return 128 + signum
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        _close_process_group()
    if result.interrupted_by:
        if trainer.is_writer:
            name = signal.Signals(result.interrupted_by).name
            _report(f"{name}: stopped after step {result.last_step}; {trainer.checkpoint_note()}")
        return 128 + result.interrupted_by
    return 0


def _abandon_on_sigterm() -> Any:
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum: int, frame: object) -> None:
        raise Abandoned(signum)

    return signal.signal(signal.SIGTERM, handler)


def _close_process_group() -> None:
    # A process that exits with its process group still open can abort in the group's destructor.
    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())

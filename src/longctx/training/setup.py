"""The building blocks of the `Trainer`'s constructor: the mesh and the agreement of the ranks, the device, the
data and its model shape, and the attention backend a run uses."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from longctx.api import explain
from longctx.models.gpt import GPT, GPTConfig
from longctx.training.config import TrainConfig
from longctx.training.data import ByteText, RecallTask, parse_separator

RUN_FILES = ("checkpoint.pt", "metrics.jsonl", "loss.png")  # what a run writes in its --save folder
SHARDED_DIR = "checkpoint"  # the folder of sharded checkpoints (step-N/) a run under a mesh writes in --save

__all__ = [
    "RUN_FILES",
    "SHARDED_DIR",
    "init_mesh_for",
    "world_size",
    "model_error",
    "run_folder_error",
    "device_of",
    "build_task",
    "default_backend",
    "chosen_backend",
]


def init_mesh_for(cfg: TrainConfig) -> tuple[int, torch.device, Any]:
    """This process's rank, its device and the ("dp", "cp") DeviceMesh under torchrun.

    Every rank first checks with the others (`check_agreement`, through `init_mesh`) that they run the same
    settings and that the world holds data_parallel x context_parallel ranks, and learns why any rank cannot
    start (a sequence length or head count the context-parallel size cannot split, the first rank's run folder),
    so each such case is the same ValueError on every rank instead of a hang.
    """
    from longctx.distributed.mesh import ParallelDims, init_mesh
    from longctx.distributed.model import init_distributed

    rank, world, device = init_distributed()
    dims = ParallelDims(cfg.data_parallel, cfg.context_parallel)
    errors = [dims.world_error(world), model_error(cfg), run_folder_error(cfg) if rank == 0 else None]
    settings = {**cfg.to_dict(), **cfg.model_config().to_dict()}
    local_error = next((e for e in errors if e), None)
    mesh = init_mesh(cfg.data_parallel, cfg.context_parallel, settings=settings, local_error=local_error)
    return rank, device, mesh


def world_size() -> int:
    """The number of processes: torch.distributed's world if initialised, else torchrun's WORLD_SIZE (or 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def model_error(cfg: TrainConfig) -> str | None:
    """Why the model cannot run at this context-parallel size (sequence length, heads, dropout), or None."""
    if cfg.context_parallel == 1:
        return None
    from longctx.distributed.sharding import check_divisible
    from longctx.distributed.ulysses import kv_replication

    mcfg = cfg.model_config()
    try:
        check_divisible(mcfg.seq_length, cfg.context_parallel, cfg.cp_layout, what="context-parallel sequence length")
        method = cfg.context_parallel_method()
        if method in ("ulysses", "ulysses_ring"):
            size = cfg.context_parallel if method == "ulysses" else cfg.cp_ulysses_size
            kv_replication(mcfg.num_attention_heads, mcfg.kv_heads, size)
    except ValueError as e:
        return str(e)
    if mcfg.attention_dropout > 0:
        return (
            f"context parallelism needs attention_dropout == 0, got {mcfg.attention_dropout}: the dropout path is a "
            "dense local attention that cannot see the keys of the other ranks; pass --attention-dropout 0"
        )
    if mcfg.recompute_skip_core_attention and cfg.memory_budget is None:  # a budget's plan replaces it
        return (
            "recompute_skip_core_attention does not apply under context parallelism: the context-parallel attention "
            "is recomputed with its layer; pass --recompute-skip-core-attention false (or --memory-budget, whose "
            "plan chooses the recomputation)"
        )
    return None


def run_folder_error(cfg: TrainConfig) -> str | None:
    """Why a fresh run may not start in ``cfg.save`` (it holds another run's files), or None."""
    if not cfg.save or cfg.resume or cfg.overwrite:
        return None
    folder = Path(cfg.save)
    found = [name for name in (*RUN_FILES[:2], SHARDED_DIR) if (folder / name).exists()]
    if not found:
        return None
    return (
        f"--save {folder} holds another run ({', '.join(found)}); continue it with --resume, start a new run "
        f"there with --overwrite (deletes {', '.join((*RUN_FILES, SHARDED_DIR))}), or pass another --save folder"
    )


def device_of(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but CUDA is not available; use --device cpu")
    return torch.device(name)


def build_task(cfg: TrainConfig) -> tuple[RecallTask | ByteText, GPTConfig]:
    """The data and the model configuration that fits it (byte-level text sets the vocabulary to 256)."""
    if cfg.data:
        sep = None if cfg.doc_separator is None else parse_separator(cfg.doc_separator)
        task = ByteText(cfg.data, cfg.model_config().seq_length, doc_separator=sep)
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


def default_backend(mcfg: GPTConfig, device: torch.device, use_bf16: bool) -> str:
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


def chosen_backend(model: GPT, device: torch.device, dtype: torch.dtype) -> str:
    """The backend that will run the model's attention; ValueError (with the reasons) if the configured one can't."""
    c = model.config
    q, kv = _attention_probe(c, device, dtype)
    try:
        return explain(q, kv, kv, causal=True, backend=c.attention_backend).backend.name
    except ValueError as e:
        raise ValueError(f"attention backend {c.attention_backend!r}: {e}") from e

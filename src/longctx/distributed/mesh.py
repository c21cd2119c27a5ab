"""Data parallelism x context parallelism on a 2D DeviceMesh (what ``longctx train --data-parallel N
--context-parallel P`` builds), and the same pieces for a training loop of one's own.

    mesh = init_mesh(data_parallel=2, context_parallel=4)          # torchrun --nproc-per-node 8; dims ("dp", "cp")
    cp = setup_context_parallel(model, group=cp_group(mesh))       # each cp group splits one sequence
    apply_fsdp(model, mesh)                                        # FSDP2 over "dp": layers, embeddings, root
    rows = batch_rows(global_batch.inputs, mesh)                   # this dp rank's sequences
    inputs, labels, mask, pos = cp.shard_batch(rows, ...)          # this cp rank's tokens of them
    local_sum = model(inputs, position_ids=pos, labels=labels, loss_mask=mask, reduction="sum")
    loss, loss_value = share_of_mean(local_sum, mask.sum())        # over every rank: token-weighted mean
    loss.backward()                                                # FSDP2 sums the gradients over "dp"
    reduce_gradients(model, mesh)                                  # ... and this sums them over "cp"
    optimizer.step()

Ranks are laid out dp-major: rank = dp_rank * P + cp_rank, so the ranks of one context-parallel group are
neighbours (one node, the fast links) and the data-parallel groups stride across nodes.

The loss of a step is the mean over every counted token of the global batch (dp * micro batch sequences), not a
mean of per-rank means: each rank differentiates (sum of its token losses) / (count over all ranks), and the sum
of the ranks' gradients is the single-process gradient of the whole batch. FSDP2 is set to sum (not average) in
its reduce-scatter for that reason.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from longctx.distributed.model import check_agreement, init_distributed
from longctx.dtypes import accumulation_dtype

__all__ = [
    "ParallelDims",
    "MESH_DIMS",
    "init_mesh",
    "dp_rank",
    "dp_group",
    "cp_group",
    "batch_rows",
    "apply_fsdp",
    "decoder_units",
    "fsdp_available",
    "share_of_mean",
    "reduce_gradients",
]

MESH_DIMS = ("dp", "cp")


@dataclass(frozen=True)
class ParallelDims:
    """How many ranks share the data (``data_parallel``) and each sequence (``context_parallel``).

    Raises:
        TypeError: a size that is not an int.
        ValueError: a size below 1.
    """

    data_parallel: int = 1
    context_parallel: int = 1

    def __post_init__(self) -> None:
        for name in ("data_parallel", "context_parallel"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int >= 1, got {value!r} ({type(value).__name__})")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}; 1 means no {name.replace('_', ' ')}ism")

    @property
    def world_size(self) -> int:
        """The number of processes the mesh needs: data_parallel * context_parallel."""
        return self.data_parallel * self.context_parallel

    def world_error(self, world_size: int) -> str | None:
        """Why a world of ``world_size`` processes cannot hold this mesh, or None."""
        if world_size == self.world_size:
            return None
        dp, cp = self.data_parallel, self.context_parallel
        return (
            f"--data-parallel {dp} x --context-parallel {cp} needs {self.world_size} processes, got world size "
            f"{world_size}; start {self.world_size} processes (torchrun --nnodes N --nproc-per-node M with N * M = "
            f"{self.world_size}) or choose sizes whose product is {world_size}"
        )

    def check_world(self, world_size: int) -> None:
        """Raise ValueError unless ``world_size == data_parallel * context_parallel``."""
        error = self.world_error(world_size)
        if error:
            raise ValueError(error)

    def rank_coords(self, rank: int) -> tuple[int, int]:
        """``(dp_rank, cp_rank)`` of a global rank in the dp-major layout."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        return divmod(rank, self.context_parallel)


def init_mesh(
    data_parallel: int = 1,
    context_parallel: int = 1,
    *,
    device_type: str | None = None,
    timeout: float | None = None,
    settings: dict[str, Any] | None = None,
    local_error: str | None = None,
):
    """The 2D DeviceMesh ``(data_parallel, context_parallel)`` with dims named ``("dp", "cp")``.

    Initialises torch.distributed from torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
    MASTER_PORT; NCCL on GPUs, gloo on the CPU) unless it is initialised already; a single process without them
    gets a one-rank gloo group. Before the mesh is built, every rank checks with the others (one collective with
    a timeout, `check_agreement`) that they asked for the same sizes and that the world holds them, so a wrong
    size is the same error on every rank instead of a hang.

    Args:
        data_parallel: ranks that see different sequences (parameters sharded over them by `apply_fsdp`).
        context_parallel: ranks that split each sequence.
        device_type: "cuda" or "cpu"; default: the device `init_distributed` chose.
        timeout: seconds the agreement waits for the other ranks (default: `check_agreement`'s).
        settings: more that must be equal on every rank (the model and training configuration), checked in the
            same collective.
        local_error: why this rank cannot start, or None; raised on every rank.

    Raises:
        TypeError, ValueError: sizes that are not ints >= 1; on every rank, a product that is not the world size,
            settings that differ between ranks, or a rank's ``local_error``.
    """
    dims = ParallelDims(data_parallel, context_parallel)
    if not dist.is_initialized() and "RANK" not in os.environ and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        # one process: gloo for CPU tensors, and NCCL for CUDA ones where FSDP2 runs on the GPU (its all-gathers
        # and reduce-scatters are collectives even over one rank)
        on_gpu = (device_type or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
        backend = "cpu:gloo,cuda:nccl" if on_gpu else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    _, world, device = init_distributed()
    check_agreement(
        {**(settings or {}), "data_parallel": data_parallel, "context_parallel": context_parallel},
        dims.world_error(world) or local_error,
        timeout=timeout,
    )
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type or device.type, (data_parallel, context_parallel), mesh_dim_names=MESH_DIMS)


def _check_mesh(mesh: Any) -> None:
    names = getattr(mesh, "mesh_dim_names", None)
    if names is None or tuple(names) != MESH_DIMS:
        raise TypeError(f"mesh must be the DeviceMesh of init_mesh (dims {MESH_DIMS}), got {mesh!r}")


def dp_rank(mesh: Any) -> int:
    """This process's index along "dp" (which part of the global batch it reads)."""
    _check_mesh(mesh)
    return mesh.get_local_rank("dp")


def dp_group(mesh: Any):
    """The process group of this rank's data-parallel peers (same cp rank, other sequences)."""
    _check_mesh(mesh)
    return mesh.get_group("dp")


def cp_group(mesh: Any):
    """The process group of this rank's context-parallel peers (the ranks splitting the same sequences)."""
    _check_mesh(mesh)
    return mesh.get_group("cp")


def batch_rows(x: torch.Tensor | None, mesh: Any) -> torch.Tensor | None:
    """This dp rank's rows of a global batch ``x`` (B, ...): rows ``[r * B/dp, (r + 1) * B/dp)`` (None passes).

    Raises:
        ValueError: B not divisible by the dp size.
    """
    if x is None:
        return None
    _check_mesh(mesh)
    n, r = mesh.size(0), mesh.get_local_rank("dp")
    if x.shape[0] % n:
        raise ValueError(
            f"the global batch has {x.shape[0]} sequences, not divisible by data_parallel={n}; "
            f"pass a multiple of {n} sequences (micro_batch_size sequences per dp rank)"
        )
    per = x.shape[0] // n
    return x[r * per : (r + 1) * per]


def fsdp_available() -> bool:
    """Whether FSDP2 (`torch.distributed.fsdp.fully_shard`) can be imported (torch >= 2.6)."""
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


def decoder_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards one by one, in the order they run: the input embedding (unless tied to the output
    projection, which then stays in the root with it) and every decoder layer.

    Knows the longctx GPT (``embedding``, ``layers``) and transformers' causal LMs, PEFT-wrapped or not
    (``get_input_embeddings()``, ``model.layers``).

    Raises:
        TypeError: a model with neither shape.
    """
    from longctx.models.gpt import GPT

    if isinstance(model, GPT):
        units: list[nn.Module] = list(model.layers)
        if not model.config.share_embeddings_and_output_weights:
            units.insert(0, model.embedding)
        return units
    layers = next(  # the decoder stack: transformers' XModel (under XForCausalLM, under PEFT's wrappers)
        (m.layers for m in model.modules() if isinstance(getattr(m, "layers", None), nn.ModuleList)), None
    )
    if layers is None:
        raise TypeError(
            f"offload_params shards a model layer by layer: expected a longctx GPT or a transformers causal LM with "
            f"model.layers, got {type(model).__name__}"
        )
    units = list(layers)
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if embed is not None and (output is None or output.weight is not embed.weight):
        units.insert(0, embed)
    return units


def _check_cpu_backend(mesh: Any) -> None:
    """Offloaded gradients are CPU DTensors: their norm (``clip_grad_norm_``) is a collective on CPU tensors, which
    a process group of NCCL alone cannot run. Say so before the first step rather than after its backward."""
    if mesh.size() == 1:
        return
    config = dist.get_backend_config(mesh.get_group())
    if "cpu:" not in config:
        raise ValueError(
            f"offload_params over {mesh.size()} ranks keeps gradients in host memory, and their collectives (the "
            f"gradient norm) need a CPU backend, but the process group has only {config!r}: initialise it with "
            'torch.distributed.init_process_group("cpu:gloo,cuda:nccl", device_id=...) (longctx.distributed.'
            "init_distributed and init_mesh do)"
        )


def apply_fsdp(
    model: torch.nn.Module,
    mesh: Any,
    *,
    offload_params: bool = False,
    param_dtype: torch.dtype | None = None,
    units: list[torch.nn.Module] | None = None,
    resident_units: int = 0,
) -> str:
    """Shard ``model`` over the "dp" dim: FSDP2 on each decoder layer, the embedding and the root; returns
    ``"fsdp2"``, ``"fsdp2-offload"``, or ``"allreduce"`` (parameters whole on every rank, gradients summed by
    `reduce_gradients` over every rank) where there is nothing to shard (one "dp" rank, no offload, no
    ``param_dtype``: FSDP2 would only add its hooks and copies around every unit) or FSDP2 is not importable.

    Each rank must hold the same initial parameters (the same seed, or `broadcast_parameters` first). A tied
    embedding (``share_embeddings_and_output_weights``) stays in the root unit, because the output projection
    reads it after the embedding's own forward. Gradients are summed over "dp" (divide factor 1): the loss of
    every rank is already its share of the global mean (`share_of_mean`).

    Args:
        model: a `longctx.GPT`, or any model whose units are given in ``units``.
        mesh: the ("dp", "cp") mesh of `init_mesh` (``init_mesh(1, 1)`` for one process).
        offload_params: FSDP2's CPU offload policy, sharded over every rank (the "dp" and "cp" dims flattened, as
            torchtitan shards over dp x cp: its reduce-scatter sums over both, so `reduce_gradients` has nothing
            left to do): this rank's shard of the fp32 parameters, their gradients and so the optimizer's states
            live in pinned host memory; each unit's parameters are copied to the GPU when
            it runs (the next unit's copy in flight behind the current unit's compute) and its gradients copied
            back after its backward. Build the optimizer after this call, on the CPU (`host_adamw`).
        param_dtype: the dtype the units compute in (FSDP2's mixed precision: bfloat16 halves the copies and the
            GPU bytes of the unsharded weights; gradients are reduced in float32); None keeps the parameters'.
        units: the modules sharded one by one, in the order they run (default: the GPT's embedding when untied,
            then its layers); the root holds what is left.
        resident_units: with ``offload_params``, how many units keep their shards of the parameters, gradients
            and optimizer states on the GPU, counted in the order the forward gathers them: the root (the output
            projection and final norm), then ``units`` in order. The rest are offloaded. A resident unit costs
            the GPU 16 bytes a parameter (its fp32 weight, gradient and AdamW's two states, this rank's shard) and
            saves the host as much; its copies and its optimizer step leave the host's critical path, and the
            next step's forward starts on it without waiting for the host's step (`OverlappedHostStep`). The
            planner picks it (`longctx.memory.plan`); ``model._longctx_resident_units`` keeps it.

    Raises:
        ValueError: ``offload_params`` where FSDP2 is not importable (there is no offload without it), or a
            ``resident_units`` that is not between 0 and the number of units + 1 (or not 0 without offload).
    """
    _check_mesh(mesh)
    if isinstance(resident_units, bool) or not isinstance(resident_units, int) or resident_units < 0:
        raise ValueError(f"resident_units must be an int >= 0, got {resident_units!r}")
    if resident_units and not offload_params:
        raise ValueError(
            f"resident_units={resident_units} keeps units on the GPU out of offloaded ones: pass offload_params=True, "
            "or resident_units=0"
        )
    if not offload_params and param_dtype is None and mesh["dp"].size() == 1:
        return "allreduce"
    if not fsdp_available():
        if offload_params:
            raise ValueError(
                "offload_params needs FSDP2 (torch.distributed.fsdp.fully_shard, torch >= 2.6), which this torch "
                f"({torch.__version__}) does not have; upgrade torch, or train without offload_params"
            )
        return "allreduce"
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    dp_mesh = mesh["dp", "cp"]._flatten("dp_cp") if offload_params else mesh["dp"]
    if offload_params:
        _check_cpu_backend(dp_mesh)
    if units is None:
        try:
            units = decoder_units(model)
        except TypeError:  # a model of one's own: its layers, if it has them
            units = list(getattr(model, "layers", []))
    if resident_units > len(units) + 1:
        raise ValueError(
            f"resident_units={resident_units} is more than the model's {len(units) + 1} units (the root and "
            f"{len(units)} sharded ones): pass at most {len(units) + 1}"
        )
    kw: dict[str, Any] = {}
    if param_dtype is not None:  # cast_forward_inputs=False: RoPE's float32 cos / sin stay float32
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32,
                                               cast_forward_inputs=False)  # fmt: skip
    offload = dict(kw, offload_policy=CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda")) if offload_params else kw
    resident = [model, *units][:resident_units]  # in the order the forward gathers them
    for unit in units:
        fully_shard(unit, mesh=dp_mesh, **(kw if any(unit is r for r in resident) else offload))
    fully_shard(model, mesh=dp_mesh, **(kw if resident_units else offload))
    if offload_params:
        model._longctx_resident_units = resident_units
    for module in [*units, model]:
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM
    if offload_params:
        # the next unit's copy to the GPU is issued before this one runs, in the forward and in the backward
        for unit, nxt in zip(units, units[1:]):
            unit.set_modules_to_forward_prefetch([nxt])
            nxt.set_modules_to_backward_prefetch([unit])
        return "fsdp2-offload"
    return "fsdp2"


def share_of_mean(
    local_sum: torch.Tensor, local_count: torch.Tensor | float, group=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, loss_value)`` from this rank's summed token loss and its number of counted tokens.

    ``loss`` = local_sum / (count over every rank of ``group``, default the world): differentiable, and the sum
    over ranks of these shares is the token-weighted mean of the global batch. ``loss_value`` is that mean
    (detached; float32, float64 for a float64 loss), the same on every rank.
    """
    count = torch.as_tensor(local_count, dtype=torch.float64, device=local_sum.device).detach()
    stats = torch.stack([local_sum.detach().to(torch.float64), count])
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(stats, group=group)
    total_sum, total_count = stats[0], stats[1].clamp_min(1.0)
    loss = local_sum / total_count.to(local_sum.dtype)
    value_dtype = accumulation_dtype(local_sum.dtype)
    return loss, (total_sum / total_count).to(value_dtype)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def reduce_gradients(model: torch.nn.Module, mesh: Any, strategy: str = "fsdp2") -> None:
    """Complete the gradient sum after ``loss.backward()``: over "cp" for FSDP2 (which summed over "dp"), over
    every rank for the ``"allreduce"`` strategy of `apply_fsdp`, nothing for ``"fsdp2-offload"``."""
    _check_mesh(mesh)
    if strategy == "fsdp2-offload":
        return  # sharded over dp x cp: FSDP2's reduce-scatter summed over every rank
    group = mesh.get_group("cp") if strategy == "fsdp2" else None
    size = mesh.size(1) if strategy == "fsdp2" else mesh.size()
    if size == 1:
        return
    grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for gs in by_dtype.values():  # one flat buffer per dtype: one all-reduce instead of one per parameter
        flat = torch.cat([g.reshape(-1) for g in gs])
        dist.all_reduce(flat, group=group)
        off = 0
        for g in gs:
            g.copy_(flat[off : off + g.numel()].view_as(g))
            off += g.numel()

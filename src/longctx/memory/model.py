"""The memory model: the bytes a training step of a longctx GPT holds at its peak, counted, not guessed.

`step_memory(config, seq_length=S)` builds the model with shape-only tensors (PyTorch's FakeTensorMode: every op
runs for its output's shape and dtype, nothing is allocated) and runs one whole forward and backward at the real
length under bf16 autocast, exactly as `longctx train` does, while `LiveBytesTracker` counts the bytes of every
tensor alive at each moment. So the recomputation, sequence chunking, offloading, the logits-free loss and the
float32 residual stream are modelled by the code that runs them, at any S, in a second or two on the CPU.

What the trace cannot run is replaced by a twin with the same memory: the attention kernels (their forward keeps q,
k, v, out and the float32 log-sum-exp; their backward holds dq, dk, dv, a float32 dQ accumulator and two float32
rows per query while it runs) and the fused RMSNorm, rotary and SwiGLU kernels (`longctx.ops.pointwise.twins`).
Under context parallelism (``context_parallel`` > 1) the trace runs on one rank's tokens and its core attention is
the method's own code (`distributed.attention.run_method`: the ring's accumulators and rotating receive buffers,
Ulysses' head-split copies, the all-gather's gathered K/V) with the kernels' twins and transfers that move nothing
(the receive buffers are allocated by the method itself). To the traced peak it adds the parameters, AdamW's two
states, and a fixed allowance for what the CUDA libraries allocate on their own (cuBLAS / cuDNN workspaces,
allocator rounding), calibrated on the H100 (docs/memory.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch

from longctx.dtypes import accumulation_dtype
from longctx.layers.recompute import plan_layers
from longctx.memory.measure import LiveBytesTracker
from longctx.models.gpt import GPT, GPTConfig

__all__ = ["StepMemory", "step_memory", "step_segments", "check_context_parallel", "CUDA_OVERHEAD_BYTES"]

# What the CUDA libraries and the caching allocator add to the tensors a step holds (cuBLAS and cuDNN workspaces,
# 512-byte rounding): calibrated against torch.cuda.max_memory_allocated on the H100 (docs/memory.md).
CUDA_OVERHEAD_BYTES = 256 << 20

# The host memory of a training process besides the states and checkpoints it offloads: the CUDA context, torch's
# libraries, the interpreter (calibrated against the measured 8B runs, one process and four under torchrun:
# docs/memory.md).
HOST_OVERHEAD_BYTES = 5 << 29  # 2.5 GiB

GiB = 1 << 30


# LoRA's usual targets, by their names in transformers' Llama family, and the longctx GPT linear each one is part of
# (the GPT fuses q, k, v into linear_qkv and gate, up into linear_fc1)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_LORA_PARTS = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
               "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2"}  # fmt: skip


def check_lora(rank: int | None, targets: tuple[str, ...]) -> None:
    """ValueError for a LoRA rank that is not a positive int or targets outside `LORA_TARGETS`."""
    if rank is None:
        return
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"lora_rank must be a positive int (the adapters' rank, e.g. 16), got {rank!r}")
    bad = [t for t in targets if t not in _LORA_PARTS]
    if bad or not targets:
        raise ValueError(f"lora_targets must be some of {list(LORA_TARGETS)}, got {list(targets)}")


def lora_parameters(c: GPTConfig, rank: int, targets: tuple[str, ...] = LORA_TARGETS) -> int:
    """Parameters of LoRA adapters of ``rank`` on ``targets`` of every layer, as PEFT counts them: A (rank, in) and
    B (out, rank) per target."""
    h, q, kv, F = c.hidden_size, c.num_attention_heads * c.head_dim, c.kv_heads * c.head_dim, c.ffn_size
    sizes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
             "gate_proj": (h, F), "up_proj": (h, F), "down_proj": (F, h)}  # fmt: skip
    return c.num_layers * rank * sum(sum(sizes[t]) for t in targets)


class _LoraTwin(torch.nn.Module):
    """The memory of PEFT's LoRA adapters on a frozen linear, one adapter per target fused into it (``shares``: each
    target's share of the linear's outputs and whether an adapter targets it). Each adapter runs as PEFT's
    ``lora.Linear`` runs it: the input cast to the adapters' float32 (a copy per target), A (autocast casts that
    copy back to bf16 and keeps it for A's gradient), B, times the scaling, added to its share of the output."""

    scaling = 2.0  # alpha / rank: its value does not change a byte

    def __init__(self, base: torch.nn.Linear, shares: list[tuple[int, bool]], rank: int) -> None:
        super().__init__()
        self.base, self.shares = base, shares
        widths = [w for w, targeted in shares if targeted]
        f32 = torch.float32
        self.lora_a = torch.nn.ParameterList(torch.empty(rank, base.in_features, dtype=f32) for _ in widths)
        self.lora_b = torch.nn.ParameterList(torch.empty(w, rank, dtype=f32) for w in widths)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        start, i = 0, 0
        for w, targeted in self.shares:
            if targeted:  # added in place: PEFT's sum replaces its target's base output, which is then freed
                a = torch.nn.functional.linear(x.to(torch.float32), self.lora_a[i])
                y[..., start : start + w] += torch.nn.functional.linear(a, self.lora_b[i]) * self.scaling
                i += 1
            start += w
        return y


def _add_lora(model: GPT, rank: int, targets: tuple[str, ...]) -> None:
    """Freeze ``model`` and put `_LoraTwin` adapters on the linears of ``targets`` (their gradients are counted
    apart, so each is dropped once made)."""
    model.requires_grad_(False)
    c = model.config
    q, kv, h, F = c.num_attention_heads * c.head_dim, c.kv_heads * c.head_dim, c.hidden_size, c.ffn_size
    fused = {"linear_qkv": [("q_proj", q), ("k_proj", kv), ("v_proj", kv)], "linear_proj": [("o_proj", h)],
             "linear_fc1": [("gate_proj", F), ("up_proj", F)], "linear_fc2": [("down_proj", h)]}  # fmt: skip
    for layer in model.layers:
        for owner in (layer.self_attention, layer.mlp):
            for name, parts in fused.items():
                shares = [(w, t in targets) for t, w in parts]
                if not hasattr(owner, name) or not any(targeted for _, targeted in shares):
                    continue
                base = getattr(owner, name)
                if sum(w for w, _ in shares) != base.out_features:  # not fused as above (an MLP without a gate)
                    shares = [(base.out_features, True)]
                setattr(owner, name, _LoraTwin(base, shares, rank))
    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))


def units_in_flight(layer_parameters: int, root_parameters: int, shards: int, param_bytes: int) -> int:
    """GPU bytes FSDP2 holds for an offloaded model at a step's peak (in a layer's backward): the root unit's
    weights (unsharded for the whole step) and its gradient (the output projection's, unsharded from the loss's
    backward until the root's own post-backward at the end of the step), the running layer's weights and the
    prefetched one's, and a finished layer's float32 gradient shard on its way to the host. ``param_bytes``: bytes
    of a weight as the units compute (2 for bf16). Read off the blocks live at the peak of llama-8b steps on an
    H200 (`dev/offload_peak.py`): by then the prefetched shard's float32 copy is cast and freed, and so are the
    finished layer's bf16 gradients and the reduce-scatter's float32 input."""
    n, w = layer_parameters, shards
    return (
        2 * param_bytes * root_parameters  # the root's weights and its gradient
        + 2 * param_bytes * n  # running and prefetched layers
        + 4 * n // w  # a finished layer's gradient shard (float32), before its copy to the host ends
    )


def pinned_block_bytes(nbytes: int) -> int:
    """Host bytes torch's pinned-memory allocator takes for a request of ``nbytes``: it rounds every block up to a
    power of two."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


# What a plan changes in a configuration; none of it changes a parameter's shape.
PLAN_FIELDS = (
    "recompute_granularity",
    "recompute_method",
    "recompute_num_layers",
    "recompute_skip_core_attention",
    "sequence_chunk_size",
    "cpu_offloading",
    "cpu_offloading_num_layers",
)


@dataclass(frozen=True)
class ParameterShapes:
    """The parameters of a GPT by where FSDP2 puts them, each as (shape, bytes an element): one decoder layer's (the
    layers are alike), the input embedding's (the output projection's too when tied) and the others' (the final
    norm, the untied output projection)."""

    num_layers: int
    layer: tuple[tuple[torch.Size, int], ...]
    embedding: tuple[tuple[torch.Size, int], ...]
    others: tuple[tuple[torch.Size, int], ...]

    def count(self, part: tuple[tuple[torch.Size, int], ...]) -> int:
        return sum(shape.numel() for shape, _ in part)

    def total(self) -> tuple[int, int]:
        """(parameters, their bytes) of the whole model."""
        parts = [*(self.layer * self.num_layers), *self.embedding, *self.others]
        return sum(s.numel() for s, _ in parts), sum(s.numel() * b for s, b in parts)


def parameter_shapes(config: GPTConfig) -> ParameterShapes:
    """`ParameterShapes` of ``GPT(config)``, from a one-layer model without storage (cached by shape: the planned
    settings, `PLAN_FIELDS`, and the length change no parameter)."""
    defaults = {f.name: f.default for f in dataclasses.fields(GPTConfig) if f.name in PLAN_FIELDS}
    one = _one_layer_shapes(config.replace(num_layers=1, seq_length=1, **defaults))
    return dataclasses.replace(one, num_layers=config.num_layers)


@functools.lru_cache(maxsize=16)
def _one_layer_shapes(config: GPTConfig) -> ParameterShapes:
    with torch.device("meta"):
        model = GPT(config)
    layer = {id(p) for p in model.layers[0].parameters()}
    embedding = id(model.embedding.weight)

    def of(keep) -> tuple[tuple[torch.Size, int], ...]:
        return tuple((p.shape, p.element_size()) for p in model.parameters() if keep(id(p)))

    return ParameterShapes(1, of(lambda i: i in layer), of(lambda i: i == embedding),
                           of(lambda i: i not in layer and i != embedding))  # fmt: skip


def offloaded_state_bytes(
    config: GPTConfig, shards: int, optimizer_bytes_per_parameter: int = 8, resident_units: int = 0
) -> int:
    """Host bytes of one rank's states with ``offload_params``: for every parameter, its dim-0 shard (padded to a
    multiple of ``shards``, as FSDP2 shards) as the float32 weight and the float32 gradient FSDP2 copies back, each
    a pinned block (`pinned_block_bytes`: the up and down projections of llama-8b, 224 MiB each, take 256), and
    the optimizer's states (pageable). Counted on a model without storage (the layers are alike: one stands for
    all). The units kept on the GPU (``resident_units``, `resident_split`) hold none of it."""
    ps = parameter_shapes(config)
    root, embedding, layers = resident_split(config, resident_units)

    def host(part: tuple[tuple[torch.Size, int], ...]) -> int:
        return host_state_bytes([shape for shape, _ in part], shards, optimizer_bytes_per_parameter)

    return ((ps.num_layers - layers) * host(ps.layer) + (0 if embedding else host(ps.embedding))
            + (0 if root else host(ps.others)))  # fmt: skip


def resident_units_of(config: GPTConfig) -> int:
    """How many units an offloaded ``GPT(config)`` has to keep resident (`resident_split`): the root, the embedding
    when untied, the layers."""
    return 1 + (0 if config.share_embeddings_and_output_weights else 1) + config.num_layers


def resident_split(config: GPTConfig, resident_units: int) -> tuple[bool, bool, int]:
    """Which parts of ``GPT(config)`` ``resident_units`` keeps on the GPU (`longctx.distributed.mesh.apply_fsdp`,
    counted in the order the forward gathers the units: the root with the final norm and the output projection,
    the embedding when untied, the layers from the first): (the root, the embedding, how many layers). A tied
    embedding is the root's."""
    n = resident_units_of(config)
    if isinstance(resident_units, bool) or not isinstance(resident_units, int) or not 0 <= resident_units <= n:
        raise ValueError(f"resident_units must be an int from 0 to {n} (the model's units), got {resident_units!r}")
    tied = config.share_embeddings_and_output_weights
    root = resident_units >= 1
    embedding = root if tied else resident_units >= 2
    return root, embedding, max(0, resident_units - (1 if tied else 2))


def resident_shard_elements(config: GPTConfig, resident_units: int, shards: int) -> tuple[int, int, int]:
    """One rank's elements of the resident units' parameters (dim-0 shards, padded as FSDP2 pads): (the root's with
    a tied embedding, the untied embedding's, one layer's); zero for a part not resident."""
    ps = parameter_shapes(config)
    root, embedding, layers = resident_split(config, resident_units)

    def elements(part: tuple[tuple[torch.Size, int], ...]) -> int:
        return sum(shard_elements(shape, shards) for shape, _ in part)

    tied = config.share_embeddings_and_output_weights
    return (
        elements(ps.others + (ps.embedding if tied else ())) if root else 0,
        elements(ps.embedding) if embedding and not tied else 0,
        elements(ps.layer) if layers else 0,
    )


def shard_elements(shape: torch.Size, shards: int) -> int:
    """Elements of one rank's FSDP2 shard of a parameter of ``shape``: its dim 0 split over ``shards``, padded up."""
    rows = shape[0] if len(shape) else 1
    return -(-rows // shards) * (shape.numel() // max(rows, 1))


def host_state_bytes(shapes: list[torch.Size], shards: int, optimizer_bytes_per_parameter: int = 8) -> int:
    """Host bytes of one rank's offloaded states of parameters of these ``shapes`` (`offloaded_state_bytes`: each
    dim-0 shard's float32 weight and gradient in pinned blocks, the optimizer's states pageable)."""

    def host(shape: torch.Size) -> int:
        shard = shard_elements(shape, shards)
        return 2 * pinned_block_bytes(4 * shard) + optimizer_bytes_per_parameter * shard

    return sum(map(host, shapes))


@dataclass(frozen=True)
class StepMemory:
    """The predicted peak of one training step, in bytes, with where it goes.

    ``total`` = parameters + optimizer_states + traced (every tensor the forward and backward hold at their peak,
    the gradients included) + overhead. The itemised parts of ``traced`` are counted from the plan
    (checkpoints, kept attention outputs, gradients); ``working_set`` is the rest at the peak: one layer's
    recomputation and backward, the attention kernels' workspace and the loss's chunk; ``freed_before_peak`` the
    checkpoints no longer held when the peak comes late in the backward (the gradients and the checkpoints of a
    whole model are never all held at once).
    """

    seq_length: int
    micro_batch_size: int
    parameters: int
    gradients: int
    optimizer_states: int
    checkpoints: int
    kept_attention: int
    working_set: int
    overhead: int
    host_offloaded: int  # pinned host memory for offloaded checkpoints, not on the GPU
    traced: int
    # offload_params: the GPU holds the units in flight (``parameters``: bf16 weights, their gradients and the
    # copies between), the host this rank's shard of the fp32 weights, gradients and AdamW states
    offload_params: bool = False
    host_states: int = 0
    resident_units: int = 0  # offload_params: units whose states stay on the GPU (`resident_split`)
    resident_bytes: int = 0  # their fp32 weights, gradients and AdamW states (16 bytes a parameter of the shard)
    host_overhead: int = 0  # the process's own host memory (libraries, the CUDA context)
    lora: bool = False  # a LoRA run: the parameters are the frozen base and the adapters, only these train
    # checkpoints already freed when the peak comes (each layer's backward frees its checkpoint as its gradients
    # arrive, so the two never all coexist): subtracted in `rows`
    freed_before_peak: int = 0

    @property
    def total(self) -> int:
        """Predicted GPU peak."""
        return self.parameters + self.optimizer_states + self.traced + self.overhead

    @property
    def first_step_peak(self) -> int:
        """Predicted GPU peak of a first step, before AdamW's states exist: the forward and backward's peak without
        the states, or the optimizer step where the states are created beside every weight and gradient (with the
        activations gone; offloaded, only the resident units' are on the GPU then), whichever is higher."""
        if self.offload_params:
            at_step = self.resident_bytes + self.overhead
        else:
            at_step = self.parameters + self.gradients + self.optimizer_states + self.overhead
        return max(self.total - self.optimizer_states, at_step)

    @property
    def host_total(self) -> int:
        """Predicted host peak: offloaded states and checkpoints, and the process itself."""
        return self.host_states + self.host_offloaded + self.host_overhead

    def rows(self) -> list[tuple[str, int]]:
        """(item, bytes) for a table, summing to ``total``."""
        if self.offload_params and self.resident_units:
            first = [
                ("units in flight (bf16 weights, gradients, host copies); resident units' fp32 weights",
                 self.parameters),
                ("gradients (resident units' fp32; the others copied to the host per unit)", self.gradients),
                ("optimizer states (resident units'; the others on the host)", self.optimizer_states),
            ]  # fmt: skip
        elif self.offload_params:
            first = [
                ("units in flight (bf16 weights, gradients, host copies)", self.parameters),
                ("gradients (reduced and copied to the host per unit)", self.gradients),
                ("optimizer states (on the host)", self.optimizer_states),
            ]
        elif self.lora:
            first = [
                ("parameters (frozen bf16 base, fp32 adapters)", self.parameters),
                ("gradients (adapters)", self.gradients),
                ("optimizer states (adapters, AdamW)", self.optimizer_states),
            ]
        else:
            first = [
                ("parameters (fp32)", self.parameters),
                ("gradients (fp32)", self.gradients),
                ("optimizer states (AdamW, fp32)", self.optimizer_states),
            ]
        return first + [
            ("checkpoints (layer inputs kept for recompute)", self.checkpoints),
            ("kept attention outputs and lse", self.kept_attention),
            ("activations at the peak (layers kept whole, the layer in backward, kernel workspace)", self.working_set),
        ] + ([("less checkpoints freed before the peak (their layers' gradients took their place)",
               -self.freed_before_peak)] if self.freed_before_peak else []) + [
            ("CUDA libraries and allocator", self.overhead),
        ]  # fmt: skip


class _FlashTwin(torch.autograd.Function):
    """The memory of a flash attention call: keeps q, k, v, out and lse; its backward holds dq, dk, dv, a float32
    dQ accumulator and two float32 rows (Delta, base-2 lse) per query while it runs."""

    @staticmethod
    def forward(ctx, q, k, v):
        out, lse = _twin_forward(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return _twin_backward(dout, q, k, v, out, lse)


def _twin_forward(q, k, v, **_):
    B, Hq, S, _ = q.shape
    return torch.empty_like(q), q.new_empty((B, Hq, S), dtype=torch.float32)


def _twin_backward(dout, q, k, v, out, lse, grad_dtype=None, **_):
    """dq, dk, dv in the inputs' dtypes (or ``grad_dtype``), with the kernels' workspace while they run: a float32
    dQ accumulator and two float32 rows per query."""
    dq, dk, dv = (t.new_empty(t.shape, dtype=grad_dtype or t.dtype) for t in (q, k, v))
    work = [q.new_empty(q.shape, dtype=torch.float32), lse.new_empty(lse.shape), lse.new_empty(lse.shape)]
    del work
    return dq, dk, dv


class _TwinLaunchers:
    forward = staticmethod(_twin_forward)
    backward = staticmethod(_twin_backward)


def _twin_attention(q, k, v):
    return _FlashTwin.apply(q, k, v)


_twin_attention.backend = "twin"  # marks the default (fused) core attention: kept-attention recompute applies

# The context-parallel methods whose buffers the trace runs (their sizes do not depend on the data); "p2p" and
# "ulysses_ring" are traced as the ring (p2p receives at most what the ring passes on; the hybrid rings across groups).
CP_TRACED = ("ring", "allgather", "ulysses")


def _cp_twin_backward(dout, q, k, v, out, lse, **_):
    """The context-parallel launchers' backward (`launchers.select`): `_twin_backward` with dq, dk, dv in the
    accumulation dtype (partial sums that the method adds up across ranks)."""
    adt = accumulation_dtype(q.dtype)
    return _twin_backward(dout, q, k, v, out, lse, grad_dtype=adt)


def check_context_parallel(config: GPTConfig, context_parallel: int, cp_method: str) -> None:
    """A context-parallel size and method the trace can run for ``config``; ValueError naming what is wrong."""
    from longctx.distributed.attention import METHODS

    if isinstance(context_parallel, bool) or not isinstance(context_parallel, int) or context_parallel < 1:
        raise ValueError(f"context_parallel must be a positive int, got {context_parallel!r}")
    if cp_method not in (*METHODS, "p2p"):
        raise ValueError(f"cp_method must be one of {(*METHODS, 'p2p')}, got {cp_method!r}")
    if context_parallel > 1 and config.recompute_skip_core_attention:
        raise ValueError(
            "recompute_skip_core_attention does not apply under context parallelism (the context-parallel "
            "attention is recomputed with its chunk): plan it with recompute_skip_core_attention=False"
        )


class _CPTwinLaunchers:
    forward = staticmethod(_twin_forward)
    backward = staticmethod(_cp_twin_backward)


@contextlib.contextmanager
def _no_transfers():
    """torch.distributed's transfers as no-ops, for a traced context-parallel method: its receive buffers are
    allocated by its own code (`distributed.comm`), and nothing moves."""
    import torch.distributed as dist

    names = ("batch_isend_irecv", "all_to_all_single", "all_gather", "all_gather_into_tensor", "all_reduce",
             "reduce_scatter_tensor")  # fmt: skip
    with contextlib.ExitStack() as stack:
        for name in names:
            stack.enter_context(mock.patch.object(dist, name, lambda *a, **k: []))
        stack.enter_context(mock.patch.object(dist, "P2POp", lambda *a, **k: None))
        yield


def _cp_twin_attention(world: int, method: str, layout: str = "zigzag"):
    """The core attention of rank 0 of ``world`` context-parallel ranks running ``method`` (causal, one dense
    sequence of ``world`` times the local tokens) with the kernels' twins; trace it under `_no_transfers`."""
    from longctx.distributed.attention import run_method
    from longctx.distributed.comm import GroupInfo
    from longctx.masks import Band

    info = GroupInfo(None, 0, world, "trace")
    traced = method if method in CP_TRACED else "ring"

    def attention(q, k, v):
        return run_method(q, k, v, info=info, method=traced, layout=layout, mask=Band(None, 0),
                          scale=q.shape[-1] ** -0.5, launchers=_CPTwinLaunchers)  # fmt: skip

    return attention


# Lengths up to this are traced as they are; longer ones from two traces at shorter lengths (`step_memory`): a trace
# costs time in proportion to its sequence chunks, so the shorter traces keep plans with small chunks to a second.
DIRECT_TRACE_TOKENS = 16384


def step_memory(
    config: GPTConfig,
    *,
    seq_length: int,
    micro_batch_size: int = 1,
    autocast_dtype: torch.dtype | None = torch.bfloat16,
    optimizer_bytes_per_parameter: int = 8,
    overhead: int = CUDA_OVERHEAD_BYTES,
    exact: bool = False,
    offload_params: bool = False,
    shards: int = 1,
    lora_rank: int | None = None,
    lora_targets: tuple[str, ...] = LORA_TARGETS,
    context_parallel: int = 1,
    cp_method: str = "ring",
    resident_units: int = 0,
) -> StepMemory:
    """Predicted peak memory of one training step (forward, backward, AdamW) of ``GPT(config)``.

    Every tensor of a step is either proportional to the tokens (activations, checkpoints, kept attention) or of a
    fixed size (parameters, a loss chunk's logits, a sequence chunk's MLP intermediates): with the chunk sizes held,
    the peak is affine in S. So beyond `DIRECT_TRACE_TOKENS` tokens (and unless ``exact``) the step is traced at two
    shorter lengths with the target's chunk sizes and the line through them is read at S: a trace costs time in
    proportion to its number of chunks, and this keeps it to seconds at any S (tests check it against a direct trace).

    Args:
        config: the model and its recompute / chunking / offloading settings.
        seq_length: tokens per sequence S.
        micro_batch_size: sequences per step B.
        autocast_dtype: the autocast dtype of training (bf16), or None for a step in the parameters' dtype.
        optimizer_bytes_per_parameter: optimizer state bytes per parameter (AdamW in fp32: 8).
        overhead: the fixed allowance for CUDA libraries and the allocator.
        exact: trace at S itself, however long.
        offload_params: the parameters, gradients and AdamW states in host memory (`longctx.distributed.offload`):
            the step is traced with the weights in the autocast dtype (FSDP2's mixed precision: the residual
            stream is in that dtype too) and each gradient gone to the host once made; the GPU holds the units in
            flight (`units_in_flight`), the host the states.
        shards: ranks the offloaded states are sharded over (data parallel x context parallel).
        lora_rank: LoRA fine-tuning (PEFT's adapters of this rank on ``lora_targets``): a frozen base in the autocast
            dtype (no gradients, no optimizer states; the residual stream in that dtype too) and float32 adapters
            with their gradients and AdamW's states; the step is traced with the adapters in place.
        lora_targets: the adapted linears, by their names in transformers' Llama family (`LORA_TARGETS`).
        context_parallel: ranks of context parallelism; ``seq_length`` is then one rank's tokens, and the core
            attention is ``cp_method``'s own code (`CP_TRACED`; the others traced as the ring). Kept attention
            outputs (``recompute_skip_core_attention``) do not apply there: the context-parallel attention is
            recomputed with its chunk.
        resident_units: with ``offload_params``, the units whose states stay on the GPU (`resident_split`): their
            fp32 weights and AdamW's states for the whole step, their fp32 gradients from their backward on
            (`_with_resident`); the host holds the others'.

    Returns:
        A `StepMemory`.
    """
    return step_segments(config, seq_length=seq_length, micro_batch_size=micro_batch_size,
                         autocast_dtype=autocast_dtype, optimizer_bytes_per_parameter=optimizer_bytes_per_parameter,
                         overhead=overhead, exact=exact, offload_params=offload_params, shards=shards,
                         lora_rank=lora_rank, lora_targets=tuple(lora_targets), context_parallel=context_parallel,
                         cp_method=cp_method, resident_units=resident_units)[0]  # fmt: skip


def step_segments(config: GPTConfig, *, resident_units: int = 0, **kw: Any) -> tuple[StepMemory, dict[str, int]]:
    """`step_memory`'s prediction (the same arguments) and the peak of each segment of the step's timeline at
    ``seq_length`` that it is read from (``"embedding"``, ``"forward i"``, ``"loss"``, ``"forward end"``, ``"loss
    backward"``, ``"backward i"``; with resident units, ``"backward end"``): traced bytes, without the parameters,
    optimizer states and overhead. The predicted ``traced`` is at least the largest of them."""
    if resident_units and not kw.get("offload_params"):
        raise ValueError(f"resident_units={resident_units} keeps units of an offloaded model on the GPU: pass "
                         "offload_params=True, or resident_units=0")  # fmt: skip
    resident_split(config, resident_units)  # a count the model has
    if "lora_targets" in kw:
        kw["lora_targets"] = tuple(kw["lora_targets"])  # a cache key
    mem, segments = _step_segments(config, **kw)
    if resident_units:
        return _with_resident(mem, segments, config, resident_units, kw.get("shards", 1),
                              kw.get("optimizer_bytes_per_parameter", 8))  # fmt: skip
    return mem, segments


def _with_resident(
    mem: StepMemory,
    segments: dict[str, int],
    config: GPTConfig,
    resident_units: int,
    shards: int,
    optimizer_bytes_per_parameter: int,
) -> tuple[StepMemory, dict[str, int]]:
    """An offloaded step's prediction with ``resident_units`` kept on the GPU: their shards' fp32 weights (with the
    parameters) and AdamW's states for the whole step; their fp32 gradients from the end of their unit's backward
    (FSDP2's reduce-scatter leaves them on the GPU) to the optimizer step: a resident layer's in the backward of
    every layer before it; the root's and the embedding's only once the backward is over (their units' backward
    ends last: the root's encloses the whole model), in a segment of their own, ``"backward end"``, which holds
    every resident gradient and no activation. The host's states are those of the other units."""
    root, embedding, layer = resident_shard_elements(config, resident_units, shards)
    _, _, layers = resident_split(config, resident_units)
    resident = root + embedding + layers * layer
    seg = dict(segments)
    for i in range(config.num_layers):
        held = 4 * layer * max(0, layers - 1 - i)  # resident layers after layer i, finished before its backward
        if f"backward {i}" in seg:
            seg[f"backward {i}"] += held
    seg["backward end"] = 4 * resident
    host = offloaded_state_bytes(config, shards, optimizer_bytes_per_parameter, resident_units)
    out = dataclasses.replace(mem, parameters=mem.parameters + 4 * resident, gradients=4 * resident,
                              optimizer_states=optimizer_bytes_per_parameter * resident, host_states=host,
                              resident_units=resident_units,
                              resident_bytes=(8 + optimizer_bytes_per_parameter) * resident)  # fmt: skip
    return _at_peak(out, max(seg.values(), default=0)), seg


@functools.lru_cache(maxsize=256)  # step_memory's cache: step_memory.cache_clear() clears it
def _step_segments(
    config: GPTConfig,
    *,
    seq_length: int,
    micro_batch_size: int = 1,
    autocast_dtype: torch.dtype | None = torch.bfloat16,
    optimizer_bytes_per_parameter: int = 8,
    overhead: int = CUDA_OVERHEAD_BYTES,
    exact: bool = False,
    offload_params: bool = False,
    shards: int = 1,
    lora_rank: int | None = None,
    lora_targets: tuple[str, ...] = LORA_TARGETS,
    context_parallel: int = 1,
    cp_method: str = "ring",
) -> tuple[StepMemory, dict[str, int]]:
    """`step_segments` with every unit's states where ``offload_params`` puts them."""
    if isinstance(seq_length, bool) or not isinstance(seq_length, int) or seq_length < 1:
        raise ValueError(f"seq_length must be a positive int, got {seq_length!r}")
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be a positive int, got {micro_batch_size!r}")
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ValueError(f"shards must be a positive int, got {shards!r}")
    check_lora(lora_rank, lora_targets)
    if lora_rank is not None and offload_params:
        raise ValueError("offload_params with lora_rank is not modelled: a LoRA run's frozen base stays on the GPU")
    check_context_parallel(config, context_parallel, cp_method)
    kw = dict(micro_batch_size=micro_batch_size, autocast_dtype=autocast_dtype, offload_params=offload_params,
              optimizer_bytes_per_parameter=optimizer_bytes_per_parameter, overhead=overhead,
              shards=shards, lora_rank=lora_rank, lora_targets=tuple(lora_targets),
              context_parallel=context_parallel, cp_method=cp_method)  # fmt: skip
    S = seq_length
    from longctx.layers import loss as loss_module

    # both shorter traces hold whole chunks of the target's sizes (the loss's, the position-wise layers')
    loss_chunk = loss_module.default_chunk_size(micro_batch_size * S, config.hidden_size, config.vocab_size)
    s1 = max(DIRECT_TRACE_TOKENS // 2, 4 * (config.sequence_chunk_size or 0), -(-loss_chunk // micro_batch_size))
    if exact or 2 * s1 >= S:
        return _traced(config, seq_length=S, **kw)
    a, seg_a = _traced(config, seq_length=s1, loss_chunk=loss_chunk, **kw)
    b, seg_b = _traced(config, seq_length=2 * s1, loss_chunk=loss_chunk, **kw)
    if list(seg_a) != list(seg_b):  # the timelines differ in shape: trace the length itself
        return _traced(config, seq_length=S, **kw)
    # each segment of the timeline (a layer's forward, the loss, a layer's backward) is affine in S; the peak is
    # the largest of them at S, whichever segment that is
    segments = {k: round(seg_a[k] + (seg_b[k] - seg_a[k]) * (S - s1) / s1) for k in seg_a}
    peak = max(segments.values())
    fields = ("gradients", "checkpoints", "kept_attention", "host_offloaded")
    at = {f: round(getattr(a, f) + (getattr(b, f) - getattr(a, f)) * (S - s1) / s1) for f in fields}
    return _at_peak(dataclasses.replace(b, seq_length=S, **at), peak), segments


step_memory.cache_clear = _step_segments.cache_clear  # type: ignore[attr-defined]


@functools.lru_cache(maxsize=256)  # the two shorter traces serve every longer length with the same chunk sizes
def _traced(
    config: GPTConfig,
    *,
    seq_length: int,
    micro_batch_size: int,
    autocast_dtype: torch.dtype | None,
    optimizer_bytes_per_parameter: int,
    overhead: int,
    whole: bool = False,
    loss_chunk: int | None = None,
    offload_params: bool = False,
    shards: int = 1,
    lora_rank: int | None = None,
    lora_targets: tuple[str, ...] = LORA_TARGETS,
    context_parallel: int = 1,
    cp_method: str = "ring",
) -> tuple[StepMemory, dict[str, int]]:
    """One trace at ``seq_length``: the `StepMemory` and the peak of each segment of the step's timeline.

    Unless ``whole``, a model whose runs of identical layers are longer than `RUN_LAYERS` is traced with each run
    cut to that many layers and the timeline is lengthened back (`_lengthen`): the same bytes, in a fraction of the
    time. Where the cut model's middle layers do not hold the same bytes, the whole model is traced instead.
    ``loss_chunk``: the loss's chunk of tokens (at most ``seq_length``) instead of its default for this length (a
    part of the cache's key: a shorter trace for a longer length holds the longer length's loss chunk).
    """
    if loss_chunk is not None:
        from longctx.layers import loss as loss_module

        with mock.patch.object(loss_module, "default_chunk_size", lambda *a: min(loss_chunk, a[0])):
            return _traced.__wrapped__(config, seq_length=seq_length, micro_batch_size=micro_batch_size,
                                       autocast_dtype=autocast_dtype, overhead=overhead, whole=whole,
                                       optimizer_bytes_per_parameter=optimizer_bytes_per_parameter,
                                       offload_params=offload_params, shards=shards, lora_rank=lora_rank,
                                       lora_targets=lora_targets, context_parallel=context_parallel,
                                       cp_method=cp_method)  # fmt: skip
    trace_kw = dict(seq_length=seq_length, micro_batch_size=micro_batch_size, autocast_dtype=autocast_dtype,
                    offload_params=offload_params, lora_rank=lora_rank, lora_targets=lora_targets,
                    context_parallel=context_parallel, cp_method=cp_method)  # fmt: skip
    cut = None if whole else _cut_runs(config)
    timeline = None
    if cut is not None:
        short, copies = cut
        short_timeline, released, counts = _trace(short, **trace_kw)
        timeline = _lengthen(short_timeline, released, copies)
        extra = config.num_layers - short.num_layers
        n_params = counts["parameters"] + extra * counts["layer parameters"]
        param_bytes = counts["parameter bytes"] + extra * counts["layer parameter bytes"]
    if timeline is None:
        timeline, _, counts = _trace(config, **trace_kw)
        n_params, param_bytes = counts["parameters"], counts["parameter bytes"]
    segments: dict[str, int] = {}
    for label, _, top in timeline:
        segments[label] = max(segments.get(label, 0), top)
    peak = max(segments.values(), default=0)

    B, S = micro_batch_size, seq_length
    checkpoint_bytes, kept, host = kept_bytes(config, S, B, counts["residual element bytes"], autocast_dtype)
    on_host = {}
    if offload_params:  # the gradients left in the trace as they were made; the weights are the units in flight
        grads = 0
        layer = counts["layer parameters"]
        units = config.num_layers * layer + (0 if config.share_embeddings_and_output_weights else counts["embedding"])
        param_bytes = units_in_flight(layer, n_params - units, shards, counts["parameter element bytes"])
        optimizer_states = 0
        # fp32 weights and gradients (pinned) and AdamW's states, this rank's shard
        on_host = dict(offload_params=True,
                       host_states=offloaded_state_bytes(config, shards, optimizer_bytes_per_parameter))  # fmt: skip
    elif lora_rank is not None:  # a frozen base (its bytes as traced) and float32 adapters, trained
        adapters = lora_parameters(config, lora_rank, lora_targets)
        param_bytes += 4 * adapters
        grads = 4 * adapters  # counted here: the trace dropped them
        optimizer_states = adapters * optimizer_bytes_per_parameter
    else:
        grads = param_bytes
        optimizer_states = n_params * optimizer_bytes_per_parameter
    mem = StepMemory(
        seq_length=S,
        micro_batch_size=B,
        parameters=param_bytes,
        gradients=grads,
        optimizer_states=optimizer_states,
        checkpoints=checkpoint_bytes,
        kept_attention=kept,
        working_set=0,
        overhead=overhead,
        host_offloaded=host,
        traced=0,
        host_overhead=HOST_OVERHEAD_BYTES,
        lora=lora_rank is not None,
        **on_host,
    )
    return _at_peak(mem, peak), segments


def _at_peak(mem: StepMemory, peak: int) -> StepMemory:
    """``mem`` with ``traced`` from the trace's ``peak`` (the largest segment of the step's timeline; a LoRA trace
    drops the adapters' gradients, which are added back) and the rest of it itemised: what the peak holds beyond
    the gradients, checkpoints and kept attention is ``working_set``; where it holds less (the layers already
    through their backward have freed their checkpoints as their gradients came), ``freed_before_peak``."""
    traced = peak + (mem.gradients if mem.lora else 0)
    rest = traced - mem.gradients - mem.checkpoints - mem.kept_attention
    return dataclasses.replace(mem, traced=traced, working_set=max(0, rest), freed_before_peak=max(0, -rest))


def kept_bytes(
    c: GPTConfig, S: int, B: int, resid_bytes: int, autocast_dtype: torch.dtype | None
) -> tuple[int, int, int]:
    """(checkpoints on the device, kept attention outputs and lse, checkpoints in host memory) of a plan, in bytes:
    a checkpoint is a chunk's input in the residual stream's dtype (``resid_bytes`` an element)."""
    chunks = plan_layers(c.recompute_granularity, c.recompute_method, c.recompute_num_layers, c.num_layers)
    n_offload = (c.cpu_offloading_num_layers or c.num_layers) if c.cpu_offloading else 0
    checkpointed = [ch for ch in chunks if ch.checkpointed]
    offloaded = [ch for ch in checkpointed if ch.end <= n_offload]
    one = B * S * c.hidden_size * resid_bytes
    kept_layers = sum(ch.end - ch.start for ch in checkpointed) if c.recompute_skip_core_attention else 0
    half = 2 if autocast_dtype is not None else resid_bytes
    kept = kept_layers * B * S * c.num_attention_heads * (c.head_dim * half + 4)
    return (len(checkpointed) - len(offloaded)) * one, kept, len(offloaded) * one


def _trace(
    config: GPTConfig,
    *,
    seq_length: int,
    micro_batch_size: int,
    autocast_dtype: torch.dtype | None,
    offload_params: bool = False,
    lora_rank: int | None = None,
    lora_targets: tuple[str, ...] = LORA_TARGETS,
    context_parallel: int = 1,
    cp_method: str = "ring",
) -> tuple[list[list], dict[tuple[int, int], int], dict[str, int]]:
    """Trace one step of ``GPT(config)``: the tracker's timeline and released bytes, and the parameters counted
    (the model's and one layer's, in numbers and bytes; the residual stream's element size).

    ``offload_params``: the weights in the autocast dtype (FSDP2's mixed precision) and every gradient dropped
    once accumulated (FSDP2 reduces it and sends it to the host after its unit's backward). ``context_parallel`` > 1:
    the core attention is `_cp_twin_attention`'s, its transfers no-ops."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import longctx.layers.attention as attention_layer
    from longctx.ops import pointwise

    tracker = LiveBytesTracker()
    cp = context_parallel > 1
    with (
        FakeTensorMode(),
        pointwise.twins(),
        mock.patch.object(attention_layer, "resolve_launchers", lambda *a, **k: _TwinLaunchers),
        _no_transfers() if cp else contextlib.nullcontext(),
    ):
        low = (offload_params or lora_rank is not None) and autocast_dtype is not None  # weights as they compute
        dtype = autocast_dtype if low else torch.get_default_dtype()
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # the weights in FSDP2's compute dtype (a fake model cannot be cast after)
        try:
            model = GPT(config)
        finally:
            torch.set_default_dtype(default)
        if offload_params:
            for p in model.parameters():
                p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
        base_counts = _parameter_counts(model)  # the base's, before any adapter
        if lora_rank is not None:
            _add_lora(model, lora_rank, lora_targets)
        model.set_core_attention(_cp_twin_attention(context_parallel, cp_method) if cp else _twin_attention)
        for layer in model.layers:  # set_core_attention keeps the policy; the kept path needs a fused core
            layer.self_attention.keep_core_attention = config.recompute_skip_core_attention
        tokens = torch.zeros(micro_batch_size, seq_length, dtype=torch.long)
        autocast = (
            torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None else contextlib.nullcontext()
        )
        _mark_segments(model, tracker)
        with tracker:
            tracker.mark("embedding")
            with autocast:
                loss = model(tokens, labels=tokens)
                tracker.mark("forward end")  # leaving autocast frees its cache (each layer's low-precision weights)
            tracker.mark("loss backward")
            model._trace_phase = "backward"
            loss.backward()
            del loss
    return tracker.timeline, tracker.released, base_counts


def _parameter_counts(model: GPT) -> dict[str, int]:
    params = list(model.parameters())
    layer_params = list(model.layers[0].parameters())
    return {
        "parameters": sum(p.numel() for p in params),
        "parameter bytes": sum(p.numel() * p.element_size() for p in params),
        "layer parameters": sum(p.numel() for p in layer_params),
        "layer parameter bytes": sum(p.numel() * p.element_size() for p in layer_params),
        "residual element bytes": model.embedding.weight.element_size(),
        "parameter element bytes": model.embedding.weight.element_size(),
        "embedding": model.embedding.weight.numel(),
    }


# A run of identical layers (the same recompute and offloading) longer than this is traced cut to this many: the
# first, two middle ones (their equality checks that a layer's bytes do not depend on its place) and the last.
RUN_LAYERS = 4


def _layer_kinds(c: GPTConfig) -> list[tuple[bool, bool]] | None:
    """(checkpointed, offloaded) of each layer; None where a recompute chunk holds several layers."""
    chunks = plan_layers(c.recompute_granularity, c.recompute_method, c.recompute_num_layers, c.num_layers)
    if any(ch.end - ch.start != 1 for ch in chunks):
        return None
    n_offload = (c.cpu_offloading_num_layers or c.num_layers) if c.cpu_offloading else 0
    return [(ch.checkpointed, ch.checkpointed and ch.end <= n_offload) for ch in chunks]


def _cut_runs(c: GPTConfig) -> tuple[GPTConfig, list[int]] | None:
    """The config with each run of identical layers cut to `RUN_LAYERS`, and how many layers of ``c`` each of its
    layers stands for (a run's second layer stands for the layers cut); None where nothing is cut."""
    kinds = _layer_kinds(c)
    if kinds is None:
        return None
    runs = [(kind, len(list(group))) for kind, group in itertools.groupby(kinds)]
    if all(n <= RUN_LAYERS for _, n in runs):
        return None
    copies: list[int] = []
    for _, n in runs:
        copies += [1] * n if n <= RUN_LAYERS else [1, n - RUN_LAYERS + 1] + [1] * (RUN_LAYERS - 2)

    def cut(t: int) -> int:  # a run boundary of c -> the same boundary in the cut config
        start = kept = 0
        for _, n in runs:
            if start >= t:
                break
            start, kept = start + n, kept + min(n, RUN_LAYERS)
        return kept

    kw: dict = dict(num_layers=len(copies))
    if c.recompute_granularity == "full" and c.recompute_method == "block":
        kw["recompute_num_layers"] = cut(c.recompute_num_layers)
    if c.cpu_offloading and c.cpu_offloading_num_layers is not None:
        kw["cpu_offloading_num_layers"] = cut(c.cpu_offloading_num_layers)
    try:
        short = dataclasses.replace(c, **kw)
    except ValueError:
        return None
    if _layer_kinds(short) != [kind for kind, n in runs for _ in range(min(n, RUN_LAYERS))]:
        return None
    return short, copies


def _lengthen(timeline: list[list], released: dict[tuple[int, int], int], copies: list[int]) -> list[list] | None:
    """The timeline of the model whose layer i of the traced (cut) model stands for ``copies[i]`` identical layers.

    Each segment of a repeated layer (its forward, its backward) starts where the previous copy's ended, so the
    copies' peaks step by the bytes the segment leaves behind (kept activations in the forward, gradients less the
    freed activations in the backward) and every later segment is shifted by the sum. Bytes that a layer's segment
    leaves and a segment outside the layers frees (autocast's cache of low-precision weights, freed at the end of
    the forward) are freed there once per copy. None where the two middle layers of a cut run differ (their bytes
    would depend on their place).
    """
    labels = [row[0] for row in timeline]
    if len(set(labels)) != len(labels):
        return None  # a segment that repeats: its layers' work is not contiguous
    where = {label: t for t, label in enumerate(labels)}
    ends = [row[1] for row in timeline[1:]] + [timeline[-1][1]]
    outside = [t for t, label in enumerate(labels) if not _layer_segment(label)]

    def shape(t: int) -> tuple:  # rise to the segment's peak, bytes left at its end, bytes freed outside the layers
        start, top = timeline[t][1], timeline[t][2]
        return top - start, ends[t] - start, tuple(released.get((t, f), 0) for f in outside)

    freed_outside = dict.fromkeys(outside, 0)  # extra bytes each outside segment frees in the longer model
    for i, n in enumerate(copies):
        if n > 1:
            for phase in ("forward", "backward"):
                a, b = where.get(f"{phase} {i}"), where.get(f"{phase} {i + 1}")
                if a is None or b is None or a == len(labels) - 1 or shape(a) != shape(b):
                    return None
                for f in outside:
                    freed_outside[f] += (n - 1) * released.get((a, f), 0)
    first = [sum(copies[:i]) for i in range(len(copies))]  # the original index of each traced layer
    out, shift = [], 0
    for t, (label, start, top) in enumerate(timeline):
        if not _layer_segment(label):
            out.append([label, start + shift, top + shift])
            shift -= freed_outside[t]
            continue
        phase, i = label.split(" ")[0], int(label.split(" ")[1])
        rise, step, _ = shape(t)
        order = range(copies[i]) if phase == "forward" else range(copies[i] - 1, -1, -1)  # backward: in reverse
        for j, k in enumerate(order):
            s = start + shift + j * step
            out.append([f"{phase} {first[i] + k}", s, s + rise])
        shift += (copies[i] - 1) * step
    return out


def _layer_segment(label: str) -> bool:
    phase, _, num = label.partition(" ")
    return phase in ("forward", "backward") and num.isdigit()


def _mark_segments(model: GPT, tracker: LiveBytesTracker) -> None:
    """Label the trace's timeline: each layer's first forward, the loss, and each layer's backward (from the
    gradient reaching its output, or where the layer's output is made inside a replayed chunk, which autograd does
    not see, from the start of its replayed forward; with recomputation it includes the replayed forward)."""
    model._trace_phase = "forward"

    def pre(i):
        def hook(module, args):
            if model._trace_phase == "forward":
                tracker.mark(f"forward {i}")
            elif f"backward {i}" not in tracker.segments:
                tracker.mark(f"backward {i}")

        return hook

    def post(i):
        def hook(module, args, out):
            if model._trace_phase == "forward" and out.requires_grad:
                out.register_hook(lambda g: tracker.mark(f"backward {i}"))

        return hook

    for i, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(pre(i))
        layer.register_forward_hook(post(i))
    model.final_layernorm.register_forward_pre_hook(
        lambda m, a: tracker.mark("loss") if model._trace_phase == "forward" else None
    )
